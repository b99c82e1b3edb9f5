"""Placement of embedding tables over N ranks (hybrid parallelism: tables model-parallel, MLPs data-parallel).

`plan_tables` decides, for every table (feature f: `rows[f]` x `dims[f]`, elements = rows x dim),
how it is stored. The rules apply in this order:

1. One rank: every table is "whole" on rank 0 (a dynamic one: rule 2); the thresholds have no effect.
2. "dynamic": a table given `dynamic[f]` (a `DynamicOptions`: raw 64-bit ids, admission and eviction,
   parallel_embedding/dynamic_table.py) has `capacity` rows (its `rows[f]` is ignored), cut into
   its `shards` S hash shards (S independent of the world size): shard s holds rows s of S
   contiguous near-equal ranges and the ids whose mixed hash falls in the s-th of S equal ranges
   of [0, 2^64) (routing.hash_shards), on rank s % N. Never replicated or sliced by columns; on disk
   only by rule 7.
3. "replicated": elements <= `data_parallel_threshold`. A full copy on every rank, no shards.
4. "row": elements > `row_slice_threshold` and rows >= N. One full-width shard per rank, rank r
   holding the r-th of N contiguous near-equal row ranges (the first rows % N ranks one row more).
5. The remaining tables are cut into 2^k column slices ("column"; k = 0 is "whole"):
   - with `column_slice_threshold` T: the smallest k with rows * ceil(dim / 2^k) <= T, stopping
     at the caps 2^k <= N and 2^k <= dim;
   - then, if there are fewer such tables than ranks, the table whose largest slice has the most
     elements (ties: lower feature) has its slice count doubled, while there are fewer pieces
     than ranks and some table can still double within the caps.
   Slices are contiguous, their widths differ by at most 1, the wider ones first.
6. The pieces (whole tables and column slices; row shards are already one per rank) are dealt
   to ranks by `strategy`:
   - "basic": the i-th piece in (feature, slice) order goes to rank i % N;
   - "memory_balanced": pieces by elements, largest first (ties: feature, slice), dealt in snake
     order 0, 1, ..., N-1, N-1, ..., 0, 0, 1, ...: equal counts (+-1) and similar memory;
   - "memory_optimized": pieces in the same order, each to the rank with the fewest elements so
     far (row shards included), preferring ranks without a piece of the same table; ties: lowest rank.
7. With `tiers` (a `TierOptions`; `assign_tiers` applies this rule to a plan): where each unit
   lives. A unit is (rank r, feature f), all of r's shards of f (column slices on one rank share
   their rows, so they share one tier and one cache). Tiers: "memory" (the default), "host" (host
   memory of a GPU machine) or "disk" (files, with an in-memory cache of `cache_rows` rows with
   their optimizer slots). Replicated tables are never tiered. Per rank, at 4 bytes an element and
   `slots` optimizer slots per parameter:
   - a unit's row takes row_bytes = 4 (1 + slots) (sum of its shards' widths), the unit rows x row_bytes;
     on disk it keeps cache_rows (row_bytes + SLOT_OVERHEAD_BYTES) + rows INDEX_BYTES_PER_ROW bytes in
     memory and all of its rows x row_bytes on disk;
   - budget: if replicated tables and units exceed it, units go to disk, largest first (ties: lower
     feature; units that would take no less memory on disk stay), each with a cache of
     min(min_cache_rows[f], rows) rows, until the rank fits; then one load factor phi in [0, 1], the
     largest that fits, sizes every disk unit's cache: min(rows, max(min_cache_rows[f], floor(phi rows)));
   - host threshold: while the parameters (no slots) of the replicated tables and the units left in
     memory exceed it, the largest of those units goes to host memory.
   Dynamic tables: their id maps (`dynamic_map_bytes`) are fixed memory under the budget. A rank's
   one hash shard of a dynamic table is a unit as above (its rows: the shard's capacity), which the
   budget may put on disk (its rows and slots in the store, its cache in memory; the map stays in
   memory); several hash shards of one table on a rank stay in memory, rows x row_bytes each, fixed.
   Dynamic tables never go to host memory: their parameters in memory count under the host threshold.

Everything is deterministic. This module is pure Python so that plans can be made and checked
without TensorFlow.
"""
import math
import operator
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

