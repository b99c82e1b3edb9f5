"""ranking.Model: a Keras 3 model (functional or subclassed) trained by the project's step.

    model = ranking.Model(inputs, logits)            # or a subclass of ranking.Model with call()
    model.compile(optimizer="adagrad", learning_rate=0.01,
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    model.fit(dataset)                               # elements (x, labels [b]); x as the inputs

The step (`train_step`, run by Keras' `fit`) is nn/trainer.py's: every `HybridEmbedding` of the
model looks up its rows outside the gradient tape and exchanges them; the dense forward and
backward run under the tape with respect to those rows and the Keras weights
(`trainable_variables`, which never include the tables); the reverse all-to-all turns the rows'
gradients into IndexedSlices, applied by the embedding's sparse optimizer; the dense gradients,
the loss and the sum of all gradients (non-finite check) travel in one grouped allreduce; the
dense weights are updated by the dense form of the same optimizer (parallel_embedding/optimizers.py).
The loss is this rank's share of the global batch's mean: the compiled loss' per-sample values
summed and divided by B = N b, so that summed over the N ranks it is one process' loss on B.
"""
import contextlib
from typing import List, Set, Union

import keras
import tensorflow as tf
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments

from nn.lr_schedule import LearningRateSchedule
from nn.trainer import gradient_sum
from parallel_embedding.optimizers import make_optimizer, slot_names
from storage.checkpoint import Entry, replicated_entries
from ranking.config import TABLE_OPTIMIZERS
from ranking.embedding import HybridEmbedding
from utils.errors import ConfigError, NonFiniteError


