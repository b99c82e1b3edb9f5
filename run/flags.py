"""Command-line flags, named as in NVIDIA's TF2 DLRM/DCNv2 reference.

Defaults are DLRM's; `dcnv2.py` overrides the model defaults with `set_defaults`.
"""
from absl import flags

from run import data_flags  # noqa: F401 (defines the flags naming the data: --dataset_type, ...)
from run.config import (BEST_METRICS, CACHE_POLICIES, COMBINERS, DIST_STRATEGIES, INTERACTION_ALIASES, INTERACTIONS,
                        LR_SCHEDULE_RESTORES, MODES, OPTIMIZERS, REFERENCE_SYNTHETIC, RESTORE_MODES, SETTINGS,
                        RunConfig, build_config)

FLAGS = flags.FLAGS

flags.DEFINE_enum("mode", "train", list(MODES), "train: train (and evaluate); eval: evaluate a "
                  "checkpoint; inference: measure prediction throughput and latency")
flags.DEFINE_integer("batch_size", 64 * 1024, "global training batch size")
flags.DEFINE_integer("valid_batch_size", 64 * 1024, "evaluation batch size")
flags.DEFINE_integer("epochs", 1, "passes over the training data")
flags.DEFINE_integer("max_steps", -1, "stop training after this many steps (-1: no limit)")
flags.DEFINE_float("learning_rate", 24.0, "peak learning rate")
flags.DEFINE_enum("optimizer", "sgd", list(OPTIMIZERS),
                  "optimizer for the MLPs; tables use its sparse (lazy) form")
flags.DEFINE_float("beta1", 0.9, "Adam beta1")
flags.DEFINE_float("beta2", 0.999, "Adam beta2")
flags.DEFINE_integer("warmup_steps", 8000, "linear learning-rate warmup steps")
flags.DEFINE_integer("decay_start_step", 48000, "step at which polynomial decay starts")
flags.DEFINE_integer("decay_steps", 24000, "length of the polynomial (power 2) decay to zero; 0: no decay")
flags.DEFINE_list("embedding_dim", ["128"], "embedding width: one value, or one per categorical feature, or a JSON "
                  "file holding the list of per-feature widths")
flags.DEFINE_list("bottom_mlp_dims", ["512", "256", "128"], "bottom MLP output widths")
flags.DEFINE_list("top_mlp_dims", ["1024", "1024", "512", "256", "1"], "top MLP output widths (last is the logit)")
flags.DEFINE_enum("interaction", "dot", list(INTERACTIONS) + list(INTERACTION_ALIASES), "dot: DLRM pairwise dots "
                  "(the custom op where it loads, else TensorFlow ops with a warning); dot_custom (or the reference's "
                  "dot_custom_cuda): dot, the custom op or an error; dot_tensorflow: dot on TensorFlow ops, never the "
                  "op; cross: DCNv2 cross network")
flags.DEFINE_string("model", "", "a Python file defining build_model(features, hparams) -> ranking.Model: trains, "
                    "evaluates or times that model instead of DLRM/DCNv2 (docs/models.md)")
flags.DEFINE_string("model_params", "", "with --model: a YAML file of the model's hyper-parameters (a mapping)")
flags.DEFINE_multi_string("model_param", None, "with --model: one hyper-parameter name=value (the value read as "
                          "YAML), over --model_params; repeat the flag for several")
flags.DEFINE_list("dynamic_tables", [], "dynamic tables (raw int64 ids, no vocabulary: docs/dynamic_tables.md), "
                  "entries <feature>:<capacity>[:<admit_after>[:<policy>[:<ttl>[:<shards>]]]]: feature by index or "
                  "name, or all (every raw-id feature without an entry); rows shared by the ids seen so far (or "
                  "<factor>x: that factor times the feature's distinct ids preprocessing counted), an id admitted at "
                  "its admit_after-th sighting (default "
                  "1), rows reused by policy lru (default), lfu or ttl (rows unused for ttl steps; 0 for the others), "
                  "hash shards (default 1) spread over the ranks (shard s on rank s % N)")
