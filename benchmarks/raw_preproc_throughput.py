"""Raw-spec preprocessing throughput (preproc.raw): rows/s end to end (a generated CSV click log with
a header -> split-binary files) of the Spark job on local[N], beside a pandas implementation of
the same transform that must write the same bytes.

    python benchmarks/raw_preproc_throughput.py [--rows 2000000] [--cores 2] [--runs 1]

The log: a 0/1 label, 3 numerical columns (log transform), 20 string categorical columns
(Zipf-like values `v123`, threshold 3) and 2 list columns (0..5 values joined by '|'); split by
fraction 0.05/0.05. Each run also times the same job with raw ids for every categorical column
(`--raw_id_columns=all`: 64-bit keys, no counting, no vocabulary; its label and numerical files
must equal the vocabulary run's). Prints JSON lines and deletes its files.
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

from dataloading.feature_spec import id_dtype
from preproc import raw
from preproc.pipeline import run
from preproc.session import spark_session

STRINGS, LISTS, NUMBERS, MAX_HOTNESS = 20, 2, 3, 5


def generate(path: str, rows: int, seed: int = 0):
    """Writes the click log in chunks (bounded memory)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for start in range(0, rows, 1 << 18):
            n = min(1 << 18, rows - start)
            df = pd.DataFrame({"label": (rng.random(n) < 0.25).astype(int)})
            for k in range(NUMBERS):
                df[f"n{k}"] = np.where(rng.random(n) < 0.1, np.nan, rng.integers(0, 10 ** (k + 2), n))
            for k in range(STRINGS):
                df[f"s{k}"] = pd.Series(rng.zipf(1.3, n) % (10 ** (2 + k % 5))).map("v{}".format)
            for k in range(LISTS):
                values = pd.DataFrame(rng.zipf(1.5, (n, MAX_HOTNESS)) % 1000).map("t{}".format)
                lengths = rng.integers(0, MAX_HOTNESS + 1, n)
                joined = values[0].where(lengths > 0, "")
                for j in range(1, MAX_HOTNESS):
                    joined = joined.where(lengths <= j, joined + "|" + values[j])
                df[f"l{k}"] = joined
            df.to_csv(f, header=start == 0, index=False, float_format="%.0f")


def spec(path: str, threshold: int = 3) -> dict:
    """The raw spec of the log (threshold 0 for the raw-id run: raw ids have no vocabulary)."""
    return {"inputs": {"paths": [path]}, "label": "label",
            "numerical": [f"n{k}" for k in range(NUMBERS)],
            "categorical": [{"column": f"s{k}", "threshold": threshold} for k in range(STRINGS)] +
                           [{"column": f"l{k}", "delimiter": "|", "max_hotness": MAX_HOTNESS, "threshold": threshold}
                            for k in range(LISTS)],
            "split": {"test": 0.05, "validation": 0.05}}


def pandas_preprocess(path: str, out: str, rows: int):
    """The same transform in pandas, one process, written as the job's single part files."""
    strings, lists = [f"s{k}" for k in range(STRINGS)], [f"l{k}" for k in range(LISTS)]
    df = pd.read_csv(path, dtype={c: str for c in strings + lists}, keep_default_na=False, na_values={
        **{f"n{k}": [""] for k in range(NUMBERS)}})
    n_test, n_val = round(rows * 0.05), round(rows * 0.05)
    bounds = {"train": (0, rows - n_test - n_val), "test": (rows - n_test - n_val, rows - n_val),
              "validation": (rows - n_val, rows)}
    numbers = df[[f"n{k}" for k in range(NUMBERS)]].to_numpy(np.float64)
    columns = {"label": df["label"].to_numpy().astype(bool),
               "numerical": np.where(np.isnan(numbers), 0, np.log(np.maximum(numbers, -2) + 3)).astype(np.float16)}
    offsets = {}
    for name in strings + lists:
        values = df[name].str.split("|").explode() if name in lists else df[name]
        row = np.asarray(values.index)
        values = values.to_numpy(object)
        present = values != ""
        keys = pd.util.hash_array(values[present], categorize=False)
        row = row[present]
        counts = pd.Series(keys[row < bounds["train"][1]]).value_counts()
        counts = counts[counts >= 3].reset_index()
        ranked = counts.sort_values(["count", "index"], ascending=[False, True])["index"].to_numpy()
        ids = pd.Index(ranked).get_indexer(keys) + 1
        dtype = id_dtype(len(ranked) + 1)
        if name in lists:
            columns[name], offsets[name] = ids.astype(dtype), np.bincount(row, minlength=rows)
        else:
            column = np.zeros(rows, dtype)
            column[present] = ids
            columns[name] = column
    for mapping, (lo, hi) in bounds.items():
        os.makedirs(os.path.join(out, mapping), exist_ok=True)
        for name, values in columns.items():
            target = os.path.join(out, mapping, f"{name}.part00000.bin")
            if name in offsets:
                ends = np.concatenate([[0], np.cumsum(offsets[name])])
                values[ends[lo]:ends[hi]].tofile(target)
                (ends[lo:hi + 1] - ends[lo]).tofile(os.path.join(out, mapping, f"{name}.offsets.part00000.bin"))
            else:
                values[lo:hi].tofile(target)