STRATEGIES = ("basic", "memory_balanced", "memory_optimized")
DYNAMIC_POLICIES = ("lru", "lfu", "ttl")   # a dynamic table's eviction (id_map)
TIER_KINDS = ("memory", "host", "disk")
BYTES_PER_ELEMENT = 4      # float32 tables and optimizer slots
INDEX_BYTES_PER_ROW = 4    # a disk unit's int32 id -> cache-slot map, one entry per row of the unit
SLOT_OVERHEAD_BYTES = 32   # per cache slot: the cache's bookkeeping (id, policy state)
# A dynamic table's id map (tensorflow-id-map/src/id_map.h), per row: its record (id, count, last
# use, sequence: 32), its place in the free list (4) and up to two eviction-order entries (2 x 24);
# per bucket (a power of two >= 2 x rows): 16; per admission candidate (K > 1: as many as rows, in
# a power of two of 4-way sets): 24.
MAP_ROW_BYTES, MAP_BUCKET_BYTES, MAP_CANDIDATE_BYTES = 84, 16, 24


class PlanError(ValueError):
    """An invalid argument to `plan_tables` (the message names it)."""


class BudgetError(PlanError):
    """A memory budget (`TierOptions.budget_bytes`) below a rank's smallest plan."""


@dataclass(frozen=True)
class TierOptions:
    """What decides the tiers (rule 7): `slots` optimizer slots per parameter; `budget_bytes`, a
    rank's bytes of embedding state in memory (None: no limit); `min_cache_rows[f]`, the fewest
    cache rows of a disk unit of feature f; `host_threshold_bytes`, parameter bytes above which
    units go to host memory (None: never)."""
    slots: int
    budget_bytes: Optional[int]
    min_cache_rows: Sequence[int]
    host_threshold_bytes: Optional[int] = None


@dataclass(frozen=True)
class DynamicOptions:
    """A dynamic table (rule 2; parallel_embedding/dynamic_table.py): `capacity` rows shared by the
    raw ids seen so far; an id gets a row at its `admit_after`-th sighting; when every row is
    taken, `policy` ("lru", "lfu" or "ttl": rows unused for `ttl` steps) picks the row to reuse."""
    capacity: int
    admit_after: int = 1
    policy: str = "lru"
    ttl: int = 0
    shards: int = 1   # hash shards, each its own id map and capacity / shards rows (rule 2)

    def __post_init__(self):
        if self.policy not in DYNAMIC_POLICIES:
            raise PlanError(f"a dynamic table's policy must be one of {', '.join(DYNAMIC_POLICIES)}, got {self.policy!r}")
        if self.capacity < 1 or self.admit_after < 1 or (self.policy == "ttl") != (self.ttl >= 1) or \
                not 1 <= self.shards <= self.capacity:
            raise PlanError(f"a dynamic table needs capacity >= 1, admit_after >= 1, ttl >= 1 exactly with policy "
                            f"ttl and 1 <= shards <= capacity; got {self}")


@dataclass(frozen=True)
class Shard:
    """One piece of one table owned by one rank: rows [row_start, row_end) x cols [col_start, col_end)."""
    feature: int
    rank: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def width(self) -> int:
        return self.col_end - self.col_start

    @property
    def elements(self) -> int:
        return self.num_rows * self.width


@dataclass(frozen=True)
class TablePlacement:
    """How one table is stored. `shards`: none if replicated, one if whole, the column slices in
    column order, or the row shards in rank order."""
    feature: int
    rows: int
    dim: int
    kind: str            # "replicated" | "whole" | "column" | "row" | "dynamic"
    shards: Tuple[Shard, ...]
    dynamic: Optional[DynamicOptions] = None   # a dynamic table's (kind "dynamic"; rows: its capacity)

    @property
    def elements(self) -> int:
        return self.rows * self.dim


