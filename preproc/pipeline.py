"""The Spark job: raw Criteo TSV files -> split-binary dataset + feature_spec.yaml.

    1. line counts of every split (one task per split)       -> the layout (mappings, parts)
    2. value counts of the training rows (numpy tables), bad-line reports -> summed per
       (feature, hash bucket) after Spark groups them, cut to the frequent values (and the values
       of the earlier vocabulary that grows); one task per feature ranks them (or grows the
       earlier vocabulary with them) and writes vocab/<feature>.npy; the driver writes vocab.json
       (step 2 parses each split once and caches the parsed columns under the job's directory)
    3. the driver creates every part file at its final size (rows per part and split are
       known from step 2); one task per split encodes its cached rows and writes them at
       their place in the part files (a shared file system on a cluster). With --shuffle, the
       training rows instead become records tagged with their part and sort key, which Spark
       groups by part and sorts; one task per part writes it. No data passes through the driver.

The result depends only on the input and the layout flags (split, fractions, part_rows, seed),
not on the split size, the number of executors or Spark's partitioning. Everything is written
under OUT/.preproc-tmp-*/ and moved into place at the end, the spec last.
"""
import dataclasses
import os
import shutil
import sys
import tempfile
import uuid
import zipfile
from fractions import Fraction
from typing import Dict, List

import numpy as np

from dataloading.feature_spec import SPEC_FILE, split_binary_spec
from preproc import layout as layouts
from preproc import parsing, reading, tasks, vocab, vocab_info
from preproc.layout import MAPPINGS
from utils.errors import DatasetError

NUMERICAL = [f"num_{k}" for k in range(parsing.NUM_INTEGER)]
CATEGORICAL = [f"cat_{k}" for k in range(parsing.NUM_CATEGORICAL)]
LABEL = "label"


@dataclasses.dataclass
class Options:
    inputs: List[str]
    output: str
    split: str = "auto"                   # auto | day | fraction
    test_fraction: float = 0.05
    validation_fraction: float = 0.05
    fractions_given: bool = False         # the fractions were set (an error with the day split)
    thresholds: List[int] = None          # per categorical feature (C1..C26); None: 0, or the earlier ones
    headroom: Fraction = Fraction(1)      # new vocabularies: capacity = ceil(headroom x (K + 1)) ...
    capacity_rows: Dict[int, int] = None  # ... or these rows (per categorical feature index)
    shuffle: bool = False
    seed: int = 12345
    vocab_from: str = ""                  # the earlier output whose vocabularies grow (or are kept)
    freeze_vocab: bool = False            # with vocab_from: keep its vocabularies as they are
    strict: bool = False
    split_bytes: int = 128 << 20
    block_bytes: int = 8 << 20
    part_rows: int = 1 << 24


def run(spark, opts: Options, log=print) -> dict:
    """Runs the job; returns the summary that also goes into the spec's metadata."""
    sc = spark.sparkContext
    _ship_code(sc)
    paths = input_files(opts.inputs)
    splits = reading.plan_splits(paths, opts.split_bytes)
    block_bytes = opts.block_bytes     # (the task closures must not capture pipeline objects)
    counts = sc.parallelize(range(len(splits)), len(splits)).map(
        lambda i: sum(reading.count_lines(b) for b in reading.iter_blocks(splits[i], block_bytes))).collect()
    split_lines = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
    file_lines = [split_lines[min(s.index for s in splits if s.file_index == k)] for k in range(len(paths))]
    lines_per_file = np.diff(file_lines + [split_lines[-1]]).tolist()
    layout = _layout(opts, paths, lines_per_file, split_lines[-1])
    tmp = os.path.join(opts.output, f".preproc-tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        ctx = tasks.Context(splits, split_lines[:-1], file_lines, layout, opts.block_bytes, NUMERICAL, CATEGORICAL,
                            LABEL, count=not opts.freeze_vocab, vocab_root=tmp, out_root=tmp,
                            cache_root=os.path.join(tmp, "cache"))
        summary = _count_and_rank(spark, ctx, opts, tmp, log)
        spec = _spec(layout, summary.pop("cardinalities"), opts.output)
        ctx.record = [(LABEL, "u1", ()), ("numerical", "<f2", (len(NUMERICAL),))] + [
            (f, spec.dtype(f).str, ()) for f in CATEGORICAL]
        ctx.part_files = _part_files(spec, layout)
        ctx.row_offsets = _create_parts(ctx, summary.pop("split_part_rows"))
        written = _write(spark, ctx)
        _check_written(written, summary["rows"], layout)
        spec.metadata = summary
        _move_into_place(tmp, opts.output)
        spec.to_yaml(os.path.join(opts.output, SPEC_FILE))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summary


