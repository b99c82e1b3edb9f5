"""The dataset's features as a model file sees them (`main.py --model=FILE`: docs/models.md).

Shapes: `b` this rank's samples, F categorical features, n numericals.

    def build_model(features: ranking.Features, hparams: dict) -> ranking.Model:
        x = features.inputs()         # {"numerical": [b, n] float32, "<feature>": [b] int64 or ragged [b, None]}
        emb = features.embedding(features.feature_configs(16))([x[f.name] for f in features])   # F x [b, 16]
        ...

The run makes `Features` from the dataset (the feature spec's categorical features in table order,
or cat_0.. of the synthetic data) and its own collectives, seed and placement flags, so that the
embedding `embedding` builds is planned over the run's ranks as the built-in models' is.
"""
import dataclasses
import importlib.util
import os
import traceback
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import keras

from parallel_embedding.planner import BudgetError, DynamicOptions
from ranking.config import FeatureConfig, TableConfig
from ranking.embedding import HybridEmbedding, TableGroup, TableStorage
from utils.errors import ConfigError

NUMERICAL = "numerical"   # the input of the n numerical features, [b, n] float32
BUILDER = "build_model"   # a model file's function: (Features, hparams dict) -> ranking.Model
COMPILE_ARGS = "compile_args"   # its optional function: (Features, hparams dict) -> compile's loss, loss_weights
# The losses main.py trains a head (or the one output) with, and the figure evaluating each: binary
# cross-entropy on a logit (a binary label): its AUC and logloss; mean squared error (a value: a rating): its RMSE.
HEAD_LOSSES = {"binary_crossentropy_from_logits": "auc", "mean_squared_error": "rmse"}


@dataclasses.dataclass(frozen=True)
class CategoricalFeature:
    """One categorical feature of the dataset: ids in [0, cardinality); `max_hotness` None for
    one id per sample, else up to that many (a ragged input); `dynamic`: the options of its
    dynamic table (the run's --dynamic_tables: raw int64 ids, `cardinality` its capacity), or None."""
    name: str
    cardinality: int
    max_hotness: Optional[int] = None
    dynamic: Optional[DynamicOptions] = None

    @property
    def multi_hot(self) -> bool:
        return self.max_hotness is not None


