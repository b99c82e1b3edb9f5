"""The run's model: a model file's (--model=FILE; dlrm.py / dcnv2.py: examples/dlrm.py /
dcnv2.py, run/assembly.py), built from the dataset's features and its hyper-parameters, compiled
with the run's optimizer and schedule, and seen by run/loop.py and run/checkpoint_policy.py
through `RunModel` (`embeddings`, `signature`) and `RunTrainer` (step, predict, checkpoint).

The contract (docs/models.md): FILE defines `build_model(features, hparams) -> ranking.Model`,
`features` a ranking.Features, `hparams` a dict (--model_params, --model_param). The model takes
a dict: "numerical" [b, n] float32 and, per feature it names, ids [b] int64 (multi-hot: ragged
[b, None] int64); it gives one logit per sample ([b] or [b, 1]), or, on data with H labels, a dict
of H heads named as the labels (features.labels), one logit per sample each, every head trained
on its label with the loss and weight FILE's optional `compile_args(features, hparams)` gives
(ranking.features.compile_args: binary cross-entropy, evaluated by AUC, the default; or mean
squared error, evaluated by RMSE), their weighted sum the loss. A subclassed model is called once
before compile, so that its Keras layers built on their first call have their weights at compile.
Shapes: b this rank's samples.
Under --amp the builder runs under Keras' mixed-precision policy of the run's compute dtype
(run.runtime.compute_dtype); --xla and --loss_scale go to the model's compile.

At N > 1 ranks without --data_parallel_input the input is model-parallel, as the built-in path's:
the run reads the global batch's ids of the features this rank's tables read, slices each rank's
[b] out of them for the model's inputs, and gives each HybridEmbedding its tables' ids (staged
into cache slots for tables on disk, at any N).
"""
import contextlib
from typing import Dict, List, Optional, Set, Union

import keras
import numpy as np
import tensorflow as tf

from nn.lr_schedule import LearningRateSchedule
from parallel_embedding.optimizers import slot_names
from parallel_embedding.planner import BudgetError
from ranking import CategoricalFeature, Features, HybridEmbedding, Model, TableStorage
from ranking.features import BUILDER, COMPILE_ARGS, NUMERICAL, compile_args, load_model_file
from ranking.model import FunctionalModel
from run.config import RunConfig
from run.runtime import batch_rows, compute_dtype
from storage.checkpoint import Entry
from utils.errors import ConfigError


def dataset_features(cfg: RunConfig, comm, tables=None) -> Features:
    """The run's dataset as a model file's builder sees it, on the run's ranks, seed, placement,
    input layout (--data_parallel_input; off: model-parallel input at N > 1), initial tables
    (--embedding_zeros_initializer) and storage (--embedding_memory_budget_gb: tables on disk; on
    a GPU, --cpu_offloading_threshold_gb: tables in host memory) and dynamic tables (--dynamic_tables:
    the features' options, which `feature_configs` gives their tables), as the built-in path's;
    `tables`: the run's tables built (the built-in models', run/assembly.py), handed to the model's
    layer."""
    shape, p, s = cfg.data.shape, cfg.parallelism, cfg.storage
    placement = dict(strategy=p.dist_strategy, column_slice_threshold=p.column_slice_threshold,
                     row_slice_threshold=p.row_slice_threshold, data_parallel_threshold=p.data_parallel_threshold)
    on_gpu = bool(tf.config.list_physical_devices("GPU"))
    host = s.cpu_offloading_threshold_gb * 2 ** 30 if s.cpu_offloading_threshold_gb is not None and on_gpu else None
    storage = None if s.embedding_memory_budget_gb is None and host is None else TableStorage(
        None if s.embedding_memory_budget_gb is None else max(1, int(s.embedding_memory_budget_gb * 2 ** 30)),
        batch_rows(cfg), len(slot_names(cfg.training.optimizer)), s.embedding_store_path, s.embedding_cache_policy,
        host)
    dynamic = cfg.dynamic_tables
    categorical = [CategoricalFeature(n, c, h, dynamic.get(i))
                   for i, (n, c, h) in enumerate(zip(shape.names, shape.cardinalities, shape.max_hotness))]
    return Features(categorical, shape.num_numerical, collectives=comm, seed=cfg.seed, placement=placement,
                    storage=storage, labels=shape.labels, data_parallel_input=p.data_parallel_input,
                    zeros_initializer=cfg.model.embedding_zeros_initializer, tables=tables)


