// DLRM's dot interaction on the CPU, free of TensorFlow.
//
// The input is n vectors of [batch, d] (the bottom-MLP output, then the F embeddings); sample b
// is T [n, d], row i = vectors[i][b].
// Forward:  out [b, W] = T[0, :], then dot(T[i], T[j]) for i > j in row-major order
//           ((1,0), (2,0), (2,1), ...), then zeros; W = OutputWidth(n, d).
// Backward: dT = S T, with S the symmetric n x n matrix of the pairs' gradients (zero
//           diagonal), plus the output gradient's first d columns on row 0; dT[i] goes to
//           grads[i][b].
// Both accumulate in float32 whatever the storage type (float, bfloat16, half). The
// micro-kernels (dot_based_interact_cpu_kernels.inc) are compiled for AVX-512, AVX2+FMA and
// plain C++; the best one this CPU runs is picked once.
#ifndef DOT_BASED_INTERACT_CPU_H_
#define DOT_BASED_INTERACT_CPU_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "dot_based_interact_shape.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DOT_INTERACT_X86 1
#include <immintrin.h>
#endif

namespace dot_interact {

// One instruction set's kernels.
struct Kernels {
  int width;   // floats per vector: rows are padded to a multiple of it
  void (*gram)(const float* const* rows, int n, int dp, float* pairs);
  // outs [n, dp] = s [n, m] rows [m, dp]; product_stream: non-temporal stores, outs aligned to width floats
  void (*product)(const float* s, const float* const* rows, int n, int m, int dp, float* const* outs);
  void (*product_stream)(const float* s, const float* const* rows, int n, int m, int dp, float* const* outs);
};

namespace portable {
// One float per "vector": correct everywhere, not fast.
struct Vec {
  static constexpr int W = 1, kWideRows = 4, kWideChunks = 4, kNarrowRows = 4;
  using V = float;
  static V Zero() { return 0.0f; }
  static V Load(const float* p) { return *p; }
  static void Store(float* p, V v) { *p = v; }
  static void Stream(float* p, V v) { *p = v; }
  static void Fence() {}
  static V Broadcast(float x) { return x; }
  static V Fma(V a, V b, V c) { return a * b + c; }
  static constexpr int Slot(int l) { return l; }
  static V Reduce(const V* acc) { return acc[0]; }
};
#include "dot_based_interact_cpu_kernels.inc"
}  // namespace portable

#ifdef DOT_INTERACT_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
struct Vec {
  static constexpr int W = 8, kWideRows = 4, kWideChunks = 2, kNarrowRows = 8;
  using V = __m256;
  static V Zero() { return _mm256_setzero_ps(); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void Stream(float* p, V v) { _mm256_stream_ps(p, v); }
  static void Fence() { _mm_sfence(); }
  static V Broadcast(float x) { return _mm256_set1_ps(x); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static constexpr int Slot(int l) { return l; }
  // Pairwise horizontal adds, then the two 128-bit halves.
  static V Reduce(const V* p) {
    const V lo = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
    const V hi = _mm256_hadd_ps(_mm256_hadd_ps(p[4], p[5]), _mm256_hadd_ps(p[6], p[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
  }
};
#include "dot_based_interact_cpu_kernels.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace avx512 {
struct Vec {
  static constexpr int W = 16, kWideRows = 4, kWideChunks = 4, kNarrowRows = 9;
  using V = __m512;
  static V Zero() { return _mm512_setzero_ps(); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void Stream(float* p, V v) { _mm512_stream_ps(p, v); }
  static void Fence() { _mm_sfence(); }
  static V Broadcast(float x) { return _mm512_set1_ps(x); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // Reduce's lane order: lane l holds accumulator 4 (l % 4) + l / 4.
  static constexpr int Slot(int l) { return 4 * (l % 4) + l / 4; }
  // Four levels of (shuffle, shuffle, add), each halving the partial sums per accumulator.
  static V Reduce(const V* p) {
    V q[8], r[4], s[2];
    for (int m = 0; m < 8; ++m)
      q[m] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0x44),
                           _mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0xEE));
    for (int m = 0; m < 4; ++m)
      r[m] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * m], q[2 * m + 1], 0x88),
                           _mm512_shuffle_f32x4(q[2 * m], q[2 * m + 1], 0xDD));
    for (int m = 0; m < 2; ++m)
      s[m] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * m], r[2 * m + 1], 0x44),
                           _mm512_shuffle_ps(r[2 * m], r[2 * m + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], 0x88), _mm512_shuffle_ps(s[0], s[1], 0xDD));
  }
};
#include "dot_based_interact_cpu_kernels.inc"
}  // namespace avx512
#pragma GCC pop_options
#endif  // DOT_INTERACT_X86

// The fastest kernels this CPU runs, or those of `isa` ("avx512", "avx2", "portable") when the
// environment variable DOT_INTERACT_ISA names one it runs (for tests and benchmarks).
inline const Kernels& BestKernels() {
  static const Kernels best = [] {
#ifdef DOT_INTERACT_X86
    const char* want = std::getenv("DOT_INTERACT_ISA");
    const std::string isa = want ? want : "";
    const bool avx512 = __builtin_cpu_supports("avx512f"), avx2 = __builtin_cpu_supports("avx2") &&
                                                                  __builtin_cpu_supports("fma");
    if (avx512 && (isa.empty() || isa == "avx512")) return avx512::Make();
    if (avx2 && isa != "portable") return avx2::Make();
#endif
    return portable::Make();
  }();
  return best;
}

