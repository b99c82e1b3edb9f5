"""W1's three largest tables dynamic in hash shards at N ranks: the bytes each rank sends per step
through the embedding's all-to-alls, and the step time of the embedding alone. Run under Horovod:

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/routed_exchange.py [--shards 2]
        [--data_parallel_input 1] [--steps 30] [--warmup 10] [--capacity 1048576] [--code DIR]

The plan holds only the three tables (workloads.yaml's dlrm-kaggle features 2, 11 and 20: D = 16),
each dynamic (`--capacity` rows in `--shards` hash shards, LRU, K = 1, SGD). A step, one
tf.function: `lookup` of the global batch (4096 samples, each table's ids Zipf(1.1) over its
cardinality as raw int64 ids; 16 batches cycled), `exchange`, `gradients` of a stand-in loss (the
features' sum), `apply_gradients`. The collectives are Horovod's, each all-to-all counting the bytes
this rank sends, and its calls, under its name. `--code DIR`: measure the parallel_embedding/ (and
the rest) of another checkout, e.g. an earlier commit's tree (`git archive <commit> | tar -x -C
DIR`): this script uses only DistributedEmbedding's interface. One JSON line per rank: bytes per
step by all-to-all and in all, the all-to-alls a step by name (an empty one included), median step
time (and quartiles), the load average.
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
WORKLOADS = os.path.join(os.path.dirname(ROOT), "shared", "bench", "workloads.yaml")
BATCH, DIM, FEATURES = 4096, 16, (2, 11, 20)
# routed_positions: the samples' own all-to-all of model-parallel input before 0ae6613 (measured with --code)
EXCHANGES = ("ids", "multi_hot_ids", "routed_ids", "routed_positions", "rows", "grads")


def counted_collectives(exchanges):
    """Horovod's collectives (of the checkout on sys.path), each all-to-all named `embedding_<x>`
    (x in `exchanges`) adding the bytes this rank sends, and a call, to `sent` and `calls` (int64
    variables by name; an empty one counts a call)."""
    import tensorflow as tf
    from parallel_embedding.collectives import HorovodCollectives

    class Counted(HorovodCollectives):
        def __init__(self):
            super().__init__()
            self.sent = {f"embedding_{x}": tf.Variable(0, dtype=tf.int64) for x in exchanges}
            self.calls = {name: tf.Variable(0, dtype=tf.int64) for name in self.sent}

        def alltoall(self, tensor, counts, name):
            self.sent[name].assign_add(tf.size(tensor, out_type=tf.int64) * tensor.dtype.size)
            self.calls[name].assign_add(1)
            return super().alltoall(tensor, counts, name)

    return Counted()


def timed_steps(emb, comm, step, batches, b, multi_hot: bool, warmup: int, steps: int):
    """The embedding alone (`b` samples a rank), a step one tf.function (lookup of batch k % len,
    exchange, gradients of a stand-in loss: the features' sum times 1e-3, SGD update at 0.1),
    `warmup` steps then `steps` timed, each after a barrier -> (the timed steps' seconds, their
    batches' indices, bytes per step by all-to-all, all-to-all calls per step by name; `comm`:
    counted_collectives')."""
    import tensorflow as tf

    @tf.function
    def train(ids):
        looked_up = emb.lookup(ids, training=True)
        features = emb.exchange(looked_up, b)
        emb.apply_gradients(emb.gradients(looked_up, [tf.ones_like(x) * 1e-3 for x in features]),
                            tf.constant(0.1), multi_hot=multi_hot)
        step.assign_add(1)
        return tf.add_n([tf.reduce_sum(x) for x in features])

    for k in range(warmup):
        train(batches[k % len(batches)]).numpy()
    sent = {k: int(v.numpy()) for k, v in comm.sent.items()}
    calls = {k: int(v.numpy()) for k, v in comm.calls.items()}
    times, timed = [], [(warmup + k) % len(batches) for k in range(steps)]
    for k, batch in enumerate(timed):
        comm.barrier(f"step_{k}")
        start = time.perf_counter()
        train(batches[batch]).numpy()
        times.append(time.perf_counter() - start)
    return (times, timed, {k: (int(v.numpy()) - sent[k]) / steps for k, v in comm.sent.items()},
            {k: (int(v.numpy()) - calls[k]) / steps for k, v in comm.calls.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=2, help="hash shards per table")
    ap.add_argument("--data_parallel_input", type=int, choices=[0, 1], default=1)
    ap.add_argument("--capacity", type=int, default=1 << 20, help="rows per table")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--code", default=ROOT, help="the checkout whose modules are measured")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.code))
    from utils.tensorflow_startup import import_tensorflow
    import_tensorflow()   # its start-up lines once, held to TF_CPP_MIN_LOG_LEVEL
    import tensorflow as tf
    from parallel_embedding.layer import DistributedEmbedding
    from parallel_embedding.planner import DynamicOptions, plan_tables

    with open(WORKLOADS) as stream:
        w1 = yaml.safe_load(stream)["workloads"]["dlrm-kaggle"]["cardinalities"]
    cards = [w1[f] for f in FEATURES]
    comm = counted_collectives(EXCHANGES)
    n, b = comm.size, BATCH // comm.size
    options = DynamicOptions(args.capacity, shards=args.shards)
    plan = plan_tables(cards, [DIM] * 3, n, dynamic={f: options for f in range(3)})
    emb = DistributedEmbedding(plan, comm, seed=(1, 100), data_parallel_input=bool(args.data_parallel_input))
    step = tf.Variable(0, dtype=tf.int64)
    emb.set_optimizer("sgd", step)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(16):   # raw ids: Zipf over the cardinality, offset per table
        ids = [(rng.zipf(1.1, BATCH) % c + (f << 40)).astype(np.int64) for f, c in enumerate(cards)]
        batches.append([tf.constant(x if emb.input_rows(f) == "global" else x[comm.rank * b:(comm.rank + 1) * b])
                        if emb.input_rows(f) != "none" else tf.zeros([0], tf.int64) for f, x in enumerate(ids)])

    times, _, sent, calls = timed_steps(emb, comm, step, batches, b, False, args.warmup, args.steps)
    sent = {k: v for k, v in sent.items() if v}
    q = statistics.quantiles(times, n=4)
    print(json.dumps({"rank": comm.rank, "ranks": n, "code": os.path.abspath(args.code), "shards": args.shards,
                      "data_parallel_input": args.data_parallel_input, "bytes_per_step": sent,
                      "total_bytes_per_step": sum(sent.values()),
                      "all_to_alls_per_step": {k: v for k, v in calls.items() if v},
                      "step_ms_median": 1e3 * statistics.median(times),
                      "step_ms_quartiles": [1e3 * q[0], 1e3 * q[2]], "load": os.getloadavg()[0],
                      "dynamic_counts": emb.dynamic_stats()}), flush=True)


if __name__ == "__main__":
    main()
