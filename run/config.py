"""Run configuration: one validated, typed view of the command-line flags (`RunConfig`: --mode,
--seed and the settings in groups, each field named as its flag).

Pure Python (no TensorFlow), so flag errors are reported in a fraction of a second and the
rules can be tested without a model. The rules are tables in groups (`_check`); every rule raises
`ConfigError` with one line that names the offending flag(s).
"""
import dataclasses
import json
import math
import os
from typing import Dict, List, Optional, Sequence, Set, Tuple

import yaml

from dataloading.feature_spec import FeatureSpec
from dataloading.synthetic import HISTORY as SYNTHETIC_HISTORY, label_names as synthetic_label_names, with_history
from nn.model_config import table_combiners
from parallel_embedding.choices import COMBINERS, OPTIMIZERS
from parallel_embedding.planner import DYNAMIC_POLICIES, STRATEGIES, DynamicOptions, PlanError
from storage.row_cache import POLICIES
from utils.errors import ConfigError

MODES = ("train", "eval", "inference")
# dot_custom: dot, forcing the custom op; dot_tensorflow (the reference's name): dot on TensorFlow ops, never the op
INTERACTIONS = ("dot", "dot_custom", "dot_tensorflow", "cross")
INTERACTION_ALIASES = {"dot_custom_cuda": "dot_custom"}   # the reference's name for ours
DATASET_TYPES = ("split_binary", "synthetic", "split_tfrecords", "tf_raw")
FILE_DATASETS = ("split_binary", "split_tfrecords")   # tf_raw: the reference's name for split_binary's files
DIST_STRATEGIES = STRATEGIES
RESTORE_MODES = ("resume", "continue", "weights")
LR_SCHEDULE_RESTORES = ("restart", "continue")
BEST_METRICS = ("auc", "logloss")   # --keep_best_metric: higher, lower is better
CACHE_POLICIES = POLICIES   # eviction of the disk tier's caches (storage/row_cache.py)


@dataclasses.dataclass(frozen=True)
class DatasetShape:
    """What the model needs to know of the data: per categorical feature its cardinality and
    max_hotness (None: one-hot), and the number of numerical features; `names`: the categorical
    features' names (the feature spec's; synthetic data: cat_0, cat_1, ...); `labels`: the labels'
    names (the feature spec's; synthetic data: label, label_1, ...: --synthetic_labels); `raw_ids`:
    the features with raw ids (preprocessed with --raw_id_columns); `distinct_ids`: per raw-id feature
    the distinct ids of its training rows (preprocessing's estimate, in the spec's metadata);
    `aliases`: other names of features ({"C1": "cat_0"}: the Criteo columns preprocessing read)."""
    cardinalities: List[int]
    num_numerical: int
    max_hotness: List[Optional[int]]
    names: Optional[List[str]] = None
    labels: List[str] = dataclasses.field(default_factory=lambda: synthetic_label_names(1))
    raw_ids: Tuple[str, ...] = ()
    distinct_ids: Dict[str, int] = dataclasses.field(default_factory=dict)
    aliases: Dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.names is None:
            object.__setattr__(self, "names", [f"cat_{k}" for k in range(len(self.cardinalities))])


# The settings of a run in groups, each field named as its flag (the flag's help is in run/flags.py).

@dataclasses.dataclass(frozen=True)
class DataSettings:
    """The data a run reads: the dataset's type, its files or the synthetic data's flags; `shape`
    is derived (from the synthetic flags or the feature spec)."""
    dataset_type: str
    dataset_path: str
    synthetic_cardinalities: List[int]
    synthetic_num_numerical: int
    synthetic_rows: int
    synthetic_eval_rows: int
    synthetic_alpha: float
    feature_spec: str = ""
    train_mapping: str = "train"
    eval_mapping: str = "test"
    validate_dataset: bool = False
    synthetic_labels: int = 1
    synthetic_history_length: int = 0
    shape: Optional[DatasetShape] = None

    @property
    def num_categorical(self) -> int:
        return len(self.shape.cardinalities)

    @property
    def cardinalities(self) -> List[int]:
        return list(self.shape.cardinalities)

    @property
    def num_numerical(self) -> int:
        return self.shape.num_numerical

    @property
    def max_hotness(self) -> List[Optional[int]]:
        return list(self.shape.max_hotness)

    @property
    def feature_spec_path(self) -> str:
        return feature_spec_path(self.dataset_path, self.feature_spec)


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The model's shape (and its tables' initial values), or a model file (--model) and its
    hyper-parameters (--model_params, --model_param: `hparams`)."""
    embedding_dims: List[int]
    bottom_mlp_dims: List[int]
    top_mlp_dims: List[int]
    interaction: str
    num_cross_layers: int
    cross_layer_projection_dim: int
    multi_hot_combiner: Optional[str] = None
    embedding_zeros_initializer: bool = False
    dynamic_tables: Sequence[str] = ()
    model: str = ""
    model_params: str = ""
    model_param: Sequence[str] = ()

    @property
    def hparams(self) -> dict:
        """The model file's hyper-parameters (`model_hparams`)."""
        return model_hparams(self.model, self.model_params, self.model_param)