// Row pointers of one sample: straight into float tensors whose rows need no padding, else into
// a zero-padded float copy.
template <typename T>
class SampleRows {
 public:
  SampleRows(int n, int d, int dp) : n_(n), d_(d), dp_(dp), direct_(std::is_same<T, float>::value && d == dp),
                                     pad_(direct_ ? 0 : static_cast<size_t>(n) * dp, 0.0f), rows_(n) {
    for (int i = 0; i < n && !direct_; ++i) rows_[i] = pad_.data() + static_cast<size_t>(i) * dp;
  }
  bool direct() const { return direct_; }
  // Sample b's rows of vectors[0..n).
  const float* const* Load(const T* const* vectors, int64_t b) {
    for (int i = 0; i < n_; ++i) {
      const T* v = vectors[i] + b * d_;
      if constexpr (std::is_same<T, float>::value) {
        if (direct_) {
          rows_[i] = v;
          continue;
        }
      }
      float* row = pad_.data() + static_cast<size_t>(i) * dp_;
      for (int k = 0; k < d_; ++k) row[k] = static_cast<float>(v[k]);
    }
    return rows_.data();
  }

 private:
  int n_, d_, dp_;
  bool direct_;
  std::vector<float> pad_;
  std::vector<const float*> rows_;
};

// Asks for sample b's rows ahead of their use: the n rows lie in n separate arrays, more
// streams than the hardware prefetchers follow.
template <typename T>
inline void Prefetch(const T* const* vectors, int n, int d, int64_t b) {
  const int64_t bytes = static_cast<int64_t>(d) * sizeof(T);
  for (int i = 0; i < n; ++i) {
    const char* v = reinterpret_cast<const char*>(vectors[i] + b * d);
    for (int64_t k = 0; k < bytes; k += 64) __builtin_prefetch(v + k);
  }
}

// How many samples ahead to prefetch: about 8 KiB of input.
inline int64_t PrefetchDistance(int n, int d, size_t size) {
  return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, static_cast<int64_t>(n) * d * size));
}

// Samples [begin, end): vectors n x [batch, d] -> out [batch, OutputWidth(n, d)].
template <typename T>
void Forward(const T* const* vectors, int n, int d, int64_t begin, int64_t end, T* out) {
  const Kernels& kernels = BestKernels();
  const int dp = static_cast<int>(RoundUp(d, kernels.width));
  const int64_t num = NumPairs(n), width = OutputWidth(n, d);
  SampleRows<T> rows(n, d, dp);
  std::vector<float> pairs(RoundUp(num, kernels.width));
  const int64_t ahead = PrefetchDistance(n, d, sizeof(T));
  for (int64_t b = begin; b < end; ++b) {
    if (b + ahead < end) Prefetch<T>(vectors, n, d, b + ahead);
    kernels.gram(rows.Load(vectors, b), n, dp, pairs.data());
    T* o = out + b * width;
    std::copy(vectors[0] + b * d, vectors[0] + (b + 1) * d, o);
    for (int64_t p = 0; p < num; ++p) o[d + p] = static_cast<T>(pairs[p]);
    std::fill(o + d + num, o + width, static_cast<T>(0.0f));
  }
}

// Samples [begin, end): vectors n x [batch, d], grad [batch, OutputWidth(n, d)] -> grads n x [batch, d].
// One product per sample: dT = [S | e0] [T; grad[:, :d]] (the bottom's gradient as an extra row
// of T, weight 1 for row 0 only). Float outputs that need no padding are written straight, with
// non-temporal stores when aligned (the gradients are not read again by this op).
template <typename T>
void Backward(const T* const* vectors, const T* grad, int n, int d, int64_t begin, int64_t end, T* const* grads) {
  const Kernels& kernels = BestKernels();
  const int dp = static_cast<int>(RoundUp(d, kernels.width)), m = n + 1;
  const int64_t width = OutputWidth(n, d);
  SampleRows<T> rows(n, d, dp);
  std::vector<float> s(static_cast<size_t>(n) * m, 0.0f), bottom(rows.direct() ? 0 : dp, 0.0f);
  std::vector<float> dpad(rows.direct() ? 0 : static_cast<size_t>(n) * dp);
  std::vector<const float*> all(m);
  std::vector<float*> outs(n);
  bool aligned = rows.direct();
  for (int i = 0; i < n; ++i) {
    outs[i] = rows.direct() ? nullptr : dpad.data() + static_cast<size_t>(i) * dp;
    aligned = aligned && reinterpret_cast<uintptr_t>(grads[i]) % (kernels.width * sizeof(float)) == 0;
  }
  const auto product = aligned ? kernels.product_stream : kernels.product;
  s[n] = 1.0f;
  const int64_t ahead = PrefetchDistance(n, d, sizeof(T));
  for (int64_t b = begin; b < end; ++b) {
    if (b + ahead < end) Prefetch<T>(vectors, n, d, b + ahead);
    const T* g = grad + b * width;
    const T* pair = g + d;
    for (int i = 1; i < n; ++i)
      for (int j = 0; j < i; ++j) s[i * m + j] = s[j * m + i] = static_cast<float>(*pair++);
    std::copy_n(rows.Load(vectors, b), n, all.begin());
    if constexpr (std::is_same<T, float>::value) {
      if (rows.direct()) {
        all[n] = g;
        for (int i = 0; i < n; ++i) outs[i] = grads[i] + b * d;
        product(s.data(), all.data(), n, m, dp, outs.data());
        continue;
      }
    }
    for (int k = 0; k < d; ++k) bottom[k] = static_cast<float>(g[k]);
    all[n] = bottom.data();
    product(s.data(), all.data(), n, m, dp, outs.data());
    for (int i = 0; i < n; ++i)
      for (int k = 0; k < d; ++k) grads[i][b * d + k] = static_cast<T>(outs[i][k]);
  }
}

}  // namespace dot_interact

#endif  // DOT_BASED_INTERACT_CPU_H_