class Features:
    """The categorical features (iterate, or index by name), `num_numerical` and `labels` (the
    labels' names: one, "label", or several, each for a head named as it) of the run's
    dataset, with the run's embedding settings (`collectives`, `seed`, `placement`: the keyword
    arguments of HybridEmbedding's planner: strategy and thresholds; `storage`: the tiers, None
    for all in memory; `data_parallel_input`, `zeros_initializer`: HybridEmbedding's). The layers
    `embedding` makes are one TableGroup: one planner call over all their tables, made at the
    first use of one (or by `plan`), the storage's budgets the rank's for all of them. `tables`:
    the run's tables built (a parallel_embedding DistributedEmbedding on the run's one planner call: the built-in DLRM /
    DCNv2's), handed to the one layer `embedding` makes. `one_row_tables`: those layers' tables are
    built of one row each (TableGroup's `one_row`; the layers' `tables` keep the shapes the model
    gives them): the model of a checkpoint's export, which reads its tables from the checkpoint."""

    def __init__(self, categorical: Sequence[CategoricalFeature], num_numerical: int, *, collectives=None,
                 seed: int = 0, placement: Optional[dict] = None, storage: Optional[TableStorage] = None,
                 labels: Sequence[str] = ("label",), data_parallel_input: bool = True,
                 zeros_initializer: bool = False, tables=None, one_row_tables: bool = False):
        self.categorical = list(categorical)
        self.num_numerical = num_numerical
        self.labels = list(labels)
        self._by_name = {f.name: f for f in self.categorical}
        self._seed = seed
        self._group = TableGroup(collectives, storage, one_row=one_row_tables, **dict(placement or {}))
        self._layer_settings = dict(data_parallel_input=data_parallel_input, zeros_initializer=zeros_initializer)
        self._planned = False   # whether `embedding` has made a layer of the run's `tables`
        self.made_dynamic = set()   # the features with `dynamic` options feature_configs has made a table of
        self._tables = tables

    def __iter__(self) -> Iterator[CategoricalFeature]:
        return iter(self.categorical)

    def __len__(self) -> int:
        return len(self.categorical)

    def __getitem__(self, name: str) -> CategoricalFeature:
        if name not in self._by_name:
            raise ConfigError(f"feature {name!r} is not in the dataset (its features: {self.names_line()})")
        return self._by_name[name]

    @property
    def seed(self) -> int:
        """The run's seed (--seed): the built-in models' layers are seeded (seed, k)."""
        return self._seed

    @property
    def names(self) -> List[str]:
        return [f.name for f in self.categorical]

    def names_line(self) -> str:
        names = self.names
        return ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:3])}, ..., {names[-1]} ({len(names)})"

    def signature(self, model_file: str, hparams: dict, heads: Optional[Sequence[str]] = None,
                  optimizer: Optional[str] = None) -> dict:
        """What a checkpoint records of a model that `model_file`'s build_model(self, hparams) built
        (its manifest's "signature", which restoring and exporting check): the file's name, the
        hyper-parameters, the features' names, cardinalities and hotness, the numericals' count,
        the labels of a model with `heads` (None: one output) and, when given, the optimizer."""
        signature = {"model": os.path.basename(model_file), "hparams": dict(hparams), "features": self.names,
                     "cardinalities": [f.cardinality for f in self], "num_numerical": self.num_numerical,
                     "max_hotness": [f.max_hotness for f in self]}
        if heads is not None:
            signature["labels"] = list(self.labels)
        if optimizer is not None:
            signature["optimizer"] = optimizer
        return signature

    def inputs(self) -> Dict[str, keras.KerasTensor]:
        """keras.Input per input the run feeds: "numerical" [b, n] float32, then per feature its ids
        ([b] int64, or ragged [b, None] int64 for a multi-hot one), named as the feature."""
        out = {NUMERICAL: keras.Input((self.num_numerical,), dtype="float32", name=NUMERICAL)}
        for f in self.categorical:
            out[f.name] = keras.Input((None,), dtype="int64", ragged=True, name=f.name) if f.multi_hot \
                else keras.Input((), dtype="int64", name=f.name)
        return out

    def feature_configs(self, embedding_dim: Union[int, Sequence[int]], combiner: str = "sum",
                        names: Optional[Sequence[str]] = None, prefix: str = "") -> List[FeatureConfig]:
        """One FeatureConfig (and its own table of `cardinality` rows x `embedding_dim`, `combiner`
        over a multi-hot sample's ids; dynamic with the feature's `dynamic` options, its rows their
        capacity) per feature of `names` (default: all, in order), each named `prefix` + the
        feature's name (a prefix tells apart two tables of one feature).
        `embedding_dim`: one width, or one per feature of `names`."""
        out = []
        names = self.names if names is None else list(names)
        dims = [embedding_dim] * len(names) if isinstance(embedding_dim, int) else list(embedding_dim)
        if len(dims) != len(names):
            raise ConfigError(f"feature_configs: {len(dims)} embedding widths for {len(names)} features")
        for name, embedding_dim in zip(names, dims):
            f = self[name]
            rows = f.dynamic.capacity if f.dynamic else f.cardinality
            if f.dynamic:
                self.made_dynamic.add(f.name)
            table = TableConfig(name=prefix + f.name, vocabulary_size=rows, embedding_dim=embedding_dim,
                                combiner=combiner, dynamic=f.dynamic)
            shape = (None, f.max_hotness) if f.multi_hot else (None,)
            out.append(FeatureConfig(name=prefix + f.name, table=table, input_shape=shape,
                                     output_shape=(None, embedding_dim)))
        return out

    def history_configs(self, candidate: str, history: str, embedding_dim: int, max_length: int = 0,
                        combiner: str = "sum", pooled: bool = False) -> Tuple[FeatureConfig, FeatureConfig]:
        """The FeatureConfigs of a candidate item and of the history of items before it, over one
        table (the candidate's, as `feature_configs` makes it, `combiner` its): the history a
        sequence of `max_length` (0: its max_hotness; fewer keeps the most recent), [b, L, D], or
        with `pooled` one pooled row [b, D] (every id, by `combiner`; max_length then 0). Unless
        `candidate` is one-hot and `history` multi-hot over one vocabulary, both dynamic tables
        or neither: a one-line ConfigError naming them."""
        item, past = self[candidate], self[history]
        if item.multi_hot or not past.multi_hot or item.cardinality != past.cardinality or \
                (item.dynamic is None) != (past.dynamic is None):
            raise ConfigError(f"candidate {item.name!r} must be one-hot and history {past.name!r} multi-hot, over "
                              f"one vocabulary (cardinalities {item.cardinality}, {past.cardinality}), both dynamic "
                              f"tables or neither")
        if pooled and max_length:
            raise ConfigError(f"history {past.name!r}: pooled, it reads every id; max_length {max_length} is a "
                              f"sequence's")
        config = self.feature_configs(embedding_dim, combiner, names=[item.name])[0]
        if past.dynamic:
            self.made_dynamic.add(past.name)   # its raw ids are read by the candidate's dynamic table
        length = max_length or past.max_hotness
        return config, FeatureConfig(past.name, config.table, (None, length),
                                     (None, embedding_dim) if pooled else (None, length, embedding_dim))

    def sequence_configs(self, names: Sequence[str], embedding_dim: int, max_length: int = 0,
                         prefix: str = "") -> List[FeatureConfig]:
        """The FeatureConfigs of sequences over tables of their own, [b, L, D] each (L `max_length`,
        0: each feature's max_hotness), named `prefix` + the feature's name: a history's side
        features, aligned with its items (each item's category, its time gap; preproc.raw's
        aligned_with and gaps_of), read beside it. A one-hot feature among `names`: a one-line
        ConfigError naming it."""
        one_hot = [n for n in names if not self[n].multi_hot]
        if one_hot:
            raise ConfigError(f"feature {one_hot[0]!r} is one-hot: a sequence is a multi-hot feature")
        out = []
        for name, config in zip(names, self.feature_configs(embedding_dim, names=names, prefix=prefix)):
            length = max_length or self[name].max_hotness
            out.append(FeatureConfig(config.name, config.table, (None, length), (None, length, embedding_dim)))
        return out

    def embedding(self, feature_configs: Sequence[FeatureConfig], name: str = "embedding") -> HybridEmbedding:
        """A HybridEmbedding of `feature_configs` (called with their ids in the same order: a list
        in, a list of [b, D] out) on the run's ranks, placement, storage and seed. A model may have several,
        each of its own `name` (its tables' checkpoint names start with it). Its tables start as
        the built-in models' of the same seed and shapes; the run's `tables`, where given, are
        this layer's (a second layer: ConfigError)."""
        if self._tables is not None:
            if self._planned:
                raise ConfigError(f"layer {name!r}: the run's tables are built for one layer, made before it")
            self._planned = True
            return HybridEmbedding(list(feature_configs), embedding=self._tables, name=name)
        return HybridEmbedding(list(feature_configs), group=self._group, seed=(self._seed, 1000), name=name,
                               **self._layer_settings)

    def plan(self):
        """Plans the tables of the layers `embedding` made (one planner call; BudgetError naming
        them), if no use of one has yet."""
        if self._group.layers:
            self._group.plan()


