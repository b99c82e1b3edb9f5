"""DLRM's dot interaction as a TensorFlow op pair, DotBasedInteract / DotBasedInteractGrad.

    import dot_based_interact
    out = dot_based_interact.dot_based_interact([bottom] + embeddings)   # differentiable

N vectors [B, D] (the bottom-MLP output, then the N - 1 embeddings; or one [B, N, D] tensor) ->
[B, round_up_8(D + N(N-1)/2)]: vectors[0], the dots of every pair i > j in row-major order
((1,0), (2,0), (2,1), ...), zero padding. The op takes the vectors as a list (no stacking copy
on the CPU) and its gradient returns one gradient per vector. CPU: float32, bfloat16, float16; GPU (CUDA builds): float32, float16.
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


def dot_based_interact(vectors) -> tf.Tensor:
    """N x [B, D] (a list) or [B, N, D] -> [B, round_up_8(D + N(N-1)/2)] (see the module's docstring)."""
    if not isinstance(vectors, (list, tuple)):
        vectors = tf.convert_to_tensor(vectors)
        if vectors.shape.rank != 3:
            raise ValueError(f"dot_based_interact: expected a list of [B, D] or one [B, N, D], got {vectors.shape}")
        vectors = tf.unstack(vectors, axis=1)
    return load().dot_based_interact(list(vectors))


@tf.RegisterGradient("DotBasedInteract")
def _dot_based_interact_grad(op, grad):
    return load().dot_based_interact_grad(list(op.inputs), grad)