@dataclasses.dataclass(frozen=True)
class TrainingSettings:
    """How training goes: batches and their order, the optimizer and its learning-rate schedule."""
    batch_size: int
    epochs: int
    max_steps: int
    learning_rate: float
    optimizer: str
    beta1: float
    beta2: float
    warmup_steps: int
    decay_start_step: int
    decay_steps: int
    shuffle_batch_order: bool = True
    train_last_partial_batch: bool = False
    embedding_trainable: bool = True


@dataclasses.dataclass(frozen=True)
class EvaluationSettings:
    """Evaluation (--mode=eval, and during training) and inference timing (--mode=inference)."""
    valid_batch_size: int
    evals_per_epoch: int
    inference_batch_sizes: List[int]
    inference_steps: int
    auc_thresholds: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """Where checkpoints are written and kept, and what a restore takes from one."""
    save_checkpoint_path: str
    restore_checkpoint_path: str
    checkpoint_every_n_steps: int
    keep_checkpoints: int = 2
    keep_best_checkpoint: bool = False
    keep_best_metric: str = "auc"
    skip_checkpoint_checksums: bool = False
    restore_mode: str = "resume"
    restore_lr_schedule: str = "restart"


@dataclasses.dataclass(frozen=True)
class ParallelismSettings:
    """The tables' placement over the ranks (parallel_embedding.planner) and the input's layout."""
    dist_strategy: str
    column_slice_threshold: Optional[int]
    row_slice_threshold: Optional[int]
    data_parallel_threshold: Optional[int]
    data_parallel_input: bool


@dataclasses.dataclass(frozen=True)
class StorageSettings:
    """The tables' storage tiers: host memory, disk with in-memory caches (run.runtime.embedding_plan)."""
    cpu_offloading_threshold_gb: Optional[int] = None
    embedding_memory_budget_gb: Optional[float] = None
    embedding_store_path: Optional[str] = None
    embedding_cache_policy: str = "lru"


@dataclasses.dataclass(frozen=True)
class RuntimeSettings:
    """How the run computes and reports: precision, compilation, TensorFlow's process-wide settings
    (applied by run.runtime.configure_tensorflow before TensorFlow starts), logs and the profiler."""
    amp: bool
    xla: bool
    print_freq: int
    log_path: str
    loss_scale: Optional[float] = None
    run_eagerly: bool = False
    cpu: bool = False
    tfdata_debug: bool = False
    inter_op_parallelism: Optional[int] = None
    intra_op_parallelism: Optional[int] = None
    profiler_start_step: Optional[int] = None
    profiled_rank: int = 0


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One run's settings: --mode, --seed (initialisation and data order) and the groups."""
    mode: str
    seed: int
    data: DataSettings
    model: ModelSettings
    training: TrainingSettings
    evaluation: EvaluationSettings
    checkpoints: CheckpointSettings
    parallelism: ParallelismSettings
    storage: StorageSettings
    runtime: RuntimeSettings

    def value(self, name: str):
        """The setting named `name` (a field of the run or of one of its groups)."""
        group = SETTINGS[name]
        return getattr(getattr(self, group) if group else self, name)

    def flat(self) -> dict:
        """Every setting by name (the groups' fields side by side), `shape` as "dataset"."""
        values = {name: self.value(name) for name in SETTINGS if name != "shape"}
        return dict(values, dataset=dataclasses.asdict(self.data.shape))

    def used(self, world_size: int) -> dict:
        """`flat` less the settings this run at `world_size` ranks does not read (the JSON log's
        "params"): those that apply only elsewhere (_APPLIES_ONLY, _DATASET_ONLY), a built-in
        model's shape under --model (_NOT_WITH_MODEL_FILE), table placement at one rank."""
        unread = {name for name in SETTINGS if _inapplicable(self, name)}
        unread |= set(_NOT_WITH_MODEL_FILE) if self.model.model else set()
        unread |= set(_MULTI_RANK_ONLY) if world_size == 1 else set()
        return {name: value for name, value in self.flat().items() if name not in unread}

    @property
    def combiners(self) -> List[str]:
        return table_combiners(self.data.shape.max_hotness, self.model.multi_hot_combiner)

    @property
    def dynamic_tables(self) -> Dict[int, DynamicOptions]:
        """--dynamic_tables: feature index -> its dynamic table's options (`dynamic_tables`)."""
        return dynamic_tables(self.model.dynamic_tables, self.data.shape)


GROUPS = {f.name: f.type for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(f.type)}
# setting name -> its group ("": the run's own field)
SETTINGS = {**{f.name: "" for f in dataclasses.fields(RunConfig) if f.name not in GROUPS},
            **{f.name: group for group, settings in GROUPS.items() for f in dataclasses.fields(settings)}}


def feature_spec_path(dataset_path: str, feature_spec: str) -> str:
    """--feature_spec as the reference reads it: a name inside --dataset_path, or an absolute path
    (default: <dataset_path>/feature_spec.yaml)."""
    return os.path.join(dataset_path, feature_spec or "feature_spec.yaml")


# The rules, in groups, each a table: a rule names its flag(s) and says in one line what is wrong.
# `_check` applies the groups in order; the first broken rule stops the run.

