"""preproc.reading: byte-range splits own every line exactly once, wherever the boundaries fall."""
import gzip

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
