"""A sequence feature's all-to-alls at N ranks: the bytes each rank sends per step, against what
every position of every history (padding included) would cost, and the step time of the embedding
alone. Run under Horovod:

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/sequence_exchange.py [--batch 1024]
        [--max_length 500] [--mean_length 50] [--items 100000] [--dim 16] [--steps 20] [--warmup 5] [--code DIR]

One table (`--items` rows of width `--dim`, placed by plan_tables' default rules) read by a
candidate item (one id a sample) and a history of at most L = `--max_length` items: lengths
lognormal (sigma 1, mean `--mean_length`), capped at L. The table gets them as HybridEmbedding
gives them, with data-parallel input: L + 1 inputs of b rows, the candidate, then the history
position by position (ranking/sequences.by_position), each row one id or none. A step, one
tf.function: lookup, exchange, gradients of a stand-in loss, SGD update; 8 batches cycled.
`--code DIR`: measure the parallel_embedding/ of another checkout (`git archive <commit> | tar -x
-C DIR`). One JSON line per rank: bytes per step by all-to-all; what each all-to-all carries if
only the ids present and their rows travel (`bytes_of_ids`, computed here from the lengths) and
if every position does (`bytes_padded`: a length per position, every position's row); the median
step time.
"""
import argparse
import json
import os
import statistics
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.routed_exchange import counted_collectives, timed_steps  # noqa: E402
EXCHANGES = ("ids", "multi_hot_ids", "rows", "grads")
BATCHES = 8


def lengths_of(args, rng) -> np.ndarray:
    mu = np.log(args.mean_length) - 0.5   # sigma 1: the mean is exp(mu + 1/2)
    return np.minimum(np.round(rng.lognormal(mu, 1.0, args.batch)).astype(np.int64), args.max_length)


def table_ids(candidates, lengths, ids, max_length):
    """b samples -> their L + 1 inputs' ids as ragged row lengths and values, input by input: the
    candidate, then position j of every history (one id if j < the sample's length)."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows, values = [np.ones_like(candidates)], [candidates]
    for j in range(max_length):
        has = lengths > j
        rows.append(has.astype(np.int64))
        values.append(ids[starts[has] + j])
    return np.concatenate(rows), np.concatenate(values)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1024, help="global batch")
    ap.add_argument("--max_length", type=int, default=500)
    ap.add_argument("--mean_length", type=float, default=50)
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--code", default=ROOT, help="the checkout whose modules are measured")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.code))
    from utils.tensorflow_startup import import_tensorflow
    import_tensorflow()
    import tensorflow as tf
    from parallel_embedding.layer import DistributedEmbedding
    from parallel_embedding.planner import plan_tables

    comm = counted_collectives(EXCHANGES)
    n, m = comm.size, args.max_length + 1
    if args.batch % n:
        sys.exit(f"--batch {args.batch}: not a multiple of the {n} ranks")
    b = args.batch // n
    plan = plan_tables([args.items], [args.dim], n)
    emb = DistributedEmbedding(plan, comm, seed=(1, 100), data_parallel_input=True, inputs_per_table=[m])
    step = tf.Variable(0, dtype=tf.int64)
    emb.set_optimizer("sgd", step)
    rng = np.random.default_rng(0)   # the same global batches on every rank
    widths = {r: sum(s.width for s in plan.shards_on(r)) for r in range(n)}
    batches, held, local_held = [], [], []
    for _ in range(BATCHES):
        lengths = lengths_of(args, rng)
        ids = rng.integers(0, args.items, lengths.sum())
        candidates = rng.integers(0, args.items, args.batch)
        mine = slice(comm.rank * b, (comm.rank + 1) * b)
        offset = lengths[:comm.rank * b].sum()
        rows, values = table_ids(candidates[mine], lengths[mine], ids[offset:offset + lengths[mine].sum()],
                                 args.max_length)
        batches.append([tf.RaggedTensor.from_row_lengths(values, rows)])
        held.append(args.batch + lengths.sum())   # the global batch's (input, sample) rows that hold an id
        local_held.append(b + lengths[mine].sum())

    times, timed, sent, _ = timed_steps(emb, comm, step, batches, b, True, args.warmup, args.steps)
    # ids, to each rank holding a shard: two int64 counts, then each row's length and its one id
    # (every row that holds an id holds one here); rows: this rank's shards' rows of every rank's
    # samples; gradients: every shard's of this rank's samples. Padded: a length per row, then
    # the ids; every row, then its gradient.
    mine, every = np.mean([local_held[k] for k in timed]), np.mean([held[k] for k in timed])
    owners, width = sum(1 for w in widths.values() if w), sum(widths.values())
    of_ids = {"embedding_ids": 8 * 2 * owners, "embedding_multi_hot_ids": 8 * 2 * mine * owners,
              "embedding_rows": 4 * widths[comm.rank] * every, "embedding_grads": 4 * width * mine}
    padded = {"embedding_ids": 8 * m * b * owners, "embedding_multi_hot_ids": 8 * mine * owners,
              "embedding_rows": 4 * widths[comm.rank] * m * args.batch, "embedding_grads": 4 * width * m * b}
    q = statistics.quantiles(times, n=4)
    print(json.dumps({"rank": comm.rank, "ranks": n, "code": os.path.abspath(args.code),
                      "kinds": sorted({t.kind for t in plan.tables}), "batch": args.batch,
                      "max_length": args.max_length, "mean_length_kept": float(np.mean(
                          [held[k] / args.batch - 1 for k in timed])),
                      "bytes_per_step": {k: v for k, v in sent.items() if v},
                      "bytes_of_ids": of_ids, "bytes_padded": padded,
                      "step_ms_median": 1e3 * statistics.median(times),
                      "step_ms_quartiles": [1e3 * q[0], 1e3 * q[2]], "load": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
