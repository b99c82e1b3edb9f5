"""ranking.Model: a Keras 3 model (functional or subclassed) trained by the project's step.

    model = ranking.Model(inputs, logits)            # or a subclass of ranking.Model with call()
    model.compile(optimizer="adagrad", learning_rate=0.01,
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    model.fit(dataset)                               # elements (x, labels [b]); x as the inputs

The step (`train_step`, run by Keras' `fit`): every `HybridEmbedding` of the model looks up
its rows outside the gradient tape and exchanges them; the dense forward and backward run under
the tape with respect to those rows and the Keras weights
(`trainable_variables`, which never include the tables); the reverse all-to-all turns the rows'
gradients into IndexedSlices, applied by the embedding's sparse optimizer; the dense gradients,
the loss and the sum of all gradients (non-finite check) travel in one grouped allreduce; the
dense weights are updated by the dense form of the same optimizer (parallel_embedding/optimizers.py).
The loss is this rank's share of the global batch's mean: the compiled loss' per-sample values
summed and divided by B = N b, so that summed over the N ranks it is one process' loss on B.

AMP is Keras' mixed precision: a model built under `keras.mixed_precision.set_global_policy(
"mixed_bfloat16")` (or "mixed_float16") computes its Keras layers in that dtype, with float32
weights; the tables and the looked-up rows stay float32 and the loss is computed on float32
logits. A model computing in float16 anywhere scales its loss (ranking.precision.LossScale:
dynamic, or static with `compile(loss_scale=...)`); a step whose scaled gradients are not finite
is skipped and the scale halved. `compile(jit_compile=True)` XLA-compiles the dense part (forward
and backward, the loss), as the run's --xla: a functional model's `dense_part`, a subclass'
`dense_call`; the lookups, exchanges, allreduce and updates run outside it.

`evaluate` gives the loss and the exact AUC over every rank's samples (main.py's evaluation);
`predict` this rank's outputs, float32 (`inference`).
"""
import contextlib
import math
from typing import Dict, List, Optional, Set, Union

import keras
import numpy as np
import tensorflow as tf

from nn.lr_schedule import LearningRateSchedule
from parallel_embedding.optimizers import make_optimizer, slot_names
from parallel_embedding import UPDATED_AT
from parallel_embedding.dynamic_table import IDS
from storage import checkpoint
from storage.checkpoint import KEEP, Entry, replicated_entries
from ranking.config import TABLE_OPTIMIZERS
from ranking.embedding import HybridEmbedding
from ranking.features import binary_loss
from ranking.keras_internals import Functional, TFEpochIterator
from ranking.precision import LOSS_SCALE_STATE, LossScale, gradient_sum, scale_gradient
from utils.errors import ConfigError, NonFiniteError
from utils.metrics import roc_auc