def hyperparameters(given: dict, **defaults) -> dict:
    """A model file's hyper-parameters: `defaults` (name=default) updated by `given` (the
    builder's hparams). A name not in `defaults`, or a value not of its default's type (an int is
    a float; a list's items are not checked), is a one-line ConfigError naming it."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(f"hyper-parameter {unknown[0]!r} is not one of this model's ({', '.join(sorted(defaults))})")
    out = dict(defaults)
    for name, value in given.items():
        kind = type(defaults[name])
        ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(f"hyper-parameter {name!r} must be {kind.__name__} (like {defaults[name]!r}), "
                              f"got {value!r}")
        out[name] = value
    return out


def load_model_file(path: str):
    """(`build_model`, `compile_args` or None) of the Python file at `path`, each of them raising a
    one-line ConfigError where FILE's function exits (SystemExit, any code) or raises anything but a
    ConfigError or BudgetError (the run's own checks, which pass as they are). ConfigError too where
    FILE is not a .py file, importing it exits or raises, or it has no build_model."""
    name = "user_model_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ConfigError("not a Python file (its name ends in .py)")
    module = importlib.util.module_from_spec(spec)
    _guarded(spec.loader.exec_module, path, "importing it")(module)
    builder = getattr(module, BUILDER, None)
    if not callable(builder):
        raise ConfigError(f"defines no function {BUILDER}(features, hparams)")
    chosen = getattr(module, COMPILE_ARGS, None)
    return _guarded(builder, path, BUILDER), None if chosen is None else _guarded(chosen, path, COMPILE_ARGS)


def _guarded(function, path: str, what: str):
    """`function`, its exits and errors (but ConfigError, BudgetError) one-line ConfigErrors saying
    `what` exited or raised which exception, at which line of the file at `path`."""
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (ConfigError, BudgetError):
            raise
        except SystemExit as e:
            raise ConfigError(f"{what} exited (SystemExit({e.code!r})){_line_in(e, path)}; a model file returns "
                              f"its model, it never ends the process") from e
        except Exception as e:
            message = " ".join(str(e).split())   # one line
            raise ConfigError(f"{what} raised {type(e).__name__}{_line_in(e, path)}"
                              f"{f': {message}' if message else ''}") from e
    return call


def _line_in(error: BaseException, path: str) -> str:
    """" at line N": the last line of the file at `path` in `error`'s traceback ("" where it has none)."""
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
             if os.path.abspath(frame.filename) == os.path.abspath(path)]
    return f" at line {lines[-1]}" if lines else ""


