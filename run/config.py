"""Run configuration: one validated, typed view of the command-line flags.

Pure Python (no TensorFlow), so flag errors are reported in a fraction of a second and the
rules can be tested without a model. Every rule raises `ConfigError` with one line that names
the offending flag(s).
"""
import dataclasses
import json
import os
from typing import List, Optional, Sequence, Set

from dataloading.feature_spec import FeatureSpec
from nn.model_config import table_combiners
from utils.errors import ConfigError

MODES = ("train", "eval", "inference")
OPTIMIZERS = ("sgd", "adagrad", "adam")
# dot_custom: dot, forcing the custom op; dot_tensorflow (the reference's name): dot on TensorFlow ops, never the op
INTERACTIONS = ("dot", "dot_custom", "dot_tensorflow", "cross")
INTERACTION_ALIASES = {"dot_custom_cuda": "dot_custom"}   # the reference's name for ours
DATASET_TYPES = ("split_binary", "synthetic", "split_tfrecords", "tf_raw")
FILE_DATASETS = ("split_binary", "split_tfrecords")   # tf_raw: the reference's name for split_binary's files
COMBINERS = ("sum", "mean")
DIST_STRATEGIES = ("basic", "memory_balanced", "memory_optimized")   # as parallel_embedding.planner
RESTORE_MODES = ("resume", "continue", "weights")
LR_SCHEDULE_RESTORES = ("restart", "continue")
CACHE_POLICIES = ("lru", "lfu")   # eviction of the disk tier's caches


@dataclasses.dataclass(frozen=True)
class RunConfig:
    mode: str
    batch_size: int
    valid_batch_size: int
    epochs: int
    max_steps: int
    learning_rate: float
    optimizer: str
    beta1: float
    beta2: float
    warmup_steps: int
    decay_start_step: int
    decay_steps: int
    embedding_dims: List[int]
    bottom_mlp_dims: List[int]
    top_mlp_dims: List[int]
    interaction: str
    num_cross_layers: int
    cross_layer_projection_dim: int
    amp: bool
    xla: bool
    seed: int
    print_freq: int
    evals_per_epoch: int
    log_path: str
    save_checkpoint_path: str
    restore_checkpoint_path: str
    checkpoint_every_n_steps: int
    dataset_path: str
    dataset_type: str
    synthetic_cardinalities: List[int]
    synthetic_num_numerical: int
    synthetic_rows: int
    synthetic_eval_rows: int
    synthetic_alpha: float
    inference_batch_sizes: List[int]
    inference_steps: int
    dist_strategy: str
    column_slice_threshold: Optional[int]
    row_slice_threshold: Optional[int]
    data_parallel_threshold: Optional[int]
    data_parallel_input: bool
    feature_spec: str = ""
    train_mapping: str = "train"
    eval_mapping: str = "test"
    validate_dataset: bool = False
    shuffle_batch_order: bool = True
    train_last_partial_batch: bool = False
    multi_hot_combiner: Optional[str] = None
    loss_scale: Optional[float] = None
    embedding_trainable: bool = True
    embedding_zeros_initializer: bool = False
    cpu_offloading_threshold_gb: Optional[int] = None
    embedding_memory_budget_gb: Optional[float] = None   # storage tiers: run.runtime.tiered_plan
    embedding_store_path: Optional[str] = None
    embedding_cache_policy: str = "lru"
    profiler_start_step: Optional[int] = None
    profiled_rank: int = 0
    cpu: bool = False   # applied (with the three below) by run.runtime before TensorFlow starts
    tfdata_debug: bool = False
    inter_op_parallelism: Optional[int] = None
    intra_op_parallelism: Optional[int] = None
    run_eagerly: bool = False
    auc_thresholds: Optional[int] = None
    keep_checkpoints: int = 2
    keep_best_checkpoint: bool = False
    skip_checkpoint_checksums: bool = False
    restore_mode: str = "resume"
    restore_lr_schedule: str = "restart"
    dataset: Optional["DatasetShape"] = None   # derived: the synthetic flags' or the feature spec's

    @property
    def num_categorical(self) -> int:
        return len(self.dataset.cardinalities)

    @property
    def cardinalities(self) -> List[int]:
        return list(self.dataset.cardinalities)

    @property
    def num_numerical(self) -> int:
        return self.dataset.num_numerical

    @property
    def max_hotness(self) -> List[Optional[int]]:
        return list(self.dataset.max_hotness)

    @property
    def combiners(self) -> List[str]:
        return table_combiners(self.dataset.max_hotness, self.multi_hot_combiner)

    @property
    def feature_spec_path(self) -> str:
        return feature_spec_path(self.dataset_path, self.feature_spec)