flags.DEFINE_integer("num_cross_layers", 3, "DCNv2 cross layers")
flags.DEFINE_integer("cross_layer_projection_dim", 512, "DCNv2 low-rank projection width (0: full rank)")
flags.DEFINE_bool("amp", False, "mixed precision: float16 with loss scaling on GPU, bfloat16 on CPU; tables stay float32")
flags.DEFINE_bool("xla", False, "jit-compile the train and evaluation steps with XLA")
flags.DEFINE_integer("print_freq", 100, "print a progress line every this many steps")
flags.DEFINE_integer("evals_per_epoch", 1, "evaluations per epoch (0: only at the end of training)")
flags.DEFINE_string("log_path", "", "JSON-lines log file; TensorBoard scalars go to <log_path without .json>_tb/")
flags.DEFINE_string("save_checkpoint_path", "", "directory for checkpoints (written at the end of training)")
flags.DEFINE_string("restore_checkpoint_path", "", "checkpoint directory to resume or evaluate from")
flags.DEFINE_bool("skip_checkpoint_checksums", False, "restore without verifying the checksums of the checkpoint's "
                  "pieces (faster; a piece changed on disk then goes unnoticed); a checkpoint whose manifest "
                  "records no checksums restores only with it")
flags.DEFINE_enum("restore_mode", "resume", list(RESTORE_MODES), "training from --restore_checkpoint_path: "
                  "resume (the same data and settings, exactly where the checkpoint stopped; nothing left to "
                  "train is an error), continue (weights and optimizer state; this run's own data and epochs from "
                  "its start), weights (the model's weights only, a fresh optimizer)")
flags.DEFINE_enum("restore_lr_schedule", "restart", list(LR_SCHEDULE_RESTORES), "with --restore_mode=continue: "
                  "restart (warmup and decay counted from the restored step) or continue (from step 0 of the "
                  "first run, as if uninterrupted)")
flags.DEFINE_integer("checkpoint_every_n_steps", 0, "also checkpoint every this many steps (0: only at the end)")
flags.DEFINE_float("preemption_grace_s", 120.0, "after SIGTERM or SIGINT in training, the seconds the step and its "
                   "checkpoint may take (every rank stops at the same step); past it, or at a second signal, the "
                   "run ends at once, the unfinished checkpoint removed (utils/preemption.py)")
flags.DEFINE_integer("keep_checkpoints", 2, "checkpoints kept in --save_checkpoint_path: the newest writes (and "
                     "the best, with --keep_best_checkpoint)")
flags.DEFINE_bool("keep_best_checkpoint", False, "also keep the checkpoint with the best evaluation AUC (or "
                  "--keep_best_metric; named by <save_checkpoint_path>/best); a model that beats it is checkpointed "
                  "when evaluated; chosen on the feature spec's validation mapping where it has one (evaluated "
                  "after each evaluation)")
flags.DEFINE_enum("keep_best_metric", "auc", list(BEST_METRICS), "the evaluation figure --keep_best_checkpoint "
                  "chooses by: auc (the highest) or logloss (the lowest)")
flags.DEFINE_string("train_mapping", "train", "the feature spec's source_spec mapping to train on")
flags.DEFINE_bool("validate_dataset", False, "scan every value of the dataset's files before training "
                  "(ids in range, finite numericals, 0/1 labels, offsets); sizes are always checked")
flags.DEFINE_bool("shuffle_batch_order", True, "reshuffle the order of the training batches every epoch (from "
                  "--seed); false: file order")
flags.DEFINE_bool("train_last_partial_batch", False, "also train on the last, smaller batch of each epoch (its "
                  "size rounded down to a multiple of the ranks)")
flags.DEFINE_enum("multi_hot_combiner", None, list(COMBINERS), "how a multi-hot feature's embeddings are combined "
                  "(default sum); only for datasets with multi-hot features")
flags.DEFINE_integer("synthetic_rows", 2 ** 21, "synthetic training samples per epoch")
# The reference's names for the synthetic data (run.config.REFERENCE_SYNTHETIC maps them onto ours).
flags.DEFINE_bool("synthetic_dataset_use_feature_spec", False, "synthetic data shaped by the feature spec at "
                  "--dataset_path/--feature_spec (cardinalities, numerical count, hotness, alpha)")
flags.DEFINE_integer("synthetic_dataset_train_batches", None, "synthetic training batches per epoch "
                     "(--synthetic_rows = this x --batch_size)")
flags.DEFINE_integer("synthetic_dataset_valid_batches", None, "synthetic evaluation batches "
                     "(--synthetic_eval_rows = this x --valid_batch_size)")
flags.DEFINE_list("synthetic_dataset_cardinalities", None, "the reference's name for --synthetic_cardinalities")
flags.DEFINE_list("synthetic_dataset_hotness", None, "per feature: 1 one-hot, h > 1 multi-hot with 0..h ids a row")
flags.DEFINE_integer("synthetic_dataset_num_numerical_features", None, "the reference's name for "
                     "--synthetic_num_numerical")
