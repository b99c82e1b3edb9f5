"""One block of raw Criteo lines -> validated columns (pyarrow's CSV reader, vectorised checks).

A line is `label, I1..I13, C1..C26`, tab-separated: label 0 or 1; integer features (empty:
missing); categorical features in hex, up to 16 digits (empty: missing), read as uint64
numbers (so `0a` and `A` are the same value). A line with another field count, a label other
than 0/1, a non-integer integer field or a non-hex categorical is bad: it is dropped and
reported with its reason.
"""
import dataclasses
from typing import List, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

NUM_INTEGER, NUM_CATEGORICAL = 13, 26
INTEGER_NAMES = [f"I{k}" for k in range(1, NUM_INTEGER + 1)]
CATEGORICAL_NAMES = [f"C{k}" for k in range(1, NUM_CATEGORICAL + 1)]
NAMES = ["label"] + INTEGER_NAMES + CATEGORICAL_NAMES
_INTEGER = r"^[+-]?[0-9]{1,18}$"
_HEX_DIGIT = np.full(256, -1, np.int16)
for _k, _c in enumerate(b"0123456789abcdef"):
    _HEX_DIGIT[_c] = _HEX_DIGIT[bytes([_c]).upper()[0]] = _k
# Two ASCII characters (a little-endian uint16) -> the byte they spell in hex, or -1.
_HEX_PAIR = np.where((_HEX_DIGIT[:, None] >= 0) & (_HEX_DIGIT[None, :] >= 0),
                     _HEX_DIGIT[None, :] * 16 + _HEX_DIGIT[:, None], -1).astype(np.int16).reshape(-1)


@dataclasses.dataclass
class Block:
    """The good lines of a block: `lines` their 0-based line numbers in the block, `labels` [n]
    uint8, `integers` [n, 13] int64 and `integer_missing` [n, 13] bool, `categorical` [n, 26]
    uint64 and `categorical_missing` [n, 26] bool; `bad` (line number, reason) per bad line."""
    lines: np.ndarray
    labels: np.ndarray
    integers: np.ndarray
    integer_missing: np.ndarray
    categorical: np.ndarray
    categorical_missing: np.ndarray
    bad: List[Tuple[int, str]]


def parse_block(data: bytes, num_lines: int) -> Block:
    """Parses `num_lines` lines (reading.count_lines(data))."""
    bad = []

    def wrong_count(row):
        bad.append((row.number - 1, f"{row.actual_columns} fields, expected {len(NAMES)}"))
        return "skip"

    table = pacsv.read_csv(
        pa.py_buffer(data),
        read_options=pacsv.ReadOptions(column_names=NAMES, use_threads=False, block_size=max(len(data), 1 << 20)),
        parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False,
                                         ignore_empty_lines=False, invalid_row_handler=wrong_count),
        convert_options=pacsv.ConvertOptions(column_types={n: pa.string() for n in NAMES}, null_values=[""],
                                             strings_can_be_null=True, check_utf8=False))
    skipped = np.zeros(num_lines, bool)
    skipped[[line for line, _ in bad]] = True
    lines = np.flatnonzero(~skipped)
    label = table.column("label")
    ok = pc.fill_null(pc.is_in(label, pa.array(["0", "1"])), False).to_numpy(zero_copy_only=False)
    reasons = np.where(ok, None, "label must be 0 or 1").astype(object)
    integers, integer_missing = _integers(table, ok, reasons)
    categorical, categorical_missing = _categorical(table, ok, reasons)
    bad += [(int(lines[k]), reasons[k]) for k in np.flatnonzero(~ok)]
    bad.sort()
    labels = pc.equal(label, "1").to_numpy(zero_copy_only=False)[ok].astype(np.uint8)
    return Block(lines[ok], labels, integers[ok], integer_missing[ok], categorical[ok], categorical_missing[ok], bad)


def _integers(table: pa.Table, ok: np.ndarray, reasons: np.ndarray):
    n = table.num_rows
    values, missing = np.zeros([n, NUM_INTEGER], np.int64), np.zeros([n, NUM_INTEGER], bool)
    for k, name in enumerate(INTEGER_NAMES):
        column = table.column(name)
        missing[:, k] = column.is_null().to_numpy(zero_copy_only=False)
        try:
            parsed = pc.cast(column, pa.int64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            valid = pc.fill_null(pc.match_substring_regex(column, _INTEGER), True).to_numpy(zero_copy_only=False)
            _reject(ok, reasons, ~valid, f"{name} is not an integer")
            parsed = pc.cast(pc.if_else(pa.array(valid), column, None), pa.int64())
        values[:, k] = pc.fill_null(parsed, 0).to_numpy()
    return values, missing


def _categorical(table: pa.Table, ok: np.ndarray, reasons: np.ndarray):
    n = table.num_rows
    values, missing = np.zeros([n, NUM_CATEGORICAL], np.uint64), np.zeros([n, NUM_CATEGORICAL], bool)
    for k, name in enumerate(CATEGORICAL_NAMES):
        column = table.column(name).combine_chunks() if n else pa.array([], pa.string())
        missing[:, k] = column.is_null().to_numpy(zero_copy_only=False)
        too_long = pc.fill_null(pc.greater(pc.binary_length(column), 16), False).to_numpy(zero_copy_only=False)
        if too_long.any() or not pc.all(pc.string_is_ascii(column)).as_py() in (True, None):
            too_long |= ~pc.fill_null(pc.string_is_ascii(column), True).to_numpy(zero_copy_only=False)
            column = pc.if_else(pa.array(too_long), None, column)
        padded = pc.utf8_lpad(pc.fill_null(column, ""), 16, "0")
        start = np.frombuffer(padded.buffers()[1], np.int32, 1, padded.offset * 4)[0]
        pairs = np.frombuffer(padded.buffers()[2], np.uint8, 16 * n, int(start)).view("<u2").reshape(n, 8)
        decoded = _HEX_PAIR[pairs]
        not_hex = too_long | (decoded < 0).any(axis=1)
        _reject(ok, reasons, not_hex, f"{name} is not a hex number of at most 16 digits")
        values[:, k] = decoded.astype(np.uint8).view(">u8")[:, 0].astype(np.uint64)
    return values, missing


def _reject(ok: np.ndarray, reasons: np.ndarray, bad: np.ndarray, reason: str):
    new = bad & ok
    reasons[new] = reason
    ok &= ~bad


def transform_integers(values: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """The numerical features: log(v + 3) for v >= -2; values below -2 count as -2 (-> 0);
    missing -> 0. float32."""
    out = np.log(np.maximum(values, -2).astype(np.float64) + 3.0).astype(np.float32)
    out[missing] = 0.0
    return out
