"""Optimizers with sparse updates for embedding tables (DistributedEmbedding.set_optimizer); the
trainer uses their dense form for the MLPs.

Dense gradients use TensorFlow's fused training ops. IndexedSlices gradients (embedding
tables) touch only the looked-up rows of the variable and of its slots: SGD scatters, Adagrad
and Adam are lazy (rows not in the batch keep their accumulators unchanged). Duplicate ids in a
batch are summed first; the sparse update is written with static shapes (no tf.unique), so the
same code runs eagerly, in graph mode and under XLA.
"""
from typing import Dict, List, Tuple

import tensorflow as tf

from parallel_embedding.choices import OPTIMIZERS

_ADAGRAD_INITIAL_ACCUMULATOR = 0.1   # as Keras' Adagrad
_EPSILON = 1e-7                       # as Keras' Adagrad and Adam


def slot_name(var: tf.Variable, slot: str) -> str:
    return f"{var.name.split(':')[0]}/{slot}"


def sum_duplicates(grad: tf.IndexedSlices) -> Tuple[tf.Tensor, tf.Tensor]:
    """Returns (indices, rows): for every entry of grad.indices, the sum of all gradient rows
    that share its index. Duplicates get identical rows, so scattering the updated rows back
    with tf.tensor_scatter/scatter_update is order independent.
    """
    indices = grad.indices
    order = tf.argsort(indices, stable=True)
    sorted_ids = tf.gather(indices, order)
    is_new = tf.concat([[True], sorted_ids[1:] != sorted_ids[:-1]], axis=0)
    segment_sorted = tf.cumsum(tf.cast(is_new, tf.int32)) - 1
    segment = tf.gather(segment_sorted, tf.math.invert_permutation(order))
    n = tf.shape(indices)[0]
    summed = tf.math.unsorted_segment_sum(grad.values, segment, n)
    return indices, tf.gather(summed, segment)


class Optimizer(tf.Module):
    """Base: owns per-variable slots and an update counter; `apply` takes a learning rate tensor."""
    slot_names: Tuple[str, ...] = ()

    def __init__(self, variables: List[tf.Variable], name: str):
        super().__init__(name=name)
        self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name=f"{name}/iterations")
        names = [v.name for v in variables]
        if len(set(names)) != len(names):
            raise ValueError(f"{name}: variable names must be unique (slots are saved by name): {names}")
        self.slots: Dict[object, Dict[str, tf.Variable]] = {}
        for var in variables:
            with tf.device(var.device):   # beside the variable (a table in host memory: there)
                self.slots[var.ref()] = {s: tf.Variable(self._slot_init(s, var), trainable=False,
                                                        name=slot_name(var, s)) for s in self.slot_names}

    def _slot_init(self, slot, var):
        return tf.zeros_like(var)

    def variables_by_name(self) -> Dict[str, tf.Variable]:
        """Checkpointable state: slots and the update counter, by stable name."""
        named = {self.iterations.name.split(":")[0]: self.iterations}
        for slots in self.slots.values():
            named.update({v.name.split(":")[0]: v for v in slots.values()})
        return named

    def apply(self, grads_and_vars, lr: tf.Tensor):
        self.iterations.assign_add(1)
        for grad, var in grads_and_vars:
            lr_v = tf.cast(lr, var.dtype)
            if isinstance(grad, tf.IndexedSlices):
                self._apply_sparse(grad, var, lr_v)
            else:
                self._apply_dense(grad, var, lr_v)


class SGD(Optimizer):
    def _apply_dense(self, grad, var, lr):
        tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=lr, delta=grad)

    def _apply_sparse(self, grad, var, lr):
        var.scatter_sub(tf.IndexedSlices(lr * grad.values, grad.indices))


class Adagrad(Optimizer):
    slot_names = ("accumulator",)

    def _slot_init(self, slot, var):
        return tf.fill(tf.shape(var), tf.constant(_ADAGRAD_INITIAL_ACCUMULATOR, var.dtype))

    def _apply_dense(self, grad, var, lr):
        acc = self.slots[var.ref()]["accumulator"]
        tf.raw_ops.ResourceApplyAdagradV2(var=var.handle, accum=acc.handle, lr=lr,
                                          epsilon=tf.constant(_EPSILON, var.dtype), grad=grad)

    def _apply_sparse(self, grad, var, lr):
        acc = self.slots[var.ref()]["accumulator"]
        idx, g = sum_duplicates(grad)
        new_acc = tf.gather(acc, idx) + g * g
        new_var = tf.gather(var, idx) - lr * g / (tf.sqrt(new_acc) + _EPSILON)
        acc.scatter_update(tf.IndexedSlices(new_acc, idx))
        var.scatter_update(tf.IndexedSlices(new_var, idx))


class Adam(Optimizer):
    """Adam with bias correction; for tables the lazy form (only batch rows' moments move)."""
    slot_names = ("m", "v")

    def __init__(self, variables, name, beta1=0.9, beta2=0.999):
        super().__init__(variables, name)
        self.beta1, self.beta2 = beta1, beta2

    def apply(self, grads_and_vars, lr):
        # Bias-corrected step size from the count including this update.
        t = tf.cast(self.iterations + 1, tf.float32)
        self._lr_t = lr * tf.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        self._powers = (self.beta1 ** t, self.beta2 ** t)
        super().apply(grads_and_vars, lr)

    def _apply_dense(self, grad, var, lr):
        s = self.slots[var.ref()]
        dt = var.dtype
        tf.raw_ops.ResourceApplyAdam(
            var=var.handle, m=s["m"].handle, v=s["v"].handle,
            beta1_power=tf.cast(self._powers[0], dt), beta2_power=tf.cast(self._powers[1], dt), lr=lr,
            beta1=tf.constant(self.beta1, dt), beta2=tf.constant(self.beta2, dt),
            epsilon=tf.constant(_EPSILON, dt), grad=grad)

    def _apply_sparse(self, grad, var, lr):
        s = self.slots[var.ref()]
        idx, g = sum_duplicates(grad)
        m = self.beta1 * tf.gather(s["m"], idx) + (1.0 - self.beta1) * g
        v = self.beta2 * tf.gather(s["v"], idx) + (1.0 - self.beta2) * g * g
        new_var = tf.gather(var, idx) - tf.cast(self._lr_t, var.dtype) * m / (tf.sqrt(v) + _EPSILON)
        s["m"].scatter_update(tf.IndexedSlices(m, idx))
        s["v"].scatter_update(tf.IndexedSlices(v, idx))
        var.scatter_update(tf.IndexedSlices(new_var, idx))


_OPTIMIZERS = dict(zip(OPTIMIZERS, (SGD, Adagrad, Adam)))


def _optimizer_class(name: str):
    if name not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}")
    return _OPTIMIZERS[name]


def slot_names(name: str) -> Tuple[str, ...]:
    """The optimizer slots (per parameter) of optimizer `name`."""
    return _optimizer_class(name).slot_names


def make_optimizer(name: str, variables, scope: str, beta1=0.9, beta2=0.999) -> Optimizer:
    cls = _optimizer_class(name)
    return cls(variables, scope, beta1, beta2) if cls is Adam else cls(variables, scope)