flags.DEFINE_list("inference_batch_sizes", ["1", "64", "1024", "8192"], "batch sizes timed by --mode=inference")
flags.DEFINE_integer("inference_steps", 100, "timed batches per batch size in --mode=inference")

flags.DEFINE_enum("dist_strategy", "memory_balanced", list(DIST_STRATEGIES),
                  "placement of the embedding tables over the ranks: basic (round-robin), memory_balanced "
                  "(largest first, dealt in snake order: equal counts, similar memory), memory_optimized "
                  "(largest first onto the least-loaded rank)")
flags.DEFINE_integer("column_slice_threshold", None, "split tables with more elements than this by columns into "
                     "2^k slices on different ranks (unset: only when there are fewer tables than ranks)")
flags.DEFINE_integer("row_slice_threshold", None, "split tables with more elements than this by rows over all "
                     "ranks (unset: never)")
flags.DEFINE_integer("data_parallel_threshold", None, "replicate tables with at most this many elements on every "
                     "rank, gradients allreduced (unset: never)")
flags.DEFINE_bool("data_parallel_input", False, "each rank reads every feature of its local batch (ids are "
                  "exchanged by an all-to-all) instead of its own tables' ids for the global batch")

flags.DEFINE_float("loss_scale", None, "static loss scale for float16 AMP (--amp on a GPU); unset: dynamic "
                  "loss scaling")
flags.DEFINE_bool("embedding_trainable", True, "false: the embedding tables are frozen (no table gradients or "
                  "updates); the MLPs still train")
flags.DEFINE_bool("embedding_zeros_initializer", False, "initialise the embedding tables to zeros (fast start-up "
                  "for benchmarks and debugging)")
flags.DEFINE_integer("cpu_offloading_threshold_gb", None, "GiB of a rank's embedding table parameters above which, "
                     "on a GPU, the largest tables go to host memory until those left in GPU memory fit; a CPU run "
                     "keeps every table in host memory (a line after the plan says so)")
flags.DEFINE_float("embedding_memory_budget_gb", None, "GiB of embedding state a rank keeps in memory (tables, "
                   "optimizer slots, dynamic tables' id maps, the disk tier's caches and their index); the largest "
                   "tables above it go to disk, each with an in-memory cache (unset: no limit)")
flags.DEFINE_string("embedding_store_path", None, "directory of the disk tier's files (with "
                    "--embedding_memory_budget_gb; needed when a table goes to disk)")
flags.DEFINE_enum("embedding_cache_policy", "lru", list(CACHE_POLICIES), "eviction in the disk tier's caches (with "
                  "--embedding_memory_budget_gb): lru (least recently used rows) or lfu (least frequently used)")
flags.DEFINE_integer("profiler_start_step", None, "write a TensorFlow profile of training steps N..N+99 (0-based; "
                     "fewer if training ends first) to the TensorBoard directory of --log_path")
flags.DEFINE_integer("profiled_rank", 0, "the rank --profiler_start_step profiles")
flags.DEFINE_bool("cpu", False, "run on the CPU even where GPUs are visible (they are hidden before TensorFlow "
                  "starts)")
flags.DEFINE_bool("tfdata_debug", False, "tf.data debug mode (tf.data.experimental.enable_debug_mode), and the "
                  "batches are made in the training thread, without prefetching")
flags.DEFINE_integer("inter_op_parallelism", None, "TensorFlow's inter-op thread pool size (unset or 0: its choice)")
flags.DEFINE_integer("intra_op_parallelism", None, "TensorFlow's intra-op thread pool size (unset or 0: its choice)")
flags.DEFINE_bool("run_eagerly", False, "debugging: run the train and predict steps eagerly, op by op (no "
                  "tf.function)")
flags.DEFINE_integer("auc_thresholds", None, "also report the reference's approximate AUC (Keras AUC with this many "
                     "thresholds, ROC, interpolation) as auc_thresholded beside the exact auc (unset: exact only)")


def set_defaults(**defaults):
    """Sets model defaults before parsing (used by dlrm.py / dcnv2.py)."""
    for name, value in defaults.items():
        FLAGS.set_default(name, value)


def config_from_flags(world_size: int = 1) -> RunConfig:
    """Builds the validated RunConfig from the parsed flags."""
    names = [name for name in SETTINGS if name not in ("embedding_dims", "shape")]
    names += ["embedding_dim", *REFERENCE_SYNTHETIC]
    values = {n: FLAGS[n].value for n in names}
    present = {n for n in names if FLAGS[n].present}
    return build_config(values, present, world_size)
