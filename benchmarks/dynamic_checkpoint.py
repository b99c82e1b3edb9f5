"""A dynamic table on disk: the memory and time of its checkpoint's save and restore, one JSON line:

    python benchmarks/dynamic_checkpoint.py --dir DIR [--rows 3000000] [--dim 32] [--batch 250000]

A DynamicTable of `--rows` rows of `--dim` floats (Adam: 2 slots, so 3 parts a row) on disk
(parallel_embedding/tiered.py: DynamicUnit in a DiskTier, as the layer builds it, a cache of
`--batch` rows) takes `--rows` distinct raw ids in training lookups of `--batch` ids, so every row
is live and most are in the store only. Then its checkpoint is saved under DIR/ckpt, and restored
into a second such table on disk (its store DIR/b). Reported per phase: seconds; the peak resident
memory above the resident memory when it began (VmHWM after resetting it through
/proc/self/clear_refs, against VmRSS: it includes file pages mapped into the process, the
store's while reading and writing, at most 256 MiB, and in the restore each checkpoint file the
verification maps whole, pages the kernel may drop); the peak anonymous resident memory above
its start (RssAnon, sampled every 2 ms: the arrays held, and in the restore the id map's memory
as it fills); and the live rows' payload (rows and slots), which a save or restore holding them
whole adds.
"""
import argparse
import json
import os
import shutil
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # this checkout's modules, not an installed copy's
from utils.tensorflow_startup import import_tensorflow  # noqa: E402


def _status(key: str) -> int:
    """/proc/self/status's `key` (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def _measured(what):
    """(seconds, peak resident bytes, peak anonymous resident bytes (sampled every 2 ms), each above
    those when it began) of calling `what`."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # VmHWM := VmRSS
    before, anon, peak, done = _status("VmRSS"), _status("RssAnon"), [0], threading.Event()

    def sample():
        while not done.wait(0.002):
            peak[0] = max(peak[0], _status("RssAnon"))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    what()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    return seconds, _status("VmHWM") - before, max(peak[0], _status("RssAnon")) - anon


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="the store files and the checkpoint go here (removed after)")
    parser.add_argument("--rows", type=int, default=3_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=250_000)
    args = parser.parse_args()
    import_tensorflow()
    import tensorflow as tf
    from parallel_embedding.collectives import SingleProcess
    from parallel_embedding.dynamic_table import DynamicTable
    from parallel_embedding.tiered import DiskTier, DynamicUnit
    from storage import checkpoint

    def on_disk(store):
        os.makedirs(store)
        table = DynamicTable("embedding/table_0", args.rows, args.dim, (1, 2), optimizer="adam",
                             cache_rows=args.batch)
        tier = DiskTier({0: DynamicUnit(0, table, args.batch, None)}, [0], store, "lru", 0)
        tier.open({0: [table.parts]}, lambda unit, i, j, start, stop: np.broadcast_to(
            table.parts[j][0].numpy(), (stop - start, args.dim)))
        return table, tier

    table, tier = on_disk(os.path.join(args.dir, "a"))
    ids = (np.random.default_rng(0).permutation(args.rows).astype(np.int64) + 1) * 0x9E3779B1
    for step, start in enumerate(range(0, args.rows, args.batch)):
        table.rows(tf.constant(ids[start:start + args.batch]), tf.constant(step, tf.int64), True)
    assert table.counts()["live"] == args.rows
    root = os.path.join(args.dir, "ckpt")
    save = _measured(lambda: checkpoint.save(root, table.checkpoint_entries(), 1, {}, SingleProcess()))
    restored, restored_tier = on_disk(os.path.join(args.dir, "b"))
    restore = _measured(lambda: restored.restore(root))
    assert restored.counts()["live"] == args.rows
    payload = args.rows * 3 * args.dim * 4
    print(json.dumps({"rows": args.rows, "dim": args.dim, "parts": 3, "payload_mib": round(payload / 2 ** 20),
                      "save_s": round(save[0], 2), "save_peak_mib": round(save[1] / 2 ** 20),
                      "save_peak_anon_mib": round(save[2] / 2 ** 20),
                      "restore_s": round(restore[0], 2), "restore_peak_mib": round(restore[1] / 2 ** 20),
                      "restore_peak_anon_mib": round(restore[2] / 2 ** 20),
                      "load": os.getloadavg()[0]}))
    for t in (tier, restored_tier):
        t.close()
    shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
