"""Which mapping (train/test/validation) each line goes to, and where in the output it lands.

Lines are numbered globally over the input files in order. By day (files day_0 ... day_N):
every day but the last is training, the last day's first half (floor) is test and the rest
validation. By fraction: the first lines are training, then the test lines
(round(lines * test_fraction)), then the validation lines (or the mappings in another order). A
split by a column's value (preproc.raw_source) numbers each mapping's rows in input order
instead of the lines and lays the mappings out in turn (`by_counts`). A mapping the split means
to fill (every one by day, one of a positive fraction) that gets no line is an error naming why.
A mapping's rows are written as
part files of at most `part_rows` lines each, in line order; shuffled training rows instead go
to part hash % parts and are ordered by the hash, a seeded 64-bit mix of the line's index in the
mapping: a global shuffle that depends on nothing but the input and the seed.
"""
import dataclasses
import math
import os
import re
from typing import Dict, List, Tuple

import numpy as np

from utils.errors import DatasetError

MAPPINGS = ("train", "test", "validation")
_DAY = re.compile(r"day_(\d+)(\.gz)?")


def day_of(path: str):
    match = _DAY.fullmatch(os.path.basename(path))
    return int(match.group(1)) if match else None


@dataclasses.dataclass
class Layout:
    """Segments of global line numbers: (start, end, mapping index, index in the mapping of start)."""
    segments: List[Tuple[int, int, int, int]]
    lines: Dict[str, int]            # lines per mapping (good and bad)
    part_rows: int
    shuffle_seed: int = -1           # >= 0: training rows shuffled with this seed
    wanted: Tuple[str, ...] = MAPPINGS   # the mappings the split means to fill (not one of a fraction of 0)

    def parts(self, mapping: str) -> int:
        return max(1, math.ceil(self.lines[mapping] / self.part_rows))

    def part_base(self, mapping: str) -> int:
        """The global part id of the mapping's first part (parts of all mappings numbered in turn)."""
        return sum(self.parts(m) for m in MAPPINGS[:MAPPINGS.index(mapping)])

    def unshuffled(self, pids: np.ndarray) -> np.ndarray:
        """Whether each global part id holds rows in line order (all but shuffled training parts)."""
        return np.full(len(pids), self.shuffle_seed < 0) | (pids >= self.parts("train"))

    def assign(self, lines: np.ndarray):
        """Per global line number: (mapping index, global part id, sort key as int64)."""
        starts = np.array([s[0] for s in self.segments], np.int64)
        seg = np.searchsorted(starts, lines, side="right") - 1
        table = np.array(self.segments, np.int64).reshape(-1, 4)
        mapping = table[seg, 2]
        index = (lines - table[seg, 0] + table[seg, 3]).astype(np.uint64)
        parts = np.array([self.parts(m) for m in MAPPINGS], np.uint64)[mapping]
        base = np.array([self.part_base(m) for m in MAPPINGS], np.int64)[mapping]
        key, part = index, index // np.uint64(self.part_rows)
        if self.shuffle_seed >= 0:
            shuffled = mapping == MAPPINGS.index("train")
            mixed = mix(index, self.shuffle_seed)
            key = np.where(shuffled, mixed, key)
            part = np.where(shuffled, mixed % parts, part)
        return mapping, base + part.astype(np.int64), key.view(np.int64)


def mix(x: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 of x + seed's offset: a bijection of uint64, so distinct lines get distinct keys."""
    z = x.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) % 2 ** 64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_buckets(keys: np.ndarray, seed: int, buckets: int):
    """(bucket, indices of its keys, in order) of every non-empty bucket of mix(keys, seed) % buckets."""
    bucket = (mix(keys, seed) % np.uint64(buckets)).astype(np.int64)
    order = np.argsort(bucket, kind="stable")
    sizes = np.bincount(bucket, minlength=buckets)
    ends = np.cumsum(sizes)
    for b in np.flatnonzero(sizes):
        yield int(b), order[ends[b] - sizes[b]:ends[b]]


def by_day(file_lines: List[int], days: List[int], part_rows: int, shuffle_seed: int) -> Layout:
    """Every day but the last (highest number): train; the last day: test, then validation halves."""
    last = max(days)
    segments, start, index = [], 0, {m: 0 for m in MAPPINGS}

    def add(mapping, n):
        nonlocal start
        if n:
            segments.append((start, start + n, MAPPINGS.index(mapping), index[mapping]))
            index[mapping] += n
            start += n

    for n, day in zip(file_lines, days):
        if day != last:
            add("train", n)
        else:
            add("test", n // 2)
            add("validation", n - n // 2)
    if not index["train"]:
        raise DatasetError("train: no lines: the days before the last one are empty")
    if not index["test"]:
        raise DatasetError(f"test: no lines: the last day, day_{last}, has {index['validation']} line(s), too few to "
                           "halve into test and validation")
    return Layout(segments, index, part_rows, shuffle_seed)


def by_fraction(total_lines: int, test_fraction: float, validation_fraction: float, part_rows: int,
                shuffle_seed: int, order: Tuple[str, ...] = MAPPINGS) -> Layout:
    """round(lines x fraction) test and validation lines, the rest training, the mappings in `order`."""
    fractions = {"test": test_fraction, "validation": validation_fraction}
    counts = {m: round(total_lines * f) for m, f in fractions.items()}
    counts["train"] = total_lines - sum(counts.values())
    wanted = tuple(m for m in MAPPINGS if m == "train" or fractions[m] > 0)
    for m in wanted:
        if not counts[m]:
            why = (f"{fractions[m]} of the {total_lines} input lines rounds to none (a fraction of 0 leaves it empty "
                   "on purpose)" if m != "train" else f"test and validation take all {total_lines} input lines")
            raise DatasetError(f"{m}: no lines: {why}")
    return by_counts(counts, part_rows, shuffle_seed, order, wanted)


def by_counts(counts: Dict[str, int], part_rows: int, shuffle_seed: int, order: Tuple[str, ...] = MAPPINGS,
              wanted: Tuple[str, ...] = MAPPINGS) -> Layout:
    """The first counts[order[0]] positions go to mapping order[0], the next ones to order[1], ..."""
    segments, start = [], 0
    for mapping in order:
        if counts[mapping]:
            segments.append((start, start + counts[mapping], MAPPINGS.index(mapping), 0))
            start += counts[mapping]
    return Layout(segments, counts, part_rows, shuffle_seed, wanted)
