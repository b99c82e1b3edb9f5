"""What the checkpoint's checksums cost a save and a restore of W1's tables, one JSON line each.

    python benchmarks/checkpoint_checksums.py [--dir /tmp/ckpt-bench] [--repeats 3]
    python benchmarks/checkpoint_checksums.py --module /tmp/checkpoint_before.py   # another version's module

W1 (../shared/bench/workloads.yaml, dlrm-kaggle): its 26 tables at width 16 and their
`updated_at` [rows, 1] int32, as one rank's tf.Variables (2.3 GB; W1 trains with SGD, so no
optimizer slots; the MLPs' 0.5M parameters are left out). Each save (storage.checkpoint.save, one
process, into --dir) is timed with the CRC-32s computed as usual and with zlib.crc32 replaced by a
constant (the cost of the checksums alone); each restore (storage.checkpoint.restore into the same
variables) with and without verification, its files in the page cache (just written) and dropped
from it first (posix_fadvise DONTNEED on the checkpoint's files only). With --module, that file is
loaded as the checkpoint module instead (e.g. an earlier version, to time the save and restore as
they were: lines say "module"); its restore is timed without `verify`. Seconds are the median of
--repeats runs, alternated; "runs" lists them all.
"""
import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
import types
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # this checkout's modules, not an installed copy's

from benchmarks.tiered_store import W1_CARDINALITIES  # noqa: E402
from utils import files  # noqa: E402 (its Checksummed computes the pieces' CRC-32 as they are written)
from utils.tensorflow_startup import import_tensorflow  # noqa: E402

DIM = 16
NO_CRC = types.SimpleNamespace(crc32=lambda data, crc=0: 0)


def checkpoint_module(path):
    if not path:
        from storage import checkpoint
        return checkpoint
    spec = importlib.util.spec_from_file_location("checkpoint_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def w1_entries(checkpoint):
    import numpy as np
    import_tensorflow()   # its start-up lines once, held to TF_CPP_MIN_LOG_LEVEL
    import tensorflow as tf
    rng = np.random.default_rng(0)
    entries = []
    for f, rows in enumerate(W1_CARDINALITIES):
        table = tf.Variable(rng.random((rows, DIM), dtype=np.float32))
        updated_at = tf.Variable(rng.integers(0, 1000, (rows, 1), dtype=np.int32))
        entries += [checkpoint.Entry(f"embedding/table_{f}", table, (rows, DIM)),
                    checkpoint.Entry(f"embedding/table_{f}/updated_at", updated_at, (rows, 1))]
    return entries


def drop_from_page_cache(path):
    for file in os.listdir(path):
        fd = os.open(os.path.join(path, file), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(run):
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/ckpt-checksums-bench", help="checkpoint root (removed at the end)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--module", default="", help="a storage/checkpoint.py to time instead of this checkout's")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from parallel_embedding.collectives import SingleProcess
    checkpoint = checkpoint_module(args.module)
    has_checksums = hasattr(checkpoint, "CHECKSUMS")
    entries = w1_entries(checkpoint)
    names = {e.name for e in entries}
    shutil.rmtree(args.dir, ignore_errors=True)
    comm, step = SingleProcess(), 0
    size = sum(int(e.variable.shape.num_elements()) * e.variable.dtype.size for e in entries)
    common = {"bench": "checkpoint_checksums", "workload": "W1", "bytes": size,
              "module": args.module or "storage/checkpoint.py", "crc": f"zlib.crc32, zlib {zlib.ZLIB_RUNTIME_VERSION}"}

    def save(checksums):
        nonlocal step
        step += 1
        if not checksums:
            files.zlib = NO_CRC
        try:
            return checkpoint.save(args.dir, entries, step, {}, comm, keep=1)
        finally:
            files.zlib = zlib

    def restore(path, verify, cold):
        if cold:
            drop_from_page_cache(path)
        kwargs = {"verify": verify} if has_checksums else {}
        return timed(lambda: checkpoint.restore(path, entries, {}, names, **kwargs))

    saves = {False: [], True: []} if has_checksums else {None: []}   # the last save of a round has its checksums
    restores = {(v, c): [] for v in ([True, False] if has_checksums else [None]) for c in (False, True)}
    path = None
    for _ in range(args.repeats):
        for checksums in saves:
            start = time.perf_counter()
            path = save(checksums is not False)
            saves[checksums].append(time.perf_counter() - start)
        for verify, cold in restores:
            restores[verify, cold].append(restore(path, verify is not False, cold))
    for checksums, runs in saves.items():
        print(json.dumps(dict(common, op="save", checksums=checksums, seconds=round(statistics.median(runs), 3),
                              gb_per_s=round(size / statistics.median(runs) / 1e9, 3),
                              runs=[round(r, 3) for r in runs])), flush=True)
    for (verify, cold), runs in restores.items():
        print(json.dumps(dict(common, op="restore", verify=verify, page_cache="dropped" if cold else "warm",
                              seconds=round(statistics.median(runs), 3),
                              gb_per_s=round(size / statistics.median(runs) / 1e9, 3),
                              runs=[round(r, 3) for r in runs])), flush=True)
    data = os.urandom(256 << 20)
    seconds = min(timed(lambda: zlib.crc32(data)) for _ in range(3))
    print(json.dumps(dict(common, op="crc32 of 256 MiB in memory", seconds=round(seconds, 3),
                          gb_per_s=round(len(data) / seconds / 1e9, 3))), flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