# Flags that only mean something in some settings: name -> (predicate on config, where they apply).
_ADAM = (lambda c: c.training.optimizer == "adam", "--optimizer=adam")
_CROSS = (lambda c: c.model.interaction == "cross", "--interaction=cross")
_TRAIN = (lambda c: c.mode == "train", "--mode=train")
_INFERENCE = (lambda c: c.mode == "inference", "--mode=inference")
_EVALUATING = (lambda c: c.mode in ("train", "eval"), "--mode=train or --mode=eval")
_DECAYING = (lambda c: c.mode == "train" and c.training.decay_steps > 0, "--mode=train and --decay_steps > 0")
_RESTORING = (lambda c: c.mode == "train" and bool(c.checkpoints.restore_checkpoint_path),
              "--mode=train and --restore_checkpoint_path")
_CONTINUING = (lambda c: _RESTORING[0](c) and c.checkpoints.restore_mode == "continue",
               "--restore_mode=continue (resume continues the schedule, weights restarts it)")
_APPLIES_ONLY = {
    **dict.fromkeys(("beta1", "beta2"), _ADAM),
    **dict.fromkeys(("num_cross_layers", "cross_layer_projection_dim"), _CROSS),
    **dict.fromkeys(("epochs", "max_steps", "evals_per_epoch", "checkpoint_every_n_steps", "save_checkpoint_path",
                     "synthetic_rows", "batch_size", "learning_rate", "warmup_steps", "decay_steps", "print_freq"),
                    _TRAIN),
    "decay_start_step": _DECAYING,
    **dict.fromkeys(("inference_batch_sizes", "inference_steps"), _INFERENCE),
    **dict.fromkeys(("valid_batch_size", "synthetic_eval_rows"), _EVALUATING),
    "auc_thresholds": _EVALUATING,
    **dict.fromkeys(("train_mapping", "shuffle_batch_order", "train_last_partial_batch"), _TRAIN),
    "loss_scale": (lambda c: c.runtime.amp, "--amp"),
    **dict.fromkeys(("embedding_trainable", "profiler_start_step"), _TRAIN),
    "profiled_rank": (lambda c: c.runtime.profiler_start_step is not None, "--profiler_start_step"),
    "restore_mode": _RESTORING,
    "skip_checkpoint_checksums": (lambda c: bool(c.checkpoints.restore_checkpoint_path), "--restore_checkpoint_path"),
    **dict.fromkeys(("model_params", "model_param"), (lambda c: bool(c.model.model), "--model")),
    "restore_lr_schedule": _CONTINUING,
    **dict.fromkeys(("embedding_store_path", "embedding_cache_policy"),
                    (lambda c: c.storage.embedding_memory_budget_gb is not None, "--embedding_memory_budget_gb")),
}
# What a model file (--model) does not take: the built-in models' shape. Refused in one line naming
# every one set.
_NOT_WITH_MODEL_FILE = ("embedding_dim", "bottom_mlp_dims", "top_mlp_dims", "interaction", "num_cross_layers",
                        "cross_layer_projection_dim", "multi_hot_combiner")
# Table placement flags: they only mean something at several ranks.
_MULTI_RANK_ONLY = ("dist_strategy", "column_slice_threshold", "row_slice_threshold", "data_parallel_threshold",
                    "data_parallel_input")
# Flags read by one dataset type only.
_DATASET_ONLY = {
    **dict.fromkeys(("synthetic_cardinalities", "synthetic_num_numerical", "synthetic_rows", "synthetic_eval_rows",
                     "synthetic_alpha", "synthetic_labels", "synthetic_history_length"), ("synthetic",)),
    **dict.fromkeys(("dataset_path", "feature_spec", "train_mapping", "eval_mapping", "validate_dataset",
                     "multi_hot_combiner"), FILE_DATASETS),
}
# Flags with a set of values: name -> its values.
_CHOICES = {"mode": MODES, "optimizer": OPTIMIZERS, "interaction": INTERACTIONS, "dataset_type": DATASET_TYPES,
            "dist_strategy": DIST_STRATEGIES, "restore_mode": RESTORE_MODES,
            "restore_lr_schedule": LR_SCHEDULE_RESTORES, "embedding_cache_policy": CACHE_POLICIES,
            "keep_best_metric": BEST_METRICS}


def _not_positive(value) -> Optional[str]:
    """What is wrong with a flag's `value` that must be positive (None: nothing)."""
    return None if value > 0 else f"must be positive, got {value}"


def _not_positive_list(values) -> Optional[str]:
    """What is wrong with a list flag's `values`, which must be positive (None: nothing)."""
    if not values:
        return "must not be empty"
    bad = [v for v in values if v <= 0]
    return f"entries must be positive, got {bad[0]}" if bad else None