@dataclass(frozen=True)
class Tier:
    """Where one unit (a rank's shards of one table) is stored: "memory", "host" or "disk";
    `cache_rows`: a disk unit's in-memory cache (rows with their optimizer slots), else 0."""
    kind: str = "memory"
    cache_rows: int = 0

    def __post_init__(self):
        if self.kind not in TIER_KINDS:
            raise PlanError(f"tier kind must be one of {', '.join(TIER_KINDS)}, got {self.kind!r}")
        if self.cache_rows < 0 or (self.cache_rows and self.kind != "disk"):
            raise PlanError(f"cache_rows must be >= 0, and 0 outside the disk tier; got {self.cache_rows} "
                            f"({self.kind})")


@dataclass(frozen=True)
class Plan:
    """Where every table lives; `tables[f]` is feature f's placement; `tiers`: (rank, feature, tier)
    of the units not in "memory", sorted by (rank, feature) (see `assign_tiers`)."""
    world_size: int
    strategy: str
    tables: Tuple[TablePlacement, ...]
    tiers: Tuple[Tuple[int, int, Tier], ...] = ()

    def part(self, first: int, count: int) -> "Plan":
        """The plan of tables first .. first + count - 1 alone, numbered from 0 (their placements and
        tiers unchanged): one layer's share of a plan made for the tables of several."""
        def renumbered(s):
            return replace(s, feature=s.feature - first)
        tables = tuple(replace(t, feature=t.feature - first, shards=tuple(renumbered(s) for s in t.shards))
                       for t in self.tables[first:first + count])
        tiers = tuple((r, f - first, t) for r, f, t in self.tiers if first <= f < first + count)
        return Plan(self.world_size, self.strategy, tables, tiers)

    def shards_on(self, rank: int) -> List[Shard]:
        """The model-parallel shards owned by `rank`, sorted by (feature, col_start, row_start)."""
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank must be in [0, {self.world_size}), got {rank}")
        return sorted((s for t in self.tables for s in t.shards if s.rank == rank),
                      key=lambda s: (s.feature, s.col_start, s.row_start))

    @property
    def replicated(self) -> List[int]:
        """The features whose tables are replicated on every rank."""
        return [t.feature for t in self.tables if t.kind == "replicated"]

    def features_on(self, rank: int) -> List[int]:
        """The distinct features with a shard on `rank` (replicated ones excluded), sorted."""
        return sorted({s.feature for s in self.shards_on(rank)})

    def bytes_on(self, rank: int, bytes_per_element: int = 4, slots: int = 0) -> int:
        """Bytes of `rank`'s shards and of all replicated tables, with `slots` optimizer slots per parameter."""
        elements = sum(s.elements for s in self.shards_on(rank))
        elements += sum(self.tables[f].elements for f in self.replicated)
        return elements * bytes_per_element * (1 + slots)

    def tier(self, rank: int, feature: int) -> Tier:
        """The tier of `rank`'s shards of `feature` (Tier() for memory, replicated tables and absent units)."""
        return next((t for r, f, t in self.tiers if (r, f) == (rank, feature)), Tier())

    def units_on(self, rank: int) -> List[Tuple[int, int, int]]:
        """(feature, rows, width) of every unit on `rank`, by feature: its shards' rows (equal) and summed
        widths; a dynamic table's hash shards: their summed rows and the table's width."""
        units: Dict[int, Tuple[int, int]] = {}
        for s in self.shards_on(rank):
            rows, width = units.get(s.feature, (0, 0))
            units[s.feature] = (rows + s.num_rows, s.width) if self.tables[s.feature].kind == "dynamic" else \
                (s.num_rows, width + s.width)
        return [(f, rows, width) for f, (rows, width) in units.items()]

    def map_bytes_on(self, rank: int) -> int:
        """Bytes of the id maps of the dynamic tables' hash shards on `rank` (`dynamic_map_bytes`)."""
        return sum(dynamic_map_bytes(s.num_rows, self.tables[s.feature].dynamic.admit_after)
                   for s in self.shards_on(rank) if self.tables[s.feature].kind == "dynamic")

    def memory_bytes_on(self, rank: int, slots: int = 0) -> int:
        """Bytes `rank` holds in memory (device or host) at BYTES_PER_ELEMENT: replicated tables, memory
        and host units, disk units' caches and indexes, dynamic tables' id maps. Without tiers and
        dynamic tables: `bytes_on(rank, slots=slots)`."""
        return self._tier_bytes(rank, BYTES_PER_ELEMENT, slots)[0]

    def disk_bytes_on(self, rank: int, slots: int = 0) -> int:
        """Bytes of `rank`'s disk units in their files (rows with their optimizer slots)."""
        return self._tier_bytes(rank, BYTES_PER_ELEMENT, slots)[1]

    def _tier_bytes(self, rank: int, bytes_per_element: int, slots: int) -> Tuple[int, int]:
        """(bytes in memory, bytes on disk) of `rank`."""
        memory = sum(self.tables[f].elements for f in self.replicated) * bytes_per_element * (1 + slots)
        memory += self.map_bytes_on(rank)
        disk = 0
        for f, rows, width in self.units_on(rank):
            in_memory, on_disk = _unit_bytes(rows, width, self.tier(rank, f), bytes_per_element, slots)
            memory, disk = memory + in_memory, disk + on_disk
        return memory, disk

    def format(self, bytes_per_element: int = 4, slots: int = 0) -> str:
        """The plan as an aligned table: replicated tables, then every rank's shards and total, then the sum.
        With tiers, four more columns: the unit's tier and cache rows (on each of its shard lines), and its
        bytes in memory and on disk (on its first shard line; the totals: the ranks' and their sum)."""
        tiered = bool(self.tiers)

        def row(rank, feature="", kind="", rows="", cols="", elements=0, tier="", cache="", split=None):
            params = elements * bytes_per_element
            line = [rank, str(feature), kind, rows, cols, f"{elements:,}",
                    _human_bytes(params), _human_bytes(params * slots), _human_bytes(params * (1 + slots))]
            if tiered:
                line += [tier, cache] + ([_human_bytes(b) for b in split] if split else ["", ""])
            return line

        lines = [["rank", "feature", "kind", "rows", "cols", "elements", "params", "slots", "total"]]
        if tiered:
            lines[0] += ["tier", "cache rows", "in memory", "on disk"]
        replicated = sum(self.tables[f].elements for f in self.replicated)
        for f in self.replicated:
            t = self.tables[f]
            lines.append(row("on every rank", f, "replicated", f"0:{t.rows}", f"0:{t.dim}", t.elements, "memory",
                             split=(t.elements * bytes_per_element * (1 + slots), 0)))
        grand_total, grand_split = 0, (0, 0)
        for rank in range(self.world_size):
            shards = self.shards_on(rank)
            figures = {f: _unit_bytes(rows, width, self.tier(rank, f), bytes_per_element, slots)
                       for f, rows, width in self.units_on(rank)}
            for s in shards:   # a dynamic table's id maps
                if self.tables[s.feature].kind == "dynamic":
                    map_bytes = dynamic_map_bytes(s.num_rows, self.tables[s.feature].dynamic.admit_after)
                    figures[s.feature] = (figures[s.feature][0] + map_bytes, figures[s.feature][1])
            for i, s in enumerate(shards):
                tier = self.tier(rank, s.feature)
                first = i == 0 or shards[i - 1].feature != s.feature
                lines.append(row(str(rank), s.feature, self.tables[s.feature].kind, f"{s.row_start}:{s.row_end}",
                                 f"{s.col_start}:{s.col_end}", s.elements, tier.kind,
                                 f"{tier.cache_rows:,}" if tier.kind == "disk" else "",
                                 figures[s.feature] if first else None))
            total = replicated + sum(s.elements for s in shards)
            split = self._tier_bytes(rank, bytes_per_element, slots)
            lines.append(row(f"{rank} total", elements=total, split=split))
            grand_total += total
            grand_split = (grand_split[0] + split[0], grand_split[1] + split[1])
        lines.append(row("all ranks", elements=grand_total, split=grand_split))

        widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
        left = {0, 2, 3, 4, 9}   # text columns; numbers are right-aligned
        text = ["  ".join(cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in
                         enumerate(zip(line, widths))).rstrip() for line in lines]
        header = (f"embedding plan: strategy {self.strategy}, world size {self.world_size}, "
                  f"{len(self.tables)} table(s), {len(self.replicated)} replicated, "
                  f"{bytes_per_element} bytes/element, {slots} optimizer slot(s) per parameter")
        if tiered:
            kinds = [t.kind for _, _, t in self.tiers]
            header += f", {kinds.count('disk')} unit(s) on disk, {kinds.count('host')} in host memory"
        return "\n".join([header] + text)


