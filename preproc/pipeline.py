"""The Spark job: raw logs (a Source: the Criteo preset, or any CSV/Parquet a raw spec describes)
-> split-binary dataset + feature_spec.yaml.

    1. line counts of every split (one task per split; a split by value: rows per mapping)
       -> the layout (mappings, parts)
    2. value counts of the training rows (numpy tables; not of the features with raw ids, whose
       ids are their values' 64-bit keys), bad-line reports -> summed per
       (feature, hash bucket) after Spark groups them, cut to the frequent values (and the values
       of the earlier vocabulary that grows); one task per feature ranks them (or grows the
       earlier vocabulary with them) and writes vocab/<feature>.npy; the driver writes vocab.json
       (step 2 parses each split once and caches the parsed columns under the job's directory, and
       the events of the history features)
    2b. histories (preproc.history): the events of all splits, and the state of --vocab_from's
       histories, grouped by (feature, bucket of users); one task per bucket computes its events'
       histories and writes its state under vocab/; Spark groups the histories by split and one
       task per split writes them beside its cache, in its rows' order
    3. the driver creates every part file at its final size (rows, and multi-hot ids, per
       part and split are known from step 2); one task per split encodes its cached rows and writes them at
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
from typing import Dict, List, Tuple

import numpy as np

from dataloading.feature_spec import SPEC_FILE, split_binary_spec
from preproc import layout as layouts
from preproc import distinct, history, tasks, vocab, vocab_info
from preproc.layout import MAPPINGS
from preproc.sources import CATEGORICAL, CriteoSource, Source
from utils import preemption
from utils.errors import DatasetError

__all__ = ["CATEGORICAL", "Options", "run", "input_files"]


@dataclasses.dataclass
class Options:
    inputs: List[str]
    output: str
    split: str = "auto"                   # auto | day | fraction
    test_fraction: float = 0.05
    validation_fraction: float = 0.05
    fractions_given: bool = False         # the fractions were set (an error with the day split)
    order: Tuple[str, ...] = None         # fraction split: the mappings' order in the input (None: MAPPINGS')
    thresholds: List[int] = None          # per categorical feature (C1..C26); None: 0, or the earlier ones
    headroom: Fraction = Fraction(1)      # new vocabularies: capacity = ceil(headroom x (K + 1)) ...
    capacity_rows: Dict[int, int] = None  # ... or these rows (per categorical feature index)
    source: Source = None                 # what reads the input (None: the Criteo preset)
    shuffle: bool = False
    seed: int = 12345
    vocab_from: str = ""                  # the earlier output whose vocabularies grow (or are kept)
    freeze_vocab: bool = False            # with vocab_from: keep its vocabularies as they are
    strict: bool = False
    split_bytes: int = 128 << 20
    block_bytes: int = 8 << 20
    part_rows: int = 1 << 24
    history_bucket_rows: int = 1 << 20    # histories: events per bucket of users (about; a bucket is one task) ...
    history_buckets: int = 8              # ... and at least this many buckets


def run(spark, opts: Options, log=print) -> dict:
    """Runs the job; returns the summary that also goes into the spec's metadata."""
    sc = spark.sparkContext
    _ship_code(sc)
    source = opts.source or CriteoSource()
    schema = source.schema
    counted_before = [f for f in schema.raw_ids if opts.vocab_from and os.path.exists(vocab.path(opts.vocab_from, f))]
    if counted_before:
        raise DatasetError(f"--raw_id_columns: {counted_before[0]} has a vocabulary in --vocab_from {opts.vocab_from} "
                           "(a feature keeps its ids day after day: raw ids need a new first dataset)")
    stateless = [f for f in schema.histories if opts.vocab_from and not os.path.isdir(history.state_dir(
        opts.vocab_from, f))]
    if stateless:
        raise DatasetError(f"--vocab_from {opts.vocab_from}: no history state of {stateless[0]} there "
                           f"({os.path.relpath(history.state_dir(opts.vocab_from, stateless[0]), opts.vocab_from)}/: "
                           "a history continues only from an output that built it)")
    paths = input_files(opts.inputs)
    splits = source.plan(paths, opts.split_bytes)
    block_bytes = opts.block_bytes     # (the task closures must not capture pipeline objects)
    counts = sc.parallelize(range(len(splits)), len(splits)).map(
        lambda i: tasks.count_lines(source, splits[i], block_bytes)).collect()
    split_lines = np.concatenate([[0], np.cumsum([c[0] for c in counts])]).astype(int).tolist()
    file_lines = [split_lines[min(s.index for s in splits if s.file_index == k)] for k in range(len(paths))]
    lines_per_file = np.diff(file_lines + [split_lines[-1]]).tolist()
    if not split_lines[-1]:
        more = f" and {len(paths) - 1} more input file{'s' * (len(paths) > 2)}" if len(paths) > 1 else ""
        raise DatasetError(f"{paths[0]}{more}: no lines to read (an empty input)")
    if source.by_value:
        layout, positions = _layout_by_value(opts, [c[1:] for c in counts], source.wanted(paths))
    else:
        layout, positions = _layout(opts, paths, lines_per_file, split_lines[-1]), None
    created = not os.path.exists(opts.output)
    tmp = os.path.join(opts.output, f".preproc-tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        ctx = tasks.Context(splits, split_lines[:-1], file_lines, layout, opts.block_bytes, source,
                            count=not opts.freeze_vocab, vocab_root=tmp, out_root=tmp,
                            cache_root=os.path.join(tmp, "cache"), split_positions=positions)
        summary = _count_and_rank(spark, ctx, opts, tmp, log)
        split_part_ids = summary.pop("split_part_ids")
        for split_id, part_ids in _histories(sc, ctx, opts, sum(summary["rows"].values())).items():
            for pid, ids in part_ids.items():
                split_part_ids[split_id].setdefault(pid, {}).update(ids)
        spec = _spec(schema, layout, summary.pop("cardinalities"), opts.output)
        ctx.record = _record(schema, spec)
        ctx.part_files = _part_files(spec, layout)
        ctx.row_offsets, ctx.id_offsets = _create_parts(ctx, summary.pop("split_part_rows"), split_part_ids)
        written = _write(spark, ctx)
        _check_written(written, summary["rows"], layout)
        spec.metadata = summary
        preemption.check()
        _move_into_place(tmp, opts.output)
        spec.to_yaml(os.path.join(opts.output, SPEC_FILE))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if created and not os.listdir(opts.output):        # a failed run leaves no folder it made
            os.rmdir(opts.output)
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
        if opts.fractions_given or opts.order:
            raise DatasetError("--test_fraction/--validation_fraction/--split_order have no effect: the inputs are "
                               "split by day")
        return layouts.by_day(lines_per_file, days, opts.part_rows, seed)
    return layouts.by_fraction(total, opts.test_fraction, opts.validation_fraction, opts.part_rows, seed,
                               opts.order or MAPPINGS)