def compile_args(chosen, features: Features, hparams: dict, heads: Optional[Sequence[str]]):
    """A model file's choice of compile's `loss`, `loss_weights` and `metrics` (`chosen`: its
    `compile_args` function, or None: binary cross-entropy, weight 1, for each head) for a model of
    `heads` (None: one output) -> (compile's keyword arguments {"loss", and "loss_weights" and
    "metrics" if chosen}, per output (each of `heads`, in order; or the one) the figure evaluating
    it: "auc" or "rmse", `_evaluated_by`). A loss is a Keras loss (an object or its name;
    HEAD_LOSSES' names too), one for every output or a dict by head; one on probabilities or over
    classes is a one-line ConfigError naming it. `metrics` as Keras' (a list, or a dict of lists
    by head), given as {output (None: the one): [keras.metrics.Metric]}."""
    given = dict(chosen(features, dict(hparams))) if chosen is not None else {}
    other = sorted(set(given) - {"loss", "loss_weights", "metrics"})
    if other:
        raise ConfigError(f"{COMPILE_ARGS} gives {other[0]!r}; it chooses compile's loss, loss_weights and metrics "
                          f"(the optimizer, learning rate, XLA and loss scale are the run's flags)")
    loss = given.get("loss", "binary_crossentropy_from_logits")
    outputs = [None] if heads is None else list(heads)
    if isinstance(loss, dict) and (heads is None or sorted(loss) != sorted(heads)):
        raise ConfigError(f"{COMPILE_ARGS}: loss names heads {', '.join(map(str, sorted(loss)))}; the model has "
                          + (f"the heads {', '.join(heads)}" if heads else "one output"))
    losses = loss if isinstance(loss, dict) else dict.fromkeys(outputs, loss)
    metrics = [_evaluated_by(losses[h], h) for h in outputs]
    out = {"loss": loss if heads is None or isinstance(loss, dict) else losses}
    if "loss_weights" in given:
        out["loss_weights"] = given["loss_weights"]
    if "metrics" in given:
        out["metrics"] = _metrics(given["metrics"], outputs)
    return out, metrics


