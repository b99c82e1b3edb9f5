"""Byte-range splits of the raw files and the complete lines each one owns (no Spark here).

A split of a plain file owns the lines that start in its byte range [start, end), so the splits
of a file cover every line exactly once wherever the boundaries fall; a .gz file is one split.
Lines are read in blocks of whole lines, so memory stays bounded whatever the file size.
"""
import dataclasses
import gzip
import os
from typing import Iterator, List, Optional


@dataclasses.dataclass(frozen=True)
class Split:
    index: int
    path: str
    file_index: int
    start: int = 0
    end: Optional[int] = None   # None: to the end of the file (a .gz file is read whole)

    @property
    def gz(self) -> bool:
        return self.path.endswith(".gz")


def plan_splits(paths: List[str], split_bytes: int) -> List[Split]:
    """Splits of `split_bytes` for plain files, one per .gz file, in file order."""
    splits = []
    for k, path in enumerate(paths):
        size = os.path.getsize(path)
        if path.endswith(".gz") or size <= split_bytes:
            splits.append(Split(len(splits), path, k))
            continue
        for start in range(0, size, split_bytes):
            splits.append(Split(len(splits), path, k, start, min(start + split_bytes, size)))
    return splits


def iter_blocks(split: Split, block_bytes: int) -> Iterator[bytes]:
    """The split's lines, in blocks of whole lines (each ends with a newline, except perhaps the
    file's last line)."""
    if split.gz:
        with gzip.open(split.path, "rb") as f:
            yield from _blocks(f, None, block_bytes)
        return
    with open(split.path, "rb") as f:
        pos = split.start
        if pos > 0:                      # the line running into the range belongs to the split before
            f.seek(pos - 1)
            while True:
                piece = f.read(1 << 16)
                newline = piece.find(b"\n")
                if newline >= 0 or not piece:
                    pos += newline if newline >= 0 else len(piece) + 1
                    break
                pos += len(piece)
        limit = None if split.end is None else split.end - pos
        f.seek(pos)
        yield from _blocks(f, limit, block_bytes)


def _blocks(f, limit: Optional[int], block_bytes: int) -> Iterator[bytes]:
    """Whole lines from f's position: all of them, or those starting in the next `limit` bytes."""
    rest = b""
    while limit is None or limit > 0:
        data = f.read(block_bytes)
        if not data:
            if rest:
                yield rest
            return
        buf = rest + data
        if limit is not None and len(buf) >= limit:
            newline = buf.find(b"\n", limit - 1)    # ends the line holding the range's last byte
            while newline < 0:
                more = f.read(block_bytes)
                if not more:
                    yield buf
                    return
                buf += more
                newline = buf.find(b"\n", limit - 1)
            yield buf[:newline + 1]
            return
        cut = buf.rfind(b"\n") + 1
        if cut:
            yield buf[:cut]
        rest = buf[cut:]
        if limit is not None:
            limit -= cut


def count_lines(block: bytes) -> int:
    return block.count(b"\n") + (1 if block and not block.endswith(b"\n") else 0)