def _layout_by_value(opts: Options, split_counts: List[List[int]], wanted: Tuple[str, ...]):
    """A split by a column's value: the mappings' rows in turn, each in input order (`wanted`: the
    mappings the split means to fill); returns the layout and each split's first position per mapping."""
    counts = np.array(split_counts, np.int64).reshape(-1, len(MAPPINGS))
    totals = counts.sum(axis=0)
    starts = np.concatenate([[0], np.cumsum(totals)[:-1]]) + np.cumsum(counts, axis=0) - counts
    layout = layouts.by_counts(dict(zip(MAPPINGS, totals.tolist())), opts.part_rows,
                               opts.seed if opts.shuffle else -1, wanted=wanted)
    return layout, starts.tolist()


def _count_and_rank(spark, ctx, opts: Options, tmp, log) -> dict:
    sc, schema = spark.sparkContext, ctx.schema
    counted = sc.parallelize(range(len(ctx.splits)), len(ctx.splits)).map(
        lambda i: tasks.count_values(ctx, i)).persist()
    try:
        infos = sorted(counted.map(lambda r: r[0]).collect(), key=lambda i: i["split"])
        rows = {m: sum(i["rows"][m] for i in infos) for m in MAPPINGS}
        bad = sum(i["bad"] for i in infos)
        first_bad = [b for i in infos for b in i["first_bad"]][:tasks.MAX_REPORTED]
        where = "; ".join(f"{p}:{line}: {reason}" for p, line, reason in first_bad)
        message = f"{bad} bad line{'s' * (bad > 1)} (first: {where})"
        if bad and opts.strict:
            raise DatasetError(f"--strict: {message}")
        for m in ctx.layout.wanted:
            if not rows[m]:
                lines = ctx.layout.lines[m]       # (a split by value: its good rows)
                why = (f"its {lines} lines are all bad" if lines > 1 else "its one line is bad") if lines else \
                    f"no row falls in it ({schema.rules['split']})"
                raise DatasetError(f"{m}: no rows: {why}" + f"; {message}" * (bad > 0))
        if bad:
            log(f"skipped {message}")
        caps, thresholds, report = _vocabularies(sc, counted, ctx, opts, tmp, log)
        distinct_ids = _distinct_ids(counted, ctx, log)
    finally:
        counted.unpersist()
    return {"rows": rows, "split_part_rows": [{int(p): n for p, n in i["part_rows"].items()} for i in infos],
            "split_part_ids": [i["part_ids"] for i in infos],
            "bad_lines": bad, "first_bad_lines": [f"{p}:{line}: {r}" for p, line, r in first_bad],
            "cardinalities": [history.GAP_IDS if f in schema.gaps else None if f in schema.raw_ids else
                              caps.get(item) or schema.buckets[item] + 1
                              for f, item in ((f, schema.histories.get(f, f)) for f in schema.categorical)],
            "inputs": [s.path for s in ctx.splits if s.start == 0],
            "frequency_threshold": thresholds,
            "vocabulary": f"{vocab.VOCAB_DIR}/<feature>.npy (value, count, generation) in id order from id 1; "
                          "id 0: missing and rare values and those past capacity; cardinality: the capacity",
            "vocabularies": report,
            **({"raw_ids": f"{', '.join(schema.raw_ids)}: no vocabulary; each value's 64-bit key as an int64 id "
                           "(a missing value: 0)",
                "distinct_ids": distinct_ids,
                "distinct_ids_are": f"per raw-id feature the distinct values of its training rows (missing ones "
                                    f"not counted), estimated: relative standard error "
                                    f"{1.04 / distinct.M ** 0.5:.1%}"} if schema.raw_ids else {}),
            **({"columns": dict(zip(schema.categorical, schema.names))} if schema.names else {}),
            **schema.rules,
            "shuffle_seed": opts.seed if opts.shuffle else None}


