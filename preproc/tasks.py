"""The work of the Spark tasks, run on the executors (numpy and pyarrow, no Spark objects).

`count_values` parses a split once: it returns its report (rows per mapping and per part, bad
lines) and the value counts of its training rows as numpy tables, and caches the parsed columns
(labels, float16 numericals, per block the distinct values and each row's code) in
`cache_root`. `bucketed`, `summed`, `kept` and `rank_column` sum the tables per (feature, hash
bucket) and rank each feature's frequent values (or grow an earlier vocabulary with them).
`write_direct` encodes a split's cached rows and writes those of unshuffled parts at their known
place in the pre-sized part files. With a shuffle,
`encode` turns the shuffled rows into fixed-size binary records (part, sort key) that Spark
groups and sorts, and `write` writes whole sorted parts.
"""
import dataclasses
import os
from typing import Dict, Iterator, List

import numpy as np
import pandas as pd
import pyarrow as pa

from preproc import parsing, reading, vocab
from preproc.layout import MAPPINGS, Layout, mix

RECORD_SCHEMA = "pid int, key long, rec binary"
WRITTEN_SCHEMA = "pid int, rows long"
MAX_REPORTED = 5


@dataclasses.dataclass
class Context:
    """What every task needs, shipped with the task."""
    splits: List[reading.Split]
    split_lines: List[int]                 # first global line number of each split
    file_lines: List[int]                  # first global line number of each file
    layout: Layout
    block_bytes: int
    numerical: List[str]                   # output feature names
    categorical: List[str]
    label: str
    count: bool = True                     # count values (False: the vocabularies are given)
    vocab_root: str = ""                   # where vocab/<feature>.npy lie
    base_root: str = ""                    # rank: the earlier output whose vocabularies grow ("": new ones)
    generation: int = 0                    # rank: the generation of the ids it adds
    out_root: str = ""                     # write: where the part files go
    cache_root: str = ""                   # where the parsed splits are cached
    record: list = None                    # write: the record's numpy dtype description
    part_files: Dict[int, Dict[str, str]] = None   # write: pid -> feature (or "numerical") -> file
    row_offsets: Dict[int, Dict[int, int]] = None  # write: split -> pid -> its first row in the part

    def record_dtype(self) -> np.dtype:
        return np.dtype([(n, d, tuple(s)) for n, d, s in self.record])

    def cache_path(self, split_id: int) -> str:
        return os.path.join(self.cache_root, f"split{split_id:05d}.npy")


def _split_ids(batches) -> Iterator[int]:
    for batch in batches:
        yield from batch.column(0).to_pylist()


def count_values(ctx: Context, split_id: int):
    """Parses and caches a split; returns its report and {feature index: (values, counts)} of its
    training rows."""
    split, line, bad = ctx.splits[split_id], ctx.split_lines[split_id], []
    rows, part_rows, counted = dict.fromkeys(MAPPINGS, 0), {}, [[] for _ in range(parsing.NUM_CATEGORICAL)]
    os.makedirs(ctx.cache_root, exist_ok=True)
    with open(ctx.cache_path(split_id), "wb") as cache:
        for data in reading.iter_blocks(split, ctx.block_bytes):
            block = parsing.parse_block(data)
            n = block.num_lines
            bad += [(line + k, reason) for k, reason in block.bad]
            lines = line + block.lines
            line += n
            mapping, pid, _ = ctx.layout.assign(lines)
            for k, name in enumerate(MAPPINGS):
                rows[name] += int(np.sum(mapping == k))
            for p in np.unique(pid):
                part_rows[int(p)] = part_rows.get(int(p), 0) + int(np.sum(pid == p))
            train = mapping == MAPPINGS.index("train")
            codes = np.empty((parsing.NUM_CATEGORICAL, len(lines)), np.int32)
            np.save(cache, lines)
            np.save(cache, block.labels)
            np.save(cache, parsing.transform_integers(block.integers, block.integer_missing).astype(np.float16))
            for k in range(parsing.NUM_CATEGORICAL):
                column, distinct = pd.factorize(block.categorical[:, k])
                column[block.categorical_missing[:, k]] = -1
                codes[k] = column
                np.save(cache, distinct)
                if ctx.count and train.any():
                    counts = np.bincount(column[train] + 1, minlength=len(distinct) + 1)[1:]
                    counted[k].append((distinct, counts))
            np.save(cache, codes)
    tables = {k: summed(pieces) for k, pieces in enumerate(counted) if pieces}
    first = ctx.file_lines[split.file_index]
    info = {"split": split_id, "rows": rows, "part_rows": part_rows, "bad": len(bad),
            "first_bad": [[split.path, int(g - first + 1), reason] for g, reason in bad[:MAX_REPORTED]]}
    return info, tables


def bucketed(tables: Dict[int, tuple], buckets: int):
    """((feature, bucket of the value's hash), (values, counts)) pieces of a split's count tables."""
    for k, (values, counts) in tables.items():
        bucket = (mix(values, k) % np.uint64(buckets)).astype(np.int64)
        order = np.argsort(bucket, kind="stable")
        sizes = np.bincount(bucket, minlength=buckets)
        ends = np.cumsum(sizes)
        for b in np.flatnonzero(sizes):
            piece = order[ends[b] - sizes[b]:ends[b]]
            yield (k, int(b)), (values[piece], counts[piece])