def input_files(inputs: List[str]) -> List[str]:
    """The files named, directories expanded (visible files); day_N files in day order."""
    paths = []
    for item in inputs:
        if os.path.isdir(item):
            paths += sorted(os.path.join(item, f) for f in os.listdir(item)
                            if not f.startswith(".") and os.path.isfile(os.path.join(item, f)))
        elif os.path.isfile(item):
            paths.append(item)
        else:
            raise DatasetError(f"--input {item}: no such file or directory")
    if not paths:
        raise DatasetError(f"--input {' '.join(inputs)}: no input files")
    days = [layouts.day_of(p) for p in paths]
    if all(d is not None for d in days):
        paths = [p for _, p in sorted(zip(days, paths))]
    return paths


def _layout(opts: Options, paths, lines_per_file, total) -> layouts.Layout:
    days = [layouts.day_of(p) for p in paths]
    split = opts.split
    if split == "auto":
        split = "day" if len(paths) > 1 and all(d is not None for d in days) else "fraction"
    seed = opts.seed if opts.shuffle else -1
    if split == "day":
        if any(d is None for d in days) or len(set(days)) < 2:
            raise DatasetError("--split=day: the inputs must be files day_N[.gz] of at least two different days")
        if opts.fractions_given:
            raise DatasetError("--test_fraction/--validation_fraction have no effect: the inputs are split by day")
        return layouts.by_day(lines_per_file, days, opts.part_rows, seed)
    return layouts.by_fraction(total, opts.test_fraction, opts.validation_fraction, opts.part_rows, seed)


def _count_and_rank(spark, ctx, opts: Options, tmp, log) -> dict:
    sc = spark.sparkContext
    counted = sc.parallelize(range(len(ctx.splits)), len(ctx.splits)).map(
        lambda i: tasks.count_values(ctx, i)).persist()
    try:
        infos = sorted(counted.map(lambda r: r[0]).collect(), key=lambda i: i["split"])
        rows = {m: sum(i["rows"][m] for i in infos) for m in MAPPINGS}
        bad = sum(i["bad"] for i in infos)
        first_bad = [b for i in infos for b in i["first_bad"]][:tasks.MAX_REPORTED]
        if bad:
            where = "; ".join(f"{p}:{line}: {reason}" for p, line, reason in first_bad)
            message = f"{bad} bad line{'s' * (bad > 1)} (first: {where})"
            if opts.strict:
                raise DatasetError(f"--strict: {message}")
            log(f"skipped {message}")
        cards, thresholds, report = _vocabularies(sc, counted, ctx, opts, tmp, log)
    finally:
        counted.unpersist()
    return {"rows": rows, "split_part_rows": [{int(p): n for p, n in i["part_rows"].items()} for i in infos],
            "bad_lines": bad, "first_bad_lines": [f"{p}:{line}: {r}" for p, line, r in first_bad],
            "cardinalities": cards,
            "inputs": [s.path for s in ctx.splits if s.start == 0],
            "frequency_threshold": dict(zip(CATEGORICAL, thresholds)),
            "vocabulary": f"{vocab.VOCAB_DIR}/<feature>.npy (value, count, generation) in id order from id 1; "
                          "id 0: missing and rare values and those past capacity; cardinality: the capacity",
            "vocabularies": report,
            "numerical": "log(v + 3); v < -2 counts as -2; missing -> 0",
            "shuffle_seed": opts.seed if opts.shuffle else None}