def _distinct_ids(counted, ctx, log) -> Dict[str, int]:
    """Per raw-id feature (by name) the distinct values of its training rows, estimated from the
    splits' sketches merged (preproc.distinct), and one line saying them."""
    if not ctx.schema.raw_ids:
        return {}
    sketches = counted.map(lambda r: r[2]).reduce(lambda a, b: {k: distinct.merged(a[k], b[k]) for k in a})
    counts = {ctx.categorical[k]: distinct.estimate(registers) for k, registers in sorted(sketches.items())}
    log("distinct ids in the training rows (estimated, for --dynamic_tables): "
        + ", ".join(f"{ctx.schema.name(k)} {counts[ctx.categorical[k]]:,}" for k in sorted(sketches)))
    return counts


def _vocabularies(sc, counted, ctx, opts: Options, tmp, log):
    """Ranks new vocabularies, grows the earlier ones (--vocab_from) or copies them (--freeze_vocab)
    into tmp/vocab/ with vocab.json; returns (capacities, thresholds, report) of the features with a
    vocabulary, by name."""
    schema = ctx.schema
    counted_ids = schema.counted
    names = [schema.categorical[k] for k in counted_ids]
    info = vocab_info.load(opts.vocab_from, names) if opts.vocab_from else None
    if info and set(names) - set(info["features"]):
        raise DatasetError(f"--vocab_from {opts.vocab_from}: no vocabulary of "
                           f"{sorted(set(names) - set(info['features']))[0]} there")
    earlier = {f: info["features"][f] for f in names} if info else None
    thresholds = list(opts.thresholds or ([earlier[f]["threshold"] if f in names else 0 for f in schema.categorical]
                                          if info else [0] * len(schema.categorical)))
    by_name = lambda values: {schema.categorical[k]: values[k] for k in counted_ids}   # noqa: E731
    if opts.freeze_vocab:
        for f in names:
            vocab.save(tmp, f, vocab.load(opts.vocab_from, f))
        vocab_info.save(tmp, info)
        caps = {f: earlier[f]["capacity"] for f in names}
        sizes = {f: earlier[f]["generations"][-1]["end_id"] for f in names}
        return caps, by_name(thresholds), _report(info["generation"], "frozen", caps, sizes, dict.fromkeys(names, {}))
    caps = [earlier[f]["capacity"] if info and f in earlier else 0 for f in schema.categorical]
    buckets = sc.defaultParallelism
    ctx.base_root, ctx.generation = opts.vocab_from, info["generation"] + 1 if info else 0
    ranked = dict(counted.flatMap(lambda r: tasks.bucketed(r[1], buckets)).groupByKey(buckets)
                  .map(lambda kv: (kv[0][0], tasks.kept(ctx, kv[0][0], tasks.summed(kv[1]), thresholds[kv[0][0]])))
                  .groupByKey(buckets)
                  .map(lambda kv: (kv[0], tasks.rank_column(ctx, kv[0], kv[1], thresholds[kv[0]], caps[kv[0]])))
                  .collect())
    nothing = (np.zeros(0, np.uint64), np.zeros(0, np.int64))
    ranked = {schema.categorical[k]: ranked[k] if k in ranked else
              tasks.rank_column(ctx, k, [nothing], thresholds[k], caps[k])
              for k in counted_ids}      # (features with no value in the training rows)
    sizes = {f: r.pop("size") for f, r in ranked.items()}
    if info:
        info = vocab_info.grown(info, by_name(thresholds), sizes)
        for f, r in ranked.items():
            if r["past_capacity"]:
                log(f"{f}: capacity {info['features'][f]['capacity']} full: {r['past_capacity']} new values "
                    f"({r['past_capacity_rows']} training rows) -> id 0")
        log(f"vocabulary generation {info['generation']}: {sum(r['added'] for r in ranked.values())} values added, "
            f"{sum(r['past_capacity'] for r in ranked.values())} past capacity")
        caps = by_name(caps)
    else:
        rows = opts.capacity_rows or {}
        caps = {schema.categorical[k]: vocab_info.capacity(sizes[schema.categorical[k]], opts.headroom, rows.get(k),
                                                           schema.name(k)) for k in counted_ids}
        info = vocab_info.first(caps, by_name(thresholds), sizes)
        ranked = {f: {"added": n - 1, "past_capacity": 0, "past_capacity_rows": 0} for f, n in sizes.items()}
    vocab_info.save(tmp, info)
    return caps, by_name(thresholds), _report(info["generation"], "grown" if opts.vocab_from else "new", caps, sizes,
                                              ranked)


