"""The id map of dynamic tables (tensorflow-id-map) alone: find-or-insert of W1-shaped batches
against tf.lookup.experimental.DenseHashTable in the same process, one JSON line each:

    python benchmarks/id_map_throughput.py [--threads 1] [--rounds 5] [--steps 10] [--warmup 20] [--zipf 1.1]
    python benchmarks/id_map_throughput.py --checkpoint DIR     also: checkpoint bytes against the live rows' bytes

A W1 batch: 4096 samples x 26 tables (workloads.yaml's dlrm-kaggle cardinalities) = 106,496 raw
64-bit ids, each table's ids drawn Zipf(--zipf) over its cardinality and mixed to 64 bits. One map
per table, capacity = its cardinality (LRU, admission at the first sighting). DenseHashTable's
find-or-insert is what it takes: lookup, the missing ids made unique and inserted with fresh
rows, lookup again. Both run in one tf.function over the 26 tables, `--warmup` batches first,
then `rounds` rounds of `steps` batches each, the two alternating, so that load from other
processes hits both alike. Reported: ids/s over the whole batch (median and best round) and per
thread (--threads, TensorFlow's intra- and inter-op threads: 1 measures one core), the load
average, and `call_floor`: the same tf.function call with only tf.identity of the 26 id tensors
inside (the part of both figures that is TensorFlow's call, not the lookups).

`--checkpoint DIR`: a dynamic table (D = 16, SGD, capacity the largest W1 table's) after the
warm-up and timed batches (that table's ids) saves its checkpoint entries
(parallel_embedding.dynamic_table) under DIR; reported: the checkpoint's bytes on disk (manifest
included) against the live rows' payload (ids int64, rows, updated_at int32) and against ids and
rows alone, and the bytes DenseHashTable's export (what its checkpoint saves) of that table holds.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # this checkout's modules, not an installed copy's
from utils.tensorflow_startup import import_tensorflow  # noqa: E402

WORKLOADS = os.path.join(os.path.dirname(ROOT), "shared", "bench", "workloads.yaml")
BATCH = 4096


def w1_cardinalities(path):
    with open(path) as f:
        return yaml.safe_load(f)["workloads"]["dlrm-kaggle"]["cardinalities"]


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise (uint64)."""
    x = x.astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def zipf_ranks(rng, n, size, s):
    """`size` ranks in [0, n), P(rank) ~ (rank + 1)^-s (continuous inverse CDF, s != 1)."""
    u = rng.random(size)
    a = 1.0 - s
    return np.minimum(np.floor(((n ** a - 1.0) * u + 1.0) ** (1.0 / a)) - 1, n - 1).astype(np.int64)


