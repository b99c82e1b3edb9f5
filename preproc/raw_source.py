"""A Source for any CSV (plain or .gz, with or without a header) or Parquet log that a raw spec
(preproc.raw_spec) describes: blocks of lines (CSV, pyarrow's reader) or record batches
(Parquet, one split per file) -> Rows, in numpy and pyarrow.

Every categorical value becomes a uint64 key before the vocabulary or the hash sees it: `string`
values pandas' 64-bit SipHash of their UTF-8 text (pd.util.hash_array, categorize=False), `hex`
values their number (up to 16 digits, so `0a` = `A`), `int` values their two's complement.
Empty values (and the empty entries of a list) are missing. A row is bad, with the first reason
found, when its field count differs from the header's, the label cannot be read, a number or
key cannot be read, a list is longer than its max_hotness, a transformed number is outside
float16, or the file lacks a column the spec names.
"""
import gzip
import math
import os
import re
from typing import Iterator, List, Optional

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from preproc import history, parsing, reading
from preproc.layout import MAPPINGS
from preproc.raw_spec import Categorical, Numerical, RawSpec
from preproc.sources import Rows, Schema, Source
from utils.errors import DatasetError

PARQUET_BATCH_ROWS = 1 << 16
FLOAT16_MAX = 65504.0
_HEX = re.compile(r"[0-9a-fA-F]{1,16}")