class _ProjectStep:
    """compile / train_step / fit of `Model` and `FunctionalModel` (a mixin before keras.Model)."""

    def compile(self, optimizer: Union[str, keras.optimizers.Optimizer] = "sgd",
                learning_rate: Union[None, float, LearningRateSchedule] = None,
                loss="binary_crossentropy_from_logits", beta_1: float = 0.9, beta_2: float = 0.999, metrics=None,
                run_eagerly: bool = False, jit_compile: bool = False, auto_scale_loss: bool = True,
                loss_scale: Optional[float] = None, loss_weights: Optional[Dict[str, float]] = None,
                weighted_metrics=None):
        """`optimizer`: "sgd", "adagrad" or "adam" (lazy sparse updates for the tables, the
        dense form for the Keras weights), at `learning_rate` (default 0.01: a float, or an
        nn.lr_schedule.LearningRateSchedule or any callable of the global step), `beta_1` and
        `beta_2` (Adam's); or Keras' object of one of them, which gives these (`_keras_optimizer`);
        `loss`: a Keras loss on
        (labels, logits), or the default, binary cross-entropy on logits; `metrics` as Keras'
        (fit's sample weights not applied), `weighted_metrics` as Keras' (applied).
        A model with several heads (a dict of outputs, each [b] or [b, 1]; its labels a dict of
        [b] by head) takes `loss` for every head or a dict by head, `loss_weights` a dict by head
        (default 1.0), and `metrics` as Keras' (a dict by head: "<head>_<metric>" in the logs); a
        subclassed one names its heads in the `loss` dict.
        `jit_compile`: XLA-compile the dense part (a functional model's; a subclass' `dense_call`,
        see `Model`). A model computing in
        float16 scales its loss: dynamically with `auto_scale_loss` (Keras' name), at the static
        `loss_scale` when given."""
        if isinstance(optimizer, keras.optimizers.Optimizer):
            if learning_rate is not None:
                raise ConfigError(f"compile: the optimizer object has its learning rate; learning_rate={learning_rate!r} "
                                  f"gives it twice")
            optimizer, learning_rate, beta_1, beta_2 = _keras_optimizer(optimizer)
        learning_rate = 0.01 if learning_rate is None else learning_rate
        if optimizer not in TABLE_OPTIMIZERS:
            raise ConfigError(f"compile: optimizer must be one of {', '.join(TABLE_OPTIMIZERS)} (or Keras' object of "
                              f"one), got {optimizer!r}")
        self._optimizer_kind = optimizer
        self.embedding_layers = [l for l in self._flatten_layers() if isinstance(l, HybridEmbedding)]
        if not self.embedding_layers:
            raise ConfigError(f"model {self.name!r}: no HybridEmbedding layer (build the model before compile)")
        names = [l.name for l in self.embedding_layers]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:   # their tables would be one checkpoint tensor
            raise ConfigError(f"model {self.name!r}: two HybridEmbedding layers are named {twice[0]!r}; name "
                              f"each its own (its tables' checkpoint names start with it)")
        for layer in self.embedding_layers:
            other = next((t for t in layer.tables if t.optimizer not in (None, optimizer)), None)
            if other is not None:   # the step has one sparse optimizer for every table
                raise ConfigError(f"table {other.name!r} of layer {layer.name!r}: its optimizer is "
                                  f"{other.optimizer!r}, compile's is {optimizer!r}; compile's updates every "
                                  f"table (leave the table's optimizer None or name compile's)")
            if layer.storage and layer.storage.slots != len(slot_names(optimizer)):
                raise ConfigError(f"layer {layer.name!r}: its storage counts {layer.storage.slots} optimizer slots "
                                  f"per parameter, compile's {optimizer!r} has {len(slot_names(optimizer))}")
        self.comm = self.embedding_layers[0].collectives
        if any(l.collectives is not self.comm for l in self.embedding_layers):
            raise ConfigError(f"model {self.name!r}: its HybridEmbedding layers use different collectives")
        self._heads = self._head_names(loss, loss_weights)
        losses = loss if isinstance(loss, dict) else dict.fromkeys(self._heads or [None], loss)
        self._per_sample_loss = {head: _per_sample_loss(fn) for head, fn in losses.items()}
        for head, fn in self._per_sample_loss.items():
            reduction = getattr(fn, "reduction", "sum_over_batch_size")
            if reduction not in ("sum_over_batch_size", "mean"):
                raise ConfigError(f"compile: the loss{'' if head is None else f' of head {head!r}'} has reduction "
                                  f"{reduction!r}; the step takes the global batch's mean of the samples' losses "
                                  f"(Keras' 'sum_over_batch_size')")
        self._loss_weights = {head: float((loss_weights or {}).get(head, 1.0)) for head in losses}
        # Each head's share of the loss, a running mean over the epoch as Keras' loss ("<head>_loss").
        # A built subclass' state is locked; these trackers are compile's, as Keras' own loss tracker.
        locked = self._tracker.locked
        self._tracker.unlock()
        self.head_loss_trackers = {h: keras.metrics.Mean(name=f"{h}_loss") for h in self._heads or []}
        if locked:
            self._tracker.lock()
        self.schedule = learning_rate if callable(learning_rate) else LearningRateSchedule(learning_rate, 0, 0, 0)
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        # The update with global index `step` runs at schedule(step - schedule_origin) (a run
        # continued from a checkpoint may restart the schedule there).
        self.schedule_origin = tf.Variable(0, dtype=tf.int64, trainable=False, name="schedule_origin")
        # The first step (counted from 1; 0: none) whose loss or gradients were not finite, and its
        # loss: kept on the device, read by check_finite, so that no step waits for the host.
        self.first_nonfinite_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="first_nonfinite_step")
        self.first_nonfinite_loss = tf.Variable(0.0, trainable=False, name="first_nonfinite_loss")
        dtypes = sorted({l.compute_dtype for l in self._flatten_layers()})
        if loss_scale is not None and "float16" not in dtypes:
            raise ConfigError(f"compile: loss_scale applies to a model computing in float16 (built under Keras' "
                              f"'mixed_float16' policy); model {self.name!r} computes in {', '.join(dtypes)}")
        self.loss_scale = LossScale(static=loss_scale) if "float16" in dtypes and (auto_scale_loss or loss_scale) \
            else None
        if not isinstance(self, FunctionalModel):
            _has_halves(self)   # call, or both halves: a one-line error otherwise
        self._xla = _DenseSplit.of(self) if jit_compile else None
        self._eval_batch = None   # evaluate's step, made at its first call
        for layer in self.embedding_layers:   # one layer: the built-in checkpoints' counter name
            scope = "table_optimizer" if len(self.embedding_layers) == 1 else f"{layer.name}_table_optimizer"
            layer.embedding.set_optimizer(optimizer, self.global_step, beta_1, beta_2, compiled=not run_eagerly,
                                          scope=scope)
        self.dense_optimizer = make_optimizer(optimizer, self.dense_variables, "dense_optimizer", beta_1, beta_2)
        # Keras initialises each rank's weights at random: start every rank from rank 0's.
        self.comm.broadcast_variables([v.value for v in self.weights])
        # Keras' own optimizer is not used (the step above updates every variable).
        super().compile(optimizer=keras.optimizers.SGD(0.0), loss=losses if self._heads else loss, metrics=metrics,
                        weighted_metrics=weighted_metrics, run_eagerly=run_eagerly, jit_compile=False)

    def _head_names(self, loss, loss_weights) -> Optional[List[str]]:
        """The model's heads (None: one output): a functional model's output dict's keys, else
        the `loss` dict's; checked against `loss` and `loss_weights` (one-line ConfigErrors)."""
        outputs = getattr(self, "_outputs_struct", None)
        if isinstance(outputs, dict):
            heads = sorted(outputs)
            for head in heads:
                shape = tuple(outputs[head].shape)
                if shape not in ((None,), (None, 1)):
                    layer = outputs[head]._keras_history.operation.name
                    raise ConfigError(f"compile: head {head!r} (layer {layer!r}) gives shape {shape}; a head gives "
                                      f"one logit per sample ([b] or [b, 1])")
        elif outputs is not None and isinstance(loss, dict):
            raise ConfigError(f"compile: loss is a dict by head ({', '.join(sorted(loss))}); model {self.name!r} "
                              f"gives one output")
        else:
            heads = sorted(loss) if isinstance(loss, dict) else None
        for what, given in (("loss", loss), ("loss_weights", loss_weights)):
            if isinstance(given, dict) and heads is not None and sorted(given) != heads \
                    and not (what == "loss_weights" and set(given) <= set(heads)):
                raise ConfigError(f"compile: {what} names heads {', '.join(sorted(given))}; model {self.name!r} has "
                                  f"the heads {', '.join(heads)}")
        if loss_weights is not None and heads is None:
            raise ConfigError(f"compile: loss_weights applies to a model with several heads; model {self.name!r} "
                              f"gives one output")
        return heads

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
        ("top_0/kernel") and, unless `weights_only`, the dense optimizer's slots and counter,
        "global_step" and, scaling the loss, its state (ranking.precision.LOSS_SCALE_STATE: optional in a
        checkpoint). After compile.
        Name the layers: a Keras auto-name ("dense_3") depends on the layers made before it in
        the process."""
        entries = [e for layer in self.embedding_layers for e in layer.embedding.checkpoint_entries(weights_only)]
        named = {w.path: w.value for w in self.weights}
        if not weights_only:
            named.update(self.dense_optimizer.variables_by_name())
            named["global_step"] = self.global_step
            if self.loss_scale is not None:
                named.update(zip(LOSS_SCALE_STATE, (self.loss_scale.scale, self.loss_scale.good_steps)))
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

    def optional_checkpoint_names(self) -> Set[str]:
        """Tensors a checkpoint may lack (their variables then keep their values): float16 loss
        scaling's state (a run with or without it restores the other's checkpoints), and the static
        tables' updated_at (checkpoints written before rows' updates were recorded; a dynamic
        table's, beside its ids, has been saved since there are dynamic tables, and orders their
        eviction: never optional)."""
        names = {n for layer in self.embedding_layers for n in layer.embedding.checkpoint_names()}
        return set(LOSS_SCALE_STATE) | {n for n in names if n.endswith(UPDATED_AT)
                                        and n[:-len(UPDATED_AT)] + IDS not in names}

    @contextlib.contextmanager
    def restoring_tables(self, tensors: dict):
        """The block restoring a checkpoint whose manifest's "tensors" are `tensors`, for every
        HybridEmbedding (DistributedEmbedding.restoring: one line naming a table static in one and
        dynamic in the other; a dynamic table saved in other hash shards re-hashed into this run's)."""
        with contextlib.ExitStack() as stack:
            for layer in self.embedding_layers:
                stack.enter_context(layer.embedding.restoring(tensors))
            yield self

    def save_checkpoint(self, root: str, model_file: Optional[str] = None, features=None,
                        hparams: Optional[dict] = None, keep: int = KEEP) -> str:
        """Writes the compiled model at its global step as ROOT/ckpt-<step> (ROOT/latest names it,
        the `keep` newest are kept), every rank calling it, and returns its path;
        `restore_checkpoint` reads it back at any rank count. With `model_file` and `features`
        (the ranking.Features that file's build_model(features, hparams) built this model from;
        `hparams` as `--model_param`s give them, default none), it is the checkpoint
        `main.py --model=model_file` writes: main.py restores it (evaluation, or training on with
        --restore_mode=continue or weights: it records no data position) and
        `deploy.py --model=model_file` exports it."""
        if (model_file is None) != (features is None):
            raise ConfigError(f"save_checkpoint: model_file and features go together (the checkpoint of a model file's "
                              f"model records both), got {'model_file' if features is None else 'features'} alone")
        signature = {} if model_file is None else features.signature(model_file, hparams or {}, self._heads,
                                                                     self._optimizer_kind)
        state = {"schedule_origin": int(self.schedule_origin.numpy())}
        return checkpoint.save(root, self.checkpoint_entries(), int(self.global_step.numpy()), signature, self.comm,
                               state, keep=keep)

    def restore_checkpoint(self, path: str, weights_only: bool = False) -> dict:
        """Loads a checkpoint (its directory, or ROOT: its latest) written at any rank count, by
        `save_checkpoint` or main.py, into the compiled model, every rank calling it: the tables,
        Keras weights, optimizer state, global step and schedule origin; with `weights_only`,
        the tables and Keras weights alone (the optimizer as compiled). Every tensor's name and
        shape, and each piece's checksum, are checked before anything changes (one line
        otherwise). Returns the checkpoint's manifest (storage.checkpoint)."""
        manifest = checkpoint.read_manifest(path)
        with self.restoring_tables(manifest["tensors"]):
            checkpoint.restore(manifest["path"], self.checkpoint_entries(weights_only), {},
                               self.checkpoint_names(weights_only), extra_ok=weights_only,
                               optional=self.optional_checkpoint_names())
        if not weights_only:
            self.schedule_origin.assign(manifest["state"].get("schedule_origin", 0))
        return manifest

    def _loss_share(self, labels, outputs, sample_weight=None):
        """This rank's share of the global batch's mean loss (float32 []): the weighted sum of the
        heads' (one output: its own); and each head's share ({head: []}; empty for one output).
        `sample_weight`: None, [b] (every head's), or a dict of [b] by head (a head left out: 1)."""
        if isinstance(outputs, dict) and self._heads is None:
            raise ConfigError(f"model {self.name!r} gives heads {', '.join(sorted(outputs))}; compile's loss is "
                              f"for one output: give it as a dict by head")
        if isinstance(sample_weight, dict) and (self._heads is None or not set(sample_weight) <= set(self._heads)):
            raise ConfigError(f"model {self.name!r}: sample weights by head ({', '.join(sorted(sample_weight))}) "
                              f"for " + ("one output" if self._heads is None else f"heads {', '.join(self._heads)}"))
        weight = sample_weight.get if isinstance(sample_weight, dict) else lambda head: sample_weight
        if self._heads is None:
            return self._head_share(self._per_sample_loss[None], labels, outputs, sample_weight), {}
        if not isinstance(labels, dict) or sorted(labels) != self._heads:
            given = ", ".join(sorted(labels)) if isinstance(labels, dict) else "one tensor"
            raise ConfigError(f"model {self.name!r}: its labels must be a dict by head ({', '.join(self._heads)}), "
                              f"got {given}")
        shares = {h: self._head_share(self._per_sample_loss[h], labels[h], outputs[h], weight(h)) for h in self._heads}
        return tf.add_n([self._loss_weights[h] * shares[h] for h in self._heads]), shares

    def _head_share(self, fn, labels, logits, weight=None) -> tf.Tensor:
        """One output's share: `fn`'s per-sample losses on (labels [b], logits [b] or [b, 1]),
        times `weight` [b] where given, summed, divided by the global batch B = N b (Keras'
        "sum_over_batch_size")."""
        per_sample = self._per_sample(fn, labels, logits)
        if weight is not None:
            per_sample = per_sample * tf.cast(tf.reshape(weight, [-1]), tf.float32)
        return tf.reduce_sum(per_sample) / tf.cast(tf.shape(per_sample)[0] * self.comm.size, tf.float32)

    @staticmethod
    def _per_sample(fn, labels, logits) -> tf.Tensor:
        """A Keras loss `fn`'s per-sample values [b] on `labels` [b] and `logits` [b] or [b, 1], in float32."""
        labels, logits = tf.cast(tf.reshape(labels, [-1]), tf.float32), tf.cast(tf.reshape(logits, [-1]), tf.float32)
        return fn.call(labels[:, None], logits[:, None]) if isinstance(fn, keras.losses.Loss) \
            else fn(labels[:, None], logits[:, None])

    def learning_rate(self, step) -> tf.Tensor:
        """The learning rate of the update with 0-based global index `step`."""
        return self.schedule(step - self.schedule_origin)

    def train_step(self, data):
        x, labels, weights = keras.utils.unpack_x_y_sample_weight(data)
        loss, head_losses, logits = self.step_on(x, labels, weights)
        self._update_metrics(loss, head_losses, labels, logits, weights)   # the losses global, compile's metrics local
        return self.get_metrics_result()

    def _update_metrics(self, loss, head_losses, labels, outputs, sample_weight=None):
        """Keras' loss tracker (a running mean) with `loss`, each head's with its `head_losses`,
        compile's metrics with (`labels`, `outputs`, `sample_weight`)."""
        heads = {id(m): h for h, m in self.head_loss_trackers.items()}
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            elif id(metric) in heads:
                metric.update_state(head_losses[heads[id(metric)]])
            else:
                metric.update_state(labels, outputs, sample_weight=sample_weight)

    def predict_step(self, data):
        """This rank's outputs on its batch: `inference` (float32; XLA under jit_compile)."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self.inference(x)

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None, steps=None,
                 callbacks=None, return_dict=False, _use_cached_eval_dataset=False):
        """keras.Model.evaluate over every rank's samples: each rank runs `inference` on its own
        batches (every rank the same number of them: the lookups exchange rows), rank 0 gathers
        the (output, label) columns and computes from them the figures every rank returns: "loss"
        (the compiled loss' mean over all samples; several heads: the weighted sum of their means,
        and "<head>_loss" each), the exact ROC AUC "auc" ("<head>_auc"; utils.metrics.roc_auc,
        as main.py's evaluation: ties count one half) of an output trained by a binary
        cross-entropy, and compile's metrics, each over all samples (a compiled metric named as
        the exact AUC gives way to it: an AUC of any output, if so asked). The same figures as
        one process evaluating the same samples. fit's validation_data runs it too (its "val_"
        logs); callbacks see no per-batch figures."""
        self._assert_compile_called("evaluate")
        if sample_weight is not None:
            raise ConfigError(f"evaluate: model {self.name!r} weighs every sample alike; sample_weight is not "
                              f"supported")
        batches = self._eval_epoch_iterator if _use_cached_eval_dataset else TFEpochIterator(
            x=x, y=y, batch_size=batch_size, steps_per_epoch=steps, shuffle=False,
            distribute_strategy=self.distribute_strategy)
        batches.reset()
        if not isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks = keras.callbacks.CallbackList(callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1,
                                                     steps=batches.num_batches, model=self)
        if self._eval_batch is None:
            self._eval_batch = self._columns if self.run_eagerly else tf.function(self._columns, reduce_retracing=True,
                                                                                  autograph=False)
        callbacks.on_test_begin()
        columns = []
        with batches.catch_stop_iteration():
            for begin, end, iterator in batches:
                callbacks.on_test_batch_begin(begin)
                for _ in range(end - begin + 1):
                    data = next(iterator)
                    if not columns:
                        self._check_labels(*keras.utils.unpack_x_y_sample_weight(data)[1:])
                    columns.append([c.numpy() for c in self._eval_batch(data)])
                callbacks.on_test_batch_end(end, {})
        logs = self._evaluation_figures(columns)
        callbacks.on_test_end(logs)
        return logs if return_dict else self._flatten_metrics_in_order(logs)

    def _columns(self, data) -> List[tf.Tensor]:
        """A batch's (x, labels) -> per head (in `_heads` order; one output: its own) its outputs
        [b] and labels [b], float32."""
        x, labels, _ = keras.utils.unpack_x_y_sample_weight(data)
        outputs = self.inference(x)
        if self._heads is None:
            outputs, labels = {None: outputs}, {None: labels}
        return [tf.cast(tf.reshape(t[h], [-1]), tf.float32) for h in self._heads or [None] for t in (outputs, labels)]

    def _check_labels(self, labels, sample_weight=None):
        """One line unless `labels` are one tensor (one output) or a dict by head, and the data carry
        no `sample_weight`."""
        if sample_weight is not None:
            raise ConfigError(f"evaluate: model {self.name!r} weighs every sample alike (the exact AUC); its data "
                              f"carry sample weights: give it (x, labels)")
        if self._heads is None and isinstance(labels, dict):
            raise ConfigError(f"evaluate: model {self.name!r} gives one output; its labels are one tensor [b]")
        if self._heads is not None and (not isinstance(labels, dict) or sorted(labels) != self._heads):
            raise ConfigError(f"evaluate: model {self.name!r} takes labels as a dict by head "
                              f"({', '.join(self._heads)})")

    def _evaluation_figures(self, columns: List[List]) -> Dict[str, float]:
        """`evaluate`'s figures from every rank's `_columns` of its batches, computed on rank 0
        and given to every rank."""
        heads = self._heads or [None]
        local = np.concatenate([np.stack(c, axis=1) for c in columns]) if columns \
            else np.zeros([0, 2 * len(heads)], np.float32)
        gathered = self.comm.gather(local, "evaluation_columns")   # [all samples, 2 per head] on rank 0
        logs = None
        if self.comm.rank == 0:
            outputs = {h: tf.constant(gathered[:, 2 * i, None]) for i, h in enumerate(heads)}
            labels = {h: tf.constant(gathered[:, 2 * i + 1]) for i, h in enumerate(heads)}
            means = {h: np.mean(self._per_sample(self._per_sample_loss[h], labels[h], outputs[h]).numpy(),
                                dtype=np.float64) if len(gathered) else np.nan for h in heads}
            loss = sum(self._loss_weights[h] * means[h] for h in heads)
            self.reset_metrics()
            if self._heads is None:
                self._update_metrics(loss, {}, labels[None], outputs[None])
            else:
                self._update_metrics(loss, means, labels, outputs)
            logs = _python_figures(self.get_metrics_result())
            for i, h in enumerate(heads):   # the exact AUC over all samples, of a binary label's logit or if asked
                key = "auc" if h is None else f"{h}_auc"
                if key in logs or binary_loss(self._per_sample_loss[h]):
                    logs[key] = roc_auc(gathered[:, 2 * i + 1], gathered[:, 2 * i])
        return self.comm.broadcast_object(logs, "evaluation_figures")

    def step_on(self, x, labels, sample_weight=None):
        """One training step on this rank's inputs `x` and `labels` ([b]; several heads: a dict of
        [b] by head), each sample's loss times its `sample_weight` where given ([b], or a dict of
        [b] by head; fit's, as Keras'): (the global batch's mean loss [], its heads' ({head: []}; empty for one
        output), this rank's logits as the model gives them, float32). A frozen HybridEmbedding
        (Keras' `trainable` false) is looked up only: its tables get no gradients and no updates."""
        dense = self.dense_variables
        with tf.GradientTape() as tape:
            with contextlib.ExitStack() as stack:
                trained = [l for l in self.embedding_layers if l.trainable]   # frozen ones: plain lookups
                records = [stack.enter_context(l.recording(tape)) for l in trained]
                if self._xla is None:
                    logits = self(x, training=True)
                else:   # the lookups and exchanges (and what else precedes the dense part); the dense part below
                    embedded, watch = self._xla.embedded(x, training=True)
            if self._xla is None:
                loss, head_losses = self._loss_share(labels, logits, sample_weight)
                scaled = loss if self.loss_scale is None else loss * self.loss_scale.value
        late = [w.path for w in self.trainable_variables if w.value.ref() not in self.dense_optimizer.slots]
        if late:   # a layer built on its first call, after compile: no optimizer state, broadcast or checkpoint
            raise ConfigError(f"model {self.name!r}: weight {late[0]!r} was made after compile (a layer built on "
                              f"its first call); build each layer in __init__ before compile: layer.build(input_shape)")
        calls = []
        for layer, rec in zip(trained, records):
            if len(rec.calls) != 1:
                raise ConfigError(f"layer {layer.name!r}: called {len(rec.calls)} times in one forward; "
                                  f"a HybridEmbedding is called once per step")
            calls.append((layer,) + rec.calls[0])
        sources = [r for _, _, rows in calls for r in rows]
        if self._xla is None:
            grads = tape.gradient(scaled, sources + dense)
            row_grads, dense_grads = grads[:len(sources)], grads[len(sources):]
        else:
            loss, head_losses, logits, watched_grads, dense_grads = self._xla.forward_backward(embedded, watch, labels,
                                                                                               sample_weight)
            watched = [t for t, w in zip(keras.tree.flatten(embedded), watch) if w]
            # The chain rule through the part before the XLA one: the rows', and the Keras weights' used there.
            before = tape.gradient(watched, sources + dense, output_gradients=watched_grads)
            row_grads = before[:len(sources)]
            dense_grads = [g if b is None else b if g is None else g + b
                           for g, b in zip(dense_grads, before[len(sources):])]
        # A Keras weight read by a gather (a relative bias, a keras.layers.Embedding) takes IndexedSlices: dense here.
        dense_grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in dense_grads]
        table_grads, i = [], 0
        for layer, looked_up, rows in calls:
            table_grads.append(layer.gradients(looked_up, row_grads[i:i + len(rows)]))
            i += len(rows)
        flat_table_grads = [g for gs in table_grads for g in gs]
        # Every rank must agree on a non-finite step (to skip it under loss scaling, else to stop).
        heads = sorted(head_losses)
        reduced = self.comm.allreduce_sum(list(dense_grads) + [loss] + [head_losses[h] for h in heads]
                                          + [gradient_sum(flat_table_grads + dense_grads)], "dense_grads")
        n = len(dense_grads)
        loss, finite = reduced[n], tf.math.is_finite(reduced[-1])
        head_losses = dict(zip(heads, reduced[n + 1:-1]))
        dense_grads = reduced[:n]
        lr = self.learning_rate(self.global_step)
        if self.loss_scale is None:
            self._apply(calls, table_grads, dense_grads, lr)
            good = tf.logical_and(finite, tf.math.is_finite(loss))
        else:   # an overflowing step is skipped, not an error
            unscale = 1.0 / self.loss_scale.value
            table_grads = [[scale_gradient(g, unscale) for g in gs] for gs in table_grads]
            dense_grads = [scale_gradient(g, unscale) for g in dense_grads]
            tf.cond(finite, lambda: self._apply(calls, table_grads, dense_grads, lr), tf.no_op)
            self.loss_scale.update(finite)
            good = tf.math.is_finite(loss)
        first = tf.logical_and(tf.logical_not(good), self.first_nonfinite_step == 0)
        self.first_nonfinite_step.assign(tf.where(first, self.global_step + 1, self.first_nonfinite_step))
        self.first_nonfinite_loss.assign(tf.where(first, loss, self.first_nonfinite_loss))
        self.global_step.assign_add(1)
        return loss, head_losses, keras.tree.map_structure(lambda t: tf.cast(t, tf.float32), logits)

    def _apply(self, calls, table_grads, dense_grads, lr):
        """The updates of one step: every layer's tables (sparse), then the Keras weights."""
        for (layer, looked_up, _), gs in zip(calls, table_grads):
            multi_hot = any(f.sample is not None for f in looked_up.shard_ids + looked_up.replicated_ids)
            layer.embedding.apply_gradients(gs, lr, multi_hot)
        self.dense_optimizer.apply(zip(dense_grads, self.dense_variables), lr)
        return tf.no_op()

    def inference(self, x):
        """The model's outputs on this rank's inputs `x` for evaluation, float32 and computed in
        float32 (an AMP model's too: those of its float32 form with the same weights, as the
        built-in path evaluates); the dense part XLA-compiled under `compile(jit_compile=True)`."""
        if self._xla is not None:
            with _computing_in_float32(self):
                embedded, _ = self._xla.embedded(x, training=False)
            return self._xla.forward(embedded)
        with _computing_in_float32(self):
            outputs = self(x, training=False)
        return keras.tree.map_structure(lambda t: tf.cast(t, tf.float32), outputs)

    def check_finite(self):
        """Raises NonFiniteError, naming the step, its loss (where not finite, else its gradients)
        and learning rate, if a step so far had a non-finite loss or, without loss scaling,
        non-finite gradients. The run (run/loop.py) calls it at every progress line and before
        every save and evaluation; `fit` after every step."""
        step = int(self.first_nonfinite_step.numpy())
        if step:
            loss = float(self.first_nonfinite_loss.numpy())
            what = f"loss ({loss})" if not math.isfinite(loss) else "gradients"
            lr = float(self.learning_rate(step - 1))
            raise NonFiniteError(f"step {step}: non-finite {what} at learning rate {lr:g}; "
                                 f"training stopped, nothing saved from step {step} on")

    def fit(self, *args, callbacks=None, **kwargs):
        """keras.Model.fit, stopped with NonFiniteError after a step with a non-finite loss or
        gradients. With dynamic tables or sequence features, their counts join the logs every
        callback sees (progress bar, History, TensorBoard), after every batch and epoch: each dynamic
        table's "<table>/live", "/admitted", "/evicted", "/refused" (HybridEmbedding.dynamic_stats),
        each sequence's "<layer>/<feature>/truncated" (sequence_stats)."""
        layers = getattr(self, "embedding_layers", ())
        counted = any(t.kind == "dynamic" for layer in layers for t in layer.embedding.plan.tables) or \
            any(f.sequence for layer in layers for f in layer.features)
        first = [_TableCounts()] if counted else []
        return super().fit(*args, callbacks=first + list(callbacks or []) + [_StopOnNonFinite()], **kwargs)

    def dynamic_stats(self) -> Dict[str, int]:
        """Every dynamic table's counts, "<table>/<count>" (utils.logger.DYNAMIC_COUNTS), over every
        HybridEmbedding and rank ({} without dynamic tables; at N ranks a collective). After compile."""
        return {f"{table}/{k}": v for layer in self.embedding_layers
                for table, counts in layer.dynamic_stats().items() for k, v in counts.items()}

    def sequence_stats(self) -> Dict[str, int]:
        """Every sequence feature's "<layer>/<feature>/truncated": the ids dropped from histories
        longer than its L, over every rank ({} without sequences; at N ranks a collective)."""
        return {f"{name}/{k}": v for layer in self.embedding_layers
                for name, counts in layer.sequence_stats().items() for k, v in counts.items()}



def _functional_arguments(args, kwargs) -> bool:
    """Whether Model(...) is called as a functional model: Model(inputs, outputs)."""
    return len(args) == 2 or (len(args) == 1 and "outputs" in kwargs) or ("inputs" in kwargs and "outputs" in kwargs)


def _python_figures(logs: dict) -> dict:
    """Keras' metric results as Python numbers (a dict of them flattened in)."""
    out = {}
    for key, value in sorted(logs.items()):
        if isinstance(value, dict):
            out.update(_python_figures(value))
        else:
            try:
                out[key] = float(value)
            except (TypeError, ValueError):
                out[key] = value
    return out

class Model(_ProjectStep, keras.Model):
    """A keras.Model whose `fit` (and `train_on_batch`) runs the project's step over its
    `HybridEmbedding` layers (at least one, each called once a step; all on the same
    collectives); `evaluate` gives figures over every rank's samples, `predict` this rank's
    outputs (see `_ProjectStep.evaluate`). Outputs: logits
    [b] or [b, 1], or a dict of them by head (see `compile`). Subclass it (with `call`), or call
    it as `Model(inputs, outputs)`, which returns a `FunctionalModel` (Keras' own route for that,
    which rewrites the subclass's bases in place, would turn every later subclass of Model
    functional).

    A subclass writes `call`, or, to be XLA-compiled (`compile(jit_compile=True)`), its two
    halves instead: `embedding_call`, run outside XLA, and `dense_call`, compiled; its `call` is
    then `dense_call(embedding_call(inputs))`."""

    def __new__(cls, *args, **kwargs):
        if cls is Model and _functional_arguments(args, kwargs):
            return FunctionalModel(*args, **kwargs)
        return super().__new__(cls, *args, **kwargs)

    def call(self, inputs, training=False):
        """dense_call(embedding_call(inputs)): a subclass writing the halves, not call."""
        _has_halves(self)
        return self.dense_call(self.embedding_call(inputs, training=training), training=training)

    def embedding_call(self, inputs, training=False):
        """The first half of a subclass' forward: its HybridEmbedding calls on `inputs` (and
        anything else to run before them; Keras weights used here are trained too), giving what
        `dense_call` takes: a structure of tensors [b, ...] (not ragged), e.g. the embeddings
        and the numericals."""
        raise NotImplementedError

    def dense_call(self, embedded, training=False):
        """The second half: `embedding_call`'s result -> the model's outputs (as `call` gives
        them), with no HybridEmbedding; XLA-compiled, forward and backward, under
        `compile(jit_compile=True)`."""
        raise NotImplementedError


class FunctionalModel(_ProjectStep, Functional):
    """A functional Keras model (inputs, outputs) trained by the project's step (see `Model`)."""

    def dense_part(self) -> keras.Model:
        """The model after its embeddings, for export beside the tables: a functional keras.Model
        from the model's inputs that the outputs need beside the embeddings (the numericals, a
        sequence's ids read by a SequenceMask; not those only ids computed in the model read), in
        order, then every HybridEmbedding's outputs ([b, D_f] or a sequence's [b, L, D_f] each, as
        keras.tree.flatten orders them: a dict by feature name), to the model's outputs. It shares
        the Keras weights; `export(path)` writes it as a SavedModel."""
        layers = [l for l in self._flatten_layers() if isinstance(l, HybridEmbedding)]
        embedded = [t for l in layers for t in keras.tree.flatten(l.output)]
        inputs = [t for t in self.inputs if self.readers(t, exclude=HybridEmbedding)]
        inputs = [t for t in inputs if not _connected([x for x in inputs if x is not t] + embedded, self.outputs)]
        return keras.Model(inputs + embedded, self.outputs, name=f"{self.name}_dense")

    def readers(self, tensor, exclude=()) -> list:
        """The layers of the model (not `exclude`'s kind) called on `tensor` (a KerasTensor of it)."""
        return [op for op in self.operations if not isinstance(op, exclude) and
                any(id(t) == id(tensor) for node in op._inbound_nodes for t in keras.tree.flatten(node.input_tensors))]


def _connected(inputs: list, outputs: list) -> bool:
    """Whether `outputs` (KerasTensors) are computed from `inputs` alone."""
    try:
        keras.Model(inputs, outputs)
    except ValueError:
        return False
    return True


def _per_sample_loss(loss):
    """A Keras loss (its `call` gives per-sample values); "binary_crossentropy_from_logits": the default."""
    if loss == "binary_crossentropy_from_logits":
        loss = keras.losses.BinaryCrossentropy(from_logits=True)
    return keras.losses.get(loss)


# Keras' optimizers the step runs (their other settings at their defaults), by the step's name.
_KERAS_OPTIMIZERS = dict(zip(TABLE_OPTIMIZERS, (keras.optimizers.SGD, keras.optimizers.Adagrad, keras.optimizers.Adam)))


def _keras_optimizer(optimizer: keras.optimizers.Optimizer):
    """(name, learning rate: a float or its schedule, beta_1, beta_2) of Keras' SGD, Adagrad or
    Adam object as the step runs it (its epsilon 1e-7 and Adagrad's initial accumulator 0.1, as
    Keras'); a one-line ConfigError for another optimizer or a setting the step does not take."""
    name = next((n for n, kind in _KERAS_OPTIMIZERS.items() if type(optimizer) is kind), None)
    kind = type(optimizer).__name__
    if name is None:
        raise ConfigError(f"compile: the step updates the tables and weights by SGD, Adagrad or Adam; the optimizer "
                          f"is Keras' {kind}")
    config, defaults = optimizer.get_config(), _KERAS_OPTIMIZERS[name]().get_config()
    own = {"name", "learning_rate", "beta_1", "beta_2"}
    other = [k for k in config if k not in own and config[k] != defaults[k]]
    if other:
        raise ConfigError(f"compile: {kind}({other[0]}={config[other[0]]!r}) is not the step's {kind}, which takes "
                          f"learning_rate{', beta_1 and beta_2' if name == 'adam' else ''} only (its other "
                          f"settings at Keras' defaults)")
    rate = optimizer._learning_rate
    rate = rate if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) else float(rate.numpy())
    return name, rate, config.get("beta_1", 0.9), config.get("beta_2", 0.999)