# Each flag's own range: (flags, what is wrong with a value (None: nothing)); unset (None) values are not checked.
_RANGES = [
    (("multi_hot_combiner",),
     lambda v: None if v in COMBINERS else f"must be one of {', '.join(COMBINERS)}; got {v!r}"),
    (("batch_size", "valid_batch_size", "epochs", "learning_rate", "print_freq", "synthetic_rows",
      "synthetic_eval_rows", "synthetic_num_numerical", "synthetic_labels", "inference_steps", "loss_scale",
      "embedding_memory_budget_gb"), _not_positive),
    (("embedding_dims", "bottom_mlp_dims", "top_mlp_dims", "inference_batch_sizes"), _not_positive_list),
    (("warmup_steps", "decay_start_step", "decay_steps", "evals_per_epoch", "checkpoint_every_n_steps",
      "cross_layer_projection_dim", "synthetic_alpha", "data_parallel_threshold", "cpu_offloading_threshold_gb",
      "profiler_start_step", "synthetic_history_length"), lambda v: None if v >= 0 else f"must be >= 0, got {v}"),
    (("column_slice_threshold", "row_slice_threshold"),
     lambda v: None if v >= 1 else f"must be >= 1 (elements per table), got {v}"),
    (("max_steps",), lambda v: None if v > 0 or v == -1 else f"must be positive, or -1 for no limit; got {v}"),
    (("auc_thresholds",), lambda v: None if v >= 2 else f"must be >= 2, got {v}"),
    (("keep_checkpoints",), lambda v: None if v >= 1 else f"must be >= 1 (the newest is always kept), got {v}"),
]
# Rules between flags: (broken(config, ranks, the flags set), its one-line message(config, ranks)).
_MODEL_RULES = [
    (lambda c, n, p: c.model.multi_hot_combiner is not None and not any(c.data.max_hotness),
     lambda c, n: "--multi_hot_combiner only applies to multi-hot features (max_hotness in the feature spec); this "
                  "dataset has none"),
    (lambda c, n, p: c.runtime.profiler_start_step is not None and not 0 <= c.runtime.profiled_rank < n,
     lambda c, n: f"--profiled_rank={c.runtime.profiled_rank}: there is no such rank (ranks 0..{n - 1})"),
    (lambda c, n, p: c.runtime.profiler_start_step is not None and not c.runtime.log_path,
     lambda c, n: "--profiler_start_step needs --log_path (the profile goes to its TensorBoard directory)"),
    (lambda c, n, p: c.training.optimizer == "adam" and not 0.0 <= c.training.beta1 < 1.0,
     lambda c, n: f"--beta1 must be in [0, 1), got {c.training.beta1}"),
    (lambda c, n, p: c.training.optimizer == "adam" and not 0.0 <= c.training.beta2 < 1.0,
     lambda c, n: f"--beta2 must be in [0, 1), got {c.training.beta2}"),
    (lambda c, n, p: c.training.decay_steps > 0 and c.training.decay_start_step < c.training.warmup_steps,
     lambda c, n: f"--decay_start_step ({c.training.decay_start_step}) must not come before the end of "
                  f"--warmup_steps ({c.training.warmup_steps})"),
    (lambda c, n, p: not c.model.model and len(c.data.shape.labels) > 1,
     lambda c, n: f"the data have {len(c.data.shape.labels)} labels ({', '.join(c.data.shape.labels)}); the built-in "
                  f"DLRM/DCNv2 learn one: train a model with a head per label with --model=FILE (docs/models.md)"),
    (lambda c, n, p: c.model.top_mlp_dims[-1] != 1,
     lambda c, n: f"the last --top_mlp_dims entry is the logit and must be 1, got {c.model.top_mlp_dims[-1]}"),
    (lambda c, n, p: c.model.interaction == "dot_custom" and c.runtime.xla,
     lambda c, n: "--interaction=dot_custom has no XLA kernel; drop --xla or use --interaction=dot"),
    (lambda c, n, p: c.model.interaction != "cross" and len(set(c.model.embedding_dims)) != 1,
     lambda c, n: "--interaction=dot needs one --embedding_dim for all features "
                  f"(got {sorted(set(c.model.embedding_dims))}); use --interaction=cross for unequal dims"),
    (lambda c, n, p: c.model.interaction != "cross" and c.model.bottom_mlp_dims[-1] != c.model.embedding_dims[0],
     lambda c, n: f"--interaction=dot needs the last --bottom_mlp_dims entry ({c.model.bottom_mlp_dims[-1]}) to "
                  f"equal --embedding_dim ({c.model.embedding_dims[0]})"),
    (lambda c, n, p: c.model.interaction == "cross" and c.model.num_cross_layers < 1,
     lambda c, n: f"--num_cross_layers must be >= 1 with --interaction=cross, got {c.model.num_cross_layers}"),
]
_RUN_RULES = [
    (lambda c, n, p: c.parallelism.data_parallel_input and c.storage.embedding_memory_budget_gb is not None,
     lambda c, n: "--data_parallel_input does not work with --embedding_memory_budget_gb: the disk tier stages the "
                  "next batch's ids on the rank that owns them, which data-parallel input only knows inside the "
                  "step; drop one of the two"),
    (lambda c, n, p: c.runtime.run_eagerly and c.runtime.xla,
     lambda c, n: "--run_eagerly runs no compiled function, --xla compiles them: drop one of the two"),
    (lambda c, n, p: c.training.batch_size % n,
     lambda c, n: f"--batch_size ({c.training.batch_size}) must be divisible by the number of ranks ({n})"),
    (lambda c, n, p: c.mode == "inference" and any(size % n for size in c.evaluation.inference_batch_sizes),
     lambda c, n: f"--inference_batch_sizes entry {[s for s in c.evaluation.inference_batch_sizes if s % n][0]} "
                  f"must be divisible by the number of ranks ({n})"),
    (lambda c, n, p: c.mode == "train" and c.data.dataset_type == "synthetic"
     and c.data.synthetic_rows < c.training.batch_size,
     lambda c, n: f"--synthetic_rows ({c.data.synthetic_rows}) is smaller than one --batch_size "
                  f"({c.training.batch_size})"),
    (lambda c, n, p: c.checkpoints.checkpoint_every_n_steps and not c.checkpoints.save_checkpoint_path,
     lambda c, n: "--checkpoint_every_n_steps needs --save_checkpoint_path"),
    (lambda c, n, p: "keep_checkpoints" in p and not c.checkpoints.save_checkpoint_path,
     lambda c, n: "--keep_checkpoints needs --save_checkpoint_path (checkpoints are kept only in training)"),
    (lambda c, n, p: c.checkpoints.keep_best_checkpoint and not c.checkpoints.save_checkpoint_path,
     lambda c, n: "--keep_best_checkpoint needs --save_checkpoint_path (checkpoints are kept only in training)"),
    (lambda c, n, p: "keep_best_metric" in p and not c.checkpoints.keep_best_checkpoint,
     lambda c, n: "--keep_best_metric chooses the checkpoint --keep_best_checkpoint keeps; give that too, or "
                  "remove it"),
    (lambda c, n, p: c.mode == "eval" and not c.checkpoints.restore_checkpoint_path,
     lambda c, n: "--mode=eval needs --restore_checkpoint_path (a trained model to evaluate)"),
]


