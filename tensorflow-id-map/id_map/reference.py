"""A pure-Python IdMap (dicts and the policy, one id at a time) that the op must equal exactly:
the same rows, codes, evictions and state for the same batches (tests/test_id_map.py).

    ref = Reference(capacity, admit_after=1, policy="lru", ttl=0, candidate_slots=0)
    rows, codes, evicted = ref.find_or_insert(ids, step)    lists, as IdMap.find_or_insert
    ref.export()                                             {STATE name: list}, as IdMap.export
Raises Full when a batch has more distinct admitted ids than rows.
"""
from . import ADMITTED, EVICTED, HIT, REFUSED

_MASK = (1 << 64) - 1
WAYS = 4


class Full(Exception):
    """Every row is in use by the batch and another id needs one."""


def mix(x: int) -> int:
    """splitmix64's finaliser of x's 64 bits."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _power_of_two_at_least(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


class Reference:
    def __init__(self, capacity, admit_after=1, policy="lru", ttl=0, candidate_slots=0):
        self.capacity, self.k, self.policy, self.ttl = capacity, admit_after, policy, ttl
        self.sets = _power_of_two_at_least(max(-(-(candidate_slots or capacity) // WAYS), 1))
        self.row_of = {}                  # id -> row
        self.meta = {}                    # row -> [id, count, last_used, seq]
        self.free = list(range(capacity))
        self.cands = [[] for _ in range(self.sets)]   # per set: [id, sightings, last_seen] ways
        self.seq = 0
        self.totals = [0, 0, 0]

    def _set_order(self, row):
        self.meta[row][3] = self.seq
        self.seq += 1

    def _key(self, row):
        _, count, _, seq = self.meta[row]
        return (count, seq) if self.policy == "lfu" else (seq,)

    def _victim(self, step):
        """The row to reuse, None to refuse; raises Full."""
        ready = [r for r in self.meta if self.meta[r][2] != step]
        if not ready:
            raise Full()
        if self.policy == "lfu":
            return min(ready, key=self._key)
        first = min(self.meta, key=self._key)
        if self.meta[first][2] == step:
            raise Full()
        if self.policy == "ttl" and step - self.meta[first][2] < self.ttl:
            return None
        return first

    def _sight(self, id_, step):
        ways = self.cands[mix(id_) & (self.sets - 1)]
        for way in ways:
            if way[0] == id_:
                if way[2] != step:
                    way[1] += 1
                    way[2] = step
                return way[1]
        if len(ways) < WAYS:
            ways.append([id_, 1, step])
        else:
            stalest = min(range(WAYS), key=lambda w: (ways[w][2], ways[w][1], w))
            ways[stalest] = [id_, 1, step]
        return 1

    def _forget(self, id_):
        ways = self.cands[mix(id_) & (self.sets - 1)]
        ways[:] = [w for w in ways if w[0] != id_]

    def find_or_insert(self, ids, step):
        found = [self.row_of.get(i, -1) for i in ids]
        for r in found:
            if r >= 0 and self.meta[r][2] != step:
                self.meta[r][1] += 1
                self.meta[r][2] = step
                self._set_order(r)
        rows, codes, evicted = list(found), [HIT] * len(ids), [0] * len(ids)
        for i, id_ in enumerate(ids):
            if rows[i] >= 0:
                continue
            if id_ in self.row_of:
                rows[i] = self.row_of[id_]
                continue
            sightings = self._sight(id_, step) if self.k > 1 else 1
            row = None
            if sightings >= self.k:
                if self.free:
                    row = self.free.pop(0)
                    codes[i] = ADMITTED
                else:
                    row = self._victim(step)
                    if row is not None:
                        evicted[i] = self.meta[row][0]
                        del self.row_of[evicted[i]]
                        codes[i] = EVICTED
                        self.totals[1] += 1
            if row is None:
                codes[i] = REFUSED
                self.totals[2] += 1
                continue
            if self.k > 1:
                self._forget(id_)
            self.row_of[id_] = row
            self.meta[row] = [id_, sightings, step, 0]
            self._set_order(row)
            rows[i] = row
            self.totals[0] += 1
        return rows, codes, evicted

    def export(self):
        order = sorted(self.meta, key=self._key)
        cands = [way for ways in self.cands for way in ways]
        return {"ids": [self.meta[r][0] for r in order], "rows": order,
                "counts": [self.meta[r][1] for r in order], "last_used": [self.meta[r][2] for r in order],
                "candidate_ids": [w[0] for w in cands], "candidate_sightings": [w[1] for w in cands],
                "candidate_last_seen": [w[2] for w in cands], "totals": list(self.totals)}