@contextlib.contextmanager
def _computing_in_float32(*models: keras.Model):
    """Within: every layer of `models` that computes in floats computes in float32 (Keras' dtype
    policy "float32"; an AMP model's weights are float32 already; a layer giving ids, as
    HashedCrossing's int64, keeps its own); its own policies after."""
    layers = [l for l in {id(l): l for m in models for l in m._flatten_layers()}.values()
              if keras.backend.is_float_dtype(l.dtype_policy.compute_dtype)]
    policies = [l.dtype_policy for l in layers]
    try:
        for layer in layers:
            layer.dtype_policy = "float32"
        yield
    finally:
        for layer, policy in zip(layers, policies):
            layer.dtype_policy = policy


class _DenseSplit:
    """A model cut at its embeddings for XLA: `embedded(x, training)`, outside XLA, calls its
    HybridEmbedding layers and gives the dense part's inputs (a structure of tensors [b, ...]);
    the dense part, forward and backward, is one XLA-compiled function (`forward_backward`,
    `forward`). A functional model is cut by its graph (FunctionalModel.dense_part), a subclassed
    one by its halves (Model.embedding_call, Model.dense_call). Built by compile; a one-line
    ConfigError for a subclassed model without the halves. A functional model's HybridEmbedding
    may be fed ids computed from its inputs: that computation (`ids_part`) runs outside XLA with
    the lookups; the dense part recomputes from the inputs whatever else it takes of it."""

    def __init__(self, model, embed, dense, models):
        """`embed(x, training)` -> the dense part's inputs; `dense(embedded, training)` -> the model's
        outputs; `models`: those whose layers compute in float32 in `forward`."""
        self.model, self._embed, self._dense, self._models = model, embed, dense, models
        self.forward_backward = tf.function(self._forward_backward, jit_compile=True, autograph=False)
        self.forward = tf.function(self._forward, jit_compile=True, autograph=False)

    @classmethod
    def of(cls, model) -> "_DenseSplit":
        if not isinstance(model, FunctionalModel):
            if not _has_halves(model):
                raise ConfigError(f"compile: jit_compile (XLA) compiles a subclassed model's dense part, which it "
                                  f"writes as the halves embedding_call and dense_call (docs/models.md); model "
                                  f"{model.name!r} writes only call")
            return cls(model, model.embedding_call, model.dense_call, [model])
        position = {id(t): i for i, t in enumerate(model.inputs)}
        computed = [t for layer in model.embedding_layers for t in keras.tree.flatten(layer.input)
                    if id(t) not in position]
        ids = ids_part(model, computed, why="compile: jit_compile (XLA) runs the lookups before the dense part; ") \
            if computed else None
        dense = model.dense_part()
        n_other = len(dense.inputs) - sum(len(keras.tree.flatten(l.output)) for l in model.embedding_layers)
        other = [position[id(t)] for t in dense.inputs[:n_other]]

        def embed(x, training):   # the model's other inputs, then every HybridEmbedding's outputs
            flat = keras.tree.flatten(x)
            fed = {id(t): v for t, v in zip(model.inputs, flat)}
            if ids is not None:   # the ids computed in the model, from its inputs
                fed.update(zip(map(id, computed), keras.tree.flatten(ids(flat, training=training))))
            out = [layer(_as_called(layer, [fed[id(t)] for t in layer.call_inputs()]), training=training)
                   for layer in model.embedding_layers]
            return [_padded(flat[i]) for i in other] + keras.tree.flatten(out)

        def outputs(embedded, training):   # in the model's output structure (a dict by head: as the model's)
            return keras.tree.pack_sequence_as(model._outputs_struct,
                                               keras.tree.flatten(dense(embedded, training=training)))
        return cls(model, embed, outputs, [model, dense])

    def embedded(self, x, training: bool):
        """(the dense part's inputs from this rank's inputs `x`, whether each of them, flattened,
        takes a gradient: a floating tensor that is not one of `x`'s own); one line for a ragged one."""
        embedded = self._embed(x, training=training)
        given = {id(t) for t in keras.tree.flatten(x)}
        for i, t in enumerate(keras.tree.flatten(embedded)):
            if not isinstance(t, tf.Tensor):
                raise ConfigError(f"model {self.model.name!r}: the XLA-compiled dense part takes tensors [b, ...]; "
                                  f"input {i} of it (flattened) is a {type(t).__name__}")
        return embedded, tuple(t.dtype.is_floating and id(t) not in given for t in keras.tree.flatten(embedded))

    def _forward_backward(self, embedded, watch, labels, sample_weight=None):
        """The dense part on `embedded` (with `watch`, from `embedded()`): (loss share [], the heads'
        shares, outputs, the scaled loss' gradients w.r.t. the watched inputs and the Keras weights)."""
        model, dense = self.model, self.model.dense_variables
        watched = [t for t, w in zip(keras.tree.flatten(embedded), watch) if w]
        with tf.GradientTape() as tape:
            tape.watch(watched)
            outputs = self._dense(embedded, training=True)
            loss, head_losses = model._loss_share(labels, outputs, sample_weight)
            scaled = loss if model.loss_scale is None else loss * model.loss_scale.value
        grads = tape.gradient(scaled, watched + dense)
        return loss, head_losses, outputs, grads[:len(watched)], grads[len(watched):]

    def _forward(self, embedded):
        """The dense part's float32 outputs on `embedded`, computed in float32."""
        with _computing_in_float32(*self._models):
            outputs = self._dense(embedded, training=False)
        return keras.tree.map_structure(lambda t: tf.cast(t, tf.float32), outputs)