# NVIDIA's main.py flags for its synthetic data, mapped onto ours by _reference_synthetic.
REFERENCE_SYNTHETIC = {"synthetic_dataset_cardinalities": "synthetic_cardinalities",
                       "synthetic_dataset_num_numerical_features": "synthetic_num_numerical",
                       "synthetic_dataset_train_batches": "synthetic_rows",
                       "synthetic_dataset_valid_batches": "synthetic_eval_rows",
                       "synthetic_dataset_hotness": None, "synthetic_dataset_use_feature_spec": None}


def _reference_synthetic(v: dict, present: Set[str]) -> Optional[List[Optional[int]]]:
    """Applies the reference's synthetic_dataset_* flags (removed from `v`; --dataset_path and
    --feature_spec removed from `present` when the spec shapes the synthetic data) to our
    synthetic_* values; returns the per-feature max_hotness they give (None: all one-hot)."""
    ref = {name: v.pop(name, None) for name in REFERENCE_SYNTHETIC}
    given = [n for n in REFERENCE_SYNTHETIC if n in present and ref[n] is not None and ref[n] is not False]
    if not given:
        return None
    if v["dataset_type"] != "synthetic":
        raise ConfigError(f"--{given[0]} only applies with --dataset_type=synthetic; remove it or change that flag")
    for name in given:
        if REFERENCE_SYNTHETIC[name] in present:
            raise ConfigError(f"--{name} and --{REFERENCE_SYNTHETIC[name]} set the same thing; give one")
    for name in ("synthetic_dataset_cardinalities", "synthetic_dataset_num_numerical_features"):
        if name in given:
            v[REFERENCE_SYNTHETIC[name]] = ref[name]
    for name, batch, modes in (("synthetic_dataset_train_batches", "batch_size", ("train",)),
                               ("synthetic_dataset_valid_batches", "valid_batch_size", ("train", "eval"))):
        if name in given:
            if v["mode"] not in modes:
                raise ConfigError(f"--{name} only applies with --mode={' or --mode='.join(modes)}; remove it or "
                                  "change that flag")
            _positive(name, ref[name])
            v[REFERENCE_SYNTHETIC[name]] = ref[name] * v[batch]   # batches of the run's batch size
    if "synthetic_dataset_use_feature_spec" in given:
        return _synthetic_spec(v, present, given)
    if "synthetic_dataset_hotness" not in given:
        return None
    cards = parse_int_list("synthetic_cardinalities", v["synthetic_cardinalities"])
    hotness = parse_int_list("synthetic_dataset_hotness", ref["synthetic_dataset_hotness"])
    _positive_list("synthetic_dataset_hotness", hotness)
    if len(hotness) != len(cards):
        raise ConfigError(f"--synthetic_dataset_hotness has {len(hotness)} values but there are {len(cards)} "
                          "categorical features")
    return [h if h > 1 else None for h in hotness]


def _synthetic_spec(v: dict, present: Set[str], given: List[str]) -> List[Optional[int]]:
    """--synthetic_dataset_use_feature_spec: the spec at --dataset_path / --feature_spec gives the
    synthetic cardinalities, numerical count, hotness and alpha (the features' common one)."""
    shaping = ("synthetic_dataset_cardinalities", "synthetic_dataset_num_numerical_features",
               "synthetic_dataset_hotness", "synthetic_cardinalities", "synthetic_num_numerical")
    clash = [n for n in shaping if n in given or n in present]
    if clash:
        raise ConfigError(f"--{clash[0]}: --synthetic_dataset_use_feature_spec takes the data's shape from the "
                          "feature spec; remove one")
    if not v["dataset_path"] and not v["feature_spec"]:
        raise ConfigError("--synthetic_dataset_use_feature_spec needs --dataset_path (a directory with "
                          "feature_spec.yaml) or --feature_spec")
    path = feature_spec_path(v["dataset_path"], v["feature_spec"])
    spec = FeatureSpec.from_yaml(path, chunk_type=None)
    if spec.raw_id_features:
        raise ConfigError(f"--synthetic_dataset_use_feature_spec: feature {spec.raw_id_features[0]} of {path} has raw "
                          "ids (no cardinality to draw synthetic ids from)")
    alphas = sorted({spec.features[f].alpha for f in spec.categorical} - {None})
    if len(alphas) > 1:
        raise ConfigError(f"--synthetic_dataset_use_feature_spec: {path} gives the features different alphas "
                          f"{alphas}; the synthetic ids follow one power law (--synthetic_alpha)")
    if alphas and "synthetic_alpha" in present:
        raise ConfigError(f"--synthetic_alpha: {path} gives the ids' alpha; remove one")
    v.update(synthetic_cardinalities=spec.cardinalities, synthetic_num_numerical=len(spec.numerical),
             synthetic_alpha=alphas[0] if alphas else v["synthetic_alpha"])
    present.difference_update({"dataset_path", "feature_spec"})
    return spec.max_hotness


