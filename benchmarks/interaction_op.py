"""Forward+backward time of the DotBasedInteract op against DotInteraction's TensorFlow
implementation (its XLA-compiled forward/backward pair), one JSON line per shape:

    python benchmarks/interaction_op.py [--threads 2] [--rounds 7] [--calls 10] [--shapes 4096,27,16 ...]
    python benchmarks/interaction_op.py --steps 100 --workloads dlrm-kaggle dlrm-large

Both run as the train step runs them: bottom [B, D] and F embeddings [B, D] in, the output's
gradient in, the inputs' gradients out, inside one tf.function. The two alternate, `rounds`
rounds of `calls` calls each, so that load from other processes hits both alike; reported: the
median and the minimum over all calls, and the load average when the shape finished.

`--workloads`: the whole train step of those workloads as dlrm.py runs them (train_throughput.py's
set-up: the example model examples/dlrm.py the run trains), built twice in one process
(--interaction=dot_custom: the op; dot_tensorflow: the TensorFlow pair), one step of each in turn `--steps`
times; reported: the median of the paired differences (TF step - op step), how many pairs the
op won, and each side's median and minimum. Paired steps cancel the slow swings of a shared
machine's load that separate processes (train_throughput.py --dot_op 1|0) cannot.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout's modules
from benchmarks.train_throughput import DEFAULT_BENCH  # noqa: E402
from utils.tensorflow_startup import import_tensorflow  # noqa: E402

SHAPES = ["4096,27,16", "4096,27,128", "8192,27,16", "8192,27,128"]   # W1 and W2: B, F+1, D


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="B,F+1,D")
    ap.add_argument("--workloads", nargs="*", default=[], help="time these train steps instead of --shapes")
    ap.add_argument("--steps", type=int, default=100, help="--workloads: paired steps")
    ap.add_argument("--bench_dir", default=DEFAULT_BENCH, help="--workloads: the folder holding workloads.yaml and "
                    "yardstick/")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import_tensorflow()   # its start-up lines once, held to TF_CPP_MIN_LOG_LEVEL
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    for workload in args.workloads:
        train_step_pairs(workload, args.steps, args.threads, args.bench_dir)
    if not args.workloads:
        interaction_shapes(args)


def train_step_pairs(workload, steps, threads, bench_dir):
    """One JSON line: `steps` pairs of train steps of `workload`, with and without the op."""
    import types
    from benchmarks.train_throughput import batch_pool, run_trainer, yardstick_module
    from parallel_embedding.collectives import make_collectives

    w = yardstick_module(bench_dir).load_workload(workload, threads)
    if w["model"] != "dlrm":
        raise SystemExit(f"--workloads {workload}: a {w['model']} workload has no dot interaction")
    comm = make_collectives()
    trainers = {kernel: run_trainer(types.SimpleNamespace(dot_op=kernel == "op", xla=0, amp=0), w, comm)[1]
                for kernel in ("op", "tf")}   # tf: DotInteraction's XLA-compiled TensorFlow pair
    batch = int(w["batch_size"])
    pool = batch_pool(w, comm, [trainers["op"].model.embeddings.input_rows(f) for f in range(len(w["cardinalities"]))])
    times = {"op": [], "tf": []}
    for i in range(3 + steps):
        for kernel in (("op", "tf") if i % 2 else ("tf", "op")):
            t0 = time.perf_counter()
            float(trainers[kernel].train_step(*pool[i % len(pool)]))
            if i >= 3:
                times[kernel].append(1000 * (time.perf_counter() - t0))
    diffs = [t - o for o, t in zip(times["op"], times["tf"])]
    print(json.dumps({"workload": workload, "batch": batch, "threads": threads, "pairs": steps,
                      "tf_minus_op_median_ms": round(statistics.median(diffs), 1),
                      "op_faster_pairs": sum(d > 0 for d in diffs),
                      **{f"{k}_median_ms": round(statistics.median(v), 1) for k, v in times.items()},
                      **{f"{k}_min_ms": round(min(v), 1) for k, v in times.items()},
                      "load": round(os.getloadavg()[0], 2)}), flush=True)


def interaction_shapes(args):
    """One JSON line per shape: the interaction's forward+backward, op against the TF pair."""
    import numpy as np
    import_tensorflow()   # its start-up lines once, held to TF_CPP_MIN_LOG_LEVEL
    import tensorflow as tf
    from nn.interaction import DotInteraction

    for shape in args.shapes:
        batch, n, dim = map(int, shape.split(","))
        rng = np.random.default_rng(0)
        vectors = [tf.constant(rng.standard_normal((batch, dim), dtype=np.float32)) for _ in range(n)]
        steps, times = {}, {"custom": [], "tf": []}
        for kernel in times:
            layer = DotInteraction(n - 1, dim, kernel=kernel)

            @tf.function
            def step(vectors, layer=layer):
                with tf.GradientTape() as tape:
                    tape.watch(vectors)
                    out = layer(vectors[0], vectors[1:], training=True)
                return tape.gradient(out, vectors, output_gradients=tf.ones_like(out))

            for _ in range(3):
                step(vectors)
            steps[kernel] = step
        for _ in range(args.rounds):
            for kernel, step in steps.items():
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    float(step(vectors)[0][0, 0])
                    times[kernel].append(1000 * (time.perf_counter() - t0))
        op, ref = statistics.median(times["custom"]), statistics.median(times["tf"])
        print(json.dumps({"batch": batch, "vectors": n, "dim": dim, "threads": args.threads,
                          "op_ms": round(op, 2), "op_min_ms": round(min(times["custom"]), 2),
                          "tf_xla_ms": round(ref, 2), "tf_xla_min_ms": round(min(times["tf"]), 2),
                          "speedup": round(ref / op, 2), "load": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