class RawSource(Source):
    """The source of `spec`; `raw_ids`: the categorical features (names) whose ids are their keys."""

    def __init__(self, spec: RawSpec, raw_ids: List[str] = ()):
        self.spec = spec
        cats = spec.categorical
        self.by_value = spec.split in ("column", "files")
        self.header_lines = int(spec.format == "csv" and spec.header)
        histories = {c.name: c.history.of for c in cats if c.history}
        gaps = [c.name for c in cats if c.history and c.history.gaps]
        raw_ids = list(raw_ids) + [h for h, item in histories.items() if item in raw_ids and h not in gaps]
        self.schema = Schema([n.name for n in spec.numerical], [c.name for c in cats],
                             max_hotness={c.name: c.max_hotness or c.history.max_length for c in cats
                                          if c.max_hotness or c.history},
                             buckets={c.name: c.buckets for c in cats if c.buckets}, raw_ids=raw_ids,
                             histories=histories, gaps=gaps, rules=_rules(spec, raw_ids))

    def plan(self, paths, split_bytes):
        named = [os.path.abspath(p) for p in self.spec.test_files + self.spec.validation_files]
        unknown = sorted(set(named) - set(map(os.path.abspath, paths)))
        if unknown:
            raise DatasetError(f"split: {unknown[0]} is not one of the input files")
        self._check_columns(paths)
        if self.spec.format == "parquet":
            return [reading.Split(k, p, k) for k, p in enumerate(paths)]
        return reading.plan_splits(paths, split_bytes)

    def _check_columns(self, paths):
        """Every column the spec names must be in some input file (a file without one: its lines
        are bad); empty CSV files have no columns to check."""
        if self.spec.columns:
            return                                  # (raw_spec checked them)
        columns = {}
        for path in paths:
            names = self._columns(path)
            if names is not None:
                columns[path] = names
        for c in self.spec.columns_used():
            if columns and not any(c in names for names in columns.values()):
                path, names = next(iter(columns.items()))
                more = len(columns) - 1
                where = f"{path} and {more} more input file{'s' * (more > 1)}" if more else path
                shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "") if names else "none readable"
                raise DatasetError(f"{where}: no column {c!r}, which the spec names (columns: {shown})")

    def _columns(self, path: str):
        """An input file's column names (None: an empty CSV file)."""
        try:
            if self.spec.format == "csv":
                return _header(path, self.spec.delimiter)
            return pq.read_schema(path).names
        except (pa.ArrowException, OSError, EOFError) as e:
            raise DatasetError(f"{path}: cannot read it ({(str(e) or type(e).__name__).splitlines()[0]})")

    def wanted(self, paths):
        """Train, and test and validation where a bound or a file names them (a bound left out, or
        test_from = validation_from, leaves test or validation empty on purpose)."""
        spec = self.spec
        if spec.split == "files":
            chosen = {MAPPINGS[spec.file_mapping(p)] for p in paths}
        else:
            chosen = {"train"}
            if spec.test_from is not None and spec.test_from != spec.validation_from:
                chosen.add("test")
            if spec.validation_from is not None:
                chosen.add("validation")
        return tuple(m for m in MAPPINGS if m in chosen)

    def count(self, split, block_bytes):
        if self.spec.format == "parquet":
            return pq.ParquetFile(split.path).metadata.num_rows
        lines = super().count(split, block_bytes)
        return max(lines - 1, 0) if self.header_lines and split.start == 0 else lines

    def rows(self, split, block_bytes) -> Iterator[Rows]:
        if self.spec.format == "parquet":
            f = pq.ParquetFile(split.path)
            present = [c for c in self.spec.columns_used() if c in f.schema_arrow.names]
            for batch in f.iter_batches(PARQUET_BATCH_ROWS, columns=present):
                yield self._rows(pa.Table.from_batches([batch]), np.arange(batch.num_rows), [], batch.num_rows,
                                 f.schema_arrow.names, split.path)
            return
        names = self.spec.columns or _header(split.path, self.spec.delimiter)
        skip_header = self.header_lines and split.start == 0
        for data in reading.iter_blocks(split, block_bytes):
            if skip_header:
                data, skip_header = data[data.find(b"\n") + 1 if b"\n" in data else len(data):], False
                if not data:
                    continue
            yield self._csv_rows(data, names, split.path)

    def _csv_rows(self, data: bytes, names: List[str], path: str) -> Rows:
        num_lines = reading.count_lines(data)
        used = [c for c in self.spec.columns_used() if c in names]
        if len(used) < len(self.spec.columns_used()):
            return self._rows(None, np.zeros(0, np.int64), [], num_lines, names, path)
        table, lines, bad = parsing.read_strings(data, num_lines, names, self.spec.delimiter, used)
        return self._rows(table, lines, bad, num_lines, names, path)

    def _rows(self, table, lines: np.ndarray, bad: list, num_lines: int, names: List[str], path: str) -> Rows:
        """Rows from `table` (the good-shaped lines `lines` of a block of `path`); None: every line is bad."""
        spec = self.spec
        mapping = np.full(num_lines, -1, np.int8) if self.by_value else None
        missing = [c for c in spec.columns_used() if c not in names]
        if missing:
            return Rows(np.zeros(0, np.int64), np.zeros(0, np.uint8), np.zeros((0, len(spec.numerical)), np.float32),
                        [None if c.history else
                         (np.zeros(0, np.uint64), np.zeros(0, np.int64 if c.max_hotness else bool))
                         for c in spec.categorical],
                        [(k, f"no column {missing[0]!r} in the file") for k in range(num_lines)], num_lines, mapping,
                        {c.name: (np.zeros(0, np.uint64), np.zeros(0), np.zeros(0, bool))
                         for c in spec.categorical if c.history})
        checks = _Checks(table.num_rows)
        labels = self._label(table.column(spec.label), checks)
        numerical = np.zeros((table.num_rows, len(spec.numerical)), np.float32)
        for k, f in enumerate(spec.numerical):
            numerical[:, k] = _numerical(table.column(f.column), f, checks)
        categorical = [None if c.history else _categorical(table.column(c.column), c, checks)
                       for c in spec.categorical]
        events = {c.name: self._events(table, c.history, categorical, labels, checks)
                  for c in spec.categorical if c.history}
        if spec.split == "files":
            chosen = np.full(table.num_rows, spec.file_mapping(path), np.int8)
        elif self.by_value:
            values, absent = _numbers(table.column(spec.split_column), spec.split_column, checks)
            checks.reject(absent, f"{spec.split_column} (the split column) is missing")
            chosen = np.zeros(table.num_rows, np.int8)
            for k, cut in ((1, spec.test_from), (2, spec.validation_from)):
                if cut is not None:
                    chosen[values >= cut] = k
        ok = checks.ok
        bad = sorted(bad + [(int(lines[k]), checks.reasons[k]) for k in np.flatnonzero(~ok)])
        if self.by_value:
            mapping[lines[ok]] = chosen[ok]
        kept = []
        for c, entry in zip(spec.categorical, categorical):
            kept.append(None if c.history else (entry[0][np.repeat(ok, entry[1])], entry[1][ok]) if c.max_hotness
                        else (entry[0][ok], entry[1][ok]))
        return Rows(lines[ok], labels[ok], numerical[ok], kept, bad, num_lines, mapping,
                    {name: tuple(a[ok] for a in e) for name, e in events.items()})

    def _events(self, table, h, categorical, labels, checks):
        """A history's (user keys, times, counts) of the rows: a row counts when it has a user and
        an item (and, with only_positive, a positive label); a missing time makes it bad."""
        users, no_user, _ = _keys(_text(table.column(h.user)), "string")
        times, no_time = _numbers(table.column(h.time), f"{h.time} (a history's time)", checks)
        checks.reject(no_time, f"{h.time} (a history's time) is missing")
        _, no_item = categorical[[c.name for c in self.spec.categorical].index(h.counts_of)]
        counts = ~no_user & ~no_item & (labels.astype(bool) if h.only_positive else True)
        return users, times, counts

    def _label(self, column, checks) -> np.ndarray:
        spec = self.spec
        if spec.positive is not None:
            text = _text(column)
            checks.reject(_missing(text), f"label {spec.label} is missing")
            return pc.fill_null(pc.is_in(text, pa.array(spec.positive)), False).to_numpy(zero_copy_only=False) \
                .astype(np.uint8)
        values, absent = _numbers(column, f"label {spec.label}", checks)
        checks.reject(absent, f"label {spec.label} is missing")
        if spec.label_threshold is not None:
            return (values >= spec.label_threshold).astype(np.uint8)
        checks.reject((values != 0) & (values != 1), f"label {spec.label} must be 0 or 1", _text(column))
        return (values == 1).astype(np.uint8)


