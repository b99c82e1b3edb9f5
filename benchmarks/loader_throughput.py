"""Split-binary loader throughput per rank, one JSON line per measurement.

    python benchmarks/loader_throughput.py [--rows 10000000] [--dir /tmp/loader_bench] [--keep]

Writes a Criteo-shaped dataset (13 float16 numericals, 26 categorical features with the Criteo
Kaggle cardinalities, bool label; uniform random ids) under --dir, then times one epoch of
training batches (dataloading.batches.train_batches: shuffled batch order, the same code the
trainer's tf.data pipeline runs) for each rank's view: 1 rank; 2 ranks with model-parallel
input (each rank reads its tables' ids for the global batch, placed by the default plan, and its
half of the numericals and labels); 2 ranks with data-parallel input (every column, its half).
"warm": after a pass that loads the files into the page cache; "cold": with the
files unmapped, then posix_fadvise(DONTNEED) on each (drops its clean cached pages, no root
needed), then mapped again, so the pass reads from disk (the rank-0 views only). One process, one core; samples/s counts the global batch samples that the
rank's share was read for, MB/s the bytes this rank read. The dataset is deleted unless --keep.
With --tfrecords, the same rows are also converted to the reference's split-TFRecord layout
(prebatches of --batch_size, dataloading/to_tfrecords.py) and each view is timed warm on them
(samples/s only: records are decoded, not mapped).
"""
import argparse
import gc
import json
import os
import shutil
import time

import numpy as np

from dataloading.batches import RankInput, steps_per_epoch, train_batches
from dataloading.feature_spec import FeatureSpec, split_binary_spec
from dataloading.split_binary import SplitBinaryDataset
from dataloading.writer import MappingWriter
from parallel_embedding.planner import plan_tables

CRITEO_KAGGLE = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def write_dataset(path: str, rows: int, block: int = 1 << 20):
    spec = split_binary_spec([f"num_{k}" for k in range(13)], {f"cat_{k}": c for k, c in enumerate(CRITEO_KAGGLE)},
                             mappings=("train",), base_dir=path)
    rng = np.random.default_rng(0)
    with MappingWriter(spec, "train") as writer:
        for start in range(0, rows, block):
            n = min(block, rows - start)
            columns = {f"num_{k}": rng.standard_normal(n, np.float32) for k in range(13)}
            columns.update({f"cat_{k}": rng.integers(0, c, n) for k, c in enumerate(CRITEO_KAGGLE)})
            columns["label"] = rng.integers(0, 2, n)
            writer.write(columns)
    return spec


def drop_page_cache(spec):
    for chunk in spec.source["train"]:
        for f in chunk.files + chunk.offsets:
            fd = os.open(spec.path(f), os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def bytes_read(dataset, view: RankInput, batch_size: int) -> int:
    """Bytes this rank reads for one global batch."""
    spec, b = dataset.spec, batch_size // view.size
    total = b * (len(spec.numerical) * spec.dtype(spec.numerical[0]).itemsize + 1)
    for name, scope in zip(spec.categorical, view.scopes):
        total += {"global": batch_size, "local": b, "none": 0}[scope] * spec.dtype(name).itemsize
    return total


def timed_epoch(dataset, rows, batch_size, view):
    steps = steps_per_epoch(rows, batch_size, view.size, False)
    t0 = time.perf_counter()
    for _ in train_batches(dataset, view, rows=rows, batch_size=batch_size, seed=1, start_step=0, end_step=steps):
        pass
    return steps, time.perf_counter() - t0


def views(num_features: int):
    plan = plan_tables(CRITEO_KAGGLE, [128] * num_features, 2)
    yield "1 rank", RankInput.single_process(num_features)
    for r in range(2):
        mine = plan.features_on(r)
        yield f"2 ranks model-parallel input, rank {r}", RankInput(r, 2, tuple(
            "global" if f in mine else "none" for f in range(num_features)))
    for r in range(2):
        yield f"2 ranks data-parallel input, rank {r}", RankInput(r, 2, ("local",) * num_features)


def time_tfrecords(spec, args):
    from dataloading.split_tfrecords import SplitTFRecordsDataset
    from dataloading.to_tfrecords import convert
    out = os.path.join(args.dir, "tfrecords")
    convert(spec, out, ["train"], args.batch_size, 0)
    tfr = SplitTFRecordsDataset(FeatureSpec.from_yaml(os.path.join(out, "feature_spec.yaml"), chunk_type=None),
                                {"train": "train"})
    rows = tfr.rows("train")
    for name, view in views(len(CRITEO_KAGGLE)):
        timed_epoch(tfr, rows, args.batch_size, view)   # loads the page cache
        steps, seconds = timed_epoch(tfr, rows, args.batch_size, view)
        print(json.dumps({"view": name, "format": "split_tfrecords", "cache": "warm", "batch_size": args.batch_size,
                          "batches": steps, "seconds": round(seconds, 2),
                          "samples_per_s": round(steps * args.batch_size / seconds)}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--batch_size", type=int, default=65536)
    parser.add_argument("--dir", default="/tmp/loader_bench")
    parser.add_argument("--keep", action="store_true", help="do not delete the dataset afterwards")
    parser.add_argument("--tfrecords", action="store_true", help="also time the split-TFRecord reader (warm)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    spec = write_dataset(args.dir, args.rows)
    size = sum(os.path.getsize(spec.path(f)) for c in spec.source["train"] for f in c.files)
    print(json.dumps({"dataset": args.dir, "rows": args.rows, "bytes": size,
                      "write_seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    dataset = SplitBinaryDataset(spec, {"train": "train"})
    try:
        for cache in ("warm", "cold"):
            for name, view in views(len(CRITEO_KAGGLE)):
                if cache == "warm":
                    timed_epoch(dataset, args.rows, args.batch_size, view)   # loads the page cache
                elif "rank 1" in name:
                    continue
                else:   # unmap, drop the cached pages, map again
                    del dataset
                    gc.collect()
                    drop_page_cache(spec)
                    dataset = SplitBinaryDataset(spec, {"train": "train"})
                steps, seconds = timed_epoch(dataset, args.rows, args.batch_size, view)
                mb = bytes_read(dataset, view, args.batch_size) * steps / 1e6
                print(json.dumps({"view": name, "cache": cache, "batch_size": args.batch_size, "batches": steps,
                                  "seconds": round(seconds, 2),
                                  "samples_per_s": round(steps * args.batch_size / seconds),
                                  "mb_per_s": round(mb / seconds, 1)}), flush=True)
        if args.tfrecords:
            time_tfrecords(spec, args)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
