"""One block of raw Criteo lines -> validated columns, in numpy on the raw bytes.

A line is `label, I1..I13, C1..C26`, tab-separated: label 0 or 1; integer features (empty:
missing); categorical features in hex, up to 16 digits (empty: missing), read as uint64
numbers (so `0a` and `A` are the same value). A line with another field count, a label other
than 0/1, a non-integer integer field or a non-hex categorical is bad: it is dropped and
reported with its reason.

The common line (40 fields, label 0/1, integers of at most 16 digits with an optional '-', hex
of at most 16 digits) is decoded on the raw bytes: the delimiters found at once, each field
read as the 8 (or 16) bytes that end it, right-aligned and '0'-padded, and decoded as whole
words (SWAR decimal, a 64K table for pairs of hex digits). Any other line goes through
pyarrow's CSV reader, which gives the bad lines their reasons.
"""
import dataclasses
import functools
import re
from typing import Dict, List, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from preproc import reading

NUM_INTEGER, NUM_CATEGORICAL = 13, 26
INTEGER_NAMES = [f"I{k}" for k in range(1, NUM_INTEGER + 1)]
CATEGORICAL_NAMES = [f"C{k}" for k in range(1, NUM_CATEGORICAL + 1)]
NAMES = ["label"] + INTEGER_NAMES + CATEGORICAL_NAMES
_INTEGER = r"^-?[0-9]{1,18}$"
_HEX_DIGIT = np.full(256, -1, np.int16)
for _k, _c in enumerate(b"0123456789abcdef"):
    _HEX_DIGIT[_c] = _HEX_DIGIT[bytes([_c]).upper()[0]] = _k
# Two ASCII characters (a little-endian uint16) -> the byte they spell in hex, or -1.
_HEX_PAIR = np.where((_HEX_DIGIT[:, None] >= 0) & (_HEX_DIGIT[None, :] >= 0),
                     _HEX_DIGIT[None, :] * 16 + _HEX_DIGIT[:, None], -1).astype(np.int16).reshape(-1)
_PAIR_OR_BAD = np.where(_HEX_PAIR < 0, 0x100, _HEX_PAIR).astype(np.uint16)    # bad: bit 8 set
_U = np.uint64
_ZEROS, _HIGH_NIBBLES, _LOW_NIBBLES = _U(0x3030303030303030), _U(0xF0F0F0F0F0F0F0F0), _U(0x0F0F0F0F0F0F0F0F)
# For a field of k <= 8 characters ending a word: _KEEP[k] masks its bytes (the high k), _FILL[k]
# writes '0' over the bytes before it.
_KEEP = np.array([(2 ** 64 - 1) ^ ((1 << (8 * (8 - k))) - 1) for k in range(9)], np.uint64)
_FILL = _ZEROS & ~_KEEP


@dataclasses.dataclass
class Block:
    """The good lines of a block: `lines` their 0-based line numbers in the block, `labels` [n]
    uint8, `integers` [n, 13] int64 and `integer_missing` [n, 13] bool, `categorical` [n, 26]
    uint64 and `categorical_missing` [n, 26] bool; `bad` (line number, reason) per bad line;
    `num_lines` the lines of the block, good and bad."""
    lines: np.ndarray
    labels: np.ndarray
    integers: np.ndarray
    integer_missing: np.ndarray
    categorical: np.ndarray
    categorical_missing: np.ndarray
    bad: List[Tuple[int, str]]
    num_lines: int


def read_strings(data: bytes, num_lines: int, names: List[str], delimiter: str, columns: List[str] = None,
                 quoting: bool = True) -> Tuple[pa.Table, np.ndarray, List[Tuple[int, str]]]:
    """The `num_lines` lines of `data` read by pyarrow's CSV reader as string columns `columns` of
    `names` (default all; empty fields null; `quoting`: fields may be quoted, no newline inside).
    Lines with another field count, and those pyarrow would not read as one row of text (`broken`)
    are skipped: returns (table, the line number of each of its rows, bad lines [(line, reason)])."""
    columns = columns or names
    unreadable = broken(data, delimiter if quoting else None)
    table, bad = _read_csv(_blank(data, unreadable), names, delimiter, columns, quoting)
    if quoting and b'"' in data and table.num_rows + len(bad) != num_lines:      # a quote ran on into a line
        unreadable.update(broken(data, delimiter, all_quotes=True))
        table, bad = _read_csv(_blank(data, unreadable), names, delimiter, columns, quoting)
    skipped = np.zeros(num_lines, bool)
    skipped[[line for line, _ in bad]] = True
    if unreadable:
        blank = np.zeros(num_lines, bool)
        blank[list(unreadable)] = True
        table = table.filter(pa.array(~blank[~skipped]))
        bad = sorted(bad + list(unreadable.items()))
        skipped |= blank
    return table, np.flatnonzero(~skipped), bad


