"""The work of the Spark tasks, run on the executors (numpy and pyarrow, no Spark objects).

Each stage gets the split ids (or encoded records) as Arrow batches and yields Arrow batches:
`count_values` (per-split value counts of the training rows, and the split's bad-line report),
`encode` (one fixed-size binary record per good row, with its part and sort key) and `write`
(the records of whole parts, sorted, into the part files of every feature).
"""
import dataclasses
import json
import os
from typing import Dict, Iterator, List

import numpy as np
import pyarrow as pa

from preproc import parsing, reading, vocab
from preproc.layout import MAPPINGS, Layout

COUNT_SCHEMA = "col int, value long, count long, info string"
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
    out_root: str = ""                     # write: where the part files go
    record: list = None                    # write: the record's numpy dtype description
    part_files: Dict[int, Dict[str, str]] = None   # write: pid -> feature (or "numerical") -> file

    def record_dtype(self) -> np.dtype:
        return np.dtype([(n, d, tuple(s)) for n, d, s in self.record])


def _parsed(ctx: Context, split_id: int):
    """(global line numbers of the good rows, their Block) per block of the split, then the
    split's bad lines as a list of (global line, reason)."""
    split, line, bad = ctx.splits[split_id], ctx.split_lines[split_id], []
    for data in reading.iter_blocks(split, ctx.block_bytes):
        n = reading.count_lines(data)
        block = parsing.parse_block(data, n)
        bad += [(line + k, reason) for k, reason in block.bad]
        yield line + block.lines, block
        line += n
    return bad


def _split_ids(batches) -> Iterator[int]:
    for batch in batches:
        yield from batch.column(0).to_pylist()


def count_values(ctx: Context, batches):
    for split_id in _split_ids(batches):
        split, rows, bad = ctx.splits[split_id], dict.fromkeys(MAPPINGS, 0), []
        parsed = _parsed(ctx, split_id)
        while True:
            try:
                lines, block = next(parsed)
            except StopIteration as done:
                bad = done.value
                break
            mapping = ctx.layout.assign(lines)[0]
            for k, name in enumerate(MAPPINGS):
                rows[name] += int(np.sum(mapping == k))
            train = mapping == MAPPINGS.index("train")
            if not ctx.count or not train.any():
                continue
            for k in range(parsing.NUM_CATEGORICAL):
                present = train & ~block.categorical_missing[:, k]
                values, counts = vocab.count(block.categorical[present, k])
                yield pa.RecordBatch.from_arrays(
                    [pa.array(np.full(len(values), k, np.int32)), pa.array(values.view(np.int64)),
                     pa.array(counts), pa.nulls(len(values), pa.string())], names=["col", "value", "count", "info"])
        first = ctx.file_lines[split.file_index]
        info = {"split": split_id, "rows": rows, "bad": len(bad),
                "first_bad": [[split.path, int(g - first + 1), reason] for g, reason in bad[:MAX_REPORTED]]}
        yield pa.RecordBatch.from_arrays([pa.array([-1], pa.int32()), pa.array([split_id], pa.int64()),
                                          pa.array([0], pa.int64()), pa.array([json.dumps(info)])],
                                         names=["col", "value", "count", "info"])


def encode(ctx: Context, batches):
    dtype = ctx.record_dtype()
    encoders = [vocab.encoder(ctx.vocab_root, f) for f in ctx.categorical]
    for split_id in _split_ids(batches):
        for lines, block in _parsed(ctx, split_id):
            n = len(lines)
            records = np.empty(n, dtype)
            records[ctx.label] = block.labels
            records["numerical"] = parsing.transform_integers(block.integers, block.integer_missing)
            for k, feature in enumerate(ctx.categorical):
                records[feature] = encoders[k](block.categorical[:, k], block.categorical_missing[:, k])
            _, pid, key = ctx.layout.assign(lines)
            offsets = np.arange(n + 1, dtype=np.int32) * dtype.itemsize
            rec = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(records.tobytes())])
            yield pa.RecordBatch.from_arrays([pa.array(pid.astype(np.int32)), pa.array(key), rec],
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


def rank_column(ctx: Context, thresholds: List[int], table: pa.Table) -> pa.Table:
    """One feature's summed counts -> its vocabulary file; returns (col, cardinality)."""
    col = table.column("col")[0].as_py()
    entries = vocab.rank(table.column("value").to_numpy().view(np.uint64), table.column("count").to_numpy(),
                         thresholds[col])
    vocab.save(ctx.vocab_root, ctx.categorical[col], entries)
    return pa.table({"col": pa.array([col], pa.int32()), "cardinality": pa.array([len(entries) + 1], pa.int64())})