def feature_spec_path(dataset_path: str, feature_spec: str) -> str:
    """--feature_spec as the reference reads it: a name inside --dataset_path, or an absolute path
    (default: <dataset_path>/feature_spec.yaml)."""
    return os.path.join(dataset_path, feature_spec or "feature_spec.yaml")


@dataclasses.dataclass(frozen=True)
class DatasetShape:
    """What the model needs to know of the data: per categorical feature its cardinality and
    max_hotness (None: one-hot), and the number of numerical features."""
    cardinalities: List[int]
    num_numerical: int
    max_hotness: List[Optional[int]]


# Flags that only mean something in some settings: name -> (predicate on config, where they apply).
_ADAM = (lambda c: c.optimizer == "adam", "--optimizer=adam")
_CROSS = (lambda c: c.interaction == "cross", "--interaction=cross")
_TRAIN = (lambda c: c.mode == "train", "--mode=train")
_INFERENCE = (lambda c: c.mode == "inference", "--mode=inference")
_EVALUATING = (lambda c: c.mode in ("train", "eval"), "--mode=train or --mode=eval")
_DECAYING = (lambda c: c.mode == "train" and c.decay_steps > 0, "--mode=train and --decay_steps > 0")
_RESTORING = (lambda c: c.mode == "train" and bool(c.restore_checkpoint_path),
              "--mode=train and --restore_checkpoint_path")
_CONTINUING = (lambda c: _RESTORING[0](c) and c.restore_mode == "continue",
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
    "loss_scale": (lambda c: c.amp, "--amp"),
    **dict.fromkeys(("embedding_trainable", "profiler_start_step"), _TRAIN),
    "profiled_rank": (lambda c: c.profiler_start_step is not None, "--profiler_start_step"),
    "restore_mode": _RESTORING,
    "skip_checkpoint_checksums": (lambda c: bool(c.restore_checkpoint_path), "--restore_checkpoint_path"),
    "restore_lr_schedule": _CONTINUING,
    **dict.fromkeys(("embedding_store_path", "embedding_cache_policy"),
                    (lambda c: c.embedding_memory_budget_gb is not None, "--embedding_memory_budget_gb")),
}
# Table placement flags: they only mean something at several ranks.
_MULTI_RANK_ONLY = ("dist_strategy", "column_slice_threshold", "row_slice_threshold", "data_parallel_threshold",
                    "data_parallel_input")
# Flags read by one dataset type only.
_DATASET_ONLY = {
    **dict.fromkeys(("synthetic_cardinalities", "synthetic_num_numerical", "synthetic_rows", "synthetic_eval_rows",
                     "synthetic_alpha"), ("synthetic",)),
    **dict.fromkeys(("dataset_path", "feature_spec", "train_mapping", "eval_mapping", "validate_dataset",
                     "multi_hot_combiner"), FILE_DATASETS),
}


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
    if value <= 0:
        raise ConfigError(f"--{name} must be positive, got {value}")


def _positive_list(name, values):
    if not values:
        raise ConfigError(f"--{name} must not be empty")
    for v in values:
        if v <= 0:
            raise ConfigError(f"--{name} entries must be positive, got {v}")


def parse_int_list(name: str, values: Sequence) -> List[int]:
    """Turns a flag's list of strings (or ints) into ints, naming the flag on failure."""
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise ConfigError(f"--{name} must be a comma-separated list of integers, got {','.join(map(str, values))}")


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