def _vocabularies(sc, counted, ctx, opts: Options, tmp, log):
    """Ranks new vocabularies, grows the earlier ones (--vocab_from) or copies them (--freeze_vocab)
    into tmp/vocab/ with vocab.json; returns (capacities, thresholds, report) per categorical feature."""
    info = vocab_info.load(opts.vocab_from, CATEGORICAL) if opts.vocab_from else None
    earlier = [info["features"][f] for f in CATEGORICAL] if info else None
    thresholds = opts.thresholds or ([e["threshold"] for e in earlier] if info else [0] * len(CATEGORICAL))
    if opts.freeze_vocab:
        for f in CATEGORICAL:
            vocab.save(tmp, f, vocab.load(opts.vocab_from, f))
        vocab_info.save(tmp, info)
        caps = [e["capacity"] for e in earlier]
        sizes = [e["generations"][-1]["end_id"] for e in earlier]
        return caps, thresholds, _report(info["generation"], "frozen", caps, sizes, [{}] * len(caps))
    caps, buckets = [e["capacity"] for e in earlier] if info else [0] * len(CATEGORICAL), sc.defaultParallelism
    ctx.base_root, ctx.generation = opts.vocab_from, info["generation"] + 1 if info else 0
    ranked = dict(counted.flatMap(lambda r: tasks.bucketed(r[1], buckets)).groupByKey(buckets)
                  .map(lambda kv: (kv[0][0], tasks.kept(ctx, kv[0][0], tasks.summed(kv[1]), thresholds[kv[0][0]])))
                  .groupByKey(buckets)
                  .map(lambda kv: (kv[0], tasks.rank_column(ctx, kv[0], kv[1], thresholds[kv[0]], caps[kv[0]])))
                  .collect())
    nothing = (np.zeros(0, np.uint64), np.zeros(0, np.int64))
    ranked = [ranked[k] if k in ranked else tasks.rank_column(ctx, k, [nothing], thresholds[k], caps[k])
              for k in range(len(CATEGORICAL))]      # (features with no value in the training rows)
    sizes = [r.pop("size") for r in ranked]
    if info:
        info = vocab_info.grown(info, dict(zip(CATEGORICAL, thresholds)), dict(zip(CATEGORICAL, sizes)))
        for f, r in zip(CATEGORICAL, ranked):
            if r["past_capacity"]:
                log(f"{f}: capacity {info['features'][f]['capacity']} full: {r['past_capacity']} new values "
                    f"({r['past_capacity_rows']} training rows) -> id 0")
        log(f"vocabulary generation {info['generation']}: {sum(r['added'] for r in ranked)} values added, "
            f"{sum(r['past_capacity'] for r in ranked)} past capacity")
    else:
        rows = opts.capacity_rows or {}
        caps = [vocab_info.capacity(n, opts.headroom, rows.get(k), f"{parsing.CATEGORICAL_NAMES[k]} ({f})")
                for k, (f, n) in enumerate(zip(CATEGORICAL, sizes))]
        info = vocab_info.first(dict(zip(CATEGORICAL, caps)), dict(zip(CATEGORICAL, thresholds)),
                                dict(zip(CATEGORICAL, sizes)))
        ranked = [{"added": n - 1, "past_capacity": 0, "past_capacity_rows": 0} for n in sizes]
    vocab_info.save(tmp, info)
    return caps, thresholds, _report(info["generation"], "grown" if opts.vocab_from else "new", caps, sizes, ranked)