def w1_batches(cardinalities, count, s, seed):
    """`count` batches: per table [BATCH] int64 raw ids."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield [mix64(zipf_ranks(rng, n, BATCH, s) + (t << 40)).view(np.int64) for t, n in enumerate(cardinalities)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--workloads", default=WORKLOADS, help="workloads.yaml (W1's cardinalities)")
    ap.add_argument("--checkpoint", help="also measure a dynamic table's checkpoint, written under this folder")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import_tensorflow()   # its start-up lines once, held to TF_CPP_MIN_LOG_LEVEL
    import tensorflow as tf
    import id_map

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    cards = w1_cardinalities(args.workloads)
    maps = [id_map.IdMap(f"table_{t}", n) for t, n in enumerate(cards)]
    dense = [tf.lookup.experimental.DenseHashTable(tf.int64, tf.int64, default_value=-1, empty_key=-2 ** 63,
                                                   deleted_key=-2 ** 63 + 1) for _ in cards]
    counters = [tf.Variable(0, dtype=tf.int64) for _ in cards]

    @tf.function
    def map_step(ids, step):
        return [m.find_or_insert(i, step)[0] for m, i in zip(maps, ids)]

    @tf.function
    def dense_step(ids):
        out = []
        for table, counter, i in zip(dense, counters, ids):
            missing, _ = tf.unique(tf.boolean_mask(i, tf.reshape(table.lookup(i), [-1]) < 0))
            n = tf.size(missing, out_type=tf.int64)
            table.insert(missing, counter + tf.range(n))
            counter.assign_add(n)
            out.append(table.lookup(i))
        return out

    @tf.function
    def floor_step(ids):   # the same call with nothing inside: the tf.function's own cost
        return [tf.identity(i) for i in ids]

    batches = [[tf.constant(t) for t in b] for b in w1_batches(cards, args.warmup + args.rounds * args.steps,
                                                                args.zipf, 0)]
    step = 0
    for b in batches[:args.warmup]:
        step += 1
        map_step(b, tf.constant(step, tf.int64))
        dense_step(b)
    times = {"id_map": [], "dense_hash_table": [], "call_floor": []}
    for r in range(args.rounds):
        chunk = batches[args.warmup + r * args.steps: args.warmup + (r + 1) * args.steps]
        steps = [tf.constant(step + i + 1, tf.int64) for i in range(len(chunk))]
        step += len(chunk)
        order = ("id_map", "dense_hash_table", "call_floor")
        for name in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            for i, b in enumerate(chunk):
                out = (map_step(b, steps[i]) if name == "id_map" else dense_step(b) if name == "dense_hash_table"
                       else floor_step(b))
            out[-1].numpy()
            times[name].append((time.perf_counter() - start) / len(chunk))
    ids = BATCH * len(cards)
    result = {"batch_ids": ids, "tables": len(cards), "zipf": args.zipf, "threads": args.threads,
              "live_rows": sum(m.stats()["live"] for m in maps), "load_average": os.getloadavg()[0]}
    for name, t in times.items():
        result[name] = {"ms_per_batch_median": round(1e3 * statistics.median(t), 2),
                        "ms_per_batch_best": round(1e3 * min(t), 2),
                        "M_ids_per_s_median": round(ids / statistics.median(t) / 1e6, 2),
                        "M_ids_per_s_best": round(ids / min(t) / 1e6, 2),
                        "M_ids_per_s_per_thread_median": round(ids / statistics.median(t) / 1e6 / args.threads, 2)}
    result["speedup_median"] = round(statistics.median(times["dense_hash_table"]) / statistics.median(times["id_map"]), 2)
    print(json.dumps(result), flush=True)
    if args.checkpoint:
        largest = int(np.argmax(cards))
        dense_export = [int(np.prod(t.shape)) * t.dtype.size for t in dense[largest].export()]
        dense_export = (sum(dense_export), int(dense[largest].size()) * 16)   # its bucket array, its live pairs
        del maps, dense, map_step, dense_step
        print(json.dumps(checkpoint_bytes(args.checkpoint, cards[largest], [b[largest] for b in batches],
                                          dense_export)), flush=True)


def checkpoint_bytes(root, capacity, batches, dense_export_bytes, dim=16):
    """A dynamic table (`capacity` rows of `dim`, SGD) trained on `batches` ([BATCH] ids each),
    checkpointed under `root`: its bytes on disk against the live rows' own bytes; beside them
    `dense_export_bytes`: (DenseHashTable's export, its live (key, value) pairs) in bytes."""
    import_tensorflow()   # its start-up lines once, held to TF_CPP_MIN_LOG_LEVEL
    import tensorflow as tf
    from parallel_embedding.collectives import SingleProcess
    from parallel_embedding.dynamic_table import DynamicTable
    from storage import checkpoint

    table = DynamicTable("table", capacity, dim, seed=(0, 0))
    for step, ids in enumerate(batches, start=1):
        rows, emb = table.lookup(ids, tf.constant(step, tf.int64), training=True)
        table.apply_gradients(rows, tf.ones_like(emb), tf.constant(0.01), step)
    path = checkpoint.save(root, table.checkpoint_entries(), len(batches), {}, SingleProcess())
    on_disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    live = table.counts()["live"]
    ids_and_rows = live * (8 + 4 * dim)
    payload = ids_and_rows + live * 4   # + updated_at
    return {"capacity": capacity, "dim": dim, "live_rows": live, "checkpoint_bytes": on_disk,
            "live_payload_bytes": payload, "ratio_to_payload": round(on_disk / payload, 3),
            "ratio_to_ids_and_rows": round(on_disk / ids_and_rows, 3),
            "dense_hash_table_export_bytes": dense_export_bytes[0],
            "dense_hash_table_export_ratio_to_its_live_pairs": round(dense_export_bytes[0] / dense_export_bytes[1], 3),
            "path": path}


if __name__ == "__main__":
    main()