def build_config(values: dict, present: Optional[Set[str]] = None, world_size: int = 1) -> RunConfig:
    """Validates raw flag values and returns a RunConfig.

    values: flag name -> value as absl parsed it (lists as lists of strings).
    present: names of flags the user set explicitly (a flag that would have no effect in the
      chosen setting is an error only when set explicitly).
    world_size: number of ranks; the global batch must divide evenly over them.
    """
    present = set(present or ())
    v = {f.name: f.default for f in dataclasses.fields(RunConfig) if f.default is not dataclasses.MISSING}
    v.update(values)
    v["interaction"] = INTERACTION_ALIASES.get(v["interaction"], v["interaction"])
    v["embedding_dim"] = embedding_widths(v["embedding_dim"])
    hotness = _reference_synthetic(v, present)
    for name in ("embedding_dim", "bottom_mlp_dims", "top_mlp_dims", "synthetic_cardinalities",
                 "inference_batch_sizes"):
        v[name] = parse_int_list(name, v[name])
    cards = v["synthetic_cardinalities"]
    if v["dataset_type"] == "tf_raw":   # the reference's reader of the split-binary files split_binary reads
        v["dataset_type"] = "split_binary"
    if v["dataset_type"] in FILE_DATASETS:
        v["dataset"] = _spec_shape(v)
        cards = v["dataset"].cardinalities
    else:
        _positive_list("synthetic_cardinalities", cards)
        v["dataset"] = DatasetShape(list(cards), v["synthetic_num_numerical"], hotness or [None] * len(cards))
    dims = v.pop("embedding_dim")
    if len(dims) == 1:
        dims = dims * len(cards)
    elif len(dims) != len(cards):
        raise ConfigError(f"--embedding_dim has {len(dims)} values but there are {len(cards)} "
                          "categorical features: give one value or one per feature")
    v["embedding_dims"] = dims
    cfg = RunConfig(**v)
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
    for name in ("train_mapping", "eval_mapping") if v["mode"] == "train" else ("eval_mapping",):
        if tfrecords and not os.path.isdir(spec.path(v[name])):
            raise ConfigError(f"--{name}={v[name]}: no directory {spec.path(v[name])} (a split_tfrecords mapping "
                              "is a directory next to the feature spec)")
        if not tfrecords and v[name] not in spec.source:
            raise ConfigError(f"--{name}={v[name]}: the feature spec has no such mapping "
                              f"(it has {', '.join(spec.source)})")
    return DatasetShape(spec.cardinalities, len(spec.numerical), spec.max_hotness)


