"""Feature interactions, the arithmetic of nn.layers' DotInteraction and CrossNetwork: DLRM's
pairwise dot products (DotInteraction, with its custom op) and DCNv2's cross network (its
initial values and forward)."""
import functools
import sys
from typing import List, Optional, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import kernels

from nn.initializers import glorot_normal
from utils.errors import ConfigError

# The dot interactions' kernels (see interaction_op): dot_custom is the custom op or an error, never the
# fallback; dot_tensorflow never uses the op.
DOT_KERNELS = {"dot": "auto", "dot_custom": "custom", "dot_tensorflow": "tf"}


def dot_interaction_width(num_features: int, dim: int) -> int:
    """Output width of DotInteraction for F embeddings of width D: round_up_8(D + (F+1)F/2)."""
    width = dim + (num_features + 1) * num_features // 2
    return -(-width // 8) * 8


@functools.lru_cache(maxsize=None)
def _load_op():
    """(the dot_based_interact package, None) once its library loads, else (None, why)."""
    try:
        import dot_based_interact
        dot_based_interact.load()
        return dot_based_interact, None
    except (ImportError, RuntimeError) as e:   # not installed, or OpLoadError
        return None, str(e) or type(e).__name__


def _gpu_kernels_missing() -> Optional[str]:
    """Why the loaded op cannot run on this process's GPU, or None: a GPU is visible and the
    library registered no GPU kernel for the op pair (built without CUDA), so TensorFlow would
    place it on the CPU and copy its inputs and outputs every step."""
    if not tf.config.get_visible_devices("GPU") or all(
            any(k.device_type == "GPU" for k in kernels.get_registered_kernels_for_op(name).kernel)
            for name in ("DotBasedInteract", "DotBasedInteractGrad")):
        return None
    return "has no GPU kernels (its library was built without nvcc, or with DOT_INTERACT_CUDA=0)"


@functools.lru_cache(maxsize=None)
def _warn_fallback(problem: str):
    print(f"warning: the dot interaction op {problem}; using the TensorFlow implementation",
          file=sys.stderr, flush=True)


# Who asks for the op in interaction_op's error: the setting that requires it, the one that falls back.
FLAG_SETTINGS = ("--interaction=dot_custom", "--interaction=dot")


def interaction_op(kernel: str, settings: Tuple[str, str] = FLAG_SETTINGS):
    """The custom op package for `kernel` ("auto", "custom" or "tf"), or None for TensorFlow's.
    "auto" falls back with one warning line when the library cannot load, or a GPU is visible
    and the library has no GPU kernels; "custom" raises ConfigError instead, naming `settings`
    (the one that asked for the op, the one to use instead)."""
    if kernel == "tf":
        return None
    op, why = _load_op()
    problem = f"cannot load ({why})" if op is None else _gpu_kernels_missing()
    if problem is None:
        return op
    if kernel == "custom":
        raise ConfigError(f"{settings[0]}: the dot interaction op {problem}; "
                          f"rebuild it with make setup, or use {settings[1]}")
    _warn_fallback(problem)
    return None


class DotInteraction(tf.Module):
    """DLRM interaction: dense [B, D] and F embeddings [B, D] -> [B, round_up_8(D + (F+1)F/2)]:
    the dense vector, then the dot products of every pair of the F+1 vectors (strictly lower
    triangle, row-major: (1,0), (2,0), (2,1), ...; no self-interaction), then zero padding to a
    multiple of 8 columns.

    In training, the custom op DotBasedInteract (tensorflow-dot-based-interact/) when `kernel`
    allows it and it loads (see interaction_op; its error names `settings`), unless the caller
    compiles with XLA. Otherwise forward and backward are each one XLA-compiled function (on CPU
    about twice as fast as TensorFlow's gather-based gradient): with T = [dense; embeddings]
    ([B, F+1, D]) and G the symmetric matrix of the output's pair gradients (zero diagonal),
    dT = G T. Inference always uses plain TensorFlow ops (lower latency on small batches), so
    exported models never need the op library. `training`: the call is differentiated (the train
    step); `xla`: the caller compiles it with XLA (tf.function(jit_compile=True)), where no custom
    op runs.
    """

    def __init__(self, num_features: int, dim: int, kernel: str = "auto", name="dot_interaction",
                 settings: Tuple[str, str] = FLAG_SETTINGS):
        super().__init__(name=name)
        self._op = interaction_op(kernel, settings)
        n = num_features + 1
        rows, cols = np.tril_indices(n, -1)
        num_pairs = len(rows)
        self._tril = tf.constant(rows * n + cols, dtype=tf.int32)
        # For every (i, j): the output column of pair {i, j}; the diagonal reads an extra zero column.
        pair_of = np.full((n, n), num_pairs)
        pair_of[rows, cols] = pair_of[cols, rows] = np.arange(num_pairs)
        self._symmetric = tf.constant(pair_of.ravel(), dtype=tf.int32)
        self._n, self._dim, self._num_pairs = n, dim, num_pairs
        self.output_width = dot_interaction_width(num_features, dim)
        self._pad = self.output_width - dim - num_pairs
        self._forward = tf.function(self._forward_impl, jit_compile=True, autograph=False)
        self._backward = tf.function(self._backward_impl, jit_compile=True, autograph=False)

    def __call__(self, dense: tf.Tensor, sparse: List[tf.Tensor], training: bool = False,
                 xla: bool = False) -> tf.Tensor:
        if not training:
            return self._forward_impl(dense, sparse)[0]
        if self._op is not None and not xla:
            return self._op.dot_based_interact([dense] + list(sparse))

        @tf.custom_gradient
        def interact(dense, *sparse):
            out, vectors = self._forward(dense, list(sparse))
            return out, lambda d_out: self._backward(vectors, d_out)
        return interact(dense, *sparse)

    def _forward_impl(self, dense, sparse):
        """-> (output, T [B, F+1, D], kept for the backward pass)."""
        vectors = tf.stack([dense] + sparse, axis=1)
        dots = tf.matmul(vectors, vectors, transpose_b=True)              # [B, F+1, F+1]
        pairs = tf.gather(tf.reshape(dots, [-1, self._n * self._n]), self._tril, axis=1)
        parts = [dense, pairs]
        if self._pad:
            parts.append(tf.zeros([tf.shape(dense)[0], self._pad], dense.dtype))
        return tf.concat(parts, axis=1), vectors

    def _backward_impl(self, vectors, d_out):
        d_pairs = tf.pad(d_out[:, self._dim:self._dim + self._num_pairs], [[0, 0], [0, 1]])
        g = tf.reshape(tf.gather(d_pairs, self._symmetric, axis=1), [-1, self._n, self._n])
        d_vectors = tf.unstack(tf.matmul(g, vectors), axis=1)             # F+1 x [B, D]
        return [d_out[:, :self._dim] + d_vectors[0]] + d_vectors[1:]


def cross_initial_values(dim: int, projection_dim: int, layer: int, seed) -> List[Tuple[str, tf.Tensor]]:
    """Cross layer `layer`'s matrices, named, of a network seeded `seed` (two ints), Glorot-normal
    float32: [("U", [d, r]), ("V", [r, d])] when projection_dim r > 0, else [("W", [d, d])].
    Its bias [d] starts at zero."""
    s = (seed[0], seed[1] + 2 * layer)
    if projection_dim:
        return [("U", glorot_normal([dim, projection_dim], s)),
                ("V", glorot_normal([projection_dim, dim], (s[0], s[1] + 1)))]
    return [("W", glorot_normal([dim, dim], s))]


def cross_forward(x0: tf.Tensor, weights: List[List], biases: List) -> tf.Tensor:
    """x0 [B, d] through the cross layers (per layer its matrices, as cross_initial_values
    orders them, and its bias [d]): x_{l+1} = x0 * (x_l U_l V_l + b_l) + x_l. Computes in x0's
    dtype (the weights are cast)."""
    x = x0
    for mats, bias in zip(weights, biases):
        h = x
        for m in mats:
            h = tf.matmul(h, tf.cast(m, x0.dtype))
        x = x0 * tf.nn.bias_add(h, tf.cast(bias, x0.dtype)) + x
    return x