def plan_tables(rows: Sequence[int], dims: Sequence[int], world_size: int, strategy: str = "memory_balanced",
                column_slice_threshold: Optional[int] = None, row_slice_threshold: Optional[int] = None,
                data_parallel_threshold: Optional[int] = None, tiers: Optional[TierOptions] = None,
                dynamic: Optional[Dict[int, DynamicOptions]] = None) -> Plan:
    """Places tables `rows[f]` x `dims[f]` on `world_size` ranks by the rules of the module docstring,
    with the tiers of `tiers` (rule 7; None: every unit in memory); `dynamic`: feature -> the options
    of its dynamic table (rule 2). Raises PlanError (one line) for invalid arguments, BudgetError
    for a budget below a rank's smallest plan."""
    dynamic = dict(dynamic or {})
    bad = sorted(f for f in dynamic if not 0 <= f < len(rows))
    if bad:
        raise PlanError(f"dynamic: no feature {bad[0]} (features 0..{len(rows) - 1})")
    rows = [dynamic[f].capacity if f in dynamic else r for f, r in enumerate(rows)]
    plan = _place(rows, dims, world_size, strategy, column_slice_threshold, row_slice_threshold,
                  data_parallel_threshold, dynamic)
    return plan if tiers is None else assign_tiers(plan, tiers.slots, tiers.budget_bytes, tiers.min_cache_rows,
                                                   tiers.host_threshold_bytes)