def _as_called(layer: HybridEmbedding, ids: list):
    """`ids` (in feature order) in the structure `layer` was called with: a dict by feature name, or a list."""
    return {f.name: t for f, t in zip(layer.features, ids)} if layer._dict_input else ids


def _padded(t):
    """An input of the XLA-compiled dense part: a ragged one (a sequence's ids, read by a
    SequenceMask) as dense [b, k], padded with -1; any other as it is."""
    return t.to_tensor(-1) if isinstance(t, tf.RaggedTensor) else t


def ids_part(model, computed, inputs=None, why: str = "") -> keras.Model:
    """The part of functional `model` that computes the tensors `computed` (ids [b] or [b, k] a
    HybridEmbedding is fed, computed from the model's inputs): a keras.Model from `inputs`
    (default `model.inputs`) to them, run before the lookups (outside XLA; in an export's lookup
    step); a one-line ConfigError, `why` beginning it, if it holds a HybridEmbedding (ids computed
    from looked-up rows). ValueError (Keras') if they need another input than `inputs`."""
    part = keras.Model(model.inputs if inputs is None else inputs, computed, name=f"{model.name}_ids")
    inside = [l.name for l in part._flatten_layers() if isinstance(l, HybridEmbedding)]
    if inside:
        raise ConfigError(f"{why}model {model.name!r} computes ids it looks up from layer {inside[0]!r}'s outputs")
    return part


def _has_halves(model) -> bool:
    """Whether a subclassed `model` writes the halves embedding_call and dense_call (not call);
    a one-line ConfigError for one half alone, or the halves and call."""
    written = [m for m in ("embedding_call", "dense_call", "call") if getattr(type(model), m) is not getattr(Model, m)]
    if written in (["embedding_call", "dense_call"], ["call"]):
        return written != ["call"]
    raise ConfigError(f"model {model.name!r} writes {' and '.join(written) or 'neither call nor the halves'}; a "
                      f"subclassed ranking.Model writes call, or the halves embedding_call and dense_call")


class _TableCounts(keras.callbacks.Callback):
    """Adds `Model.dynamic_stats` and `sequence_stats` to the logs of every batch and epoch (first of
    fit's callbacks)."""

    def on_train_batch_end(self, batch, logs=None):
        if logs is not None:
            logs.update(self.model.dynamic_stats())
            logs.update(self.model.sequence_stats())

    def on_epoch_end(self, epoch, logs=None):
        self.on_train_batch_end(epoch, logs)


class _StopOnNonFinite(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.model.check_finite()
