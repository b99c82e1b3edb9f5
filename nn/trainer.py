"""The training step: forward, BCE loss, backward, sparse table update, dense MLP update."""
from typing import Dict

import tensorflow as tf

from nn.lr_schedule import LearningRateSchedule
from nn.model import RankingModel
from nn.optimizers import make_optimizer


def amp_dtype():
    """The AMP compute dtype on this machine: float16 on a GPU, bfloat16 on the CPU."""
    return tf.float16 if tf.config.list_physical_devices("GPU") else tf.bfloat16


def bce_loss(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean binary cross-entropy of float32 logits [B] against 0/1 labels [B]."""
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))


class DynamicLossScale(tf.Module):
    """float16 loss scaling: halve and skip the update on inf/NaN gradients, double after
    `growth_interval` finite steps."""

    def __init__(self, initial=2.0 ** 15, growth_interval=2000):
        super().__init__(name="loss_scale")
        self.scale = tf.Variable(initial, trainable=False, name="loss_scale/scale")
        self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="loss_scale/good_steps")
        self.growth_interval = growth_interval

    def update(self, finite: tf.Tensor):
        grow = tf.logical_and(finite, self.good_steps + 1 >= self.growth_interval)
        self.scale.assign(tf.where(finite, tf.where(grow, self.scale * 2.0, self.scale),
                                   tf.maximum(self.scale * 0.5, 1.0)))
        self.good_steps.assign(tf.where(tf.logical_and(finite, tf.logical_not(grow)), self.good_steps + 1,
                                        tf.zeros_like(self.good_steps)))


def _scale_grad(grad, factor):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * factor


def _all_finite(grads) -> tf.Tensor:
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values])


class Trainer(tf.Module):
    """Owns the optimizers, the step counter and the compiled train/predict functions.

    Tables are updated by the sparse form of `optimizer`, dense weights by its dense form.
    `loss_scaling` enables dynamic loss scaling (float16 AMP).
    """

    def __init__(self, model: RankingModel, optimizer: str, schedule: LearningRateSchedule,
                 beta1: float = 0.9, beta2: float = 0.999, xla: bool = False, loss_scaling: bool = False):
        super().__init__(name="trainer")
        self.model = model
        self.schedule = schedule
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        self.table_optimizer = make_optimizer(optimizer, model.table_variables, "table_optimizer", beta1, beta2)
        self.dense_optimizer = make_optimizer(optimizer, model.dense_variables, "dense_optimizer", beta1, beta2)
        self.loss_scale = DynamicLossScale() if loss_scaling else None
        # The sparse table update as one XLA-compiled function: on CPU about 5x faster than
        # TensorFlow's scatter kernels, and only the given rows are written either way.
        self._update_tables = tf.function(
            lambda grads, lr: self.table_optimizer.apply(zip(grads, model.table_variables), lr), jit_compile=True)
        self.train_step = tf.function(self._train_step, jit_compile=xla, reduce_retracing=True)
        self.predict = tf.function(self._predict, jit_compile=xla, reduce_retracing=True)

    def variables_by_name(self) -> Dict[str, tf.Variable]:
        """Everything a checkpoint holds, by stable name."""
        named = {v.name.split(":")[0]: v for v in self.model.table_variables + self.model.dense_variables}
        named.update(self.table_optimizer.variables_by_name())
        named.update(self.dense_optimizer.variables_by_name())
        named["global_step"] = self.step
        if self.loss_scale is not None:
            named.update({v.name.split(":")[0]: v for v in (self.loss_scale.scale, self.loss_scale.good_steps)})
        return named

    def _predict(self, numerical, categorical):
        return self.model(numerical, categorical)

    def _train_step(self, numerical, categorical, labels):
        tables, dense = self.model.table_variables, self.model.dense_variables
        # Differentiate with respect to the looked-up rows, not the tables: the table gradient is
        # then IndexedSlices(rows' gradient, ids) by construction, whatever the lookup's kernel.
        embeddings = self.model.embeddings(categorical, training=True)
        with tf.GradientTape() as tape:
            tape.watch(embeddings)
            loss = bce_loss(labels, self.model.predict_from_embeddings(numerical, embeddings, training=True))
            scaled = loss * self.loss_scale.scale if self.loss_scale is not None else loss
        grads = tape.gradient(scaled, embeddings + dense)
        grads[:len(tables)] = [tf.IndexedSlices(g, ids, tf.shape(t, out_type=ids.dtype))
                               for g, ids, t in zip(grads[:len(tables)], categorical, tables)]
        lr = self.schedule(self.step)
        if self.loss_scale is None:
            self._apply(grads, lr)
        else:
            grads = [_scale_grad(g, 1.0 / self.loss_scale.scale) for g in grads]
            finite = _all_finite(grads)
            tf.cond(finite, lambda: self._apply(grads, lr), lambda: tf.no_op())
            self.loss_scale.update(finite)
        self.step.assign_add(1)
        return loss

    def _apply(self, grads, lr):
        """grads: the tables' IndexedSlices, then the dense variables' gradients."""
        n = len(self.model.table_variables)
        self._update_tables(grads[:n], lr)
        self.dense_optimizer.apply(zip(grads[n:], self.model.dense_variables), lr)
        return tf.no_op()