def _positive(name, value):
    if _not_positive(value):
        raise ConfigError(f"--{name} {_not_positive(value)}")


def _positive_list(name, values):
    if _not_positive_list(values):
        raise ConfigError(f"--{name} {_not_positive_list(values)}")


def parse_int_list(name: str, values: Sequence) -> List[int]:
    """Turns a flag's list of strings (or ints) into ints, naming the flag on failure."""
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise ConfigError(f"--{name} must be a comma-separated list of integers, got {','.join(map(str, values))}")


DYNAMIC_FORM = "<feature>:<capacity>[:<admit_after>[:<policy>[:<ttl>[:<shards>]]]]"


def dynamic_tables(entries: Sequence[str], shape: DatasetShape) -> Dict[int, DynamicOptions]:
    """--dynamic_tables' entries, each DYNAMIC_FORM -> feature index -> DynamicOptions (admit_after 1,
    policy lru, ttl 0, hash shards 1 by default); ConfigError naming the entry. The feature: its
    index, name or alias, or `all` (every raw-id feature without an entry of its own); the capacity:
    rows, or `<factor>x`: that factor times the feature's distinct ids (shape.distinct_ids), rounded up."""
    names, options, every = list(shape.names), {}, None
    for entry in entries:
        parts = str(entry).split(":")
        if parts[0] == "all":
            if every is not None:
                raise ConfigError(f"--dynamic_tables entry {entry!r}: 'all' is given twice")
            every = entry, parts
            if not shape.raw_ids:
                raise ConfigError(f"--dynamic_tables entry {entry!r}: 'all' means every feature with raw ids, and "
                                  "this dataset has none (preprocess with --raw_id_columns, or name the features)")
            continue
        name = shape.aliases.get(parts[0], parts[0])
        feature = names.index(name) if name in names else int(name) if name.isdigit() else -1
        if len(parts) < 2:
            raise ConfigError(f"--dynamic_tables entry {entry!r}: expected {DYNAMIC_FORM}")
        if not 0 <= feature < len(names):
            raise ConfigError(f"--dynamic_tables entry {entry!r}: no categorical feature {parts[0]} (features "
                              f"0..{len(names) - 1}: {names[0]}..{names[-1]}, or all)")
        if feature in options:
            raise ConfigError(f"--dynamic_tables entry {entry!r}: feature {names[feature]} ({feature}) is given twice")
        options[feature] = _dynamic_options(entry, parts, names[feature], shape)
    if every is not None:
        for name in shape.raw_ids:
            options.setdefault(names.index(name), _dynamic_options(*every, name, shape))
    return options


def _dynamic_options(entry: str, parts: List[str], name: str, shape: DatasetShape) -> DynamicOptions:
    """One --dynamic_tables entry's options for feature `name` (its capacity a factor of its distinct ids)."""
    try:
        if len(parts) > 6:
            raise ValueError
        factor = float(parts[1][:-1]) if parts[1].endswith("x") else None
        capacity = int(parts[1]) if factor is None else 0
        admit_after = int(parts[2]) if len(parts) > 2 else 1
        policy = parts[3] if len(parts) > 3 else "lru"
        ttl = int(parts[4]) if len(parts) > 4 else 0
        shards = int(parts[5]) if len(parts) > 5 else 1
    except ValueError:
        raise ConfigError(f"--dynamic_tables entry {entry!r}: expected {DYNAMIC_FORM} (capacity rows or <factor>x, "
                          f"policy one of {', '.join(DYNAMIC_POLICIES)})") from None
    if factor is not None:
        if name not in shape.distinct_ids:
            raise ConfigError(f"--dynamic_tables entry {entry!r}: a capacity of {parts[1]} the distinct ids needs "
                              f"{name}'s count in the dataset's metadata (preprocessing with --raw_id_columns "
                              "records it; this dataset has none for it): give its rows")
        if not factor > 0:
            raise ConfigError(f"--dynamic_tables entry {entry!r}: the factor of the distinct ids must be above 0")
        capacity = max(1, math.ceil(factor * shape.distinct_ids[name]))
    try:
        return DynamicOptions(capacity, admit_after, policy=policy, ttl=ttl, shards=shards)
    except PlanError as e:
        raise ConfigError(f"--dynamic_tables entry {entry!r}: {e}") from None


