"""Quality of dynamic tables: held-out AUC of DLRM with dynamic tables of 25%, 50% and 100% of the
distinct ids against the exact frequency-ranked vocabulary, on a generated Criteo-format log.

    python benchmarks/dynamic_quality.py [--rows 1000000] [--test_rows 400000] [--capacities 25,50,100]
                                         [--seeds 1,2] [--policy lru] [--work /tmp/dynamic_quality]

The log (preproc/generate.py): day_0 (`--rows` lines, training) and day_1 (`--test_rows` lines,
the held-out day: its first half is the test mapping every run evaluates on), labels depending
on I1, C1 and, through `--value_effects`, on each value of the `--columns` (the large tables:
fixed per-value effects that only a model learning those values' embeddings can use). It is
preprocessed twice by preproc.criteo (`--split day`): with vocabularies (every value seen in
training gets a row, ranked by frequency: the exact vocabulary) and with `--raw_id_columns` for
`--columns` (64-bit keys, no vocabulary). dlrm.py trains one epoch on each (the same flags and
seed): the vocabulary run, and the raw-id run with those columns' tables dynamic
(`--dynamic_tables`, `--policy`, K = 1) at each capacity, a share of the column's distinct ids in
training. Each run's test AUC and log loss come from its JSON log's final record, the dynamic
tables' admitted, evicted and refused ids (summed over the columns) from its last step record.
The first line also gives the columns' distinct training ids, the share of training lookups the
most frequent 25% (50%, ...) of the ids take, and the share of test lookups of unseen ids.
Prints one JSON line per run, then a table; keeps the files under `--work` unless `--clean`.
"""
import argparse
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # this checkout's modules, not an installed copy's
import numpy as np  # noqa: E402

from preproc import criteo, generate  # noqa: E402
from preproc.parsing import CATEGORICAL_NAMES  # noqa: E402
from preproc.pipeline import run  # noqa: E402
from preproc.session import spark_session  # noqa: E402

MODEL = ["--embedding_dim=16", "--bottom_mlp_dims=64,16", "--top_mlp_dims=64,1", "--optimizer=sgd",
         "--warmup_steps=0", "--decay_steps=0", "--epochs=1", "--cpu"]


def make_log(work: str, args) -> str:
    """day_0 and day_1 of the generated log under work/log; returns the folder."""
    folder = os.path.join(work, "log")
    os.makedirs(folder, exist_ok=True)
    effects = {c: args.effect for c in args.columns}
    for day, (rows, seed) in enumerate(((args.rows, args.data_seed), (args.test_rows, args.data_seed + 1))):
        path = os.path.join(folder, f"day_{day}")
        if not os.path.exists(path):
            generate.write(generate.generate(rows, seed, value_effects=effects), path)
    return folder


def preprocess(log: str, work: str, columns) -> dict:
    """The log preprocessed with vocabularies ("exact") and with raw ids for `columns` ("raw")."""
    out = {"exact": os.path.join(work, "exact"), "raw": os.path.join(work, "raw")}
    todo = {k: v for k, v in out.items() if not os.path.exists(os.path.join(v, "feature_spec.yaml"))}
    if todo:
        spark = spark_session("local[2]", {"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"})
        try:
            for kind, path in todo.items():
                flags = ["--input", log, "--output", path, "--split", "day"]
                flags += [f"--raw_id_columns={','.join(columns)}"] if kind == "raw" else []
                run(spark, criteo.options(criteo.parser().parse_args(flags)), log=lambda m: None)
        finally:
            spark.stop()
    return out


def raw_ids(raw: str, mapping: str, feature: str) -> np.ndarray:
    """The raw ids [n] int64 of `feature` in the raw-id dataset's `mapping` files."""
    parts = sorted(glob.glob(os.path.join(raw, mapping, f"{feature}.part*.bin")))
    return np.concatenate([np.fromfile(p, np.int64) for p in parts])


def id_figures(raw: str, features, capacities) -> dict:
    """Per feature: its distinct training ids; over the features: the share of training lookups
    that the most frequent `pct`% of each feature's ids take (what a table of that capacity holds
    at best), and the share of test lookups of ids absent from training."""
    distinct, top, seen, unseen, tests = {}, dict.fromkeys(capacities, 0), 0, 0, 0
    for f in features:
        train, test = raw_ids(raw, "train", f), raw_ids(raw, "test", f)
        ids, counts = np.unique(train, return_counts=True)
        counts = np.sort(counts)[::-1]
        distinct[f] = len(ids)
        for pct in capacities:
            top[pct] += int(counts[:math.ceil(pct / 100 * len(ids))].sum())
        seen += len(train)
        unseen += int((~np.isin(test, ids)).sum())
        tests += len(test)
    return {"distinct_ids": distinct,
            "train_lookups_in_top_ids": {f"{pct:g}%": round(n / seen, 4) for pct, n in top.items()},
            "test_lookups_unseen_in_training": round(unseen / tests, 4)}