def _place(rows, dims, world_size, strategy, column_slice_threshold, row_slice_threshold,
           data_parallel_threshold, dynamic) -> Plan:
    """Rules 1-6."""
    rows, dims = _validate(rows, dims, world_size, strategy, column_slice_threshold, row_slice_threshold,
                           data_parallel_threshold)
    n, features = world_size, range(len(rows))
    kinds: List[Optional[str]] = ["dynamic" if f in dynamic else None for f in features]
    hashed = {f: tuple(Shard(f, k % n, start, end, 0, dims[f])
                       for k, (start, end) in enumerate(_near_equal_ranges(rows[f], d.shards)))
              for f, d in dynamic.items()}
    if n == 1:
        whole = (TablePlacement(f, rows[f], dims[f], kinds[f] or "whole",
                                hashed.get(f, (Shard(f, 0, 0, rows[f], 0, dims[f]),)), dynamic.get(f)) for f in features)
        return Plan(1, strategy, tuple(whole))

    for f in features:
        elements = rows[f] * dims[f]
        if kinds[f] == "dynamic":
            continue
        if data_parallel_threshold is not None and elements <= data_parallel_threshold:
            kinds[f] = "replicated"
        elif row_slice_threshold is not None and elements > row_slice_threshold and rows[f] >= n:
            kinds[f] = "row"
    remaining = [f for f in features if kinds[f] is None]
    slices = _slice_counts(remaining, rows, dims, n, column_slice_threshold)

    shards: List[List[Shard]] = [[] for _ in features]
    loads = [0] * n
    for f in features:
        if kinds[f] == "row":
            for r, (start, end) in enumerate(_near_equal_ranges(rows[f], n)):
                shards[f].append(Shard(f, r, start, end, 0, dims[f]))
                loads[r] += (end - start) * dims[f]
    for f in dynamic:
        shards[f] = list(hashed[f])
        for shard in hashed[f]:
            loads[shard.rank] += shard.elements
    pieces = [(f, i, start, end) for f in remaining for i, (start, end) in enumerate(_near_equal_ranges(dims[f], slices[f]))]
    for (f, _, start, end), rank in zip(pieces, _assign(pieces, rows, loads, strategy)):
        shards[f].append(Shard(f, rank, 0, rows[f], start, end))
    for f in remaining:
        kinds[f] = "whole" if slices[f] == 1 else "column"
    return Plan(n, strategy, tuple(TablePlacement(f, rows[f], dims[f], kinds[f], tuple(shards[f]), dynamic.get(f))
                                   for f in features))