class RunModel:
    """A model file's compiled ranking.Model (`keras_model`) as the run sees a model: `embeddings`
    (the loop's input_rows / staged / store_stats / close: _Tables), `dense_variables`,
    `table_variables`, `parameters`, `signature`.

    Built on every rank of `comm` from `cfg` (the model file `path` with `hparams`: default
    --model's with --model_params'; `tables`: the run's tables built, handed to its layer, as the
    built-in DLRM / DCNv2's, run/assembly.py) (the same seed on every rank; compile gives every
    rank rank 0's Keras weights), under --amp with Keras' policy "mixed_<compute_dtype>"
    (`compute_dtype`); --embedding_trainable=false freezes every HybridEmbedding (Keras'
    `trainable`). Checks, before any data is read, each a one-line ConfigError: the builder
    exists and returns a ranking.Model with HybridEmbedding layers on the run's ranks, its inputs
    are "numerical" and the dataset's features, a layer whose ids the run gives (model-parallel
    input, tables on disk) takes the model's inputs as they are, and a forward of two samples
    gives one logit per sample per head, its heads the data's labels by name (`heads`: in the
    order of the labels; None for one output on one label), each with a loss main.py evaluates
    (`head_metrics`: per output, in the order of `heads`, "auc" or "rmse").

    A batch of the run: numerical [b, n] and the F features' ids, each of the rows
    `embeddings.input_rows(f)` says ("global" [B] where a model-parallel layer's table on this
    rank reads it, else "local" [b]), then the staged table ids of the layers with tables on disk."""

    def __init__(self, cfg: RunConfig, comm, path: Optional[str] = None, hparams: Optional[dict] = None,
                 tables=None):
        path, training = path or cfg.model.model, cfg.training
        self.path, self.comm, self.hparams = path, comm, cfg.model.hparams if hparams is None else hparams
        self.labels = list(cfg.data.shape.labels)
        self.features = dataset_features(cfg, comm, tables)
        self.compute_dtype = compute_dtype(cfg)
        keras.utils.set_random_seed(cfg.seed)
        policy = keras.mixed_precision.global_policy()
        if self.compute_dtype != tf.float32:
            keras.mixed_precision.set_global_policy(f"mixed_{self.compute_dtype.name}")
        try:
            build, self._compile_args = load_model_file(path)
            model = build(self.features, dict(self.hparams))
            self.features.plan()   # one planner call over every layer's tables
        except ConfigError as e:   # the builder's own (a hyper-parameter, a feature): named with the file
            raise ConfigError(f"--model={path}: {e}") from None
        except BudgetError as e:
            raise ConfigError(f"--embedding_memory_budget_gb={cfg.storage.embedding_memory_budget_gb}: {e}") from None
        finally:
            keras.mixed_precision.set_global_policy(policy)
        where = f"--model={path}: {BUILDER}"   # the model it built is wrong
        if not isinstance(model, (Model, FunctionalModel)):
            raise ConfigError(f"{where} returned {type(model).__name__}, not a ranking.Model")
        layers = [l for l in model._flatten_layers() if isinstance(l, HybridEmbedding)]
        if not layers:
            raise ConfigError(f"{where}: the model has no HybridEmbedding layer; build one with "
                              "features.embedding(...)")
        for layer in layers:
            if layer.collectives is not comm:
                raise ConfigError(f"{where}: layer {layer.name!r} is not on the run's ranks; build it with "
                                  "features.embedding(...)")
            layer.trainable = training.embedding_trainable
        self._input_names = self._check_inputs(model, where)
        self._check_dynamic(model, layers, where)
        if isinstance(model, FunctionalModel):   # its heads are known before compile; a subclass' after a forward
            outputs = model._outputs_struct
            self._match_heads(sorted(outputs) if isinstance(outputs, dict) else None, where)
        self.keras_model = model
        self.embeddings = _Tables(layers, self._feeds(model, layers, where), len(self.features))
        if not isinstance(model, FunctionalModel):   # its Keras layers built (on first call) before compile
            self._check_output(where)
        empty = next((w for w in model.weights if 0 in tuple(w.shape)), None)
        if empty is not None:   # oneDNN aborts the process on a Dense over [b, 0]
            raise ConfigError(f"{where}: weight {empty.path!r} has shape {tuple(empty.shape)}: a layer over a "
                              f"zero-width input ({NUMERICAL!r} is [b, 0] on data without numerical features: "
                              "leave it out where features.num_numerical is 0)")
        schedule = LearningRateSchedule(training.learning_rate, training.warmup_steps, training.decay_start_step,
                                        training.decay_steps)
        try:
            chosen, self.head_metrics = compile_args(self._compile_args, self.features, self.hparams, self.heads)
        except ConfigError as e:
            raise ConfigError(f"--model={path}: {e}") from None
        self._metrics = chosen.pop("metrics", {})   # evaluated by the run (metric_figures), not by Keras' fit
        if cfg.checkpoints.keep_best_checkpoint and "auc" not in self.head_metrics:
            raise ConfigError(f"--keep_best_checkpoint chooses by an output's {cfg.checkpoints.keep_best_metric}; "
                              f"--model={path} evaluates no output by AUC and logloss (its {COMPILE_ARGS} trains each "
                              f"as a value, evaluated by RMSE)")
        try:   # --xla of a subclassed model, for one
            model.compile(optimizer=training.optimizer, learning_rate=schedule, beta_1=training.beta1,
                          beta_2=training.beta2, run_eagerly=cfg.runtime.run_eagerly, jit_compile=cfg.runtime.xla,
                          loss_scale=cfg.runtime.loss_scale, **chosen)
        except ConfigError as e:   # the tables' own (a store path, its space) name no file of dlrm.py's
            raise ConfigError(f"{where}: {e}" if tables is None else str(e)) from None
        model.checkpoint_entries()   # a tensor named twice: refused now, not at the first save
        if isinstance(model, FunctionalModel):
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

    def _check_dynamic(self, model, layers: List[HybridEmbedding], where: str):
        """--dynamic_tables: every feature it names has a table made by `features.feature_configs`
        (which makes it dynamic), and (a functional model) no static table reads such a feature's
        ids (raw ids, or ids the flag asks a dynamic table for): one-line ConfigErrors."""
        flagged = [f.name for f in self.features if f.dynamic]
        unused = [name for name in flagged if name not in self.features.made_dynamic]
        if unused:
            raise ConfigError(f"--dynamic_tables: {where} makes no table of feature {unused[0]!r} with "
                              "features.feature_configs(...), which makes its table dynamic")
        if not flagged or self._input_names is None:
            return
        names = {id(t): name for name, t in model._inputs_struct.items()}
        for layer in layers:
            for f, t, x in zip(layer.features, layer.table_of, layer.call_inputs()):
                name = names.get(id(x))
                if name in flagged and not layer.tables[t].dynamic:
                    raise ConfigError(f"--dynamic_tables: feature {name!r} (dynamic) is read by the static table "
                                      f"{layer.tables[t].name!r} of layer {layer.name!r} in {where}; make its table "
                                      "with features.feature_configs(...)")

    def _feeds(self, model, layers: List[HybridEmbedding], where: str) -> List[Optional[List[int]]]:
        """Per layer, None where it takes its ids from its inputs, else (tables on disk, whose ids
        the run stages, or model-parallel input) per input of the layer the index of the dataset's
        feature it reads."""
        names = {id(t): name for name, t in model._inputs_struct.items()} if self._input_names is not None else {}
        index = {f.name: i for i, f in enumerate(self.features)}
        feeds = []
        for layer in layers:
            if not layer.embedding.tiered and not layer.model_parallel_input:
                feeds.append(None)
                continue
            why = ("--embedding_memory_budget_gb puts tables on disk, whose ids the run stages from the data"
                   if layer.embedding.tiered else "model-parallel input (--data_parallel_input off) gives the layer "
                   "its tables' ids of the global batch from the data")
            fix = "" if layer.embedding.tiered else ", or give --data_parallel_input"
            inputs = layer.call_inputs() if names else [None] * len(layer.features)
            for f, t in zip(layer.features, inputs):
                if names.get(id(t)) not in index:
                    raise ConfigError(f"{why}: feature {f.name!r} of layer {layer.name!r} must take one of "
                                      f"{where}'s inputs (features.inputs()) as it is{fix}")
            feeds.append([index[names[id(t)]] for t in inputs])
        return feeds

    def inputs(self, numerical, categorical) -> dict:
        """The model's input dict from a batch of the run (numerical [b, n], the F features' ids
        as `embeddings.input_rows` reads them: each feature's [b] ids of this rank's samples)."""
        x = {NUMERICAL: numerical}
        local = self.embeddings.local_ids(categorical, tf.shape(numerical)[0])
        for f, ids in zip(self.features, local):
            x[f.name] = tf.cast(ids, tf.int64)
        return x if self._input_names is None else {name: x[name] for name in self._input_names}

    @contextlib.contextmanager
    def given(self, numerical, categorical):
        """Within: each layer whose ids the run gives looks them up (the staged table ids after the
        F features' of `categorical`, a batch of the run; without them, its ids of the batch)."""
        with contextlib.ExitStack() as stack:
            for layer, ids in self.embeddings.table_ids(categorical, tf.shape(numerical)[0]):
                stack.enter_context(layer.given_table_ids(ids))
            yield

    def logits(self, numerical, categorical) -> tf.Tensor:
        """Logits [b] float32 of this rank's batch ([b, H] for H `heads`, in their order;
        inference: computed in float32 under --amp, the dense part XLA-compiled under --xla:
        ranking.Model.inference)."""
        with self.given(numerical, categorical):
            out = self.keras_model.inference(self.inputs(numerical, categorical))
        if self.heads is None:
            return tf.reshape(out, [-1])
        return tf.stack([tf.reshape(out[head], [-1]) for head in self.heads], axis=1)

    def head_labels(self, labels) -> Union[tf.Tensor, Dict[str, tf.Tensor]]:
        """A batch's labels as the model takes them: [b], or for H `heads` ([b, H]) a dict of [b] by head."""
        return labels if self.heads is None else {head: labels[:, h] for h, head in enumerate(self.heads)}

    def _match_heads(self, heads: Optional[List[str]], where: str):
        """Sets `heads` from the model's (None: one output), which must be the data's labels by
        name: one output for one label, a head per label for several (one-line ConfigErrors)."""
        labels = ", ".join(self.labels)
        if heads is not None and len(self.labels) == 1:
            raise ConfigError(f"{where}: the model has heads ({', '.join(heads)}); the data have one label "
                              f"({labels}): give one logit per sample, or train on data with a label per head "
                              f"(a feature spec's label channel, --synthetic_labels)")
        if heads is not None and heads != sorted(self.labels):
            raise ConfigError(f"{where}: the model's heads ({', '.join(heads)}) are not the data's labels "
                              f"({labels}): give a head per label, named as it (features.labels)")
        if heads is None and len(self.labels) > 1:
            raise ConfigError(f"{where}: the model gives one output; the data have labels {labels}: give a head "
                              f"per label, named as it (a dict of outputs by features.labels)")
        self.heads = None if heads is None else list(self.labels)

    @property
    def metric_names(self) -> List[str]:
        """The figures compile_args' metrics give (`metric_figures`), "<head>_<name>" for a head."""
        return [_metric_name(output, m) for output, metrics in self._metrics.items() for m in metrics]

    def metric_figures(self, logits: np.ndarray, labels: np.ndarray) -> Dict[str, float]:
        """compile_args' Keras metrics of the outputs' logits and labels [n, H] (H outputs, in the
        order of `heads`), by `metric_names`."""
        figures = {}
        for h, output in enumerate(self.heads or [None]):
            for m in self._metrics.get(output, []):
                m.reset_state()
                m.update_state(labels[:, h], logits[:, h])
                figures[_metric_name(output, m)] = float(m.result())
        return figures

    def _check_output(self, where: str):
        """A forward of two samples of id 0 on every rank must give 2 logits per head: one logit
        for one label, a head per label named as it (any order) for several; sets `heads`. A
        subclassed model's runs before compile, through its `call` (outside the model's name
        scope): Keras layers built on their first call get their weights now, named as if built
        in `__init__`, so that compile's optimizer, broadcast and checkpoint entries hold them."""
        numerical = tf.zeros([2, self.features.num_numerical], tf.float32)
        n = self.comm.size
        rows = [2 * n if self.embeddings.input_rows(i) == "global" else 2 for i in range(len(self.features))]
        categorical = [tf.RaggedTensor.from_row_lengths(tf.zeros([r], tf.int64), [1] * r) if f.multi_hot
                       else tf.zeros([r], tf.int64) for f, r in zip(self.features, rows)]
        model = self.keras_model
        forward = model if isinstance(model, FunctionalModel) else model.call
        with self.given(numerical, categorical):
            out = forward(self.inputs(numerical, categorical), **({"training": False} if forward is model or
                                                                   model._call_has_training_arg else {}))
        self._match_heads(sorted(out) if isinstance(out, dict) else None, where)
        for head, logits in (out.items() if isinstance(out, dict) else [(None, out)]):
            shape = tuple(logits.shape) if hasattr(logits, "shape") else None
            if shape not in ((2,), (2, 1)):
                what = "the model" if head is None else f"head {head!r}"
                raise ConfigError(f"{where}: {what} gives {shape if shape else type(logits).__name__} for 2 samples; "
                                  f"it must give one logit per sample ([b] or [b, 1])")

    @property
    def dense_variables(self) -> List[tf.Variable]:
        return self.keras_model.dense_variables

    @property
    def table_variables(self) -> List[tf.Variable]:
        """This rank's table variables, layer by layer (HybridEmbedding.table_variables)."""
        return [v for layer in self.embeddings.layers for v in layer.table_variables]

    @property
    def parameters(self) -> int:
        """Every rank's table parameters and the Keras weights."""
        tables = sum(t.vocabulary_size * t.embedding_dim for layer in self.embeddings.layers for t in layer.tables)
        return tables + int(sum(np.prod(v.shape) for v in self.dense_variables))

    def table_bytes(self, rank: int) -> int:
        """Bytes of `rank`'s table parameters (shards and replicated tables: Plan.bytes_on), all layers."""
        return sum(layer.embedding.plan.bytes_on(rank) for layer in self.embeddings.layers)

    def signature(self, optimizer=None) -> dict:
        """What a checkpoint must share with this model (its manifest's "signature"): the model
        file's name, its hyper-parameters, the dataset's features (names) and shape (and, for a
        model with heads, the labels) and, when given, the optimizer."""
        return self.features.signature(self.path, self.hparams, self.heads, optimizer)