class _ProjectStep:
    """compile / train_step / fit of `Model` and `FunctionalModel` (a mixin before keras.Model)."""

    def compile(self, optimizer: str = "sgd", learning_rate: Union[float, LearningRateSchedule] = 0.01,
                loss="binary_crossentropy_from_logits", beta_1: float = 0.9, beta_2: float = 0.999, metrics=None,
                run_eagerly: bool = False):
        """`optimizer`: "sgd", "adagrad" or "adam" (lazy sparse updates for the tables, the
        dense form for the Keras weights), at `learning_rate` (a float, or an
        nn.lr_schedule.LearningRateSchedule of the global step); `loss`: a Keras loss on
        (labels, logits), or the default, binary cross-entropy on logits; `metrics` as Keras'."""
        if optimizer not in TABLE_OPTIMIZERS:
            raise ConfigError(f"compile: optimizer must be one of {', '.join(TABLE_OPTIMIZERS)}, got {optimizer!r}")
        self.embedding_layers = [l for l in self._flatten_layers() if isinstance(l, HybridEmbedding)]
        if not self.embedding_layers:
            raise ConfigError(f"model {self.name!r}: no HybridEmbedding layer (build the model before compile)")
        names = [l.name for l in self.embedding_layers]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:   # their tables would be one checkpoint tensor
            raise ConfigError(f"model {self.name!r}: two HybridEmbedding layers are named {twice[0]!r}; name "
                              f"each its own (its tables' checkpoint names start with it)")
        for layer in self.embedding_layers:
            if layer.table_optimizer not in (None, optimizer):
                raise ConfigError(f"layer {layer.name!r}: its tables name optimizer {layer.table_optimizer!r}, "
                                  f"compile names {optimizer!r}")
            if layer.storage and layer.storage.slots != len(slot_names(optimizer)):
                raise ConfigError(f"layer {layer.name!r}: its storage counts {layer.storage.slots} optimizer slots "
                                  f"per parameter, compile's {optimizer!r} has {len(slot_names(optimizer))}")
        self.comm = self.embedding_layers[0].collectives
        if any(l.collectives is not self.comm for l in self.embedding_layers):
            raise ConfigError(f"model {self.name!r}: its HybridEmbedding layers use different collectives")
        if loss == "binary_crossentropy_from_logits":
            loss = keras.losses.BinaryCrossentropy(from_logits=True)
        self._per_sample_loss = keras.losses.get(loss)
        self.schedule = learning_rate if callable(learning_rate) else LearningRateSchedule(learning_rate, 0, 0, 0)
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        # The update with global index `step` runs at schedule(step - schedule_origin) (a run
        # continued from a checkpoint may restart the schedule there).
        self.schedule_origin = tf.Variable(0, dtype=tf.int64, trainable=False, name="schedule_origin")
        self.first_nonfinite_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="first_nonfinite_step")
        for layer in self.embedding_layers:   # one layer: the counter's name as nn/trainer.py's
            scope = "table_optimizer" if len(self.embedding_layers) == 1 else f"{layer.name}_table_optimizer"
            layer.embedding.set_optimizer(optimizer, self.global_step, beta_1, beta_2, compiled=not run_eagerly,
                                          scope=scope)
        self.dense_optimizer = make_optimizer(optimizer, self.dense_variables, "dense_optimizer", beta_1, beta_2)
        # Keras initialises each rank's weights at random: start every rank from rank 0's.
        self.comm.broadcast_variables([v.value for v in self.weights])
        # Keras' own optimizer is not used (the step above updates every variable).
        super().compile(optimizer=keras.optimizers.SGD(0.0), loss=loss, metrics=metrics, run_eagerly=run_eagerly,
                        jit_compile=False)

    @property
    def dense_variables(self) -> List[tf.Variable]:
        """The Keras weights' tf.Variables (named by their unique Keras path, "dense/kernel"): the
        variables the dense optimizer updates and a checkpoint saves by name."""
        return [v.value for v in self.trainable_variables]

    def checkpoint_entries(self, weights_only: bool = False) -> List[Entry]:
        """This rank's variables as storage.checkpoint entries (written at N ranks, restored at
        any M): every HybridEmbedding's tables ("<layer>_tables/table_<t>" [rows_t, D_t], t in
        order of first use) and, unless `weights_only`, their optimizer slots, updated_at and
        update counter ("table_optimizer/iterations"; with several layers
        "<layer>_table_optimizer/iterations" each); then, replicated, the Keras weights by path
        ("top_0/kernel") and, unless `weights_only`, the dense optimizer's slots and counter and
        "global_step". After compile.
        Name the layers: a Keras auto-name ("dense_3") depends on the layers made before it in
        the process."""
        entries = [e for layer in self.embedding_layers for e in layer.embedding.checkpoint_entries(weights_only)]
        named = {w.path: w.value for w in self.weights}
        if not weights_only:
            named.update(self.dense_optimizer.variables_by_name())
            named["global_step"] = self.global_step
        entries += replicated_entries(named)
        replicated = [e.name for e in entries if e.replicated]
        sharded = {e.name for e in entries if not e.replicated}
        clash = sorted({n for n in replicated if replicated.count(n) > 1 or n in sharded})
        if clash:   # e.g. a Keras weight's path that is also a table's name
            raise ConfigError(f"model {self.name!r}: checkpoint tensor {clash[0]!r} is named twice")
        return entries

    def checkpoint_names(self, weights_only: bool = False) -> Set[str]:
        """Every tensor of `checkpoint_entries` on any rank: the tensors of a complete checkpoint."""
        names = set().union(*(l.embedding.checkpoint_names(weights_only) for l in self.embedding_layers))
        return names | {e.name for e in self.checkpoint_entries(weights_only) if e.replicated}

    def _loss_share(self, labels, logits) -> tf.Tensor:
        """This rank's share of the global batch's mean loss (float32 [])."""
        logits = tf.cast(logits, tf.float32)
        if logits.shape.rank == 2:
            logits = tf.squeeze(logits, axis=1)
        labels = tf.cast(tf.reshape(labels, [-1]), tf.float32)
        fn = self._per_sample_loss
        per_sample = fn.call(labels[:, None], logits[:, None]) if isinstance(fn, keras.losses.Loss) \
            else fn(labels[:, None], logits[:, None])
        return tf.reduce_sum(per_sample) / tf.cast(tf.shape(labels)[0] * self.comm.size, tf.float32)

    def learning_rate(self, step) -> tf.Tensor:
        """The learning rate of the update with 0-based global index `step`."""
        return self.schedule(step - self.schedule_origin)

    def train_step(self, data):
        x, labels, _ = keras.utils.unpack_x_y_sample_weight(data)
        loss, logits = self.step_on(x, labels)
        for metric in self.metrics:   # Keras' loss tracker (a running mean) and compile's metrics (local batch)
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(labels, logits)
        return self.get_metrics_result()

    def step_on(self, x, labels):
        """One training step on this rank's inputs `x` and `labels` [b]: (the global batch's mean
        loss [], this rank's logits as the model gives them)."""
        dense = self.dense_variables
        with tf.GradientTape() as tape:
            with contextlib.ExitStack() as stack:
                records = [stack.enter_context(l.recording(tape)) for l in self.embedding_layers]
                logits = self(x, training=True)
            loss = self._loss_share(labels, logits)
        calls = []
        for layer, rec in zip(self.embedding_layers, records):
            if len(rec.calls) != 1:
                raise ConfigError(f"layer {layer.name!r}: called {len(rec.calls)} times in one forward; "
                                  f"a HybridEmbedding is called once per step")
            calls.append((layer,) + rec.calls[0])
        sources = [r for _, _, rows in calls for r in rows]
        grads = tape.gradient(loss, sources + dense)
        table_grads, i = [], 0
        for layer, looked_up, rows in calls:
            table_grads.append(layer.gradients(looked_up, grads[i:i + len(rows)]))
            i += len(rows)
        dense_grads = grads[len(sources):]
        flat_table_grads = [g for gs in table_grads for g in gs]
        reduced = self.comm.allreduce_sum(list(dense_grads) + [loss, gradient_sum(flat_table_grads + dense_grads)],
                                          "dense_grads")
        loss, finite = reduced[len(dense_grads)], tf.math.is_finite(reduced[-1])
        lr = self.learning_rate(self.global_step)
        for (layer, looked_up, _), gs in zip(calls, table_grads):
            multi_hot = any(f.sample is not None for f in looked_up.shard_ids + looked_up.replicated_ids)
            layer.embedding.apply_gradients(gs, lr, multi_hot)
        self.dense_optimizer.apply(zip(reduced[:len(dense_grads)], dense), lr)
        good = tf.logical_and(finite, tf.math.is_finite(loss))
        first = tf.logical_and(tf.logical_not(good), self.first_nonfinite_step == 0)
        self.first_nonfinite_step.assign(tf.where(first, self.global_step + 1, self.first_nonfinite_step))
        self.global_step.assign_add(1)
        return loss, logits

    def check_finite(self):
        """Raises NonFiniteError naming the first step whose loss or gradients were not finite."""
        step = int(self.first_nonfinite_step.numpy())
        if step:
            raise NonFiniteError(f"step {step}: non-finite loss or gradients; training stopped")

    def fit(self, *args, callbacks=None, **kwargs):
        """keras.Model.fit, stopped with NonFiniteError after a step with a non-finite loss or gradients."""
        return super().fit(*args, callbacks=list(callbacks or []) + [_StopOnNonFinite()], **kwargs)


