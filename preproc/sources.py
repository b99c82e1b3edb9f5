"""What the pipeline reads: a Source plans the splits of its input files and turns each split into
blocks of parsed Rows; its Schema names the output features. `CriteoSource` is the Criteo
preset (preproc.parsing's fast TSV parser); preproc.raw_source reads any CSV or Parquet log a
raw spec (preproc.raw_spec) describes.
"""
import dataclasses
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from preproc import parsing, reading


@dataclasses.dataclass
class Schema:
    """The output features: `categorical` in table order, `max_hotness` of the multi-hot ones,
    `buckets` of the hashed ones (no vocabulary: id 1 + key % buckets), `raw_ids` those whose ids
    are their values' 64-bit keys (no vocabulary: the key as int64), `histories` the history
    features and the one-hot feature whose ids each holds (preproc.history; in `max_hotness` too),
    `gaps` those of them that hold their events' time gaps instead (ids in [1, GAP_IDS)), `names` what flags and messages call each categorical feature, `rules` the metadata that
    describes the transform."""
    numerical: List[str]
    categorical: List[str]
    label: str = "label"
    max_hotness: Dict[str, int] = dataclasses.field(default_factory=dict)
    buckets: Dict[str, int] = dataclasses.field(default_factory=dict)
    raw_ids: List[str] = dataclasses.field(default_factory=list)
    histories: Dict[str, str] = dataclasses.field(default_factory=dict)
    gaps: List[str] = dataclasses.field(default_factory=list)
    names: List[str] = None
    rules: dict = dataclasses.field(default_factory=dict)

    @property
    def counted(self) -> List[int]:
        """Indices of the categorical features with a vocabulary."""
        return [k for k, f in enumerate(self.categorical)
                if f not in self.buckets and f not in self.raw_ids and f not in self.histories]

    def name(self, k: int) -> str:
        return self.categorical[k] if self.names is None else f"{self.names[k]} ({self.categorical[k]})"


@dataclasses.dataclass
class Rows:
    """The good lines of a block: `lines` [n] their 0-based line numbers in the block, `labels` [n]
    uint8, `numerical` [n, N] float32 (transformed), `categorical` per feature (keys [n] uint64,
    missing [n] bool), or for a multi-hot feature (keys [K] uint64 of all its values, lengths [n]
    int64), or None for a history feature, whose `events` are (user keys [n] uint64, times [n]
    float64, counts [n] bool: the row's item enters later histories); `bad` (line number, reason)
    per bad line; `num_lines` the lines of the block; `mapping` [num_lines] int8 (a split by value:
    each line's mapping index, -1 for none)."""
    lines: np.ndarray
    labels: np.ndarray
    numerical: np.ndarray
    categorical: List[Tuple[np.ndarray, np.ndarray]]
    bad: List[Tuple[int, str]]
    num_lines: int
    mapping: Optional[np.ndarray] = None
    events: Dict[str, Tuple[np.ndarray, np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)


class Source:
    """Reads the input files; `by_value`: the split comes from a column (Rows.mapping)."""
    schema: Schema
    by_value = False
    header_lines = 0          # lines before the first row of each file (reports count file lines)

    def plan(self, paths: List[str], split_bytes: int) -> List[reading.Split]:
        return reading.plan_splits(paths, split_bytes)

    def count(self, split: reading.Split, block_bytes: int) -> int:
        """The rows (lines) of a split."""
        return sum(reading.count_lines(b) for b in reading.iter_blocks(split, block_bytes))

    def rows(self, split: reading.Split, block_bytes: int) -> Iterator[Rows]:
        raise NotImplementedError

    def wanted(self, paths: List[str]) -> Tuple[str, ...]:
        """A split by value: the mappings it means to fill (each must get rows)."""
        raise NotImplementedError


NUMERICAL = [f"num_{k}" for k in range(parsing.NUM_INTEGER)]
CATEGORICAL = [f"cat_{k}" for k in range(parsing.NUM_CATEGORICAL)]
CRITEO_RULES = {"numerical": "log(v + 3); v < -2 counts as -2; missing -> 0"}


class CriteoSource(Source):
    """The Criteo preset: label, I1..I13 -> num_0..num_12, C1..C26 (hex) -> cat_0..cat_25;
    `raw_ids`: the features (cat_K) whose ids are the hex values' numbers."""

    def __init__(self, raw_ids: List[str] = ()):
        self.schema = Schema(NUMERICAL, CATEGORICAL, raw_ids=list(raw_ids), names=parsing.CATEGORICAL_NAMES,
                             rules=CRITEO_RULES)

    def rows(self, split, block_bytes):
        for data in reading.iter_blocks(split, block_bytes):
            b = parsing.parse_block(data)
            yield Rows(b.lines, b.labels, parsing.transform_integers(b.integers, b.integer_missing),
                       [(b.categorical[:, k], b.categorical_missing[:, k]) for k in range(parsing.NUM_CATEGORICAL)],
                       b.bad, b.num_lines)