def _validate(rows, dims, world_size, strategy, column_slice_threshold, row_slice_threshold,
              data_parallel_threshold) -> Tuple[List[int], List[int]]:
    """Checks the arguments of `plan_tables`; returns rows and dims as lists of ints."""
    _integer("world_size", world_size, 1)
    if len(rows) != len(dims):
        raise PlanError(f"rows and dims must have the same length, got {len(rows)} and {len(dims)}")
    if not rows:
        raise PlanError("rows and dims must name at least one table, got none")
    rows = [_integer(f"rows[{f}] (feature {f})", r, 1) for f, r in enumerate(rows)]
    dims = [_integer(f"dims[{f}] (feature {f})", d, 1) for f, d in enumerate(dims)]
    if strategy not in STRATEGIES:
        raise PlanError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    for name, value, minimum in (("column_slice_threshold", column_slice_threshold, 1),
                                 ("row_slice_threshold", row_slice_threshold, 1),
                                 ("data_parallel_threshold", data_parallel_threshold, 0)):
        if value is not None:
            _integer(name, value, minimum)
    return rows, dims


def _integer(name: str, value, minimum: int) -> int:
    """`value` as an int >= `minimum`, else PlanError naming it."""
    try:
        value = operator.index(value)
    except TypeError:
        raise PlanError(f"{name} must be an integer, got {value!r}") from None
    if value < minimum:
        raise PlanError(f"{name} must be >= {minimum}, got {value}")
    return value


def assign_tiers(plan: Plan, slots: int, budget_bytes: Optional[int], min_cache_rows: Sequence[int],
                 host_threshold_bytes: Optional[int] = None) -> Plan:
    """`plan` with the tiers of its units (earlier tiers replaced) by rule 7 of the module docstring.

    slots: optimizer slots per parameter. budget_bytes: a rank's bytes of embedding state in memory
    (None: no limit). min_cache_rows[f]: the fewest cache rows of a disk unit of feature f (the rows
    of the batches in flight; clamped to the unit's rows). host_threshold_bytes: parameter bytes
    above which units go to host memory (None: never). Raises PlanError (one line) for invalid
    arguments, BudgetError for a budget below a rank's smallest plan."""
    _integer("slots", slots, 0)
    if budget_bytes is not None:
        _integer("budget_bytes", budget_bytes, 1)
    if host_threshold_bytes is not None:
        _integer("host_threshold_bytes", host_threshold_bytes, 0)
    if len(min_cache_rows) != len(plan.tables):
        raise PlanError(f"min_cache_rows must have one entry per table ({len(plan.tables)}), got {len(min_cache_rows)}")
    minimum = [_integer(f"min_cache_rows[{f}] (feature {f})", m, 0) for f, m in enumerate(min_cache_rows)]
    replicated = sum(plan.tables[f].elements for f in plan.replicated) * BYTES_PER_ELEMENT
    tiers = []
    for rank in range(plan.world_size):
        shards = [s.feature for s in plan.shards_on(rank)]
        units = [u for u in plan.units_on(rank) if plan.tables[u[0]].kind != "dynamic" or shards.count(u[0]) == 1]
        hashed = sum(rows * width for f, rows, width in plan.units_on(rank)   # several hash shards: in memory
                     if plan.tables[f].kind == "dynamic" and shards.count(f) > 1) * BYTES_PER_ELEMENT
        fixed = {"replicated tables": replicated * (1 + slots),
                 "dynamic tables' id maps" + (" and hash shards in memory (rows, slots)" if hashed else ""):
                     hashed * (1 + slots) + plan.map_bytes_on(rank)}
        disk = {} if budget_bytes is None else _disk_tiers(rank, units, fixed, slots, budget_bytes, minimum)
        tiers += [(rank, f, tier) for f, tier in disk.items()]
        if host_threshold_bytes is not None:
            in_memory = [(f, rows * width * BYTES_PER_ELEMENT) for f, rows, width in units if f not in disk]
            dynamic = hashed + sum(b for f, b in in_memory if plan.tables[f].kind == "dynamic")   # never on host
            in_memory = [(f, b) for f, b in in_memory if plan.tables[f].kind != "dynamic"]
            params = replicated + dynamic + sum(b for _, b in in_memory)
            for f, b in sorted(in_memory, key=lambda u: (-u[1], u[0])):
                if params <= host_threshold_bytes:
                    break
                tiers.append((rank, f, Tier("host")))
                params -= b
    return replace(plan, tiers=tuple(sorted(tiers, key=lambda t: t[:2])))


