"""The work of the Spark tasks, run on the executors (numpy and pyarrow, no Spark objects).

`count_lines` counts a split's lines (a split by value: its rows per mapping). `count_values`
parses a split once (its Source's Rows): it returns its report (rows per mapping and per part,
multi-hot ids per part, bad lines) and the value counts of its training rows as numpy tables,
and caches the parsed columns (labels, float16 numericals, per block and feature the distinct
keys, each row's (or list value's) code and the multi-hot lengths) in `cache_root`, and the
events of the history features (preproc.history, whose pass writes each split's histories there
too).
`bucketed`, `summed`, `kept` and `rank_column` sum the tables per (feature, hash
bucket) and rank each feature's frequent values (or grow an earlier vocabulary with them).
`write_direct` encodes a split's cached rows and writes those of unshuffled parts at their known
place in the pre-sized part files (a multi-hot feature's ids at their known place in its values
file, its row ends in its offsets file). With a shuffle, `encode` turns the shuffled rows into
fixed-size binary records (part, sort key; multi-hot ids padded to max_hotness) that Spark
groups and sorts, and `write` writes whole sorted parts.
"""
import dataclasses
import os
from typing import Dict, Iterator, List

import numpy as np
import pandas as pd
import pyarrow as pa

from preproc import distinct as distinct_count
from preproc import history, reading, sources, vocab
from preproc.layout import MAPPINGS, Layout, hash_buckets

RECORD_SCHEMA = "pid int, key long, rec binary"
WRITTEN_SCHEMA = "pid int, rows long"
MAX_REPORTED = 5
LENGTH, OFFSETS = ".length", ".offsets"   # a multi-hot field's lengths (records), offsets file


@dataclasses.dataclass
class Context:
    """What every task needs, shipped with the task."""
    splits: List[reading.Split]
    split_lines: List[int]                 # first global line number of each split
    file_lines: List[int]                  # first global line number of each file
    layout: Layout
    block_bytes: int
    source: sources.Source
    count: bool = True                     # count values (False: the vocabularies are given)
    vocab_root: str = ""                   # where vocab/<feature>.npy lie
    base_root: str = ""                    # rank: the earlier output whose vocabularies grow ("": new ones)
    generation: int = 0                    # rank: the generation of the ids it adds
    out_root: str = ""                     # write: where the part files go
    cache_root: str = ""                   # where the parsed splits are cached
    split_positions: List[List[int]] = None   # split by value: each split's first position per mapping
    record: list = None                    # write: the record's numpy dtype description
    part_files: Dict[int, Dict[str, str]] = None   # write: pid -> field (or its offsets field) -> file
    row_offsets: Dict[int, Dict[int, int]] = None  # write: split -> pid -> its first row in the part
    id_offsets: Dict[int, Dict[int, Dict[str, int]]] = None  # write: split -> pid -> multi-hot field -> first id

    @property
    def schema(self) -> sources.Schema:
        return self.source.schema

    @property
    def categorical(self) -> List[str]:
        return self.schema.categorical

    def record_dtype(self) -> np.dtype:
        return np.dtype([(n, d, tuple(s)) for n, d, s in self.record])

    def fields(self) -> List[str]:
        """The record's fields written to files (multi-hot lengths are not)."""
        return [n for n, _, _ in self.record if not n.endswith(LENGTH)]

    def cache_path(self, split_id: int) -> str:
        return os.path.join(self.cache_root, f"split{split_id:05d}.npy")


def _split_ids(batches) -> Iterator[int]:
    for batch in batches:
        yield from batch.column(0).to_pylist()


def count_lines(source: sources.Source, split: reading.Split, block_bytes: int) -> list:
    """[the split's lines]; a split by value: [lines, then its rows per mapping]."""
    if not source.by_value:
        return [source.count(split, block_bytes)]
    counts = np.zeros(len(MAPPINGS), np.int64)
    lines = 0
    for rows in source.rows(split, block_bytes):
        counts += np.bincount(rows.mapping[rows.mapping >= 0], minlength=len(MAPPINGS))
        lines += rows.num_lines
    return [lines] + counts.tolist()


def _positions(ctx: Context, rows: sources.Rows, line: int, next_position: np.ndarray) -> np.ndarray:
    """The layout's position of each good row: its global line, or with a split by value its place
    in its mapping's rows (`next_position` [mappings] advances)."""
    if not ctx.source.by_value:
        return line + rows.lines
    positions = np.full(rows.num_lines, -1, np.int64)
    for k in range(len(MAPPINGS)):
        chosen = np.flatnonzero(rows.mapping == k)
        positions[chosen] = next_position[k] + np.arange(len(chosen))
        next_position[k] += len(chosen)
    return positions[rows.lines]


