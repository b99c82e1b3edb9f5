"""The training step: forward, BCE loss, backward, sparse table update, dense MLP update."""
import functools
import math
from typing import Dict, List, Optional, Set

import tensorflow as tf

from storage.checkpoint import Entry, replicated_entries
from nn.lr_schedule import LearningRateSchedule
from nn.model import RankingModel
from parallel_embedding import UPDATED_AT
from parallel_embedding.optimizers import make_optimizer
from utils.errors import NonFiniteError


def amp_dtype():
    """The AMP compute dtype on this machine: float16 on a GPU, bfloat16 on the CPU."""
    return tf.float16 if tf.config.list_physical_devices("GPU") else tf.bfloat16


def bce_loss(labels: tf.Tensor, logits: tf.Tensor, global_batch) -> tf.Tensor:
    """This rank's share of the global batch's mean binary cross-entropy: the sum over its b
    float32 logits against 0/1 labels, divided by the global batch size B. Summed over the ranks
    (allreduce), losses and gradients are those of one process with the whole batch."""
    losses = tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
    return tf.reduce_sum(losses) / tf.cast(global_batch, tf.float32)


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
        return tf.constant(self.static, tf.float32) if self.static else self.scale

    def update(self, finite: tf.Tensor):
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
    """The float32 sum of every element of `grads`: not finite if any element is not (or, which
    no sane step reaches, if the sum overflows). One reduction per tensor, cheaper than
    is_finite + reduce_all (cost on W1: docs/benchmarks.md)."""
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    return tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32)) for v in values])