class _Checks:
    """The first reason each row is bad (None: good so far)."""

    def __init__(self, n: int):
        self.reasons = np.full(n, None, object)

    @property
    def ok(self) -> np.ndarray:
        return np.equal(self.reasons, None)

    def reject(self, mask: np.ndarray, reason: str, values=None):
        """Marks the rows of `mask`; with `values` (an arrow array), the reason quotes each row's value."""
        new = np.flatnonzero(mask & self.ok)
        if values is None:
            self.reasons[new] = reason
        else:
            self.reasons[new] = [f"{reason}, got {values[int(k)].as_py()!r}" for k in new]


def _header(path: str, delimiter: str) -> Optional[List[str]]:
    """The column names of a CSV file's first line (None: the file is empty; none: a blank line or
    one pyarrow's reader cannot take, parsing.broken)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        line = f.readline()
    if not line:
        return None
    if not line.strip() or parsing.broken(line, delimiter):
        return []
    return pacsv.read_csv(pa.py_buffer(line), parse_options=pacsv.ParseOptions(delimiter=delimiter)).column_names


def _text(column) -> pa.Array:
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return column if pa.types.is_string(column.type) else pc.cast(column, pa.string())


def _missing(text: pa.Array) -> np.ndarray:
    return pc.fill_null(pc.equal(text, ""), True).to_numpy(zero_copy_only=False)


def _numbers(column, name: str, checks: _Checks):
    """(float64 values, missing) of a column of numbers or text; unreadable values -> bad rows."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not pa.types.is_string(column.type):
        absent = column.is_null().to_numpy(zero_copy_only=False)
        return pc.fill_null(pc.cast(column, pa.float64()), 0).to_numpy(zero_copy_only=False), absent
    absent = _missing(column)
    try:
        values = pc.cast(column, pa.float64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        words = pc.dictionary_encode(column)
        parsed = np.array([_float(v) for v in words.dictionary.to_pylist()] + [0.0])
        values = parsed[pc.fill_null(words.indices, len(words.dictionary)).to_numpy()]
        checks.reject(np.isnan(values) & ~absent, f"{name} is not a number", column)
        return np.where(absent | np.isnan(values), 0.0, values), absent
    values = pc.fill_null(values, 0).to_numpy(zero_copy_only=False)
    checks.reject(~np.isfinite(values), f"{name} is not a finite number", column)
    return values, absent


def _float(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return math.nan
    return value if math.isfinite(value) else math.nan


def _numerical(column, f: Numerical, checks: _Checks) -> np.ndarray:
    values, absent = _numbers(column, f.column, checks)
    if f.transform == "log":
        values = np.log(np.maximum(values, -2.0) + 3.0)
    elif f.transform == "clip":
        values = np.clip(values, -np.inf if f.low is None else f.low, np.inf if f.high is None else f.high)
    values = np.where(absent, f.fill, values)
    checks.reject(np.abs(values) > FLOAT16_MAX, f"{f.column} is outside float16 after {f.transform}", column)
    return values.astype(np.float32)


def _categorical(column, c: Categorical, checks: _Checks):
    """(keys [n] uint64, missing [n] bool), or for a multi-hot column (keys of its values, lengths [n])."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(column)
    if c.derive:
        seconds, absent = _numbers(column, c.column, checks)
        seconds = np.floor(seconds).astype(np.int64)
        value = seconds // 3600 % 24 if c.derive == "hour" else (seconds // 86400 + 3) % 7   # 1970-01-01: Thursday
        return value.astype(np.uint64), absent
    if not c.max_hotness:
        keys, absent, bad = _keys(column, c.type)
        checks.reject(bad, f"{c.column} is not {_EXPECTED[c.type]}", column)
        return keys, absent
    lists = column if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) else \
        pc.split_pattern(_text(column), c.delimiter)
    flat, parent = pc.list_flatten(lists), pc.list_parent_indices(lists).to_numpy(zero_copy_only=False)
    keys, absent, bad = _keys(flat, c.type)
    checks.reject(np.bincount(parent[bad], minlength=n) > 0, f"{c.column} has a value that is not {_EXPECTED[c.type]}",
                  column)
    lengths = np.bincount(parent[~absent], minlength=n).astype(np.int64)
    checks.reject(lengths > c.max_hotness, f"{c.column} has more than max_hotness {c.max_hotness} values", column)
    return keys[~absent], lengths


_EXPECTED = {"string": "text", "hex": "a hex number of at most 16 digits", "int": "an integer"}


def _keys(values, kind: str):
    """(uint64 keys, missing, not readable) of an array of values."""
    if kind == "int" and pa.types.is_integer(values.type):
        absent = values.is_null().to_numpy(zero_copy_only=False)
        keys = pc.fill_null(pc.cast(values, pa.int64()), 0).to_numpy().view(np.uint64)
        return keys, absent, np.zeros(len(values), bool)
    text = _text(values)
    absent = _missing(text)
    words = pc.dictionary_encode(text)
    distinct = words.dictionary.to_numpy(zero_copy_only=False).astype(object)
    if kind == "string":
        keys, bad = pd.util.hash_array(distinct, categorize=False), np.zeros(len(distinct), bool)
    else:
        parsed = [_int(v, kind) for v in distinct]
        bad = np.array([p is None for p in parsed], bool)
        keys = np.array([0 if p is None else p for p in parsed], np.int64 if kind == "int" else np.uint64)
    index = pc.fill_null(words.indices, len(distinct)).to_numpy()
    keys = np.append(keys.view(np.uint64), np.uint64(0))[index]
    return keys, absent, np.append(bad, False)[index] & ~absent


def _int(text: str, kind: str):
    if kind == "hex":
        return int(text, 16) if _HEX.fullmatch(text) else None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if -2 ** 63 <= value < 2 ** 63 else None


def _rules(spec: RawSpec, raw_ids: List[str]) -> dict:
    """The spec's metadata describing the transform of each feature."""
    def numerical(f: Numerical):
        rule = {"log": "log(x + 3), x < -2 counts as -2", "none": "x",
                "clip": f"x clipped to [{f.low}, {f.high}]"}[f.transform]
        return f"{f.column}: {rule}; missing -> {f.fill}"

    def categorical(c: Categorical):
        if c.history and c.history.gaps:
            return (f"time gaps of {c.history.aligned_with}'s events: 1 + floor(log2(the event's {c.history.time} - "
                    f"theirs)), 1 below 2, at most {history.GAP_IDS - 1}")
        if c.history and c.history.aligned_with:
            return f"{c.history.of} of {c.history.aligned_with}'s events, aligned with them (missing: id 0)"
        if c.history:
            h = c.history
            return (f"history of {h.of}: its ids in the last {h.max_length} events of the same {h.user} strictly "
                    f"before the event's {h.time}, oldest first" + " (positive events only)" * h.only_positive)
        source = f"{c.derive} (UTC) of {c.column} (unix seconds)" if c.derive else f"{c.column} ({c.type})"
        if c.max_hotness:
            source += f", lists split at {c.delimiter!r}, at most {c.max_hotness} values"
        return source + (f"; hashed: id 1 + key % {c.buckets}" if c.buckets else
                         "; raw ids: the key as int64" if c.name in raw_ids else f"; threshold {c.threshold}")

    label = (f"{spec.label} in {spec.positive}" if spec.positive is not None else
             f"{spec.label} >= {spec.label_threshold}" if spec.label_threshold is not None else f"{spec.label} (0/1)")
    split = (f"by {spec.split_column}: test from {spec.test_from}, validation from {spec.validation_from}"
             if spec.split == "column" else
             f"by file: test {spec.test_files}, validation {spec.validation_files}, the others train"
             if spec.split == "files" else
             f"by fraction in file order: test {spec.test}, validation {spec.validation}")
    aligned = {c.name: c.history.aligned_with for c in spec.categorical if c.history and c.history.aligned_with}
    return {"label": label, "numerical": {f.name: numerical(f) for f in spec.numerical},
            "categorical": {c.name: categorical(c) for c in spec.categorical}, "split": split,
            **({"aligned_with": aligned} if aligned else {})}
