"""Mixed precision of the training step: the AMP compute dtype, float16 loss scaling and the
gradients' non-finite check (ranking.Model's step and the run's --amp/--loss_scale)."""
from typing import Optional

import tensorflow as tf


def amp_dtype():
    """The AMP compute dtype on this machine: float16 on a GPU, bfloat16 on the CPU."""
    return tf.float16 if tf.config.list_physical_devices("GPU") else tf.bfloat16


# The loss scale's checkpointed state: optional in a checkpoint, so that a float16 AMP run's
# checkpoint restores without AMP (and the reverse, from the initial scale).
LOSS_SCALE_STATE = ("loss_scale/scale", "loss_scale/good_steps")


class LossScale(tf.Module):
    """float16 loss scaling. Dynamic: halve and skip the update on inf/NaN gradients, double after
    `growth_interval` finite steps. Static (`static`: the scale, --loss_scale): always that scale
    (a restored one is not used); a step with inf/NaN gradients is still skipped."""

    def __init__(self, initial=2.0 ** 15, growth_interval=2000, static: Optional[float] = None):
        super().__init__(name="loss_scale")
        self.scale = tf.Variable(static or initial, dtype=tf.float32, trainable=False, name=LOSS_SCALE_STATE[0])
        self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name=LOSS_SCALE_STATE[1])
        self.growth_interval = growth_interval
        self.static = static

    @property
    def value(self) -> tf.Tensor:
        """The scale (float32 scalar) the loss is multiplied by."""
        return tf.constant(self.static, tf.float32) if self.static else self.scale

    def update(self, finite: tf.Tensor):
        """After a step whose gradients were all finite (`finite`, a bool scalar) or not."""
        if self.static:
            return
        grow = tf.logical_and(finite, self.good_steps + 1 >= self.growth_interval)
        self.scale.assign(tf.where(finite, tf.where(grow, self.scale * 2.0, self.scale),
                                   tf.maximum(self.scale * 0.5, 1.0)))
        self.good_steps.assign(tf.where(tf.logical_and(finite, tf.logical_not(grow)), self.good_steps + 1,
                                        tf.zeros_like(self.good_steps)))


def scale_gradient(grad, factor):
    """`grad` (a tensor or IndexedSlices) times `factor`."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * factor


def gradient_sum(grads) -> tf.Tensor:
    """The float32 sum of every element of `grads` (tensors or IndexedSlices): not finite if any
    element is not (or, which no sane step reaches, if the sum overflows). One reduction per
    tensor, cheaper than is_finite + reduce_all (cost on W1: docs/benchmarks.md)."""
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    return tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32)) for v in values])