def _metrics(given, outputs: List[Optional[str]]) -> Dict[Optional[str], list]:
    """compile_args' `metrics` (a list for every output, or a dict of lists by head) as Keras
    metrics by output; a one-line ConfigError for a head that is not the model's or no metric."""
    by_output = given if isinstance(given, dict) else dict.fromkeys(outputs, given)
    unknown = sorted(map(str, set(by_output) - set(outputs)))
    if unknown:
        raise ConfigError(f"{COMPILE_ARGS}: metrics name head {unknown[0]!r}; the model has "
                          + (f"the heads {', '.join(outputs)}" if outputs != [None] else "one output"))
    out = {}
    for output, metrics in by_output.items():
        out[output] = []
        for m in metrics if isinstance(metrics, (list, tuple)) else [metrics]:
            try:
                fn = keras.metrics.get(m)
            except ValueError:
                fn = None
            if fn is None:
                raise ConfigError(f"{COMPILE_ARGS}: metric {m!r} is not a Keras metric")
            if isinstance(m, str):   # named as given, as Keras' logs name it
                fn = type(fn)(name=m) if isinstance(fn, keras.metrics.Metric) else \
                    keras.metrics.MeanMetricWrapper(fn, name=m)
            elif not isinstance(fn, keras.metrics.Metric):
                fn = keras.metrics.MeanMetricWrapper(fn, name=fn.__name__)
            out[output].append(fn)
    return out


# Keras' losses by what they train one output per sample as, classes and functions (as their
# names give them, "mae", "huber": keras.losses.get): a logit of a binary label (evaluated by AUC
# and logloss; a cross-entropy only from logits), or a value (by RMSE). Others are refused.
L = keras.losses
_LOGIT_LOSSES = (L.BinaryCrossentropy, L.BinaryFocalCrossentropy, L.Hinge, L.SquaredHinge, L.hinge, L.squared_hinge)
_VALUE_LOSSES = (L.MeanSquaredError, L.MeanAbsoluteError, L.MeanSquaredLogarithmicError, L.MeanAbsolutePercentageError,
                 L.Huber, L.LogCosh, L.Poisson, L.mean_squared_error, L.mean_absolute_error,
                 L.mean_squared_logarithmic_error, L.mean_absolute_percentage_error, L.huber, L.log_cosh, L.poisson)
_PROBABILITY_LOSSES = (L.binary_crossentropy, L.binary_focal_crossentropy)   # functions: from_logits=False
del L


def _one_of(fn, kinds) -> bool:
    return any(fn is k or isinstance(k, type) and isinstance(fn, k) for k in kinds)


def binary_loss(loss) -> bool:
    """Whether a Keras loss (object or function) trains an output for a binary label, on logits
    or probabilities: one an AUC scores."""
    return _one_of(loss, _LOGIT_LOSSES + _PROBABILITY_LOSSES)


def _evaluated_by(loss, head: Optional[str]) -> str:
    """The figure ("auc" or "rmse") evaluating an output trained with `loss` (a Keras loss, its
    name, or one of HEAD_LOSSES); one line otherwise."""
    if isinstance(loss, str) and loss in HEAD_LOSSES:
        return HEAD_LOSSES[loss]
    try:
        fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    except ValueError:   # no Keras loss of that name
        fn = None
    on_logits = getattr(fn, "from_logits", True)
    probabilities = _one_of(fn, _PROBABILITY_LOSSES) or _one_of(fn, _LOGIT_LOSSES) and not on_logits
    if binary_loss(fn) and not probabilities:
        return "auc"
    if _one_of(fn, _VALUE_LOSSES):
        return "rmse"
    what = "the model's loss" if head is None else f"the loss of head {head!r}"
    why = "on probabilities (from_logits=False); the model gives logits" if probabilities \
        else "not one main.py trains one output per sample with"
    shown = repr(loss) if isinstance(loss, str) else f"keras.losses.{type(loss).__name__}"
    raise ConfigError(f"{COMPILE_ARGS}: {what} is {shown}, {why}: a logit of a binary label "
                      f"('binary_crossentropy_from_logits', keras.losses.BinaryFocalCrossentropy(from_logits=True), "
                      f"Hinge: evaluated by AUC) or a value ('mse', 'mae', Huber, ...: by RMSE)")