def _histories(sc, ctx, opts: Options, rows: int) -> Dict[int, Dict[int, Dict[str, int]]]:
    """The history pass: every split's events (and the state of --vocab_from's histories) grouped by
    (feature, bucket of users), each bucket's histories computed and its state written under
    vocab/, then each split's histories written beside its cache; returns each split's history
    ids per part."""
    schema = ctx.schema
    features = list(schema.histories)
    if not features:
        return {}
    buckets = max(opts.history_buckets, -(-rows // opts.history_bucket_rows))
    lengths = {f: schema.max_hotness[f] for f in features}
    gaps = set(schema.gaps)
    cache_root, out_root, split_lines, layout = ctx.cache_root, ctx.out_root, ctx.split_lines, ctx.layout
    n = len(ctx.splits)
    events = sc.parallelize(range(n), n).flatMap(lambda i: history.bucketed(cache_root, i, features, buckets))
    if opts.vocab_from:
        states = [(f, path) for f in features for path in history.state_files(opts.vocab_from, f)]
        if states:
            events = events.union(sc.parallelize(states, len(states)).flatMap(
                lambda s: history.bucketed_state(s[0], s[1], buckets)))
    for f in features:                            # (a run without counting events still leaves its state)
        os.makedirs(history.state_dir(out_root, f), exist_ok=True)
    return dict(events.groupByKey(buckets * len(features))
                .flatMap(lambda kv: history.compute(kv[0][0], kv[0][1], kv[1], lengths[kv[0][0]], out_root,
                                                    split_lines, kv[0][0] in gaps))
                .groupByKey(n)
                .map(lambda kv: (kv[0], history.save_split(cache_root, kv[0], kv[1], layout)))
                .collect())


def _report(generation, mode, caps, sizes, growth) -> dict:
    """The spec's metadata on the vocabularies: per feature ids in use, capacity, ids left and growth."""
    return {"generation": generation, "mode": mode, "features": {
        f: dict(growth[f], ids=n - 1, capacity=caps[f], ids_left=caps[f] - n) for f, n in sizes.items()}}


def _spec(schema, layout, cardinalities, output):
    spec = split_binary_spec(schema.numerical, dict(zip(schema.categorical, cardinalities)), schema.label, MAPPINGS,
                             max_hotness=schema.max_hotness, base_dir=output)
    for mapping, chunks in spec.source.items():
        for chunk in chunks:
            chunk.files = _parts(chunk.files[0], layout.parts(mapping))
            chunk.offsets = _parts(chunk.offsets[0], layout.parts(mapping)) if chunk.offsets else []
    return spec


def _parts(file: str, parts: int) -> List[str]:
    stem = file[:-len(".bin")]
    return [f"{stem}.part{p:05d}.bin" for p in range(parts)]


def _record(schema, spec) -> list:
    """The numpy dtype description of an encoded row (see tasks.Context.record)."""
    record = [(schema.label, "u1", ())]
    if schema.numerical:
        record.append(("numerical", "<f2", (len(schema.numerical),)))
    for f in schema.categorical:
        if f in schema.max_hotness:
            record += [(f, spec.dtype(f).str, (schema.max_hotness[f],)), (f + tasks.LENGTH, "<i4", ())]
        else:
            record.append((f, spec.dtype(f).str, ()))
    return record


def _part_files(spec, layout) -> Dict[int, Dict[str, str]]:
    out = {}
    for mapping in MAPPINGS:
        for p in range(layout.parts(mapping)):
            files = {}
            for chunk in spec.mapping(mapping):
                name = "numerical" if chunk.features == spec.numerical else chunk.features[0]
                files[name] = chunk.files[p]
                if chunk.offsets:
                    files[name + tasks.OFFSETS] = chunk.offsets[p]
            out[layout.part_base(mapping) + p] = files
    return out


def _create_parts(ctx, split_part_rows, split_part_ids):
    """Creates every part file at its final size; returns each split's first row in each part and
    its first id of each multi-hot feature in each part."""
    row_offsets, id_offsets, rows, ids = {}, {}, {}, {}
    for i, (part_rows, part_ids) in enumerate(zip(split_part_rows, split_part_ids)):
        row_offsets[i] = {pid: rows.get(pid, 0) for pid in part_rows}
        id_offsets[i] = {int(pid): {f: ids.get((int(pid), f), 0) for f in n} for pid, n in part_ids.items()}
        for pid, n in part_rows.items():
            rows[pid] = rows.get(pid, 0) + n
        for pid, n in part_ids.items():
            for f, k in n.items():
                ids[int(pid), f] = ids.get((int(pid), f), 0) + k
    dtype = ctx.record_dtype()
    for pid, files in ctx.part_files.items():
        for field, name in files.items():
            if field.endswith(tasks.OFFSETS):
                size = (rows.get(pid, 0) + 1) * 8
            elif field in ctx.schema.max_hotness:
                size = ids.get((pid, field), 0) * dtype[field].base.itemsize
            else:
                size = rows.get(pid, 0) * dtype[field].itemsize
            path = os.path.join(ctx.out_root, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(size)
    return row_offsets, id_offsets


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
    """Puts the preproc package and utils.errors on the executors' path (a zip, as --py-files would)."""
    if getattr(sc, "_preproc_shipped", False):
        return
    sc._preproc_shipped = True
    root = os.path.dirname(os.path.abspath(__file__))
    archive = os.path.join(tempfile.mkdtemp(prefix="preproc-code-"), "preproc.zip")
    utils = os.path.join(os.path.dirname(root), "utils")
    with zipfile.ZipFile(archive, "w") as z:
        for name in sorted(os.listdir(root)):
            if name.endswith(".py"):
                z.write(os.path.join(root, name), f"preproc/{name}")
        for name in ("__init__.py", "errors.py"):
            z.write(os.path.join(utils, name), f"utils/{name}")
    sc.addPyFile(archive)
    sys.path_importer_cache.clear()