def _report(generation, mode, caps, sizes, growth) -> dict:
    """The spec's metadata on the vocabularies: per feature ids in use, capacity, ids left and growth."""
    return {"generation": generation, "mode": mode, "features": {
        f: dict(g, ids=n - 1, capacity=c, ids_left=c - n) for f, c, n, g in zip(CATEGORICAL, caps, sizes, growth)}}


def _spec(layout, cardinalities, output):
    spec = split_binary_spec(NUMERICAL, dict(zip(CATEGORICAL, cardinalities)), LABEL, MAPPINGS, base_dir=output)
    for mapping, chunks in spec.source.items():
        for chunk in chunks:
            stem = chunk.files[0][:-len(".bin")]
            chunk.files = [f"{stem}.part{p:05d}.bin" for p in range(layout.parts(mapping))]
    return spec


def _part_files(spec, layout) -> Dict[int, Dict[str, str]]:
    out = {}
    for mapping in MAPPINGS:
        for p in range(layout.parts(mapping)):
            files = {}
            for chunk in spec.mapping(mapping):
                name = "numerical" if chunk.features == NUMERICAL else chunk.features[0]
                files[name] = chunk.files[p]
            out[layout.part_base(mapping) + p] = files
    return out


def _create_parts(ctx, split_part_rows) -> Dict[int, Dict[int, int]]:
    """Creates every part file at its final size; returns each split's first row in each part."""
    offsets, totals = [], {}
    for part_rows in split_part_rows:
        offsets.append({pid: totals.get(pid, 0) for pid in part_rows})
        for pid, n in part_rows.items():
            totals[pid] = totals.get(pid, 0) + n
    dtype = ctx.record_dtype()
    for pid, files in ctx.part_files.items():
        for field, name in files.items():
            path = os.path.join(ctx.out_root, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(totals.get(pid, 0) * dtype[field].itemsize)
    return dict(enumerate(offsets))


def _write(spark, ctx) -> Dict[int, int]:
    """Rows of unshuffled parts straight to their place; shuffled rows grouped and sorted by Spark."""
    n = len(ctx.splits)
    written = {}
    for rows in spark.sparkContext.parallelize(range(n), n).map(lambda i: tasks.write_direct(ctx, i)).collect():
        written.update({pid: written.get(pid, 0) + k for pid, k in rows.items()})
    if ctx.layout.shuffle_seed >= 0:
        splits = spark.sparkContext.parallelize([(i,) for i in range(n)], n)
        records = spark.createDataFrame(splits, "split int").mapInArrow(
            lambda batches: tasks.encode(ctx, batches), tasks.RECORD_SCHEMA)
        written.update({r.pid: r.rows for r in records.repartition(ctx.layout.parts("train"), "pid").sortWithinPartitions(
            "pid", "key").mapInArrow(lambda batches: tasks.write(ctx, batches), tasks.WRITTEN_SCHEMA).collect()})
    return written


def _check_written(written, rows, layout):
    for mapping in MAPPINGS:
        base = layout.part_base(mapping)
        got = sum(written.get(base + p, 0) for p in range(layout.parts(mapping)))
        if got != rows[mapping]:
            raise RuntimeError(f"{mapping}: wrote {got} rows, counted {rows[mapping]} (a task was lost?)")


def _move_into_place(tmp, output):
    for name in list(MAPPINGS) + [vocab.VOCAB_DIR]:
        final = os.path.join(output, name)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(os.path.join(tmp, name), final)


def _ship_code(sc):
    """Puts the preproc package on the executors' path (a zip, as --py-files would)."""
    if getattr(sc, "_preproc_shipped", False):
        return
    sc._preproc_shipped = True
    root = os.path.dirname(os.path.abspath(__file__))
    archive = os.path.join(tempfile.mkdtemp(prefix="preproc-code-"), "preproc.zip")
    with zipfile.ZipFile(archive, "w") as z:
        for name in sorted(os.listdir(root)):
            if name.endswith(".py"):
                z.write(os.path.join(root, name), f"preproc/{name}")
    sc.addPyFile(archive)
    sys.path_importer_cache.clear()