def same_files(spark_out: str, pandas_out: str, names=None) -> int:
    """Raises if a file pandas (or another run) wrote differs from the job's (`names`: only those
    files); returns how many were compared."""
    compared = 0
    for mapping in ("train", "test", "validation"):
        for name in names or sorted(os.listdir(os.path.join(pandas_out, mapping))):
            with open(os.path.join(pandas_out, mapping, name), "rb") as a, \
                    open(os.path.join(spark_out, mapping, name), "rb") as b:
                if a.read() != b.read():
                    raise AssertionError(f"{mapping}/{name}: pandas and the Spark job wrote different bytes")
            compared += 1
    return compared


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--runs", type=int, default=1)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="raw-preproc-bench-")
    try:
        log = os.path.join(root, "log.csv")
        start = time.time()
        generate(log, args.rows)
        print(json.dumps({"generated_rows": args.rows, "bytes": os.path.getsize(log),
                          "seconds": round(time.time() - start, 1)}), flush=True)
        spec_path, raw_ids_path = os.path.join(root, "raw.yaml"), os.path.join(root, "raw_ids.yaml")
        for path, threshold in ((spec_path, 3), (raw_ids_path, 0)):
            with open(path, "w") as f:
                yaml.safe_dump(spec(log, threshold), f)
        start = time.time()
        spark = spark_session(f"local[{args.cores}]", {"spark.sql.shuffle.partitions": str(args.cores)})
        session = time.time() - start
        for k in range(args.runs):
            out = os.path.join(root, f"out{k}")
            opts = raw.options(raw.parser().parse_args(["--spec", spec_path, "--output", out, "--split_mb", "64"]))
            start = time.time()
            summary = run(spark, opts, log=lambda m: None)
            seconds = time.time() - start
            print(json.dumps({"engine": f"spark local[{args.cores}]", "run": k, "rows": args.rows,
                              "seconds": round(seconds, 2), "rows_per_s": round(args.rows / seconds),
                              "session_start_s": round(session, 1) if k == 0 else 0.0,
                              "written": summary["rows"], "load_average": os.getloadavg()[0]}), flush=True)
            raw_out = os.path.join(root, f"raw_ids{k}")
            opts = raw.options(raw.parser().parse_args(["--spec", raw_ids_path, "--output", raw_out, "--split_mb", "64",
                                                        "--raw_id_columns=all"]))
            start = time.time()
            run(spark, opts, log=lambda m: None)
            seconds = time.time() - start
            files = same_files(raw_out, out, ["label.part00000.bin", "numerical.part00000.bin"])
            print(json.dumps({"engine": f"spark local[{args.cores}], raw ids (--raw_id_columns=all)", "run": k,
                              "rows": args.rows, "seconds": round(seconds, 2), "rows_per_s": round(args.rows / seconds),
                              "same_bytes_files": files, "load_average": os.getloadavg()[0]}), flush=True)
            shutil.rmtree(raw_out)
            start = time.time()
            pandas_preprocess(log, os.path.join(root, "pandas"), args.rows)
            seconds = time.time() - start
            files = same_files(out, os.path.join(root, "pandas"))
            print(json.dumps({"engine": "pandas", "run": k, "rows": args.rows, "seconds": round(seconds, 2),
                              "rows_per_s": round(args.rows / seconds), "same_bytes_files": files,
                              "load_average": os.getloadavg()[0]}), flush=True)
            shutil.rmtree(out)
            shutil.rmtree(os.path.join(root, "pandas"))
        spark.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
