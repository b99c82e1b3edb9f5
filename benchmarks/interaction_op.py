"""Forward+backward time of the DotBasedInteract op against DotInteraction's TensorFlow
implementation (its XLA-compiled forward/backward pair), one JSON line per shape:

    python benchmarks/interaction_op.py [--threads 2] [--rounds 7] [--calls 10] [--shapes 4096,27,16 ...]

Both run as the train step runs them: bottom [B, D] and F embeddings [B, D] in, the output's
gradient in, the inputs' gradients out, inside one tf.function. The two alternate, `rounds`
rounds of `calls` calls each, so that load from other processes hits both alike; reported: the
median and the minimum over all calls, and the load average when the shape finished.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ["4096,27,16", "4096,27,128", "8192,27,16", "8192,27,128"]   # W1 and W2: B, F+1, D


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="B,F+1,D")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, ROOT)
    import numpy as np
    import tensorflow as tf
    from nn.interaction import DotInteraction

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
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