def count_values(ctx: Context, split_id: int):
    """Parses and caches a split; returns its report, {feature index: (values, counts)} of its
    training rows (features with a vocabulary) and {feature index: distinct.sketch} of the keys of
    its training rows (raw-id features; missing values not counted)."""
    split, line, bad = ctx.splits[split_id], ctx.split_lines[split_id], []
    rows, part_rows, part_ids = dict.fromkeys(MAPPINGS, 0), {}, {}
    counted = [[] for _ in ctx.categorical]
    vocabularies = set(ctx.schema.counted) if ctx.count else set()
    sketches = {k: distinct_count.sketch(np.zeros(0, np.uint64)) for k, f in enumerate(ctx.categorical)
                if f in ctx.schema.raw_ids}
    next_position = np.array(ctx.split_positions[split_id] if ctx.source.by_value else [0], np.int64)
    histories = ctx.schema.histories
    os.makedirs(ctx.cache_root, exist_ok=True)
    for feature in histories:                  # (the history pass fills those of a split with rows)
        for path in history.history_paths(ctx.cache_root, split_id, feature):
            np.save(path, np.zeros(0, np.uint64))
    with open(ctx.cache_path(split_id), "wb") as cache, \
            open(history.events_path(ctx.cache_root, split_id) if histories else os.devnull, "wb") as events:
        for block in ctx.source.rows(split, ctx.block_bytes):
            bad += [(line + k, reason) for k, reason in block.bad]
            positions = _positions(ctx, block, line, next_position)
            history.save_events(events, block, line + block.lines, positions, ctx.schema)
            line += block.num_lines
            mapping, pid, _ = ctx.layout.assign(positions)
            for k, name in enumerate(MAPPINGS):
                rows[name] += int(np.sum(mapping == k))
            for p in np.unique(pid):
                part_rows[int(p)] = part_rows.get(int(p), 0) + int(np.sum(pid == p))
            train = mapping == MAPPINGS.index("train")
            np.save(cache, positions)
            np.save(cache, block.labels)
            np.save(cache, block.numerical.astype(np.float16))
            for k, (feature, entry) in enumerate(zip(ctx.categorical, block.categorical)):
                if feature in histories:
                    continue                   # (its ids come from the history pass)
                keys, other = entry
                column, distinct = pd.factorize(keys)
                if feature in ctx.schema.max_hotness:
                    rows_of = np.repeat(np.arange(len(other)), other)
                    ids = np.bincount(pid, other, minlength=1)
                    for p in np.flatnonzero(ids):
                        part_ids.setdefault(int(p), {}).setdefault(feature, 0)
                        part_ids[int(p)][feature] += int(ids[p])
                    np.save(cache, other)
                else:
                    column[other] = -1
                    rows_of = slice(None)
                np.save(cache, distinct)
                np.save(cache, column)
                if k in vocabularies and train.any():
                    counts = np.bincount(column[train[rows_of]] + 1, minlength=len(distinct) + 1)[1:]
                    counted[k].append((distinct, counts))
                if k in sketches and train.any():
                    seen = np.unique(column[train[rows_of]])
                    sketches[k] = distinct_count.merged(sketches[k], distinct_count.sketch(distinct[seen[seen >= 0]]))
    tables = {k: summed(pieces) for k, pieces in enumerate(counted) if pieces}
    first = ctx.file_lines[split.file_index] - ctx.source.header_lines
    info = {"split": split_id, "rows": rows, "part_rows": part_rows, "part_ids": part_ids, "bad": len(bad),
            "first_bad": [[split.path, int(g - first + 1), reason] for g, reason in bad[:MAX_REPORTED]]}
    return info, tables, sketches


def bucketed(tables: Dict[int, tuple], buckets: int):
    """((feature, bucket of the value's hash), (values, counts)) pieces of a split's count tables."""
    for k, (values, counts) in tables.items():
        for b, piece in hash_buckets(values, k, buckets):
            yield (k, b), (values[piece], counts[piece])


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


def _encoders(ctx: Context):
    """Per categorical feature: distinct keys -> ids (its vocabulary, 1 + key % buckets, or with
    raw ids the key itself as int64; a history: its item feature's; time gaps: the ids they are)."""
    def hashed(buckets):
        return lambda keys: (keys % np.uint64(buckets)).astype(np.int64) + 1

    def raw(keys):
        return keys.view(np.int64)
    schema = ctx.schema
    items = [schema.histories.get(f, f) for f in ctx.categorical]
    return [raw if f in schema.gaps else hashed(schema.buckets[item]) if item in schema.buckets else
            raw if item in schema.raw_ids else vocab.encoder(ctx.vocab_root, item)
            for f, item in zip(ctx.categorical, items)]