def summed(tables) -> tuple:
    """Count tables (values, counts) of one feature -> one, counts of equal values added, zeros
    dropped."""
    tables = list(tables)
    codes, values = pd.factorize(np.concatenate([t[0] for t in tables]))
    counts = np.bincount(codes, np.concatenate([t[1] for t in tables]), len(values)).astype(np.int64)
    return values[counts > 0], counts[counts > 0]


def kept(ctx: Context, col: int, table: tuple, threshold: int) -> tuple:
    """A summed count table cut to the values that rank: the frequent ones, and with an earlier
    vocabulary every value it holds (their counts are added to it)."""
    known = vocab.encoder(ctx.base_root, ctx.categorical[col]) if ctx.base_root else None
    return vocab.frequent(table, threshold, known)


def rank_column(ctx: Context, col: int, tables, threshold: int, capacity: int = 0) -> dict:
    """One feature's kept counts (disjoint tables) -> its vocabulary file, new or the earlier one
    grown up to `capacity` ids; returns {"size": ids in use + 1} and `vocab.grow`'s report."""
    tables, feature = list(tables), ctx.categorical[col]
    values, counts = np.concatenate([t[0] for t in tables]), np.concatenate([t[1] for t in tables])
    if ctx.base_root:
        entries, report = vocab.grow(vocab.load(ctx.base_root, feature), values, counts, threshold, capacity,
                                     ctx.generation)
    else:
        entries, report = vocab.rank(values, counts, threshold), {}
    vocab.save(ctx.vocab_root, feature, entries)
    return dict(report, size=len(entries) + 1)


def _encoded(ctx: Context, split_id: int):
    """(global line numbers, records) per cached block of the split."""
    dtype = ctx.record_dtype()
    encoders = [vocab.encoder(ctx.vocab_root, f) for f in ctx.categorical]
    with open(ctx.cache_path(split_id), "rb") as cache:
        while cache.peek(1):
            lines, labels, numerical = np.load(cache), np.load(cache), np.load(cache)
            distinct = [np.load(cache) for _ in ctx.categorical]
            codes = np.load(cache)
            records = np.empty(len(lines), dtype)
            records[ctx.label] = labels
            records["numerical"] = numerical
            for k, feature in enumerate(ctx.categorical):
                records[feature] = np.append(encoders[k](distinct[k]), 0)[codes[k]]     # code -1 (missing): id 0
            yield lines, records


def write_direct(ctx: Context, split_id: int) -> Dict[int, int]:
    """Writes the split's rows of unshuffled parts at their place in the part files; returns the
    rows written per part."""
    fields, written, files = [ctx.label, "numerical"] + ctx.categorical, {}, {}
    try:
        for lines, records in _encoded(ctx, split_id):
            _, pids, _ = ctx.layout.assign(lines)
            direct = ctx.layout.unshuffled(pids)
            pids, records = pids[direct], records[direct]
            bounds = np.flatnonzero(np.diff(pids)) + 1
            for lo, hi in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [len(pids)]])):
                if lo == hi:
                    continue
                pid = int(pids[lo])
                if pid not in files:
                    files[pid] = {f: os.open(os.path.join(ctx.out_root, ctx.part_files[pid][f]), os.O_WRONLY)
                                  for f in fields}
                row = ctx.row_offsets[split_id][pid] + written.get(pid, 0)
                for f in fields:
                    part = np.ascontiguousarray(records[f][lo:hi])
                    os.pwrite(files[pid][f], part.data, row * (part.nbytes // len(part)))
                written[pid] = written.get(pid, 0) + int(hi - lo)
    finally:
        for fds in files.values():
            for fd in fds.values():
                os.close(fd)
    return written


def encode(ctx: Context, batches):
    """The split's rows of shuffled parts as records (part, sort key, bytes)."""
    for split_id in _split_ids(batches):
        for lines, records in _encoded(ctx, split_id):
            _, pid, key = ctx.layout.assign(lines)
            keep = ~ctx.layout.unshuffled(pid)
            records, n = records[keep], int(keep.sum())
            offsets = np.arange(n + 1, dtype=np.int32) * records.dtype.itemsize
            rec = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(records.tobytes())])
            yield pa.RecordBatch.from_arrays([pa.array(pid[keep].astype(np.int32)), pa.array(key[keep]), rec],
                                             names=["pid", "key", "rec"])


def write(ctx: Context, batches):
    """Writes the records of each part (they arrive sorted by part, then key) to its files."""
    dtype, fields = ctx.record_dtype(), [ctx.label, "numerical"] + ctx.categorical
    current, files, written = None, {}, {}
    try:
        for batch in batches:
            pids = batch.column(0).to_numpy()
            rec = batch.column(2)
            start = np.frombuffer(rec.buffers()[1], np.int32, 1, rec.offset * 4)[0]
            records = np.frombuffer(rec.buffers()[2], dtype, len(rec), int(start))
            bounds = np.flatnonzero(np.diff(pids)) + 1
            for lo, hi in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [len(pids)]])):
                pid = int(pids[lo])
                if pid != current:
                    _close(files)
                    current, written[pid] = pid, 0
                    files = {f: _open(os.path.join(ctx.out_root, ctx.part_files[pid][f])) for f in fields}
                for f in fields:
                    np.ascontiguousarray(records[f][lo:hi]).tofile(files[f])
                written[pid] += int(hi - lo)
    finally:
        _close(files)
    if written:
        yield pa.RecordBatch.from_arrays([pa.array(list(written), pa.int32()), pa.array(list(written.values()), pa.int64())],
                                         names=["pid", "rows"])


def _open(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return open(path, "wb")


def _close(files):
    for f in files.values():
        f.close()
    files.clear()
