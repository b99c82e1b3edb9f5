"""A model file's model in the run (--model=FILE): built from the dataset's features and its
hyper-parameters, compiled with the run's optimizer and schedule, and seen by the run through the
interface of the built-in path (nn.model.RankingModel's `embeddings`, nn.trainer.Trainer's step,
predict and checkpoint methods, nn.model_config.ModelConfig's `signature`), so that run/loop.py
and run/checkpoint_policy.py drive either alike.

The contract (docs/models.md): FILE defines `build_model(features, hparams) -> ranking.Model`,
`features` a ranking.Features, `hparams` a dict (--model_params, --model_param). The model takes
a dict: "numerical" [b, n] float32 and, per feature it names, ids [b] int64 (multi-hot: ragged
[b, None] int64); it gives one logit per sample ([b] or [b, 1]). Shapes: b this rank's samples.
"""
import os
from typing import List, Set

import keras
import numpy as np
import tensorflow as tf

from nn.lr_schedule import LearningRateSchedule
from ranking import CategoricalFeature, Features, HybridEmbedding, Model
from ranking.features import BUILDER, NUMERICAL, load_builder
from ranking.model import FunctionalModel
from run.config import RunConfig
from storage.checkpoint import Entry
from utils.errors import ConfigError


def dataset_features(cfg: RunConfig, comm) -> Features:
    """The run's dataset as a model file's builder sees it, on the run's ranks, seed and placement."""
    shape, p = cfg.data.shape, cfg.parallelism
    placement = dict(strategy=p.dist_strategy, column_slice_threshold=p.column_slice_threshold,
                     row_slice_threshold=p.row_slice_threshold, data_parallel_threshold=p.data_parallel_threshold)
    categorical = [CategoricalFeature(n, c, h) for n, c, h in zip(shape.names, shape.cardinalities, shape.max_hotness)]
    return Features(categorical, shape.num_numerical, collectives=comm, seed=cfg.seed, placement=placement)


class UserModel:
    """A model file's compiled ranking.Model (`keras_model`) as the run sees a model: `embeddings`
    (the loop's staged / store_stats / close: its tables live in memory, so staging is the
    identity and there are no store figures), `dense_variables`, `parameters`, `signature`.

    Built on every rank of `comm` from `cfg` (the same seed on every rank; compile gives every
    rank rank 0's Keras weights). Checks, before any data is read, each a one-line ConfigError:
    the builder exists and returns a ranking.Model with one HybridEmbedding on the run's ranks,
    its inputs are "numerical" and the dataset's features, and a forward of two samples gives one
    logit per sample."""

    def __init__(self, cfg: RunConfig, comm):
        path, training = cfg.model.model, cfg.training
        self.path, self.comm, self.hparams = path, comm, cfg.model.hparams
        self.features = dataset_features(cfg, comm)
        keras.utils.set_random_seed(cfg.seed)
        try:
            model = load_builder(path)(self.features, dict(self.hparams))
        except ConfigError as e:   # the builder's own (a hyper-parameter, a feature): named with the file
            raise ConfigError(f"--model={path}: {e}") from None
        where = f"--model={path}: {BUILDER}"   # the model it built is wrong
        if not isinstance(model, (Model, FunctionalModel)):
            raise ConfigError(f"{where} returned {type(model).__name__}, not a ranking.Model")
        layers = [l for l in model._flatten_layers() if isinstance(l, HybridEmbedding)]
        if len(layers) != 1:
            raise ConfigError(f"{where}: the model has {len(layers)} HybridEmbedding layers; it needs exactly one "
                              f"(features.embedding(...): one table optimizer and one checkpoint per model)")
        if layers[0].collectives is not comm:
            raise ConfigError(f"{where}: layer {layers[0].name!r} is not on the run's ranks; build it with "
                              "features.embedding(...)")
        self._input_names = self._check_inputs(model, where)
        self.keras_model = model
        self.embeddings = _Tables(layers[0])
        schedule = LearningRateSchedule(training.learning_rate, training.warmup_steps, training.decay_start_step,
                                        training.decay_steps)
        model.compile(optimizer=training.optimizer, learning_rate=schedule, beta_1=training.beta1,
                      beta_2=training.beta2, run_eagerly=cfg.runtime.run_eagerly)
        model.checkpoint_entries()   # a tensor named twice: refused now, not at the first save
        self._check_output(where)

    def _check_inputs(self, model, where: str):
        """The names of the dict a functional model takes (None: a subclassed one, given every input)."""
        if not isinstance(model, FunctionalModel):
            return None
        struct = model._inputs_struct
        if not isinstance(struct, dict):
            raise ConfigError(f"{where}: the model's inputs must be a dict by name ({NUMERICAL!r} and the "
                              f"dataset's features: features.inputs()), got a {type(struct).__name__}")
        for name in struct:
            if name != NUMERICAL:
                self.features[name]   # a feature the dataset lacks: one line naming it
        return list(struct)

    def inputs(self, numerical, categorical) -> dict:
        """The model's input dict from a batch of the run (numerical [b, n], F ids in feature order)."""
        x = {NUMERICAL: numerical}
        for f, ids in zip(self.features, categorical):
            x[f.name] = tf.cast(ids, tf.int64)
        return x if self._input_names is None else {name: x[name] for name in self._input_names}

    def logits(self, numerical, categorical) -> tf.Tensor:
        """Logits [b] float32 of this rank's batch (inference)."""
        out = self.keras_model(self.inputs(numerical, categorical), training=False)
        return tf.reshape(tf.cast(out, tf.float32), [-1])

    def _check_output(self, where: str):
        """A forward of two samples of id 0 on every rank must give 2 logits: one per sample."""
        numerical = tf.zeros([2, self.features.num_numerical], tf.float32)
        categorical = [tf.RaggedTensor.from_row_lengths(tf.zeros([2], tf.int64), [1, 1]) if f.multi_hot
                       else tf.zeros([2], tf.int64) for f in self.features]
        out = self.keras_model(self.inputs(numerical, categorical), training=False)
        shape = tuple(out.shape) if hasattr(out, "shape") else None
        if shape not in ((2,), (2, 1)):
            raise ConfigError(f"{where}: the model gives {shape if shape else type(out).__name__} for 2 samples; "
                              f"it must give one logit per sample ([b] or [b, 1])")

    @property
    def dense_variables(self) -> List[tf.Variable]:
        return self.keras_model.dense_variables

    @property
    def parameters(self) -> int:
        """Every rank's table parameters and the Keras weights."""
        tables = sum(t.vocabulary_size * t.embedding_dim for t in self.embeddings.layer.tables)
        return tables + int(sum(np.prod(v.shape) for v in self.dense_variables))

    def signature(self, optimizer=None) -> dict:
        """What a checkpoint must share with this model (its manifest's "signature"): the model
        file's name, its hyper-parameters, the dataset's features (names) and shape and, when
        given, the optimizer."""
        shape = self.features
        signature = {"model": os.path.basename(self.path), "hparams": self.hparams, "features": shape.names,
                     "cardinalities": [f.cardinality for f in shape], "num_numerical": shape.num_numerical,
                     "max_hotness": [f.max_hotness for f in shape]}
        if optimizer is not None:
            signature["optimizer"] = optimizer
        return signature