class Trainer(tf.Module):
    """Owns the optimizers, the step counter and the compiled train/predict functions.

    Tables are updated by the embedding's own optimizer (the sparse form of `optimizer`, see
    DistributedEmbedding.set_optimizer), dense weights by its dense form.
    `loss_scaling` enables loss scaling (float16 AMP): dynamic, or static at `static_loss_scale`.
    `train_tables` false freezes the tables (no table gradients, exchanges or updates). `xla` compiles the dense part
    (MLPs, interaction; forward and backward; the dot interaction without its custom op); lookups and table updates are always compiled
    islands, and collectives run between them. `run_eagerly` (debugging) runs the train and
    predict steps and the table update op by op, as plain Python.

    One step on each of N ranks: lookup of this rank's shards, all-to-all to the local batch,
    dense forward/backward, reverse all-to-all to the shards' owners, one grouped allreduce
    (dense gradients, loss, and a non-finite-gradients flag), updates. `check_finite` stops a
    run once a step's loss or (without loss scaling) gradients were not finite.
    """

    def __init__(self, model: RankingModel, optimizer: str, schedule: LearningRateSchedule,
                 beta1: float = 0.9, beta2: float = 0.999, xla: bool = False, loss_scaling: bool = False,
                 static_loss_scale: Optional[float] = None, train_tables: bool = True, run_eagerly: bool = False):
        super().__init__(name="trainer")
        self.model = model
        self.comm = model.embeddings.comm
        self.schedule = schedule
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        # The learning rate of update `step` is schedule(step - schedule_origin): a run continued
        # from a checkpoint restarts its schedule by setting the origin to the restored step.
        self.schedule_origin = tf.Variable(0, dtype=tf.int64, trainable=False, name="schedule_origin")
        # The first step (counted from 1; 0: none) whose loss or gradients were not finite, and its
        # loss: kept on the device, read by check_finite, so that no step waits for the host.
        self.first_nonfinite_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="first_nonfinite_step")
        self.first_nonfinite_loss = tf.Variable(0.0, trainable=False, name="first_nonfinite_loss")
        model.embeddings.set_optimizer(optimizer, self.step, beta1, beta2, compiled=not run_eagerly)
        self.dense_optimizer = make_optimizer(optimizer, model.dense_variables, "dense_optimizer", beta1, beta2)
        self.loss_scale = LossScale(static=static_loss_scale) if loss_scaling else None
        self.train_tables = train_tables
        self.xla = xla
        # Evaluation and prediction compute in float32 under AMP too: the logits of the exported
        # model, without the ties of bfloat16/float16 logits in the AUC.
        forward = functools.partial(model.predict_from_embeddings, compute_dtype=tf.float32)
        self._dense_forward = tf.function(forward, jit_compile=True) if xla else forward
        self._forward_backward = tf.function(self._forward_backward_impl, jit_compile=True) if xla \
            else self._forward_backward_impl
        self.train_step = self._train_step if run_eagerly else tf.function(self._train_step, reduce_retracing=True)
        self.predict = self._predict if run_eagerly else tf.function(self._predict, reduce_retracing=True)

    def variables_by_name(self) -> Dict[str, tf.Variable]:
        """Everything a checkpoint holds, by stable name."""
        named = self.model.embeddings.variables_by_name()
        named.update({v.name.split(":")[0]: v for v in self.model.dense_variables})
        named.update(self.dense_optimizer.variables_by_name())
        named["global_step"] = self.step
        if self.loss_scale is not None:
            named.update({v.name.split(":")[0]: v for v in (self.loss_scale.scale, self.loss_scale.good_steps)})
        return named

    def learning_rate(self, step) -> tf.Tensor:
        """The learning rate of the update with 0-based global index `step`."""
        return self.schedule(step - self.schedule_origin)

    def checkpoint_entries(self, weights_only: bool = False) -> List[Entry]:
        """This rank's variables as parts of world-size-independent tensors: the embedding's (its
        tables and their optimizer state), then everything else, replicated and saved by rank 0.
        `weights_only`: the model's variables alone (no optimizer state, no step counters)."""
        if weights_only:
            return self.model.checkpoint_entries()
        emb = self.model.embeddings
        owned = emb.variables_by_name()
        return emb.checkpoint_entries() + replicated_entries(
            {n: v for n, v in self.variables_by_name().items() if n not in owned})

    def checkpoint_names(self, weights_only: bool = False) -> Set[str]:
        """The logical tensors of a complete checkpoint of this model (on any rank), or of its
        weights alone."""
        if weights_only:
            return self.model.checkpoint_names()
        return self.model.embeddings.checkpoint_names() | {e.name for e in self.checkpoint_entries()}

    def optional_names(self) -> Set[str]:
        """Tensors a checkpoint may lack (their variables then keep their values): float16 loss
        scaling's state, and the tables' updated_at (checkpoints written before rows' updates were
        recorded)."""
        return set(LOSS_SCALE_STATE) | {n for n in self.model.embeddings.checkpoint_names() if n.endswith(UPDATED_AT)}

    def broadcast_replicated(self):
        """Sets the data-parallel state (dense variables, replicated tables, their slots, counters)
        of every rank to rank 0's."""
        self.comm.broadcast_variables([e.variable for e in self.checkpoint_entries() if e.replicated])

    def _predict(self, numerical, categorical):
        """Logits [b] of this rank's local batch."""
        embeddings = self.model.embeddings(categorical, tf.shape(numerical)[0])
        return self._dense_forward(numerical, embeddings)

    def _forward_backward_impl(self, numerical, embeddings, labels):
        """The dense part: (loss share, its gradients w.r.t. the F embeddings and the dense variables)."""
        dense = self.model.dense_variables
        with tf.GradientTape() as tape:
            tape.watch(embeddings)
            logits = self.model.predict_from_embeddings(numerical, embeddings, training=True)
            loss = bce_loss(labels, logits, tf.shape(labels)[0] * self.comm.size)
            scaled = loss * self.loss_scale.value if self.loss_scale is not None else loss
        sources = list(embeddings) if self.train_tables else []
        grads = tape.gradient(scaled, sources + dense)
        return loss, grads[:len(sources)], grads[len(sources):]

    def _train_step(self, numerical, categorical, labels):
        """One step on this rank's inputs; returns the global batch's mean loss."""
        emb = self.model.embeddings
        # Differentiate with respect to the looked-up rows, not the tables: the table gradients are
        # then IndexedSlices(rows' gradient, row indices) by construction, whatever the lookup's kernel.
        looked_up = emb.lookup(categorical, training=True)
        embeddings = emb.exchange(looked_up, tf.shape(numerical)[0])
        loss, embedding_grads, dense_grads = self._forward_backward(numerical, embeddings, labels)
        table_grads = emb.gradients(looked_up, embedding_grads) if self.train_tables else []
        # Every rank must agree on a non-finite step (to skip it under loss scaling, else to stop).
        flags = [loss, gradient_sum(table_grads + dense_grads)]
        reduced = self.comm.allreduce_sum(list(dense_grads) + flags, "dense_grads")
        grads = table_grads + reduced[:len(dense_grads)]
        loss, finite = reduced[len(dense_grads)], tf.math.is_finite(reduced[-1])
        lr = self.learning_rate(self.step)
        multi_hot = any(isinstance(c, tf.RaggedTensor) for c in categorical)
        if self.loss_scale is None:
            self._apply(grads, lr, multi_hot)
            good = tf.logical_and(finite, tf.math.is_finite(loss))
        else:   # an overflowing step is skipped, not an error
            grads = [scale_gradient(g, 1.0 / self.loss_scale.value) for g in grads]
            tf.cond(finite, lambda: self._apply(grads, lr, multi_hot), lambda: tf.no_op())
            self.loss_scale.update(finite)
            good = tf.math.is_finite(loss)
        first = tf.logical_and(tf.logical_not(good), self.first_nonfinite_step == 0)
        self.first_nonfinite_step.assign(tf.where(first, self.step + 1, self.first_nonfinite_step))
        self.first_nonfinite_loss.assign(tf.where(first, loss, self.first_nonfinite_loss))
        self.step.assign_add(1)
        return loss

    def check_finite(self):
        """Raises NonFiniteError, naming the step, if a train_step so far had a non-finite loss or,
        without loss scaling, non-finite gradients. main.py calls it at every progress line and
        before every save and evaluation."""
        step = int(self.first_nonfinite_step.numpy())
        if step:
            loss = float(self.first_nonfinite_loss.numpy())
            what = f"loss ({loss})" if not math.isfinite(loss) else "gradients"
            lr = float(self.learning_rate(step - 1))
            raise NonFiniteError(f"step {step}: non-finite {what} at learning rate {lr:g}; "
                                 f"training stopped, nothing saved from step {step} on")

    def _apply(self, grads, lr, multi_hot: bool):
        """grads: the tables' IndexedSlices (none when they are frozen), then the dense variables' gradients."""
        n = len(grads) - len(self.model.dense_variables)
        if n:
            self.model.embeddings.apply_gradients(grads[:n], lr, multi_hot)
        self.dense_optimizer.apply(zip(grads[n:], self.model.dense_variables), lr)
        return tf.no_op()
