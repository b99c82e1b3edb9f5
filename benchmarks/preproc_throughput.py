"""Criteo preprocessing throughput: rows/s end to end (raw TSV -> split-binary files) of the Spark
job (preproc/, local[N]) beside a plain pandas implementation of the same transform, in one run.

    python benchmarks/preproc_throughput.py [--rows 2000000] [--cores 2]

Generates a Criteo-format file under /tmp (preproc/generate.py), runs both, checks that pandas
wrote the same bytes as Spark (every feature of the test and validation rows and of the first
--check_rows training rows), prints JSON lines and deletes its files.
"""
import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
import pandas as pd

from dataloading.feature_spec import SPEC_FILE, FeatureSpec
from preproc import generate
from preproc.parsing import CATEGORICAL_NAMES, INTEGER_NAMES, NAMES
from preproc.pipeline import CATEGORICAL, Options, run
from preproc.session import spark_session

TEST, VALIDATION, THRESHOLD = 0.05, 0.05, 3


def pandas_preprocess(path: str, out: str) -> dict:
    """The same transform in pandas, one process: {mapping: {feature file: bytes}}."""
    df = pd.read_csv(path, sep="\t", header=None, names=NAMES, quoting=3,
                     dtype={"label": np.int8, **{c: str for c in CATEGORICAL_NAMES}})
    n = len(df)
    n_test, n_val = round(n * TEST), round(n * VALIDATION)
    bounds = {"train": (0, n - n_test - n_val), "test": (n - n_test - n_val, n - n_val), "validation": (n - n_val, n)}
    ints = df[INTEGER_NAMES].to_numpy(np.float64)
    numerical = np.where(np.isnan(ints), 0.0, np.log(np.maximum(ints, -2) + 3)).astype(np.float16)
    ids = {}
    for name in CATEGORICAL_NAMES:
        counts = df[name].iloc[:bounds["train"][1]].value_counts()
        counts = counts[counts >= THRESHOLD]
        order = counts.reset_index().sort_values(["count", name], ascending=[False, True])[name]
        table = pd.Series(np.arange(1, len(order) + 1), index=order.to_numpy())
        dtype = np.int8 if len(table) < 127 else np.int16 if len(table) < 32767 else np.int32
        ids[name] = df[name].map(table).fillna(0).to_numpy().astype(dtype)
    written = {}
    for mapping, (lo, hi) in bounds.items():
        os.makedirs(os.path.join(out, mapping), exist_ok=True)
        columns = {"label": df["label"].to_numpy()[lo:hi].astype(bool), "numerical": numerical[lo:hi],
                   **{cat: ids[c][lo:hi] for cat, c in zip(CATEGORICAL, CATEGORICAL_NAMES)}}
        for name, values in columns.items():
            values.tofile(os.path.join(out, mapping, f"{name}.bin"))
        written[mapping] = hi - lo
    return written


def spark_bytes(out: str, mapping: str, feature_file: str) -> bytes:
    spec = FeatureSpec.from_yaml(os.path.join(out, SPEC_FILE))
    for chunk in spec.mapping(mapping):
        if chunk.files[0].split("/")[-1].startswith(feature_file + ".part"):
            return b"".join(open(spec.path(f), "rb").read() for f in chunk.files)
    raise KeyError(feature_file)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--split_mb", type=int, default=64)
    p.add_argument("--part_rows", type=int, default=1 << 19)
    p.add_argument("--check_rows", type=int, default=200_000)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="preproc-bench-", dir="/tmp")
    try:
        raw = os.path.join(work, "criteo.tsv")
        generate.main(["--output", raw, "--rows", str(args.rows)])
        size_mb = os.path.getsize(raw) / 2 ** 20
        start = time.perf_counter()
        spark = spark_session(f"local[{args.cores}]", {"spark.sql.shuffle.partitions": str(2 * args.cores)})
        startup = time.perf_counter() - start
        start = time.perf_counter()
        summary = run(spark, Options([raw], os.path.join(work, "spark"), test_fraction=TEST,
                                     validation_fraction=VALIDATION, thresholds=[THRESHOLD] * 26,
                                     split_bytes=args.split_mb << 20, part_rows=args.part_rows))
        spark_s = time.perf_counter() - start
        spark.stop()
        start = time.perf_counter()
        pandas_rows = pandas_preprocess(raw, os.path.join(work, "pandas"))
        pandas_s = time.perf_counter() - start
        assert pandas_rows == summary["rows"], (pandas_rows, summary["rows"])
        checked = 0
        for mapping in ("train", "test", "validation"):
            for name in ["label", "numerical"] + CATEGORICAL:
                mine = open(os.path.join(work, "pandas", mapping, f"{name}.bin"), "rb").read()
                theirs = spark_bytes(os.path.join(work, "spark"), mapping, name)
                if mapping == "train":
                    record = len(mine) // pandas_rows["train"]
                    mine, theirs = mine[:record * args.check_rows], theirs[:record * args.check_rows]
                assert mine == theirs, f"pandas and Spark differ: {mapping}/{name}"
                checked += len(mine)
        for name, seconds, extra in (("spark", spark_s, {"cores": args.cores, "session_start_s": round(startup, 1),
                                                         "rows_per_s_with_start": round(args.rows / (spark_s + startup))}),
                                     ("pandas", pandas_s, {"cores": 1})):
            print(json.dumps({"engine": name, "rows": args.rows, "input_mb": round(size_mb), "seconds": round(seconds, 1),
                              "rows_per_s": round(args.rows / seconds), **extra}))
        print(json.dumps({"equal_bytes_checked": checked, "speedup_vs_pandas": round(pandas_s / spark_s, 2)}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
