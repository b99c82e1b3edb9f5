"""DLRM's dot interaction as a TensorFlow op pair, DotBasedInteract / DotBasedInteractGrad.

    import dot_based_interact
    out = dot_based_interact.dot_based_interact(vectors)   # differentiable

vectors [B, N, D] (the bottom-MLP output, then the N - 1 embeddings) -> [B, round_up_8(D +
N(N-1)/2)]: vectors[:, 0], the dots of every pair i > j in row-major order ((1,0), (2,0), (2,1),
...), zero padding. CPU: float32, bfloat16, float16; GPU (CUDA builds): float32, float16.
`load()` raises OpLoadError, saying why, when the library is missing or was built for another
TensorFlow.
"""
import os

import tensorflow as tf

LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_dot_based_interact_ops.so")
_loaded = []


class OpLoadError(RuntimeError):
    """The op library cannot be loaded; the message (one line) says why."""


def load():
    """The library's generated op wrappers (loaded once)."""
    if not _loaded:
        if not os.path.exists(LIBRARY):
            raise OpLoadError(f"{LIBRARY} is missing")
        try:
            _loaded.append(tf.load_op_library(LIBRARY))
        except (tf.errors.NotFoundError, OSError) as e:
            raise OpLoadError(f"{LIBRARY} does not load into TensorFlow {tf.__version__}: "
                              f"{str(e).strip().splitlines()[0]}") from None
    return _loaded[0]


def dot_based_interact(vectors: tf.Tensor) -> tf.Tensor:
    """[B, N, D] -> [B, round_up_8(D + N(N-1)/2)] (see the module's docstring)."""
    return load().dot_based_interact(vectors)


@tf.RegisterGradient("DotBasedInteract")
def _dot_based_interact_grad(op, grad):
    return load().dot_based_interact_grad(op.inputs[0], grad)