class _Tables:
    """The loop's view of a model file's embedding (nn.model.RankingModel.embeddings' staged,
    store_stats, close): its tables are in memory (--embedding_memory_budget_gb is refused)."""

    def __init__(self, layer: HybridEmbedding):
        self.layer = layer

    def input_rows(self, feature: int) -> str:
        """Every rank reads every feature of its own b samples (data-parallel input)."""
        return "local"

    def staged(self, elements, training: bool):
        return elements

    def store_stats(self) -> dict:
        return {}

    def close(self):
        pass


class UserTrainer:
    """The run's trainer (nn.trainer.Trainer's interface) over a UserModel: `train_step(numerical,
    categorical, labels) -> the global batch's mean loss`, `predict(numerical, categorical) ->
    logits [b]`, `step` and `schedule_origin` (the compiled ranking.Model's variables),
    `learning_rate`, `check_finite`, and the checkpoint entries and names."""

    def __init__(self, model: UserModel, run_eagerly: bool = False):
        self.model, self.keras_model = model, model.keras_model
        self.step = self.keras_model.global_step
        self.schedule_origin = self.keras_model.schedule_origin
        self.train_step = self._train_step if run_eagerly else tf.function(self._train_step, reduce_retracing=True)
        self.predict = model.logits if run_eagerly else tf.function(model.logits, reduce_retracing=True)

    def _train_step(self, numerical, categorical, labels):
        loss, _ = self.keras_model.step_on(self.model.inputs(numerical, categorical), labels)
        return loss

    def learning_rate(self, step) -> tf.Tensor:
        return self.keras_model.learning_rate(step)

    def check_finite(self):
        self.keras_model.check_finite()

    def checkpoint_entries(self, weights_only: bool = False) -> List[Entry]:
        return self.keras_model.checkpoint_entries(weights_only)

    def checkpoint_names(self, weights_only: bool = False) -> Set[str]:
        return self.keras_model.checkpoint_names(weights_only)

    def optional_names(self) -> Set[str]:
        """Tensors a checkpoint may lack: none."""
        return set()

    def broadcast_replicated(self):
        """Sets every rank's replicated state (Keras weights, replicated tables, slots, counters) to rank 0's."""
        self.model.comm.broadcast_variables([e.variable for e in self.checkpoint_entries() if e.replicated])