def embedding_widths(values: Sequence) -> list:
    """--embedding_dim's entries, or, for one entry naming a file (an existing one, or *.json), the
    reference's JSON list of per-feature widths read from it."""
    path = str(values[0]) if len(values) == 1 else ""
    if not (path.endswith(".json") or os.path.isfile(path)):
        return list(values)
    try:
        with open(path) as f:
            widths = json.load(f)
    except OSError as e:
        raise ConfigError(f"--embedding_dim={path}: cannot read this JSON file of widths ({e.strerror})")
    except ValueError as e:
        raise ConfigError(f"--embedding_dim={path}: not valid JSON ({e})")
    if not isinstance(widths, list) or not all(type(w) is int for w in widths):
        raise ConfigError(f"--embedding_dim={path}: expected a JSON list of integers, one width per categorical "
                          "feature")
    return widths


def model_hparams(model: str, params_path: str, params: Sequence[str]) -> dict:
    """A model file's hyper-parameters: the YAML mapping of --model_params, then each
    --model_param key=value over it (the value read as YAML: 16, 0.5, [64, 32], true, text).
    Checks that the --model file exists."""
    if not os.path.isfile(model):
        raise ConfigError(f"--model={model}: no such file (a Python file defining build_model(features, hparams))")
    hparams = {}
    if params_path:
        try:
            with open(params_path) as f:
                hparams = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"--model_params={params_path}: cannot read it ({e.strerror})")
        except yaml.YAMLError as e:
            raise ConfigError(f"--model_params={params_path}: not valid YAML ({str(e).splitlines()[0]})")
        if hparams is None:
            hparams = {}
        if not isinstance(hparams, dict) or not all(isinstance(k, str) for k in hparams):
            raise ConfigError(f"--model_params={params_path}: expected a YAML mapping of names to values")
    for item in params:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--model_param={item}: expected name=value")
        try:
            hparams[key.strip()] = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ConfigError(f"--model_param={item}: the value is not valid YAML")
    return hparams


def build_config(values: dict, present: Optional[Set[str]] = None, world_size: int = 1) -> RunConfig:
    """Validates raw flag values and returns a RunConfig.

    values: flag name -> value as absl parsed it (lists as lists of strings).
    present: names of flags the user set explicitly (a flag that would have no effect in the
      chosen setting is an error only when set explicitly).
    world_size: number of ranks; the global batch must divide evenly over them.
    """
    present = set(present or ())
    v = {name: field.default for group in GROUPS.values() for name, field in group.__dataclass_fields__.items()
         if field.default is not dataclasses.MISSING}
    v.update(values)
    v["interaction"] = INTERACTION_ALIASES.get(v["interaction"], v["interaction"])
    v["model_param"] = tuple(v.get("model_param") or ())
    if v.get("model"):
        model_hparams(v["model"], v.get("model_params", ""), v["model_param"])   # its errors now, before TensorFlow
    v["embedding_dim"] = embedding_widths(v["embedding_dim"])
    hotness = _reference_synthetic(v, present)
    for name in ("embedding_dim", "bottom_mlp_dims", "top_mlp_dims", "synthetic_cardinalities",
                 "inference_batch_sizes"):
        v[name] = parse_int_list(name, v[name])
    v["dynamic_tables"] = tuple(v.get("dynamic_tables") or ())
    cards = v["synthetic_cardinalities"]
    if v["dataset_type"] == "tf_raw":   # the reference's reader of the split-binary files split_binary reads
        v["dataset_type"] = "split_binary"
    if v["dataset_type"] in FILE_DATASETS:
        v["shape"] = _spec_shape(v)
        cards = v["shape"].cardinalities
    else:
        _positive_list("synthetic_cardinalities", cards)
        names = [f"cat_{k}" for k in range(len(cards))]
        cards, hotness = with_history(cards, hotness or [None] * len(cards), v["synthetic_history_length"])
        names += [SYNTHETIC_HISTORY] * (len(cards) - len(names))   # the history of cat_0's items, a last feature
        v["shape"] = DatasetShape(cards, v["synthetic_num_numerical"], hotness, names,
                                  labels=synthetic_label_names(max(1, v["synthetic_labels"])))
    dims = v.pop("embedding_dim")
    if len(dims) == 1:
        dims = dims * len(cards)
    elif len(dims) != len(cards):
        raise ConfigError(f"--embedding_dim has {len(dims)} values but there are {len(cards)} "
                          "categorical features: give one value or one per feature")
    v["embedding_dims"] = dims
    unknown = set(v) - set(SETTINGS)
    if unknown:
        raise TypeError(f"build_config: no such settings {sorted(unknown)}")
    groups = {name: group(**{f.name: v[f.name] for f in dataclasses.fields(group) if f.name in v})
              for name, group in GROUPS.items()}
    cfg = RunConfig(**{name: v[name] for name, group in SETTINGS.items() if not group}, **groups)
    _check(cfg, present, world_size)
    return cfg


