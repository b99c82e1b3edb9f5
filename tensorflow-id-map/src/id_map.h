// IdMap: one table's (shard's) map of raw 64-bit ids to rows 0..capacity-1, with admission after K
// sightings and eviction (LRU, LFU, TTL in steps). No TensorFlow here: id_map_ops.cc wraps it.
//
// The map: open addressing with linear probing over a power-of-two bucket array of at least twice
// the capacity (load <= 0.5), the key's bits mixed first (splitmix64's finaliser), deletion by
// backward shift (no tombstones). A live id owns exactly one row and a row at most one live id
// (the map holds id -> row and rows_[row].id the way back), so two live ids never share a row.
//
// One call FindOrInsert(ids, step) is one batch at training step `step`, in three phases:
//   1. find every id (read only, so spread over threads: `parallel_for`; the GPU form is a kernel);
//   2. in batch order, touch the rows found in 1 (once per step: count + 1, a new place in the
//      eviction order): rows in use by the batch are never evicted by it;
//   3. in batch order, the ids not found in 1: found now (an earlier id of the batch inserted it:
//      a hit), else a sighting (once per step) of a candidate; at K sightings it is admitted into a
//      free row, else into the row of the policy's victim (evicted), else refused.
// Phases 2 and 3 are serial and phase 1 reads a state no thread changes, so the same batch on the
// same state gives the same rows, codes and evictions whatever the thread count.
//
// Eviction order (the victim is its first live row not touched in this step):
//   LRU, TTL: by `seq`, the sequence number of the row's last touch (its first touch in a step);
//   LFU: by (count, seq), count the number of steps the id was seen in (its K sightings included).
//   TTL evicts only a row not touched for at least `ttl` steps, and refuses the id otherwise.
// When every row is touched in the step, the batch has more distinct admitted ids than rows: the
// call fails (Status kFull). Kept lazily: touches append (seq, row) entries to a FIFO (LRU, TTL:
// already in order) or a min-heap (LFU); an entry whose seq is not its row's latest is skipped;
// the container is compacted when it holds more than twice the live rows.
//
// Candidates (K > 1): a bounded 4-way set-associative table of `candidate_slots` slots (rounded
// up to a power-of-two count of sets), set = mixed id; an id's sightings live there until it is
// admitted; a full set replaces its stalest way (smallest last-seen step, then fewest sightings,
// then first way), whose sightings are lost. Memory: 24 bytes a slot.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace id_map {

enum Policy { kLru = 0, kLfu = 1, kTtl = 2 };
enum Code { kHit = 0, kAdmitted = 1, kEvicted = 2, kRefused = 3 };
enum Status { kOk = 0, kFull = 1 };

