"""The flag defaults of run/flags.py (DLRM's) as absl hands them over (lists as lists of
strings), and run.config.build_config on them with overrides."""
from run.config import build_config

DEFAULTS = dict(
    mode="train", batch_size=64 * 1024, valid_batch_size=64 * 1024, epochs=1, max_steps=-1,
    learning_rate=24.0, optimizer="sgd", beta1=0.9, beta2=0.999, warmup_steps=8000, decay_start_step=48000,
    decay_steps=24000, embedding_dim=["128"], bottom_mlp_dims=["512", "256", "128"],
    top_mlp_dims=["1024", "1024", "512", "256", "1"], interaction="dot", num_cross_layers=3,
    cross_layer_projection_dim=512, amp=False, xla=False, seed=12345, print_freq=100, evals_per_epoch=1,
    log_path="", save_checkpoint_path="", restore_checkpoint_path="", checkpoint_every_n_steps=0,
    dataset_path="", dataset_type="split_binary",
    synthetic_cardinalities=["100000", "50000", "20000", "10000", "5000", "3000", "2000", "1000", "500", "300",
                             "200", "100", "100000", "50000", "20000", "10000", "1000", "500", "100", "50",
                             "20", "10", "8", "4", "3", "2"],
    synthetic_num_numerical=13, synthetic_rows=2 ** 21, synthetic_eval_rows=2 ** 18, synthetic_alpha=1.05,
    inference_batch_sizes=["1", "64", "1024", "8192"], inference_steps=100, dist_strategy="memory_balanced",
    column_slice_threshold=None, row_slice_threshold=None, data_parallel_threshold=None, data_parallel_input=False,
    feature_spec="", train_mapping="train", eval_mapping="test", validate_dataset=False, shuffle_batch_order=True,
    train_last_partial_batch=False, multi_hot_combiner=None, keep_checkpoints=2, keep_best_checkpoint=False,
    keep_best_metric="auc", restore_mode="resume", restore_lr_schedule="restart")
DEFAULTS.update(loss_scale=None, dynamic_tables=[], embedding_trainable=True, embedding_zeros_initializer=False,
                cpu_offloading_threshold_gb=None, profiler_start_step=None, profiled_rank=0, cpu=False,
                tfdata_debug=False, inter_op_parallelism=None, intra_op_parallelism=None)
DEFAULTS.update(run_eagerly=False, auc_thresholds=None)
DEFAULTS.update(embedding_memory_budget_gb=None, embedding_store_path=None, embedding_cache_policy="lru")
DEFAULTS.update(skip_checkpoint_checksums=False)
DEFAULTS.update(model="", model_params="", model_param=None)
DEFAULTS.update(synthetic_labels=1, synthetic_history_length=0)

FOUR_CARDS = ["10", "20", "30", "40"]


def values(**overrides):
    """The flag defaults on the synthetic dataset (which needs no files), with `overrides`."""
    v = dict(DEFAULTS, dataset_type="synthetic")
    v.update(overrides)
    return v


def build(present=None, world_size=1, **overrides):
    """build_config on the defaults with `overrides`; by default every override counts as set
    explicitly on the command line."""
    return build_config(values(**overrides), set(overrides) if present is None else set(present), world_size)