def _spec_shape(v: dict) -> DatasetShape:
    """Reads the feature spec of a file dataset (utils.errors.DatasetError, a ConfigError,
    on any problem) and checks that the mappings the run reads exist (split_tfrecords:
    directories next to the spec)."""
    if not v["dataset_path"] and not v["feature_spec"]:
        raise ConfigError(f"--dataset_type={v['dataset_type']} needs --dataset_path (a directory with "
                          "feature_spec.yaml) or --feature_spec; use --dataset_type=synthetic for generated data")
    tfrecords = v["dataset_type"] == "split_tfrecords"
    spec = FeatureSpec.from_yaml(feature_spec_path(v["dataset_path"], v["feature_spec"]),
                                 chunk_type=None if tfrecords else "split_binary")
    metadata = spec.metadata if isinstance(spec.metadata, dict) else {}
    shape = DatasetShape(list(spec.cardinalities), len(spec.numerical), spec.max_hotness, list(spec.categorical),
                         spec.labels, tuple(spec.raw_id_features), dict(metadata.get("distinct_ids") or {}),
                         {column: name for name, column in (metadata.get("columns") or {}).items()})
    for name in ("train_mapping", "eval_mapping") if v["mode"] == "train" else ("eval_mapping",):
        if tfrecords and not os.path.isdir(spec.path(v[name])):
            raise ConfigError(f"--{name}={v[name]}: no directory {spec.path(v[name])} (a split_tfrecords mapping "
                              "is a directory next to the feature spec)")
        if not tfrecords and v[name] not in spec.source:
            raise ConfigError(f"--{name}={v[name]}: the feature spec has no such mapping "
                              f"(it has {', '.join(spec.source)})")
    return dataclasses.replace(shape, cardinalities=_raw_id_rows(shape, v["dynamic_tables"]))


def _raw_id_rows(shape: DatasetShape, entries: Sequence[str]) -> List[int]:
    """The spec's cardinalities, a raw-id feature's (none in the spec) its dynamic table's capacity:
    its ids are 64-bit keys, not rows, which only a dynamic table (--dynamic_tables) takes."""
    dynamic = dynamic_tables(entries, shape) if shape.raw_ids else {}
    cardinalities = list(shape.cardinalities)
    for name in shape.raw_ids:
        f = shape.names.index(name)
        if f not in dynamic:
            counted = f" (its training rows have about {shape.distinct_ids[name]:,} distinct ids)" \
                if name in shape.distinct_ids else ""
            raise ConfigError(f"feature {name} has raw ids (preprocessed with --raw_id_columns): it needs a dynamic "
                              f"table (--dynamic_tables={name}:<capacity>, or all:<factor>x for every raw-id "
                              f"feature){counted}")
        cardinalities[f] = dynamic[f].capacity
    return cardinalities


def _flag(name: str) -> str:
    """The flag of setting `name` (--embedding_dim gives embedding_dims)."""
    return "embedding_dim" if name == "embedding_dims" else name


def _check(c: RunConfig, present: Set[str], world_size: int):
    """Applies the rule groups, in order: the first broken rule stops the run with its one line
    (the flags set where they do not apply: all of them, in one line)."""
    for name, choices in _CHOICES.items():
        if c.value(name) not in choices:
            raise ConfigError(f"--{name} must be one of {', '.join(choices)}; got {c.value(name)!r}")
    refused = sorted(present & set(_NOT_WITH_MODEL_FILE)) if c.model.model else []
    if refused:
        raise ConfigError(f"--model={c.model.model} does not take {_names(refused)} (the model file sets its own "
                          f"shape): remove "
                          f"{'it' if len(refused) == 1 else 'them'}")
    _check_applies(c, present)
    for names, wrong in _RANGES:
        for name in names:
            problem = None if c.value(name) is None else wrong(c.value(name))
            if problem:
                raise ConfigError(f"--{_flag(name)} {problem}")
    for broken, message in _MODEL_RULES:
        if broken(c, world_size, present):
            raise ConfigError(message(c, world_size))
    dynamic_tables(c.model.dynamic_tables, c.data.shape)   # its one-line errors, before TensorFlow
    if world_size == 1:
        for name in sorted(present & set(_MULTI_RANK_ONLY)):
            raise ConfigError(f"--{name} only applies with several ranks (horovodrun -np N); at one rank every "
                              "table is whole on this process: remove it")
    for broken, message in _RUN_RULES:
        if broken(c, world_size, present):
            raise ConfigError(message(c, world_size))


def _inapplicable(c: RunConfig, name: str) -> bool:
    """Whether setting `name` means nothing in `c` (_APPLIES_ONLY, _DATASET_ONLY)."""
    return (name in _APPLIES_ONLY and not _APPLIES_ONLY[name][0](c)) or \
        (name in _DATASET_ONLY and c.data.dataset_type not in _DATASET_ONLY[name])


def _check_applies(c: RunConfig, present: Set[str]):
    """The flags set explicitly that mean nothing in this setting (_APPLIES_ONLY, _DATASET_ONLY):
    one line naming every one, by where each applies."""
    wheres = {}   # where -> the flags set that apply only there
    for name in sorted(present & set(_APPLIES_ONLY)):
        applies, where = _APPLIES_ONLY[name]
        if not applies(c):
            wheres.setdefault(where, []).append(name)
    for name in sorted(present & set(_DATASET_ONLY)):
        if c.data.dataset_type not in _DATASET_ONLY[name] and not any(name in names for names in wheres.values()):
            wheres.setdefault(f"--dataset_type={' or '.join(_DATASET_ONLY[name])}", []).append(name)
    if not wheres:
        return
    parts = [f"{_names(names)} only appl{'ies' if len(names) == 1 else 'y'} with {where}"
             for where, names in wheres.items()]
    single = len(parts) == 1 and len(next(iter(wheres.values()))) == 1
    raise ConfigError("; ".join(parts) + ("; remove it or change that flag" if single else
                                          "; remove them or change those flags"))


def _names(names: List[str]) -> str:
    """--a, --b and --c"""
    flags = [f"--{n}" for n in names]
    return flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} and {flags[-1]}"
