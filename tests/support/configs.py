"""Small run configurations for tests."""
from run.config import build_config

TINY = dict(
    mode="train", batch_size=128, valid_batch_size=500, epochs=1, max_steps=-1, learning_rate=0.003,
    optimizer="adam", beta1=0.9, beta2=0.999, warmup_steps=5, decay_start_step=20, decay_steps=20,
    embedding_dim=["8"], bottom_mlp_dims=["16", "8"], top_mlp_dims=["16", "1"], interaction="dot",
    num_cross_layers=2, cross_layer_projection_dim=4, amp=False, xla=False, seed=5, print_freq=10,
    evals_per_epoch=1, log_path="", save_checkpoint_path="", restore_checkpoint_path="",
    checkpoint_every_n_steps=0, dataset_path="", dataset_type="synthetic",
    synthetic_cardinalities=["20", "50", "7", "30"], synthetic_num_numerical=3, synthetic_rows=128 * 40,
    synthetic_eval_rows=1000, synthetic_alpha=1.05, inference_batch_sizes=["1", "16"], inference_steps=5,
    dist_strategy="memory_balanced", column_slice_threshold=None, row_slice_threshold=None,
    data_parallel_threshold=None, data_parallel_input=False)


def make_config(base: dict, **overrides):
    """`base` with `overrides`, validated; the overrides count as set on the command line."""
    return build_config(dict(base, **overrides), present=set(overrides))


def tiny_config(**overrides):
    """A valid tiny configuration (40 steps of batch 128) with `overrides` applied."""
    return make_config(TINY, **overrides)
