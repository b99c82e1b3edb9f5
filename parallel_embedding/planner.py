"""Placement of embedding tables over N ranks (hybrid parallelism: tables model-parallel, MLPs data-parallel).

`plan_tables` decides, for every table (feature f: `rows[f]` x `dims[f]`, elements = rows x dim),
how it is stored. The rules apply in this order:

1. One rank: every table is "whole" on rank 0; the thresholds have no effect.
2. "replicated": elements <= `data_parallel_threshold`. A full copy on every rank, no shards.
3. "row": elements > `row_slice_threshold` and rows >= N. One full-width shard per rank, rank r
   holding the r-th of N contiguous near-equal row ranges (the first rows % N ranks one row more).
4. The remaining tables are cut into 2^k column slices ("column"; k = 0 is "whole"):
   - with `column_slice_threshold` T: the smallest k with rows * ceil(dim / 2^k) <= T, stopping
     at the caps 2^k <= N and 2^k <= dim;
   - then, if there are fewer such tables than ranks, the table whose largest slice has the most
     elements (ties: lower feature) has its slice count doubled, while there are fewer pieces
     than ranks and some table can still double within the caps.
   Slices are contiguous, their widths differ by at most 1, the wider ones first.
5. The pieces (whole tables and column slices; row shards are already one per rank) are dealt
   to ranks by `strategy`:
   - "basic": the i-th piece in (feature, slice) order goes to rank i % N;
   - "memory_balanced": pieces by elements, largest first (ties: feature, slice), dealt in snake
     order 0, 1, ..., N-1, N-1, ..., 0, 0, 1, ...: equal counts (+-1) and similar memory;
   - "memory_optimized": pieces in the same order, each to the rank with the fewest elements so
     far (row shards included), preferring ranks without a piece of the same table; ties: lowest rank.

Everything is deterministic. This module is pure Python so that plans can be made and checked
without TensorFlow.
"""
import math
import operator
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

STRATEGIES = ("basic", "memory_balanced", "memory_optimized")


class PlanError(ValueError):
    """An invalid argument to `plan_tables` (the message names it)."""


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
    kind: str            # "replicated" | "whole" | "column" | "row"
    shards: Tuple[Shard, ...]

    @property
    def elements(self) -> int:
        return self.rows * self.dim


@dataclass(frozen=True)
class Plan:
    """Where every table lives; `tables[f]` is feature f's placement."""
    world_size: int
    strategy: str
    tables: Tuple[TablePlacement, ...]

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

    def format(self, bytes_per_element: int = 4, slots: int = 0) -> str:
        """The plan as an aligned table: replicated tables, then every rank's shards and total, then the sum."""
        def row(rank, feature="", kind="", rows="", cols="", elements=0):
            params = elements * bytes_per_element
            return [rank, str(feature), kind, rows, cols, f"{elements:,}",
                    _human_bytes(params), _human_bytes(params * slots), _human_bytes(params * (1 + slots))]

        lines = [["rank", "feature", "kind", "rows", "cols", "elements", "params", "slots", "total"]]
        lines += [row("on every rank", f, "replicated", f"0:{self.tables[f].rows}", f"0:{self.tables[f].dim}",
                      self.tables[f].elements) for f in self.replicated]
        replicated = sum(self.tables[f].elements for f in self.replicated)
        grand_total = 0
        for rank in range(self.world_size):
            shards = self.shards_on(rank)
            lines += [row(str(rank), s.feature, self.tables[s.feature].kind, f"{s.row_start}:{s.row_end}",
                          f"{s.col_start}:{s.col_end}", s.elements) for s in shards]
            total = replicated + sum(s.elements for s in shards)
            lines.append(row(f"{rank} total", elements=total))
            grand_total += total
        lines.append(row("all ranks", elements=grand_total))

        widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
        left = {0, 2, 3, 4}   # text columns; numbers are right-aligned
        text = ["  ".join(cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in
                         enumerate(zip(line, widths))).rstrip() for line in lines]
        header = (f"embedding plan: strategy {self.strategy}, world size {self.world_size}, "
                  f"{len(self.tables)} table(s), {len(self.replicated)} replicated, "
                  f"{bytes_per_element} bytes/element, {slots} optimizer slot(s) per parameter")
        return "\n".join([header] + text)


def plan_tables(rows: Sequence[int], dims: Sequence[int], world_size: int, strategy: str = "memory_balanced",
                column_slice_threshold: Optional[int] = None, row_slice_threshold: Optional[int] = None,
                data_parallel_threshold: Optional[int] = None) -> Plan:
    """Places tables `rows[f]` x `dims[f]` on `world_size` ranks by the rules of the module docstring."""
    rows, dims = _validate(rows, dims, world_size, strategy, column_slice_threshold, row_slice_threshold,
                           data_parallel_threshold)
    n, features = world_size, range(len(rows))
    if n == 1:
        whole = (TablePlacement(f, rows[f], dims[f], "whole", (Shard(f, 0, 0, rows[f], 0, dims[f]),)) for f in features)
        return Plan(1, strategy, tuple(whole))

    kinds: List[Optional[str]] = [None] * len(rows)
    for f in features:
        elements = rows[f] * dims[f]
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
    pieces = [(f, i, start, end) for f in remaining
              for i, (start, end) in enumerate(_near_equal_ranges(dims[f], slices[f]))]
    for (f, _, start, end), rank in zip(pieces, _assign(pieces, rows, loads, strategy)):
        shards[f].append(Shard(f, rank, 0, rows[f], start, end))
    for f in remaining:
        kinds[f] = "whole" if slices[f] == 1 else "column"
    return Plan(n, strategy, tuple(TablePlacement(f, rows[f], dims[f], kinds[f], tuple(shards[f])) for f in features))


def _validate(rows, dims, world_size, strategy, column_slice_threshold, row_slice_threshold,
              data_parallel_threshold) -> Tuple[List[int], List[int]]:
    """Checks the arguments of `plan_tables`; returns rows and dims as lists of ints."""
    def integer(name, value, minimum):
        try:
            value = operator.index(value)
        except TypeError:
            raise PlanError(f"{name} must be an integer, got {value!r}") from None
        if value < minimum:
            raise PlanError(f"{name} must be >= {minimum}, got {value}")
        return value

    integer("world_size", world_size, 1)
    if len(rows) != len(dims):
        raise PlanError(f"rows and dims must have the same length, got {len(rows)} and {len(dims)}")
    if not rows:
        raise PlanError("rows and dims must name at least one table, got none")
    rows = [integer(f"rows[{f}] (feature {f})", r, 1) for f, r in enumerate(rows)]
    dims = [integer(f"dims[{f}] (feature {f})", d, 1) for f, d in enumerate(dims)]
    if strategy not in STRATEGIES:
        raise PlanError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    for name, value, minimum in (("column_slice_threshold", column_slice_threshold, 1),
                                 ("row_slice_threshold", row_slice_threshold, 1),
                                 ("data_parallel_threshold", data_parallel_threshold, 0)):
        if value is not None:
            integer(name, value, minimum)
    return rows, dims


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
