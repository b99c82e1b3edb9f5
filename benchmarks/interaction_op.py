"""Forward+backward time of the DotBasedInteract op against DotInteraction's TensorFlow
implementation (its XLA-compiled forward/backward pair), one JSON line per shape:

    python benchmarks/interaction_op.py [--threads 2] [--repeats 30]

Both run as the train step runs them: bottom [B, D] and F embeddings [B, D] in, the output's
gradient in, the inputs' gradients out, inside one tf.function; the median of `repeats` calls.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(4096, 27, 16), (4096, 27, 128), (8192, 27, 16), (8192, 27, 128)]   # W1 and W2: B, F+1, D


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, ROOT)
    import numpy as np
    import tensorflow as tf
    from nn.interaction import DotInteraction

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    for batch, n, dim in SHAPES:
        rng = np.random.default_rng(0)
        vectors = [tf.constant(rng.standard_normal((batch, dim), dtype=np.float32)) for _ in range(n)]
        times = {}
        for kernel in ("custom", "tf"):
            layer = DotInteraction(n - 1, dim, kernel=kernel)

            @tf.function
            def step(vectors, layer=layer):
                with tf.GradientTape() as tape:
                    tape.watch(vectors)
                    out = layer(vectors[0], vectors[1:], training=True)
                return tape.gradient(out, vectors, output_gradients=tf.ones_like(out))

            for _ in range(3):
                step(vectors)
            samples = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                float(step(vectors)[0][0, 0])
                samples.append(time.perf_counter() - t0)
            times[kernel] = statistics.median(samples)
        print(json.dumps({"batch": batch, "vectors": n, "dim": dim, "threads": args.threads,
                          "op_ms": round(1000 * times["custom"], 3), "tf_xla_ms": round(1000 * times["tf"], 3),
                          "speedup": round(times["tf"] / times["custom"], 2)}), flush=True)


if __name__ == "__main__":
    main()