def train(dataset: str, log_path: str, seed: int, args, dynamic: str = "") -> dict:
    """One dlrm.py run (one epoch, evaluated on the test mapping); its figures from its JSON log."""
    cmd = [sys.executable, os.path.join(ROOT, "dlrm.py"), "--dataset_type=split_binary", f"--dataset_path={dataset}",
           f"--batch_size={args.batch_size}", f"--learning_rate={args.learning_rate}", f"--seed={seed}",
           f"--log_path={log_path}", "--print_freq=100000", *MODEL]
    cmd += [f"--dynamic_tables={dynamic}"] if dynamic else []
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if proc.returncode:
        raise SystemExit(f"dlrm.py failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in open(log_path)]
    final = next(r for r in records if r["kind"] == "final")
    steps = [r for r in records if r["kind"] == "step"]
    counts = {k: sum(v for key, v in (steps[-1] if steps else {}).items() if key.endswith("/" + k))
              for k in ("live", "admitted", "evicted", "refused")}
    return {"auc": final["auc"], "logloss": final.get("logloss"), "steps": final.get("steps"),
            "seconds": round(time.time() - t0, 1), **counts}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="training lines (day_0)")
    ap.add_argument("--test_rows", type=int, default=400_000, help="held-out lines (day_1: half test, half validation)")
    ap.add_argument("--columns", default="C3,C4,C12,C21", help="the columns with raw ids and dynamic tables (Ck,...)")
    ap.add_argument("--effect", type=float, default=1.0, help="weight of the columns' per-value effects on the label")
    ap.add_argument("--capacities", default="25,50,100", help="dynamic tables' capacities, %% of the distinct ids")
    ap.add_argument("--policy", default="lru", choices=["lru", "lfu"], help="the dynamic tables' eviction")
    ap.add_argument("--seeds", default="1", help="dlrm.py --seed of each run, e.g. 1,2 (the noise)")
    ap.add_argument("--data_seed", type=int, default=0, help="preproc.generate's seed (day_1: this + 1)")
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--learning_rate", type=float, default=0.5)
    ap.add_argument("--work", default="/tmp/dynamic_quality", help="folder for the log, datasets and JSON logs "
                    "(existing ones are reused)")
    ap.add_argument("--clean", action="store_true", help="delete --work at the end")
    args = ap.parse_args()
    args.columns = args.columns.split(",")
    bad = [c for c in args.columns if c not in CATEGORICAL_NAMES]
    if bad:
        ap.error(f"--columns: {bad[0]} is not one of C1..C26")
    capacities = [float(c) for c in args.capacities.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]

    t0 = time.time()
    data = preprocess(make_log(args.work, args), args.work, args.columns)
    features = [f"cat_{CATEGORICAL_NAMES.index(c)}" for c in args.columns]
    figures = id_figures(data["raw"], features, capacities)
    distinct = figures["distinct_ids"]
    print(json.dumps({"rows": args.rows, "test_rows": args.test_rows, "columns": dict(zip(args.columns, features)),
                      **figures, "prepare_seconds": round(time.time() - t0, 1)}), flush=True)
    results = []
    for seed in seeds:
        runs = [("exact vocabulary", data["exact"], "", {})]
        for pct in capacities:
            caps = {f: max(1, math.ceil(pct / 100 * n)) for f, n in distinct.items()}
            runs.append((f"dynamic {pct:g}%", data["raw"],
                         ",".join(f"{f}:{c}:1:{args.policy}" for f, c in caps.items()), caps))
        for name, dataset, dynamic, caps in runs:
            log_path = os.path.join(args.work, f"{name.replace(' ', '_').replace('%', 'pct')}_seed{seed}.json")
            if os.path.exists(log_path):
                os.remove(log_path)
            r = {"run": name, "seed": seed, "capacity": sum(caps.values()) or None,
                 **train(dataset, log_path, seed, args, dynamic)}
            results.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n| run | seed | rows of the {len(features)} tables | test AUC | log loss | admitted | evicted "
          f"| refused lookups |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        counts = [f"{r[k]:,}" for k in ("admitted", "evicted", "refused")] if r["capacity"] else ["—"] * 3
        print(f"| {r['run']} | {r['seed']} | {r['capacity'] or sum(distinct.values()):,} | {r['auc']:.4f} "
              f"| {r['logloss']:.4f} | {' | '.join(counts)} |")
    if args.clean:
        shutil.rmtree(args.work)


if __name__ == "__main__":
    main()