def _read_csv(data: bytes, names, delimiter, columns, quoting):
    """(table, [(line, reason)] of the lines of another field count): pyarrow's reading of `data`."""
    bad = []

    def wrong_count(row):
        bad.append((row.number - 1, f"{row.actual_columns} fields, expected {len(names)}"))
        return "skip"

    quotes = {} if quoting else {"quote_char": False, "escape_char": False}
    table = pacsv.read_csv(
        pa.py_buffer(data),
        read_options=pacsv.ReadOptions(column_names=names, use_threads=False, block_size=max(len(data), 1 << 20)),
        parse_options=pacsv.ParseOptions(delimiter=delimiter, ignore_empty_lines=False, invalid_row_handler=wrong_count,
                                         **quotes),
        convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in columns}, include_columns=columns,
                                             null_values=[""], strings_can_be_null=True,
                                             quoted_strings_can_be_null=True, check_utf8=False))
    return table, bad


def broken(data: bytes, delimiter: str = None, all_quotes: bool = False) -> Dict[int, str]:
    """{line: reason} of the lines of `data` that pyarrow's CSV reader would not read as one row of
    text: not UTF-8, a carriage return before the line's end (a line end to the reader), or, given
    the `delimiter` of quoted fields, an unterminated quote (the reader runs on into the next
    lines). Quotes are checked on the last line (nothing follows it here, but something may in a
    larger block), on every line with `all_quotes`."""
    found, lines = {}, None
    if not data.isascii():
        try:
            data.decode()
        except UnicodeDecodeError:
            lines = data.split(b"\n")
            found.update((k, "not UTF-8 text") for k, line in enumerate(lines) if not _is_utf8(line))
    if b"\r" in data:
        chars = np.frombuffer(data, np.uint8)
        returns = np.flatnonzero(chars[:-1] == 13)
        inside = returns[chars[returns + 1] != 10]
        for k in np.unique(np.searchsorted(np.flatnonzero(chars == 10), inside)).tolist():
            found.setdefault(k, "a carriage return inside the line")
    if delimiter is not None and b'"' in data:
        last = reading.count_lines(data) - 1
        if all_quotes:
            candidates = enumerate(lines or data.split(b"\n"))
        else:
            body = data[:-1] if data.endswith(b"\n") else data
            candidates = [(last, body[body.rfind(b"\n") + 1:])]
        line_pattern = _quoted_line(delimiter)
        for k, line in candidates:
            if k <= last and b'"' in line and not line_pattern.fullmatch(line):
                found.setdefault(k, "an unterminated quote")
    return found


def _is_utf8(line: bytes) -> bool:
    try:
        line.decode()
    except UnicodeDecodeError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _quoted_line(delimiter: str) -> re.Pattern:
    """A line of fields as pyarrow's reader reads them: a field starting with a quote runs to the
    first lone quote ("" is a quote in it), then to the delimiter; any other field to the delimiter."""
    d = re.escape(delimiter.encode())
    field = b'(?:"(?:[^"]|"")*+"[^' + d + b']*|[^' + d + b'"][^' + d + b']*|)'
    return re.compile(field + b"(?:" + d + field + b")*")


def _blank(data: bytes, lines: Dict[int, str]) -> bytes:
    """`data` with the given lines emptied, each ending with a newline (pyarrow reads each as a row
    of nulls)."""
    if not lines:
        return data
    parts = data.split(b"\n")
    for k in lines:
        parts[k] = b""
    return b"\n".join(parts) + (b"" if data.endswith(b"\n") else b"\n")


def _parse_with_arrow(data: bytes, num_lines: int) -> Block:
    """The general parser (pyarrow's CSV reader): any line, good or bad, with its reason."""
    table, lines, bad = read_strings(data, num_lines, NAMES, "\t", quoting=False)
    label = table.column("label")
    ok = pc.fill_null(pc.is_in(label, pa.array(["0", "1"])), False).to_numpy(zero_copy_only=False)
    reasons = np.where(ok, None, "label must be 0 or 1").astype(object)
    integers, integer_missing = _integers(table, ok, reasons)
    categorical, categorical_missing = _categorical(table, ok, reasons)
    bad += [(int(lines[k]), reasons[k]) for k in np.flatnonzero(~ok)]
    bad.sort()
    labels = pc.equal(label, "1").to_numpy(zero_copy_only=False)[ok].astype(np.uint8)
    return Block(lines[ok], labels, integers[ok], integer_missing[ok], categorical[ok], categorical_missing[ok], bad,
                 num_lines)