inline uint64_t Mix(uint64_t x) {   // splitmix64's finaliser
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline uint64_t PowerOfTwoAtLeast(uint64_t n) {
  uint64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// An array of n T, each `value`, in transparent huge pages where the system gives them on request
// (the bucket and row arrays are read at random: 4 KiB pages would miss the TLB on nearly every id).
template <typename T>
class HugeArray {
 public:
  HugeArray(size_t n, const T& value) : n_(n) {
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t bytes = std::max<size_t>((n * sizeof(T) + kHuge - 1) / kHuge * kHuge, kHuge);
    data_.reset(static_cast<T*>(std::aligned_alloc(kHuge, bytes)));
    if (data_ == nullptr) throw std::bad_alloc();
    madvise(data_.get(), bytes, MADV_HUGEPAGE);
    std::fill(data_.get(), data_.get() + n, value);
  }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  T* begin() { return data_.get(); }
  T* end() { return data_.get() + n_; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  size_t n_;
  std::unique_ptr<T[], Free> data_;
};

// parallel_for(n, fn): calls fn(begin, end) over a partition of [0, n), possibly on many threads.
using ParallelFor = std::function<void(int64_t, const std::function<void(int64_t, int64_t)>&)>;

class IdMap {
 public:
  struct Row { int64_t id, count, last_used, seq; };
  struct Candidate { int64_t id, sightings, last_seen; };
  struct Totals { int64_t admitted = 0, evicted = 0, refused = 0; };

  IdMap(int64_t capacity, int64_t admit_after, Policy policy, int64_t ttl, int64_t candidate_slots)
      : capacity_(capacity), admit_after_(admit_after), policy_(policy), ttl_(ttl),
        mask_(PowerOfTwoAtLeast(std::max<int64_t>(2 * capacity, 2)) - 1),
        buckets_(mask_ + 1, Bucket{0, -1}), rows_(capacity, Row{0, 0, 0, -1}) {
    if (admit_after_ > 1) {
      sets_ = PowerOfTwoAtLeast(std::max<int64_t>((candidate_slots + kWays - 1) / kWays, 1));
      candidates_.assign(sets_ * kWays, Candidate{0, 0, 0});
      filled_.assign(sets_, 0);
    }
    Clear();
  }

  int64_t capacity() const { return capacity_; }
  int64_t live() const { return live_; }
  int64_t candidates() const {
    int64_t n = 0;
    for (uint8_t f : filled_) n += f;
    return n;
  }
  const Totals& totals() const { return totals_; }

  // rows[i]: the row of ids[i], -1 when it has none. Read only.
  void Find(const int64_t* ids, int64_t n, int32_t* rows, const ParallelFor& parallel_for) const {
    parallel_for(n, [&](int64_t begin, int64_t end) { FindRange(ids, begin, end, rows); });
  }

  // One batch (see the header): rows[i] (-1: refused), codes[i] (Code), evicted[i] (the id whose
  // row ids[i] took, where codes[i] == kEvicted; else 0). kFull: the call stopped at an id that
  // needed a row while every row was in use by the step (the state holds the ids before it).
  Status FindOrInsert(const int64_t* ids, int64_t n, int64_t step, int32_t* rows, int32_t* codes,
                      int64_t* evicted, const ParallelFor& parallel_for) {
    Find(ids, n, rows, parallel_for);
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n && rows[i + kAhead] >= 0) __builtin_prefetch(&rows_[rows[i + kAhead]]);
      codes[i] = kHit;
      evicted[i] = 0;
      if (rows[i] >= 0 && rows_[rows[i]].last_used != step) Touch(rows[i], step);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (rows[i] >= 0) continue;
      int64_t row = Lookup(ids[i]);
      if (row >= 0) {
        rows[i] = static_cast<int32_t>(row);
        continue;
      }
      int64_t sightings = 1;
      Candidate* cand = nullptr;
      if (admit_after_ > 1) {
        cand = Sight(ids[i], step);
        sightings = cand->sightings;
      }
      if (sightings >= admit_after_) {
        Status status = Admit(ids[i], sightings, step, &row, &evicted[i]);
        if (status != kOk) {
          Undefer();
          return status;
        }
      }
      if (row < 0) {
        codes[i] = kRefused;
        ++totals_.refused;
        continue;
      }
      if (cand != nullptr) Forget(ids[i]);
      rows[i] = static_cast<int32_t>(row);
      codes[i] = evicted_now_ ? kEvicted : kAdmitted;
      ++totals_.admitted;
      if (evicted_now_) ++totals_.evicted;
    }
    Undefer();
    return kOk;
  }

  // The live rows in eviction order (first: the next victim). Clears nothing.
  std::vector<int32_t> LiveInOrder() {
    Compact();
    std::vector<Entry> order(order_.begin(), order_.end());
    if (policy_ == kLfu)   // the FIFO is in seq order already
      std::sort(order.begin(), order.end(), [](const Entry& a, const Entry& b) { return Later()(b, a); });
    std::vector<int32_t> out;
    out.reserve(order.size());
    for (const Entry& e : order) out.push_back(e.row);
    return out;
  }
  const Row& row(int32_t r) const { return rows_[r]; }
  // The candidates, set by set, way by way (import in this order restores their places).
  std::vector<Candidate> Candidates() const {
    std::vector<Candidate> out;
    for (int64_t s = 0; s < sets_; ++s)
      for (int w = 0; w < filled_[s]; ++w) out.push_back(candidates_[s * kWays + w]);
    return out;
  }

  // Replaces the state: live rows given in eviction order (ids unique, rows unique in range),
  // candidates in Candidates()'s order, totals. Returns an error message, empty when done.
  std::string Import(const int64_t* ids, const int32_t* rows, const int64_t* counts, const int64_t* last_used,
                     int64_t n, const Candidate* cands, int64_t m, const Totals& totals) {
    if (n > capacity_) return "more live rows than the capacity";
    std::vector<char> used(capacity_, 0);
    for (int64_t i = 0; i < n; ++i) {
      if (rows[i] < 0 || rows[i] >= capacity_) return "a row outside the capacity";
      if (used[rows[i]]) return "a row given twice";
      used[rows[i]] = 1;
    }
    Clear();
    for (int64_t i = 0; i < n; ++i) {
      if (Lookup(ids[i]) >= 0) {
        Clear();
        return "an id given twice";
      }
      Insert(ids[i], rows[i]);
      rows_[rows[i]] = Row{ids[i], counts[i], last_used[i], -1};
      SetOrder(rows[i]);
    }
    free_.clear();
    for (int64_t r = capacity_ - 1; r >= 0; --r)
      if (!used[r]) free_.push_back(static_cast<int32_t>(r));
    for (int64_t j = 0; j < m && admit_after_ > 1; ++j) {
      const int64_t s = Set(cands[j].id);
      if (filled_[s] == kWays) continue;   // more than the table holds: dropped as a full set would
      candidates_[s * kWays + filled_[s]++] = cands[j];
    }
    totals_ = totals;
    return "";
  }

 private:
  static constexpr int kWays = 4;
  static constexpr int64_t kAhead = 16;   // loops prefetch the bucket (row) of the id this far ahead
  struct Bucket { int64_t id; int64_t row; };
  struct Entry { int64_t count, seq; int32_t row; };
  struct Later {   // heap order: the smallest (count, seq) on top
    bool operator()(const Entry& a, const Entry& b) const {
      return a.count != b.count ? a.count > b.count : a.seq > b.seq;
    }
  };

  void Clear() {
    for (auto& b : buckets_) b.row = -1;
    for (auto& r : rows_) r = Row{0, 0, 0, -1};
    free_.clear();
    for (int64_t r = capacity_ - 1; r >= 0; --r) free_.push_back(static_cast<int32_t>(r));
    order_.clear();
    std::fill(filled_.begin(), filled_.end(), 0);
    live_ = 0;
    next_seq_ = 0;
    totals_ = Totals();
  }

  void FindRange(const int64_t* ids, int64_t begin, int64_t end, int32_t* rows) const {
    for (int64_t i = begin; i < std::min(end, begin + kAhead); ++i)
      __builtin_prefetch(&buckets_[Mix(ids[i]) & mask_]);
    for (int64_t i = begin; i < end; ++i) {
      if (i + kAhead < end) __builtin_prefetch(&buckets_[Mix(ids[i + kAhead]) & mask_]);
      rows[i] = static_cast<int32_t>(Lookup(ids[i]));
    }
  }

  int64_t Lookup(int64_t id) const {
    for (uint64_t b = Mix(id) & mask_;; b = (b + 1) & mask_) {
      const Bucket& bucket = buckets_[b];
      if (bucket.row < 0) return -1;
      if (bucket.id == id) return bucket.row;
    }
  }

  void Insert(int64_t id, int64_t row) {
    uint64_t b = Mix(id) & mask_;
    while (buckets_[b].row >= 0) b = (b + 1) & mask_;
    buckets_[b] = Bucket{id, row};
    ++live_;
  }

  void Erase(int64_t id) {   // backward-shift deletion
    uint64_t b = Mix(id) & mask_;
    while (buckets_[b].id != id || buckets_[b].row < 0) b = (b + 1) & mask_;
    for (uint64_t next = (b + 1) & mask_;; next = (next + 1) & mask_) {
      if (buckets_[next].row < 0) break;
      const uint64_t home = Mix(buckets_[next].id) & mask_;
      // move `next` into the hole at b unless its home lies cyclically in (b, next]
      if (((next - home) & mask_) >= ((next - b) & mask_)) {
        buckets_[b] = buckets_[next];
        b = next;
      }
    }
    buckets_[b].row = -1;
    --live_;
  }

  void SetOrder(int32_t r) {
    rows_[r].seq = next_seq_++;
    PushOrder(Entry{rows_[r].count, rows_[r].seq, r});
  }
  void PushOrder(const Entry& e) {
    order_.push_back(e);
    if (policy_ == kLfu) std::push_heap(order_.begin(), order_.end(), Later());
    if (static_cast<int64_t>(order_.size()) > 2 * live_ + 1024) Compact();
  }
  bool Valid(const Entry& e) const { return rows_[e.row].seq == e.seq; }
  void Compact() {
    order_.erase(std::remove_if(order_.begin(), order_.end(), [&](const Entry& e) { return !Valid(e); }),
                 order_.end());
    if (policy_ == kLfu) std::make_heap(order_.begin(), order_.end(), Later());
  }

  void Touch(int32_t r, int64_t step) {
    Row& row = rows_[r];
    row.last_used = step;
    ++row.count;
    SetOrder(r);
  }

  // The first live row of the eviction order not touched in `step`, -1 when none. LFU moves the
  // heap's rows touched in `step` aside (deferred_) until the batch ends.
  int32_t Victim(int64_t step) {
    while (!order_.empty()) {
      const Entry e = order_.front();
      if (!Valid(e)) {
        PopOrder();
        continue;
      }
      if (rows_[e.row].last_used != step) return e.row;
      if (policy_ != kLfu) return -1;   // in seq order: every later row was touched in step too
      PopOrder();
      deferred_.push_back(e);
    }
    return -1;
  }
  void Undefer() {
    for (const Entry& e : deferred_) PushOrder(e);
    deferred_.clear();
  }
  void PopOrder() {
    if (policy_ == kLfu) {
      std::pop_heap(order_.begin(), order_.end(), Later());
      order_.pop_back();
    } else {
      order_.pop_front();
    }
  }

  Status Admit(int64_t id, int64_t sightings, int64_t step, int64_t* row, int64_t* evicted) {
    evicted_now_ = false;
    if (!free_.empty()) {
      *row = free_.back();
      free_.pop_back();
    } else {
      const int32_t v = Victim(step);
      if (v < 0) return kFull;
      if (policy_ == kTtl && step - rows_[v].last_used < ttl_) return kOk;   // refused: nothing expired
      PopOrder();
      *evicted = rows_[v].id;
      Erase(rows_[v].id);
      evicted_now_ = true;
      *row = v;
    }
    Insert(id, *row);
    rows_[*row] = Row{id, sightings, step, -1};
    SetOrder(static_cast<int32_t>(*row));
    return kOk;
  }

  int64_t Set(int64_t id) const { return static_cast<int64_t>(Mix(id) & (sets_ - 1)); }

  // The candidate of `id` after its sighting in `step` (at most one a step).
  Candidate* Sight(int64_t id, int64_t step) {
    const int64_t s = Set(id);
    Candidate* ways = &candidates_[s * kWays];
    for (int w = 0; w < filled_[s]; ++w) {
      if (ways[w].id != id) continue;
      if (ways[w].last_seen != step) {
        ++ways[w].sightings;
        ways[w].last_seen = step;
      }
      return &ways[w];
    }
    int w = filled_[s];
    if (w < kWays) {
      ++filled_[s];
    } else {
      w = 0;
      for (int v = 1; v < kWays; ++v)
        if (ways[v].last_seen < ways[w].last_seen ||
            (ways[v].last_seen == ways[w].last_seen && ways[v].sightings < ways[w].sightings))
          w = v;
    }
    ways[w] = Candidate{id, 1, step};
    return &ways[w];
  }

  void Forget(int64_t id) {   // drops the candidate of `id`, the later ways moving up one
    const int64_t s = Set(id);
    Candidate* ways = &candidates_[s * kWays];
    for (int w = 0; w < filled_[s]; ++w) {
      if (ways[w].id != id) continue;
      std::copy(ways + w + 1, ways + filled_[s], ways + w);
      --filled_[s];
      return;
    }
  }

  const int64_t capacity_, admit_after_;
  const Policy policy_;
  const int64_t ttl_;
  const uint64_t mask_;
  HugeArray<Bucket> buckets_;
  HugeArray<Row> rows_;
  std::vector<int32_t> free_;   // free rows, the smallest last
  std::deque<Entry> order_;     // LRU, TTL: a FIFO by seq; LFU: a heap (Later)
  std::vector<Entry> deferred_;
  int64_t sets_ = 0;
  std::vector<Candidate> candidates_;
  std::vector<uint8_t> filled_;   // ways in use per set (a prefix)
  int64_t live_ = 0, next_seq_ = 0;
  bool evicted_now_ = false;
  Totals totals_;
};

}  // namespace id_map
