"""preproc.reading: byte-range splits own every line exactly once, wherever the boundaries fall;
preproc.parsing: the fast path on raw bytes agrees with pyarrow's CSV reader on any line."""
import gzip
import random

import numpy as np

from preproc import parsing
from preproc.reading import count_lines, iter_blocks, plan_splits

LINES = [b"1\tab", b"", b"0\t" + b"x" * 40, b"1", b"0\tcd\tef", b"1\t" + b"y" * 7]


def lines_of(splits, block_bytes):
    out = []
    for split in splits:
        for block in iter_blocks(split, block_bytes):
            out += block.split(b"\n")[:count_lines(block)]
    return out


def test_every_split_size_and_block_size(tmp_path):
    for trailing_newline in (True, False):
        path = tmp_path / f"f{trailing_newline}.txt"
        path.write_bytes(b"\n".join(LINES) + (b"\n" if trailing_newline else b""))
        size = path.stat().st_size
        for split_bytes in range(1, size + 2):
            for block_bytes in (1, 3, 16, 1 << 20):
                assert lines_of(plan_splits([str(path)], split_bytes), block_bytes) == LINES, (split_bytes, block_bytes)


def test_gzip_is_one_split(tmp_path):
    path = tmp_path / "day_0.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"\n".join(LINES) + b"\n")
    splits = plan_splits([str(path)], 4)
    assert len(splits) == 1 and splits[0].gz
    assert lines_of(splits, 5) == LINES


GOOD = {"label": ["0", "1"], "int": ["", "0", "-1", "-0", "7", "99999999", "100000000", "1234567890123456", "-123456789"],
        "hex": ["", "a", "0", "Ab", "ffffffff", "00000000a", "0123456789ABCDEF"]}
ODD = ["", "2", "01", "12345678901234567", "+5", "-", "1a", " 1", "1.5", "0123456789abcdef0", "g", "1 2", "\u00e9"]


def test_fast_parser_agrees_with_arrow_on_odd_lines():
    """Random lines of good and bad fields (signs, 8/9/16/17 digits, upper case, non-hex, wrong
    field counts, empty lines, no final newline): same rows, values and bad-line reasons."""
    rng = random.Random(0)
    for _ in range(200):
        lines = []
        for _ in range(rng.randint(1, 20)):
            kinds = ["label"] + ["int"] * 13 + ["hex"] * 26
            fields = [rng.choice(ODD if rng.random() < 0.005 else GOOD[kind]) for kind in kinds]
            lines.append("\t".join(fields[:rng.choice([40] * 12 + [1, 39, 41])]) if rng.random() > 0.03 else "")
        data = ("\n".join(lines) + "\n" * (rng.random() < 0.7)).encode()
        fast, arrow = parsing.parse_block(data), parsing._parse_with_arrow(data, count_lines(data))
        for field in ("lines", "labels", "integers", "integer_missing", "categorical", "categorical_missing", "num_lines"):
            np.testing.assert_array_equal(getattr(fast, field), getattr(arrow, field), err_msg=field)
        assert fast.bad == arrow.bad


def alone(line: bytes, names):
    """pyarrow's reading of one line with a line of no quotes after it: (its values, or None for
    another field count; whether it ran on into the next line)."""
    table, bad = parsing._read_csv(line + b"\nx" + b",x" * (len(names) - 1) + b"\n", names, ",", names, True)
    values = table.to_pylist()[0] if table.num_rows == 2 else None
    return values, table.num_rows + len(bad) != 2


def test_read_strings_keeps_every_line_on_any_bytes():
    """Random lines of quotes, delimiters, carriage returns and bytes that are not UTF-8: each line
    is a row read as it reads alone, or a bad line with its own number: a line pyarrow's reader
    would run on past (an unterminated quote, also as the last line) or could not report (not
    UTF-8, a carriage return inside) is bad with that reason, whatever the lines around it."""
    rng = random.Random(1)
    names = ["a", "b", "c"]
    pieces = [b"a", b"b", b",", b",", b'"', b'"', b'""', b"\r", b"\xff", "\u00e9".encode(), b"\x00"]
    reasons = {"not UTF-8 text", "a carriage return inside the line", "an unterminated quote"}
    for _ in range(300):
        lines = [b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 8))) for _ in range(rng.randint(1, 12))]
        data = b"\n".join(lines) + b"\n" * (rng.random() < 0.7)
        lines = lines[:count_lines(data)]           # (an empty last line without a newline is none)
        if not lines:
            continue
        table, good, bad = parsing.read_strings(data, len(lines), names, ",")
        assert sorted(good.tolist() + [k for k, _ in bad]) == list(range(len(lines))), data
        for k, row in zip(good.tolist(), table.to_pylist()):
            values, ran_on = alone(lines[k], names)
            assert values == row and not ran_on and b"\r" not in lines[k].removesuffix(b"\r"), (data, k)
        for k, reason in bad:
            if reason not in reasons:
                assert reason.endswith(f"fields, expected {len(names)}") and alone(lines[k], names) == (None, False)
            elif reason == "an unterminated quote":
                assert alone(lines[k], names)[1], (data, k)
            else:
                assert (reason == "not UTF-8 text") == (not parsing._is_utf8(lines[k])), (data, k)


def test_random_bytes_are_bad_lines():
    """Random bytes through Criteo's parser and through pyarrow's: every line is good or bad, none lost."""
    rng = random.Random(2)
    for _ in range(20):
        data = rng.randbytes(rng.randint(1, 3000))
        block = parsing.parse_block(data)
        assert block.num_lines == count_lines(data) == len(block.lines) + len(block.bad)
        table, good, bad = parsing.read_strings(data, count_lines(data), ["x", "y"], ",")
        assert table.num_rows == len(good) and len(good) + len(bad) == count_lines(data)