class Model(_ProjectStep, keras.Model):
    """A keras.Model whose `fit` (and `train_on_batch`) runs the project's step over its
    `HybridEmbedding` layers (at least one, each called once a step; all on the same
    collectives); `evaluate` and `predict` are Keras' own, on this rank's batch. Outputs: logits
    [b] or [b, 1] (one head). Subclass it (with `call`), or call it as `Model(inputs, outputs)`, which
    returns a `FunctionalModel` (Keras' own route for that, which rewrites the subclass's bases
    in place, would turn every later subclass of Model functional)."""

    def __new__(cls, *args, **kwargs):
        if cls is Model and functional_init_arguments(args, kwargs):
            return FunctionalModel(*args, **kwargs)
        return super().__new__(cls, *args, **kwargs)


class FunctionalModel(_ProjectStep, Functional):
    """A functional Keras model (inputs, outputs) trained by the project's step (see `Model`)."""

    def dense_part(self) -> keras.Model:
        """The model after its embeddings, for export beside the tables: a functional keras.Model
        from the model's inputs that no HybridEmbedding consumes (in order), then every
        HybridEmbedding's outputs ([b, D_f] each, as keras.tree.flatten orders them: a dict by
        feature name), to the model's outputs. It shares the Keras weights; `export(path)` writes
        it as a SavedModel."""
        layers = [l for l in self._flatten_layers() if isinstance(l, HybridEmbedding)]
        consumed = {id(t) for l in layers for t in keras.tree.flatten(l.input)}
        inputs = [t for t in self.inputs if id(t) not in consumed]
        inputs += [t for l in layers for t in keras.tree.flatten(l.output)]
        return keras.Model(inputs, self.outputs, name=f"{self.name}_dense")


class _StopOnNonFinite(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.model.check_finite()