def _metric_name(output: Optional[str], metric) -> str:
    """A compile_args metric's figure: its name, "<head>_<name>" for a head's."""
    return metric.name if output is None else f"{output}_{metric.name}"


class _Tables:
    """The loop's view of a model file's embeddings, its HybridEmbedding `layers` (input_rows,
    staged, store_stats, close). `feeds`: per layer, None (it takes its ids from its
    inputs) or, for a layer whose ids the run gives (tables on disk, model-parallel input), per
    input of the layer the index of the dataset's feature it reads; F: the dataset's features."""

    def __init__(self, layers: List[HybridEmbedding], feeds: List[Optional[List[int]]], num_features: int):
        self.layers, self._feeds, self._num_features = layers, feeds, num_features
        self._global = set()   # the dataset's features a model-parallel layer's table on this rank reads
        for layer, feed in zip(layers, feeds):
            if feed is not None and layer.model_parallel_input:
                self._global |= {i for i, t in zip(feed, layer.table_of) if layer.input_rows(t) == "global"}
        self._staging = [l for l, feed in zip(layers, feeds) if feed is not None and l.embedding.tiered]

    def input_rows(self, feature: int) -> str:
        """The rows of `feature` this rank reads: "global" ([B]) where a table on this rank of a
        model-parallel layer reads it, else "local" ([b]: every feature, for the model's inputs)."""
        return "global" if feature in self._global else "local"

    def local_ids(self, categorical, b) -> list:
        """The F features' ids of a batch -> each one's ids of this rank's b samples ([b] or [b, None])."""
        rank = self.layers[0].collectives.rank
        return [ids[rank * b:(rank + 1) * b] if f in self._global else ids
                for f, ids in enumerate(categorical[:self._num_features])]

    def _layer_ids(self, layer: HybridEmbedding, feed: List[int], categorical, b) -> list:
        """One layer's table ids of a batch (HybridEmbedding.table_ids: per table its features'
        ids, of the rows `input_rows` says; a table not on this rank gets the local ones, ignored)."""
        local = self.local_ids(categorical, b)
        return layer.table_ids([categorical[i] if layer.input_rows(t) == "global" else local[i]
                                for i, t in zip(feed, layer.table_of)])

    def table_ids(self, categorical, b) -> list:
        """(layer, its table ids) of every layer whose ids the run gives: the staged ones after the
        F features' of `categorical` for layers with tables on disk, if there, else its ids of the batch."""
        out, staged = [], list(categorical[self._num_features:])
        for layer, feed in zip(self.layers, self._feeds):
            if feed is None:
                continue
            if layer in self._staging and staged:
                out.append((layer, staged[:len(layer.tables)]))
                staged = staged[len(layer.tables):]
            else:
                out.append((layer, self._layer_ids(layer, feed, categorical, b)))
        return out

    def staged(self, elements, training: bool):
        """Elements (numerical, F ids, ...) -> (numerical, F ids + each layer with tables on
        disk's T table ids as cache slots, in layer order, ...), each layer's staged one element
        ahead (DistributedEmbedding.staged); without tables on disk, `elements` itself."""
        for layer in self._staging:
            elements = self._staged_by(layer, elements, training)
        return elements

    def _staged_by(self, layer: HybridEmbedding, elements, training: bool):
        feed = self._feeds[self.layers.index(layer)]

        def with_table_ids():
            for e in elements:
                ids = self._layer_ids(layer, feed, e[1], tf.shape(e[0])[0])
                yield (e[0], tuple(ids), tuple(e[1])) + tuple(e[2:])
        return ((e[0], e[2] + e[1]) + tuple(e[3:]) for e in layer.embedding.staged(with_table_ids(), training))

    def store_stats(self) -> dict:
        """The disk tiers' figures since the last call (of several layers with tables on disk,
        their sums, and the lowest cache hit rate), every dynamic table's counts ("<table>/live",
        ...: HybridEmbedding.dynamic_stats) and every sequence's "<layer>/<feature>/truncated"
        (sequence_stats; both at N ranks a collective); {} without any."""
        stats = [layer.embedding.tiered.stats() for layer in self._staging]
        out = stats[0] if len(stats) == 1 else {} if not stats else {
            k: min(s[k] for s in stats) if k == "cache_hit_rate" else sum(s[k] for s in stats) for k in stats[0]}
        for layer in self.layers:
            out.update({f"{table}/{k}": v for table, counts in layer.dynamic_stats().items() for k, v in counts.items()})
            out.update({f"{name}/{k}": v for name, counts in layer.sequence_stats().items() for k, v in counts.items()})
        return out

    def close(self):
        for layer in self.layers:
            layer.embedding.close()