def _encoded(ctx: Context, split_id: int):
    """(layout positions, records) per cached block of the split; a multi-hot feature's record
    field holds its ids padded to max_hotness, its LENGTH field how many there are."""
    dtype, hotness, histories = ctx.record_dtype(), ctx.schema.max_hotness, ctx.schema.histories
    encoders = _encoders(ctx)
    read = {f: [np.load(p, mmap_mode="r") for p in history.history_paths(ctx.cache_root, split_id, f)]
            for f in histories}
    row, item = 0, dict.fromkeys(histories, 0)       # the histories' next row and item key
    with open(ctx.cache_path(split_id), "rb") as cache:
        while cache.peek(1):
            positions, labels, numerical = np.load(cache), np.load(cache), np.load(cache)
            records = np.zeros(len(positions), dtype)
            records[ctx.schema.label] = labels
            if ctx.schema.numerical:
                records["numerical"] = numerical
            for k, feature in enumerate(ctx.categorical):
                if feature in histories:
                    lengths_file, items_file, known_file = read[feature]
                    lengths = np.asarray(lengths_file[row:row + len(positions)])
                    taken = slice(item[feature], item[feature] + int(lengths.sum()))
                    ids = np.where(known_file[taken], encoders[k](np.asarray(items_file[taken])), 0)
                    item[feature] += int(lengths.sum())
                else:
                    lengths = np.load(cache) if feature in hotness else None
                    distinct, codes = np.load(cache), np.load(cache)
                    ids = np.append(encoders[k](distinct), 0)[codes]         # code -1 (missing): id 0
                if lengths is None:
                    records[feature] = ids
                else:
                    records[feature][np.arange(hotness[feature]) < lengths[:, None]] = ids
                    records[feature + LENGTH] = lengths
            row += len(positions)
            yield positions, records


def _ids(records, feature: str):
    """A multi-hot feature's ids of `records`, back to back, and the row lengths."""
    lengths = records[feature + LENGTH]
    return records[feature][np.arange(records.dtype[feature].shape[0]) < lengths[:, None]], lengths.astype(np.int64)


def _runs(pids: np.ndarray):
    """(lo, hi) of the runs of equal part ids."""
    bounds = np.flatnonzero(np.diff(pids)) + 1
    return zip(np.concatenate([[0], bounds]).tolist(), np.concatenate([bounds, [len(pids)]]).tolist())


def write_direct(ctx: Context, split_id: int) -> Dict[int, int]:
    """Writes the split's rows of unshuffled parts at their place in the part files; returns the
    rows written per part."""
    fields, hotness, written, written_ids, files = ctx.fields(), ctx.schema.max_hotness, {}, {}, {}
    try:
        for positions, records in _encoded(ctx, split_id):
            _, pids, _ = ctx.layout.assign(positions)
            direct = ctx.layout.unshuffled(pids)
            pids, records = pids[direct], records[direct]
            for lo, hi in _runs(pids):
                if lo == hi:
                    continue
                pid = int(pids[lo])
                if pid not in files:
                    files[pid] = {f: os.open(os.path.join(ctx.out_root, name), os.O_WRONLY)
                                  for f, name in ctx.part_files[pid].items()}
                    written_ids[pid] = {f: ctx.id_offsets[split_id].get(pid, {}).get(f, 0) for f in hotness}
                row = ctx.row_offsets[split_id][pid] + written.get(pid, 0)
                for f in fields:
                    if f in hotness:
                        ids, lengths = _ids(records[lo:hi], f)
                        first = written_ids[pid][f]
                        os.pwrite(files[pid][f], ids.data, first * ids.itemsize)
                        os.pwrite(files[pid][f + OFFSETS], (first + np.cumsum(lengths)).data, (row + 1) * 8)
                        written_ids[pid][f] += len(ids)
                    else:
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
        for positions, records in _encoded(ctx, split_id):
            _, pid, key = ctx.layout.assign(positions)
            keep = ~ctx.layout.unshuffled(pid)
            records, n = records[keep], int(keep.sum())
            offsets = np.arange(n + 1, dtype=np.int32) * records.dtype.itemsize
            rec = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(records.tobytes())])
            yield pa.RecordBatch.from_arrays([pa.array(pid[keep].astype(np.int32)), pa.array(key[keep]), rec],
                                             names=["pid", "key", "rec"])


def write(ctx: Context, batches):
    """Writes the records of each part (they arrive sorted by part, then key) to its files."""
    dtype, fields, hotness = ctx.record_dtype(), ctx.fields(), ctx.schema.max_hotness
    current, files, written, written_ids = None, {}, {}, {}
    try:
        for batch in batches:
            pids = batch.column(0).to_numpy()
            rec = batch.column(2)
            start = np.frombuffer(rec.buffers()[1], np.int32, 1, rec.offset * 4)[0]
            records = np.frombuffer(rec.buffers()[2], dtype, len(rec), int(start))
            for lo, hi in _runs(pids):
                pid = int(pids[lo])
                if pid != current:
                    _close(files)
                    current, written[pid], written_ids = pid, 0, dict.fromkeys(hotness, 0)
                    files = {f: _open(os.path.join(ctx.out_root, name)) for f, name in ctx.part_files[pid].items()}
                    for f in hotness:
                        np.zeros(1, np.int64).tofile(files[f + OFFSETS])
                for f in fields:
                    if f in hotness:
                        ids, lengths = _ids(records[lo:hi], f)
                        ids.tofile(files[f])
                        (written_ids[f] + np.cumsum(lengths)).tofile(files[f + OFFSETS])
                        written_ids[f] += len(ids)
                    else:
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