def _disk_tiers(rank: int, units: List[Tuple[int, int, int]], fixed: Dict[str, int], slots: int, budget: int,
                minimum: List[int]) -> Dict[int, Tier]:
    """feature -> disk tier of the units (feature, rows, width) of `rank` that go to disk so that
    the `fixed` bytes (what -> bytes: replicated and dynamic tables) and the units fit in `budget`
    bytes; {} if all fit in memory."""
    rows = {f: r for f, r, _ in units}
    row_bytes = {f: BYTES_PER_ELEMENT * (1 + slots) * w for f, _, w in units}
    full = {f: rows[f] * row_bytes[f] for f in rows}
    lowest = {f: min(minimum[f], rows[f]) for f in rows}

    def on_disk(f, cache_rows):   # memory of unit f on disk
        return _disk_unit_memory(rows[f], row_bytes[f], cache_rows)

    need = sum(fixed.values()) + sum(full.values())
    if need <= budget:
        return {}
    disk = []
    for f in sorted((f for f in rows if on_disk(f, lowest[f]) < full[f]), key=lambda f: (-full[f], f)):
        if need <= budget:
            break
        disk.append(f)
        need += on_disk(f, lowest[f]) - full[f]
    if need > budget:
        kept = sum(full[f] for f in rows if f not in disk)
        parts = [f"{what} {b} bytes" for what, b in fixed.items() if b]
        parts += [f"tables smaller in memory than on disk {kept} bytes"] if kept else []
        parts += [f"feature {f} on disk {on_disk(f, lowest[f])} bytes (a cache for the {lowest[f]} rows of the "
                  f"batches in flight, {row_bytes[f] + SLOT_OVERHEAD_BYTES} bytes each, plus its index of {rows[f]} "
                  f"rows, {INDEX_BYTES_PER_ROW} bytes each)" for f in sorted(disk)]
        raise BudgetError(f"rank {rank}: an embedding memory budget of {budget} bytes is too small: the smallest plan "
                        f"needs {need} bytes ({_human_bytes(need)}): {'; '.join(parts)}")

    def cache(f, c, d):   # cache rows of unit f at load factor c / d
        return min(rows[f], max(lowest[f], c * rows[f] // d))

    rest = need - sum(on_disk(f, lowest[f]) for f in disk)   # what stays the same at every load factor

    def fits(c, d):
        return rest + sum(on_disk(f, cache(f, c, d)) for f in disk) <= budget

    # The caches change only at load factors c / rows[f]: the largest that fits, over every disk unit f.
    best = (0, 1)
    for f in disk:
        low, high = 0, rows[f]   # fits(low, rows[f]); find the largest such c
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid, rows[f]) else (low, mid - 1)
        if low * best[1] > best[0] * rows[f]:
            best = (low, rows[f])
    return {f: Tier("disk", cache(f, *best)) for f in disk}


def dynamic_map_bytes(rows: int, admit_after: int) -> int:
    """Bytes of the id map of a dynamic table's hash shard of `rows` rows admitting ids at their
    `admit_after`-th sighting: an upper bound (MAP_ROW_BYTES, MAP_BUCKET_BYTES, MAP_CANDIDATE_BYTES)."""
    candidates = 4 * _power_of_two(-(-rows // 4)) if admit_after > 1 else 0
    return _power_of_two(2 * rows) * MAP_BUCKET_BYTES + rows * MAP_ROW_BYTES + candidates * MAP_CANDIDATE_BYTES


def _power_of_two(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()


def _unit_bytes(rows: int, width: int, tier: Tier, bytes_per_element: int, slots: int) -> Tuple[int, int]:
    """(bytes in memory, bytes on disk) of a unit of `rows` x `width` parameters in `tier`."""
    row_bytes = bytes_per_element * (1 + slots) * width
    if tier.kind != "disk":
        return rows * row_bytes, 0
    return _disk_unit_memory(rows, row_bytes, tier.cache_rows), rows * row_bytes


def _disk_unit_memory(rows: int, row_bytes: int, cache_rows: int) -> int:
    """Bytes a disk unit of `rows` rows keeps in memory: its cache (rows with slots, and their
    bookkeeping) and its index (one entry per row)."""
    return cache_rows * (row_bytes + SLOT_OVERHEAD_BYTES) + rows * INDEX_BYTES_PER_ROW


def _slice_counts(remaining, rows, dims, n, threshold) -> List[int]:
    """The number of column slices of each table in `remaining` (indexed by feature; 0 for the others)."""
    counts = [0] * len(rows)

    def can_double(f):
        return 2 * counts[f] <= min(n, dims[f])

    def largest_slice(f):
        return rows[f] * math.ceil(dims[f] / counts[f])

    for f in remaining:
        counts[f] = 1
        while threshold is not None and largest_slice(f) > threshold and can_double(f):
            counts[f] *= 2
    if 0 < len(remaining) < n:
        while sum(counts) < n:
            candidates = [f for f in remaining if can_double(f)]
            if not candidates:
                break
            counts[max(candidates, key=lambda f: (largest_slice(f), -f))] *= 2
    return counts


def _near_equal_ranges(length: int, parts: int) -> List[Tuple[int, int]]:
    """[0, length) cut into `parts` contiguous ranges whose sizes differ by at most 1, the longer first."""
    base, extra = divmod(length, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return list(zip(bounds, bounds[1:]))


def _assign(pieces, rows, loads, strategy) -> List[int]:
    """The rank of every piece (feature, slice, col_start, col_end), given each rank's elements so far."""
    n = len(loads)
    if strategy == "basic":
        return [i % n for i in range(len(pieces))]
    loads = list(loads)
    size = [rows[f] * (end - start) for f, _, start, end in pieces]
    order = sorted(range(len(pieces)), key=lambda i: (-size[i], pieces[i][0], pieces[i][1]))
    holders = {f: set() for f, *_ in pieces}   # feature -> ranks holding one of its slices
    ranks = [0] * len(pieces)
    for position, i in enumerate(order):
        feature = pieces[i][0]
        if strategy == "memory_balanced":
            lap, step = divmod(position, n)
            rank = step if lap % 2 == 0 else n - 1 - step
        else:
            free = [r for r in range(n) if r not in holders[feature]] or range(n)
            rank = min(free, key=lambda r: (loads[r], r))
        ranks[i] = rank
        loads[rank] += size[i]
        holders[feature].add(rank)
    return ranks


def _human_bytes(n: int) -> str:
    """`n` bytes in binary units: "512 B", "12.3 MiB"."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