class RunTrainer:
    """The run's trainer over a RunModel: `train_step(numerical, categorical, labels) -> the
    global batch's mean loss` (a model with heads, labels [b, H]: a dict of it, "loss", and each
    head's, "<head>_loss"), `predict(numerical, categorical) -> logits [b]` ([b, H]), `step` and
    `schedule_origin` (the compiled ranking.Model's variables), `loss_scale` (ranking.precision.LossScale,
    None: no loss scaling), `learning_rate`, `check_finite`, and the checkpoint entries and names."""

    def __init__(self, model: RunModel, run_eagerly: bool = False):
        self.model, self.keras_model = model, model.keras_model
        self.step = self.keras_model.global_step
        self.schedule_origin = self.keras_model.schedule_origin
        self.loss_scale = self.keras_model.loss_scale
        traced = dict(reduce_retracing=True, autograph=False)
        self.train_step = self._train_step if run_eagerly else tf.function(self._train_step, **traced)
        self.predict = model.logits if run_eagerly else tf.function(model.logits, **traced)

    def _train_step(self, numerical, categorical, labels):
        with self.model.given(numerical, categorical):
            loss, heads, _ = self.keras_model.step_on(self.model.inputs(numerical, categorical),
                                                      self.model.head_labels(labels))
        return loss if not heads else dict(loss=loss, **{f"{head}_loss": heads[head] for head in self.model.heads})

    def learning_rate(self, step) -> tf.Tensor:
        return self.keras_model.learning_rate(step)

    def check_finite(self):
        self.keras_model.check_finite()

    def checkpoint_entries(self, weights_only: bool = False) -> List[Entry]:
        return self.keras_model.checkpoint_entries(weights_only)

    def checkpoint_names(self, weights_only: bool = False) -> Set[str]:
        return self.keras_model.checkpoint_names(weights_only)

    def optional_names(self) -> Set[str]:
        """Tensors a checkpoint may lack (ranking.Model.optional_checkpoint_names)."""
        return self.keras_model.optional_checkpoint_names()

    def broadcast_replicated(self):
        """Sets every rank's replicated state (Keras weights, replicated tables, slots, counters) to rank 0's."""
        self.model.comm.broadcast_variables([e.variable for e in self.checkpoint_entries() if e.replicated])