def _check(c: RunConfig, present: Set[str], world_size: int):
    for name, choices in (("mode", MODES), ("optimizer", OPTIMIZERS), ("interaction", INTERACTIONS),
                          ("dataset_type", DATASET_TYPES), ("dist_strategy", DIST_STRATEGIES),
                          ("restore_mode", RESTORE_MODES), ("restore_lr_schedule", LR_SCHEDULE_RESTORES),
                          ("embedding_cache_policy", CACHE_POLICIES)):
        if getattr(c, name) not in choices:
            raise ConfigError(f"--{name} must be one of {', '.join(choices)}; got {getattr(c, name)!r}")
    for name in sorted(present & set(_APPLIES_ONLY)):
        applies, where = _APPLIES_ONLY[name]
        if not applies(c):
            raise ConfigError(f"--{name} only applies with {where}; remove it or change that flag")
    for name in sorted(present & set(_DATASET_ONLY)):
        if c.dataset_type not in _DATASET_ONLY[name]:
            raise ConfigError(f"--{name} only applies with --dataset_type={' or '.join(_DATASET_ONLY[name])}; remove "
                              "it or change that flag")
    if c.multi_hot_combiner is not None:
        if c.multi_hot_combiner not in COMBINERS:
            raise ConfigError(f"--multi_hot_combiner must be one of {', '.join(COMBINERS)}; got {c.multi_hot_combiner!r}")
        if not any(c.max_hotness):
            raise ConfigError("--multi_hot_combiner only applies to multi-hot features (max_hotness in the feature "
                              "spec); this dataset has none")
    for name in ("batch_size", "valid_batch_size", "epochs", "learning_rate", "print_freq",
                 "synthetic_rows", "synthetic_eval_rows", "synthetic_num_numerical", "inference_steps"):
        _positive(name, getattr(c, name))
    for name in ("embedding_dims", "bottom_mlp_dims", "top_mlp_dims", "inference_batch_sizes"):
        _positive_list(name.replace("embedding_dims", "embedding_dim"), getattr(c, name))
    for name in ("warmup_steps", "decay_start_step", "decay_steps", "evals_per_epoch",
                 "checkpoint_every_n_steps", "cross_layer_projection_dim", "synthetic_alpha"):
        if getattr(c, name) < 0:
            raise ConfigError(f"--{name} must be >= 0, got {getattr(c, name)}")
    for name in ("column_slice_threshold", "row_slice_threshold"):
        if getattr(c, name) is not None and getattr(c, name) < 1:
            raise ConfigError(f"--{name} must be >= 1 (elements per table), got {getattr(c, name)}")
    if c.data_parallel_threshold is not None and c.data_parallel_threshold < 0:
        raise ConfigError(f"--data_parallel_threshold must be >= 0, got {c.data_parallel_threshold}")
    for name in ("loss_scale", "embedding_memory_budget_gb"):
        if getattr(c, name) is not None:
            _positive(name, getattr(c, name))
    for name in ("cpu_offloading_threshold_gb", "profiler_start_step"):
        if getattr(c, name) is not None and getattr(c, name) < 0:
            raise ConfigError(f"--{name} must be >= 0, got {getattr(c, name)}")
    if c.profiler_start_step is not None:
        if not 0 <= c.profiled_rank < world_size:
            raise ConfigError(f"--profiled_rank={c.profiled_rank}: there is no such rank (ranks 0..{world_size - 1})")
        if not c.log_path:
            raise ConfigError("--profiler_start_step needs --log_path (the profile goes to its TensorBoard directory)")
    if c.max_steps == 0 or c.max_steps < -1:
        raise ConfigError(f"--max_steps must be positive, or -1 for no limit; got {c.max_steps}")
    if c.optimizer == "adam":
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(c, name) < 1.0:
                raise ConfigError(f"--{name} must be in [0, 1), got {getattr(c, name)}")
    if c.decay_steps > 0 and c.decay_start_step < c.warmup_steps:
        raise ConfigError(f"--decay_start_step ({c.decay_start_step}) must not come before the end of "
                          f"--warmup_steps ({c.warmup_steps})")
    if c.top_mlp_dims[-1] != 1:
        raise ConfigError(f"the last --top_mlp_dims entry is the logit and must be 1, got {c.top_mlp_dims[-1]}")
    if c.interaction == "dot_custom" and c.xla:
        raise ConfigError("--interaction=dot_custom has no XLA kernel; drop --xla or use --interaction=dot")
    if c.interaction != "cross":   # the dot interactions
        if len(set(c.embedding_dims)) != 1:
            raise ConfigError("--interaction=dot needs one --embedding_dim for all features "
                              f"(got {sorted(set(c.embedding_dims))}); use --interaction=cross for unequal dims")
        if c.bottom_mlp_dims[-1] != c.embedding_dims[0]:
            raise ConfigError(f"--interaction=dot needs the last --bottom_mlp_dims entry "
                              f"({c.bottom_mlp_dims[-1]}) to equal --embedding_dim ({c.embedding_dims[0]})")
    elif c.num_cross_layers < 1:
        raise ConfigError(f"--num_cross_layers must be >= 1 with --interaction=cross, got {c.num_cross_layers}")
    if world_size == 1:
        for name in sorted(present & set(_MULTI_RANK_ONLY)):
            raise ConfigError(f"--{name} only applies with several ranks (horovodrun -np N); at one rank every "
                              "table is whole on this process: remove it")
    if c.data_parallel_input and c.embedding_memory_budget_gb is not None:
        raise ConfigError("--data_parallel_input does not work with --embedding_memory_budget_gb: the disk tier stages "
                          "the next batch's ids on the rank that owns them, which data-parallel input only knows "
                          "inside the step; drop one of the two")
    if c.run_eagerly and c.xla:
        raise ConfigError("--run_eagerly runs no compiled function, --xla compiles them: drop one of the two")
    if c.auc_thresholds is not None and c.auc_thresholds < 2:
        raise ConfigError(f"--auc_thresholds must be >= 2, got {c.auc_thresholds}")
    if c.batch_size % world_size:
        raise ConfigError(f"--batch_size ({c.batch_size}) must be divisible by the number of ranks ({world_size})")
    if c.mode == "inference":
        for size in c.inference_batch_sizes:
            if size % world_size:
                raise ConfigError(f"--inference_batch_sizes entry {size} must be divisible by the number of "
                                  f"ranks ({world_size})")
    if c.mode == "train" and c.dataset_type == "synthetic" and c.synthetic_rows < c.batch_size:
        raise ConfigError(f"--synthetic_rows ({c.synthetic_rows}) is smaller than one --batch_size ({c.batch_size})")
    if c.checkpoint_every_n_steps and not c.save_checkpoint_path:
        raise ConfigError("--checkpoint_every_n_steps needs --save_checkpoint_path")
    for name, used in (("keep_checkpoints", "keep_checkpoints" in present),
                       ("keep_best_checkpoint", c.keep_best_checkpoint)):
        if used and not c.save_checkpoint_path:
            raise ConfigError(f"--{name} needs --save_checkpoint_path (checkpoints are kept only in training)")
    if c.keep_checkpoints < 1:
        raise ConfigError(f"--keep_checkpoints must be >= 1 (the newest is always kept), got {c.keep_checkpoints}")
    if c.mode == "eval" and not c.restore_checkpoint_path:
        raise ConfigError("--mode=eval needs --restore_checkpoint_path (a trained model to evaluate)")