def parse_block(data: bytes) -> Block:
    """Parses the lines of `data` (a block of reading.iter_blocks: not empty, whole lines; the last
    may lack its newline)."""
    buf = b"0" * 16 + data + (b"" if data.endswith(b"\n") else b"\n")
    chars = np.frombuffer(buf, np.uint8)
    delims = np.flatnonzero((chars == 9) | (chars == 10))
    newline = chars[delims] == 10
    ends = delims[newline]
    num_lines = len(ends)
    if len(delims) == len(NAMES) * num_lines and newline.reshape(num_lines, -1)[:, -1].all():
        shaped = np.ones(num_lines, bool)
        fields = delims.reshape(num_lines, len(NAMES))
    else:                                     # lines of another field count exist
        line_of = np.cumsum(newline) - newline
        shaped = np.bincount(line_of, minlength=num_lines) == len(NAMES)
        fields = delims[shaped[line_of]].reshape(-1, len(NAMES))
    starts = np.concatenate([[16], ends[:-1] + 1])
    before = np.concatenate([starts[shaped, None] - 1, fields[:, :-1]], axis=1)   # each field's preceding delimiter
    lengths = fields - before - 1
    negative = chars[before[:, 1:1 + NUM_INTEGER] + 1] == ord("-")
    integers, bad_integer = _decode(buf, fields[:, 1:1 + NUM_INTEGER], lengths[:, 1:1 + NUM_INTEGER] - negative, _decimal, 10 ** 8)
    integers = np.where(negative, -integers.view(np.int64), integers.view(np.int64))
    bad_integer |= negative & (lengths[:, 1:1 + NUM_INTEGER] == 1)
    categorical, bad_categorical = _decode(buf, fields[:, 1 + NUM_INTEGER:], lengths[:, 1 + NUM_INTEGER:], _hex, 1 << 32)
    labels = chars[starts[shaped]] - ord("0")
    suspect = (lengths[:, 0] != 1) | (labels > 1) | bad_integer.any(axis=1) | bad_categorical.any(axis=1)
    keep = slice(None) if not suspect.any() else ~suspect
    good = np.flatnonzero(shaped)[keep]
    block = Block(good, labels[keep], integers[keep], lengths[keep, 1:1 + NUM_INTEGER] == 0,
                  categorical[keep], lengths[keep, 1 + NUM_INTEGER:] == 0, [], num_lines)
    others = np.setdiff1d(np.arange(num_lines), good, assume_unique=True)
    if len(others):
        block = _merge(block, others, _parse_with_arrow(b"".join(buf[starts[k]:ends[k] + 1] for k in others), len(others)))
    return block


def _decode(buf: bytes, ends: np.ndarray, lengths: np.ndarray, word, scale: int):
    """Fields of at most 16 characters ending at `ends` -> (values uint64, not decodable): the
    last 8 characters by `word`, the 8 before them (fields longer than 8) times `scale`."""
    windows = np.ndarray((len(buf) - 7,), "<u8", buf, 0, (1,))     # the 8 bytes from every offset

    def chars(end, length):
        length = np.minimum(length, 8)
        return (windows[end] & _KEEP[length]) | _FILL[length]

    values, bad = word(chars(ends - 8, lengths))
    bad |= lengths > 16
    long = np.nonzero((lengths > 8) & ~bad)
    if len(long[0]):
        high, bad_high = word(chars(ends[long] - 16, lengths[long] - 8))
        values[long] += high * _U(scale)
        bad[long] |= bad_high
    return values, bad


def _decimal(x: np.ndarray):
    """8 ASCII characters ('0'-padded, first in the low byte) -> their decimal value, not digits."""
    bad = ((x & _HIGH_NIBBLES) != _ZEROS) | (((x & _LOW_NIBBLES) + _U(0x0606060606060606)) & _HIGH_NIBBLES != 0)
    x = x - _ZEROS
    x = (x * _U(10) + (x >> _U(8))) & _U(0x00FF00FF00FF00FF)
    x = (x * _U(100) + (x >> _U(16))) & _U(0x0000FFFF0000FFFF)
    return (x * _U(10000) + (x >> _U(32))) & _U(0xFFFFFFFF), bad


def _hex(x: np.ndarray):
    """8 ASCII characters -> their hex value, not hex digits."""
    pairs = _PAIR_OR_BAD[x.view("<u2")]
    bad = (pairs.view("<u8") & _U(0x0100010001000100)).reshape(x.shape) != 0
    return pairs.astype(np.uint8).view(">u4").reshape(x.shape).astype(np.uint64), bad


def _merge(block: Block, lines: np.ndarray, other: Block) -> Block:
    """`block` with the rows of `other`, a parse of the given lines of the same block."""
    merged = [np.concatenate([a, b]) for a, b in zip(
        (block.lines, block.labels, block.integers, block.integer_missing, block.categorical, block.categorical_missing),
        (lines[other.lines], other.labels, other.integers, other.integer_missing, other.categorical,
         other.categorical_missing))]
    order = np.argsort(merged[0], kind="stable")
    return Block(*[m[order] for m in merged], [(int(lines[k]), reason) for k, reason in other.bad], block.num_lines)


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
