"""User histories in raw-spec preprocessing (preproc.raw): seconds of the Spark job on local[N] for a
generated event log with and without a history feature, and a check of the histories of a sample
of users against pandas (every event's last L items strictly before its time).

    python benchmarks/history_preproc.py [--rows 1000000] [--users 10000] [--length 50] [--cores 2] [--runs 2]

The log: click (0/1, 20% positive), user (uniform over --users), item (Zipf 1.2 mod 100,000,
threshold 2), ts (uniform seconds over a week: many ties); split by fraction 0.05/0.05; 4 MB
splits. Prints JSON lines (both jobs in one warm session, alternating) and deletes its files.
"""
import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
import pandas as pd
import yaml

from dataloading.feature_spec import FeatureSpec
from dataloading.split_binary import SplitBinaryDataset
from preproc import raw
from preproc.pipeline import run
from preproc.session import spark_session


def spec(path: str, length: int) -> dict:
    categorical = [{"column": "user"}, {"column": "item", "threshold": 2}]
    if length:
        categorical.append({"name": "history", "history_of": "item", "user": "user", "time": "ts",
                            "max_length": length})
    return {"inputs": {"paths": [path]}, "label": "click", "categorical": categorical,
            "split": {"test": 0.05, "validation": 0.05}}


def histories(out: str):
    """(item ids, histories as lists) of every row, train, test and validation in turn (file order)."""
    spec_ = FeatureSpec.from_yaml(os.path.join(out, "feature_spec.yaml"))
    items, lists = [], []
    for mapping in ("train", "test", "validation"):
        data = SplitBinaryDataset(spec_, {"x": mapping})
        batch = data.batch("x", 0, data.rows("x"))
        item, history = batch["categorical"][1], batch["categorical"][2]
        items += item.tolist()
        bounds = history.row_splits.tolist()
        values = history.values.tolist()
        lists += [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return items, lists


def mismatches(df: pd.DataFrame, out: str, length: int, users: int = 30) -> tuple:
    """(events checked, histories that differ from pandas') for a random sample of users."""
    items, lists = histories(out)
    ids = dict(zip(df["item"].tolist(), items))
    chosen = np.random.default_rng(0).choice(df["user"].unique(), users, replace=False)
    checked = wrong = 0
    for _, events in df[df["user"].isin(chosen)].reset_index().groupby("user"):
        events = events.sort_values(["ts", "index"], kind="stable")
        ts, item = events["ts"].to_numpy(), events["item"].to_numpy()
        for row, before in zip(events["index"], np.searchsorted(ts, ts, "left")):
            wrong += lists[row] != [ids[v] for v in item[:before][-length:]]
            checked += 1
    return checked, wrong


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--users", type=int, default=10_000)
    p.add_argument("--length", type=int, default=50)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="history-bench-")
    try:
        rng = np.random.default_rng(1)
        df = pd.DataFrame({"click": (rng.random(args.rows) < 0.2).astype(int),
                           "user": rng.integers(0, args.users, args.rows),
                           "item": rng.zipf(1.2, args.rows) % 100_000, "ts": rng.integers(0, 7 * 86400, args.rows)})
        log = os.path.join(root, "log.csv")
        df.to_csv(log, index=False)
        spark = spark_session(f"local[{args.cores}]", {"spark.sql.shuffle.partitions": str(args.cores)})
        for k in range(args.runs):
            for length in (0, args.length):
                spec_path, out = os.path.join(root, f"raw{length}.yaml"), os.path.join(root, f"out{length}")
                with open(spec_path, "w") as f:
                    yaml.safe_dump(spec(log, length), f)
                opts = raw.options(raw.parser().parse_args(["--spec", spec_path, "--output", out, "--split_mb", "4"]))
                start = time.time()
                run(spark, opts, log=lambda m: None)
                seconds = time.time() - start
                line = {"run": k, "rows": args.rows, "users": args.users, "history_length": length,
                        "seconds": round(seconds, 2), "load_average": os.getloadavg()[0]}
                if length and k == 0:
                    line["checked_events"], line["mismatches"] = mismatches(df, out, length)
                    line["history_ids"] = sum(map(len, histories(out)[1]))
                print(json.dumps(line), flush=True)
                shutil.rmtree(out)
        spark.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
