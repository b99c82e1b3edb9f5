"""Flag validation rules of run/config.py (pure Python: no TensorFlow, no model).

Every rule must stop the run with a ConfigError whose message is ONE line naming the offending
flag as `--name`; a flag that does not apply in the chosen setting is an error only when the
user set it explicitly.
"""
import os
import subprocess
import sys

import pytest

from run.config import _APPLIES_ONLY, SETTINGS, RunConfig
from utils.errors import ConfigError
from tests.support.flag_defaults import DEFAULTS, FOUR_CARDS, build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def assert_rejected(flag, fragment=None, present=None, world_size=1, **overrides):
    with pytest.raises(ConfigError) as info:
        build(present=present, world_size=world_size, **overrides)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message and message, repr(message)
    assert f"--{flag}" in message, message
    if fragment:
        assert fragment in message, message
    return message


# --------------------------------------------------------------------------------------------
# Baselines that must be accepted.

def test_flag_defaults_are_valid_and_typed():
    cfg = build()
    assert isinstance(cfg, RunConfig)
    assert cfg.model.embedding_dims == [128] * 26
    assert cfg.model.bottom_mlp_dims == [512, 256, 128]
    assert cfg.model.top_mlp_dims == [1024, 1024, 512, 256, 1]
    assert cfg.evaluation.inference_batch_sizes == [1, 64, 1024, 8192]
    assert cfg.data.synthetic_cardinalities[:3] == [100000, 50000, 20000]
    assert cfg.data.num_categorical == 26 and cfg.data.num_numerical == 13


def test_baseline_mirrors_flag_defaults():
    """DEFAULTS above is what run/flags.py defines (absl only, no TensorFlow), and every
    RunConfig field has a flag."""
    from run import flags as run_flags
    fields = set(SETTINGS) - {"embedding_dims", "shape"} | {"embedding_dim"}
    assert set(DEFAULTS) == fields
    for name, default in DEFAULTS.items():
        assert run_flags.FLAGS[name].default == default, name


def test_dcnv2_defaults_are_valid():
    cfg = build(present=set(), interaction="cross", optimizer="adam", learning_rate=0.0001, warmup_steps=100,
                decay_start_step=48000, decay_steps=24000)
    assert cfg.model.interaction == "cross" and cfg.model.num_cross_layers == 3
    assert cfg.model.cross_layer_projection_dim == 512


def test_config_is_pure_python():
    """Flag errors come before (and without) the TensorFlow import."""
    code = ("import sys, run.config, run.flags, main; "
            "sys.exit(1 if 'tensorflow' in sys.modules else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------------
# Every rule: (flag named in the message, fragment of the message, overrides, world_size).

RULES = [
    # enums
    ("mode", "must be one of", dict(mode="serve"), 1),
    ("optimizer", "must be one of", dict(optimizer="rmsprop"), 1),
    ("interaction", "must be one of", dict(interaction="concat"), 1),
    ("dataset_type", "must be one of", dict(dataset_type="criteo"), 1),
    ("restore_mode", "must be one of", dict(restore_checkpoint_path="/t", restore_mode="auto"), 1),
    ("restore_lr_schedule", "must be one of", dict(restore_checkpoint_path="/t", restore_mode="continue",
                                                   restore_lr_schedule="keep"), 1),
    # positive sizes
    ("batch_size", "must be positive", dict(batch_size=0), 1),
    ("batch_size", "must be positive", dict(batch_size=-64), 1),
    ("valid_batch_size", "must be positive", dict(valid_batch_size=0), 1),
    ("epochs", "must be positive", dict(epochs=0), 1),
    ("learning_rate", "must be positive", dict(learning_rate=0.0), 1),
    ("learning_rate", "must be positive", dict(learning_rate=-0.1), 1),
    ("print_freq", "must be positive", dict(print_freq=0), 1),
    ("synthetic_rows", "must be positive", dict(synthetic_rows=0), 1),
    ("synthetic_eval_rows", "must be positive", dict(synthetic_eval_rows=0), 1),
    ("synthetic_num_numerical", "must be positive", dict(synthetic_num_numerical=0), 1),
    ("inference_steps", "must be positive", dict(mode="inference", inference_steps=0), 1),
    ("embedding_dim", "must be positive", dict(embedding_dim=["0"]), 1),
    ("embedding_dim", "must be positive", dict(synthetic_cardinalities=FOUR_CARDS, interaction="cross",
                                               embedding_dim=["8", "-8", "8", "8"]), 1),
    ("bottom_mlp_dims", "must be positive", dict(bottom_mlp_dims=["64", "0", "128"]), 1),
    ("bottom_mlp_dims", "must not be empty", dict(bottom_mlp_dims=[]), 1),
    ("top_mlp_dims", "must be positive", dict(top_mlp_dims=["16", "-4", "1"]), 1),
    ("top_mlp_dims", "must not be empty", dict(top_mlp_dims=[]), 1),
    ("inference_batch_sizes", "must be positive", dict(mode="inference", inference_batch_sizes=["1", "0"]), 1),
    ("inference_batch_sizes", "must not be empty", dict(mode="inference", inference_batch_sizes=[]), 1),
    ("synthetic_cardinalities", "must be positive", dict(synthetic_cardinalities=["10", "0"]), 1),
    ("synthetic_cardinalities", "must not be empty", dict(synthetic_cardinalities=[]), 1),
    # non-integer list entries
    ("embedding_dim", "list of integers", dict(embedding_dim=["8x"]), 1),
    ("bottom_mlp_dims", "list of integers", dict(bottom_mlp_dims=["512", "a", "128"]), 1),
    ("top_mlp_dims", "list of integers", dict(top_mlp_dims=["16", "1.5"]), 1),
    ("synthetic_cardinalities", "list of integers", dict(synthetic_cardinalities=["ten", "20"]), 1),
    ("inference_batch_sizes", "list of integers", dict(mode="inference", inference_batch_sizes=["1", "x"]), 1),
    # negative counts
    ("warmup_steps", ">= 0", dict(warmup_steps=-1), 1),
    ("decay_start_step", ">= 0", dict(decay_start_step=-1, warmup_steps=0), 1),
    ("decay_steps", ">= 0", dict(decay_steps=-1), 1),
    ("evals_per_epoch", ">= 0", dict(evals_per_epoch=-1), 1),
    ("checkpoint_every_n_steps", ">= 0", dict(checkpoint_every_n_steps=-5, save_checkpoint_path="/tmp/ck"), 1),
    ("cross_layer_projection_dim", ">= 0", dict(interaction="cross", cross_layer_projection_dim=-1), 1),
    ("synthetic_alpha", ">= 0", dict(synthetic_alpha=-0.5), 1),
    # max_steps: positive or -1
    ("max_steps", "-1 for no limit", dict(max_steps=0), 1),
    ("max_steps", "-1 for no limit", dict(max_steps=-2), 1),
    # Adam betas in [0, 1)
    ("beta1", "[0, 1)", dict(optimizer="adam", beta1=1.0), 1),
    ("beta1", "[0, 1)", dict(optimizer="adam", beta1=-0.1), 1),
    ("beta2", "[0, 1)", dict(optimizer="adam", beta2=1.0), 1),
    ("beta2", "[0, 1)", dict(optimizer="adam", beta2=1.5), 1),
    # schedule
    ("decay_start_step", "--warmup_steps", dict(warmup_steps=100, decay_start_step=50, decay_steps=10), 1),
    # model shape
    ("top_mlp_dims", "must be 1", dict(top_mlp_dims=["16", "2"]), 1),
    ("embedding_dim", "--interaction=dot", dict(synthetic_cardinalities=FOUR_CARDS, bottom_mlp_dims=["8"],
                                                embedding_dim=["8", "8", "16", "8"]), 1),
    ("bottom_mlp_dims", "--embedding_dim", dict(embedding_dim=["64"]), 1),
    ("num_cross_layers", "--interaction=cross", dict(interaction="cross", num_cross_layers=0), 1),
    ("num_cross_layers", "--interaction=cross", dict(interaction="cross", num_cross_layers=-1), 1),
    ("embedding_dim", "one value or one per feature", dict(embedding_dim=["128", "128"]), 1),
    ("embedding_dim", "one value or one per feature", dict(synthetic_cardinalities=FOUR_CARDS, interaction="cross",
                                                           embedding_dim=["8", "8", "8", "8", "8"]), 1),
    # distribution
    ("batch_size", "(3)", dict(batch_size=64 * 1024), 3),
    # data and files
    ("synthetic_rows", "--batch_size", dict(batch_size=128, synthetic_rows=100), 1),
    ("checkpoint_every_n_steps", "--save_checkpoint_path", dict(checkpoint_every_n_steps=100), 1),
    ("keep_checkpoints", "--save_checkpoint_path", dict(keep_checkpoints=3), 1),
    ("keep_checkpoints", ">= 1", dict(keep_checkpoints=0, save_checkpoint_path="/tmp/ck"), 1),
    ("keep_best_checkpoint", "--save_checkpoint_path", dict(keep_best_checkpoint=True), 1),
    ("keep_best_checkpoint", "--save_checkpoint_path", dict(keep_best_checkpoint=True, mode="eval",
                                                            restore_checkpoint_path="/tmp/ck"), 1),
    ("restore_checkpoint_path", "--mode=eval", dict(mode="eval"), 1),
    ("dataset_path", "--dataset_type=split_binary", dict(dataset_path="/data/criteo"), 1),
    ("dataset_path", "--dataset_type=split_binary needs", dict(dataset_type="split_binary"), 1),
    ("feature_spec", "--dataset_type=split_binary", dict(feature_spec="/data/criteo/feature_spec.yaml"), 1),
    ("eval_mapping", "--dataset_type=split_binary", dict(eval_mapping="validation"), 1),
    ("validate_dataset", "--dataset_type=split_binary", dict(validate_dataset=True), 1),
    ("multi_hot_combiner", "--dataset_type=split_binary", dict(multi_hot_combiner="mean"), 1),
    # placement flags at one rank
    ("dist_strategy", "several ranks", dict(dist_strategy="basic"), 1),
    ("dist_strategy", "several ranks", dict(dist_strategy="memory_balanced"), 1),   # even its default value
    ("column_slice_threshold", "several ranks", dict(column_slice_threshold=1000), 1),
    ("row_slice_threshold", "several ranks", dict(row_slice_threshold=1000), 1),
    ("data_parallel_threshold", "several ranks", dict(data_parallel_threshold=100), 1),
    ("data_parallel_input", "several ranks", dict(data_parallel_input=True), 1),
    # debugging and evaluation
    ("run_eagerly", "--xla", dict(run_eagerly=True, xla=True), 1),
    ("auc_thresholds", ">= 2", dict(auc_thresholds=1), 1),
    # storage tiers
    ("embedding_memory_budget_gb", "must be positive", dict(embedding_memory_budget_gb=0.0), 1),
    ("embedding_memory_budget_gb", "must be positive", dict(embedding_memory_budget_gb=-2.5), 1),
    ("embedding_cache_policy", "must be one of", dict(embedding_memory_budget_gb=1.0, embedding_cache_policy="fifo"),
     1),
    ("data_parallel_input", "--embedding_memory_budget_gb", dict(data_parallel_input=True,
                                                                 embedding_memory_budget_gb=1.0), 2),
    ("embedding_dim", "cannot read", dict(embedding_dim=["/nonexistent/widths.json"]), 1),
]


@pytest.mark.parametrize("flag,fragment,overrides,world_size", RULES,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(RULES)])
def test_rule_rejects_with_one_line_naming_the_flag(flag, fragment, overrides, world_size):
    assert_rejected(flag, fragment, world_size=world_size, **overrides)


@pytest.mark.parametrize("overrides,world_size", [
    (dict(batch_size=64 * 1024), 4),                                    # divisible by the ranks
    (dict(max_steps=1), 1),
    (dict(warmup_steps=100, decay_start_step=100, decay_steps=10), 1),  # decay right after warmup
    (dict(warmup_steps=100, decay_steps=0), 1),                         # no decay
    (dict(optimizer="adam", beta1=0.0, beta2=0.0), 1),
    (dict(interaction="cross", cross_layer_projection_dim=0), 1),       # full-rank cross
    (dict(batch_size=128, synthetic_rows=128), 1),                      # exactly one batch
    (dict(checkpoint_every_n_steps=100, save_checkpoint_path="/tmp/ck"), 1),
    (dict(keep_checkpoints=1, keep_best_checkpoint=True, save_checkpoint_path="/tmp/ck"), 1),
    (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), 1),
    (dict(mode="inference"), 1),                                        # inference of a fresh model
    (dict(synthetic_alpha=0.0, evals_per_epoch=0, warmup_steps=0), 1),
    (dict(embedding_memory_budget_gb=1e-6), 1),                         # any positive budget, at one rank too
    (dict(embedding_memory_budget_gb=80.0, data_parallel_input=False), 2),
    (dict(data_parallel_input=True), 2),                                # data-parallel input without a budget
])
def test_boundary_values_are_accepted(overrides, world_size):
    cfg = build(world_size=world_size, **overrides)
    for name, value in overrides.items():
        assert cfg.value(name) == value, name


def test_per_feature_embedding_dims_with_cross():
    cfg = build(synthetic_cardinalities=FOUR_CARDS, interaction="cross", embedding_dim=["4", "8", "2", "6"])
    assert cfg.model.embedding_dims == [4, 8, 2, 6]
    assert cfg.data.cardinalities == [10, 20, 30, 40]


def test_one_embedding_dim_is_broadcast_to_all_features():
    cfg = build(synthetic_cardinalities=FOUR_CARDS, embedding_dim=["16"], bottom_mlp_dims=["32", "16"])
    assert cfg.model.embedding_dims == [16, 16, 16, 16]
    cfg = build(synthetic_cardinalities=FOUR_CARDS, interaction="cross", embedding_dim=["6"])
    assert cfg.model.embedding_dims == [6, 6, 6, 6]


def test_integer_lists_accept_ints_too():
    cfg = build(synthetic_cardinalities=[10, 20], embedding_dim=[8], bottom_mlp_dims=[16, 8], top_mlp_dims=[4, 1])
    assert (cfg.data.synthetic_cardinalities, cfg.model.embedding_dims, cfg.model.bottom_mlp_dims) == (
        [10, 20], [8, 8], [16, 8])


# --------------------------------------------------------------------------------------------
# Flags that apply only in some settings: explicit -> error naming the flag; default -> fine.
# name -> list of (overrides that make it not apply (set explicitly), the flag's value).
# `values` behind them: save_checkpoint_path is given (not explicitly) so that a non-zero
# --checkpoint_every_n_steps does not trip its own rule.

NOT_APPLYING = {
    "beta1": [(dict(optimizer="sgd"), 0.5), (dict(optimizer="adagrad"), 0.5)],
    "beta2": [(dict(optimizer="sgd"), 0.99), (dict(optimizer="adagrad"), 0.99)],
    "num_cross_layers": [(dict(interaction="dot"), 2)],
    "cross_layer_projection_dim": [(dict(interaction="dot"), 16)],
    "epochs": [(dict(mode="inference"), 2), (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), 2)],
    "max_steps": [(dict(mode="inference"), 10), (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), 10)],
    "evals_per_epoch": [(dict(mode="inference"), 2), (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), 2)],
    "checkpoint_every_n_steps": [(dict(mode="inference"), 10),
                                 (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), 10)],
    "save_checkpoint_path": [(dict(mode="inference"), "/tmp/ck2"),
                             (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), "/tmp/ck2")],
    "inference_batch_sizes": [(dict(mode="train"), ["1", "2"]),
                              (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), ["1", "2"])],
    "inference_steps": [(dict(mode="train"), 7), (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), 7)],
    "synthetic_rows": [(dict(mode="inference"), 4096),
                       (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), 4096)],
    "batch_size": [(dict(mode="inference"), 1024), (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), 1024)],
    "learning_rate": [(dict(mode="inference"), 0.5), (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), 0.5)],
    "warmup_steps": [(dict(mode="inference"), 10), (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), 10)],
    "decay_steps": [(dict(mode="inference"), 10), (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), 10)],
    "decay_start_step": [(dict(decay_steps=0), 50), (dict(mode="inference"), 60000),
                         (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), 60000)],
    "print_freq": [(dict(mode="inference"), 10), (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), 10)],
    "valid_batch_size": [(dict(mode="inference"), 4096)],
    "synthetic_eval_rows": [(dict(mode="inference"), 4096)],
    "train_mapping": [(dict(mode="inference"), "train2"), (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), "t")],
    "shuffle_batch_order": [(dict(mode="inference"), False),
                            (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), False)],
    "train_last_partial_batch": [(dict(mode="inference"), True),
                                 (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), True)],
    "auc_thresholds": [(dict(mode="inference"), 8000)],
    "restore_mode": [(dict(mode="train"), "continue"),
                     (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), "weights")],
    "restore_lr_schedule": [(dict(mode="train"), "continue"),
                            (dict(mode="train", restore_checkpoint_path="/tmp/ck"), "continue"),
                            (dict(restore_checkpoint_path="/tmp/ck", restore_mode="weights"), "continue")],
}
NOT_APPLYING.update({
    "loss_scale": [(dict(amp=False), 1024.0)],
    "embedding_trainable": [(dict(mode="inference"), False),
                            (dict(mode="eval", restore_checkpoint_path="/tmp/ck"), False)],
    "profiler_start_step": [(dict(mode="inference", log_path="/tmp/l.json"), 3),
                            (dict(mode="eval", restore_checkpoint_path="/tmp/ck", log_path="/tmp/l.json"), 3)],
    "profiled_rank": [(dict(), 0)],
    "embedding_store_path": [(dict(), "/tmp/store"), (dict(embedding_memory_budget_gb=None), "/tmp/store")],
    "embedding_cache_policy": [(dict(), "lfu"), (dict(embedding_memory_budget_gb=None), "lru")],
    "skip_checkpoint_checksums": [(dict(), True), (dict(mode="inference"), True)],
    "model_params": [(dict(), "/tmp/params.yaml")],
    "model_param": [(dict(), ("hidden=[8]",))],
})
NOT_APPLYING_CASES = [(name, setting, value) for name, cases in NOT_APPLYING.items() for setting, value in cases]


def test_every_applies_only_entry_is_tested():
    assert set(NOT_APPLYING) == set(_APPLIES_ONLY)


@pytest.mark.parametrize("name,setting,value", NOT_APPLYING_CASES,
                         ids=[f"{c[0]}-{'-'.join(map(str, c[1].values()))}" for c in NOT_APPLYING_CASES])
def test_flag_set_where_it_does_not_apply_is_rejected(name, setting, value):
    overrides = dict(setting, **{name: value})
    if name == "checkpoint_every_n_steps":
        overrides["save_checkpoint_path"] = "/tmp/ck"
    _, where = _APPLIES_ONLY[name]
    message = assert_rejected(name, "only applies with", present=set(setting) | {name}, **overrides)
    assert where in message
    # The same values with the flag left at its (not explicitly set) value are accepted.
    cfg = build(present=set(setting), **overrides)
    assert cfg.value(name) in (value, [int(x) for x in value] if isinstance(value, list) else value)


def test_every_flag_set_where_it_does_not_apply_is_named_in_one_line():
    """A training command run with --mode=eval: one line names every flag that does not apply, by where each does."""
    message = assert_rejected("batch_size", present={"mode", "restore_checkpoint_path", "batch_size", "epochs",
                                                     "learning_rate", "warmup_steps", "beta1", "dataset_path"},
                              mode="eval", restore_checkpoint_path="/tmp/ck", batch_size=1024, epochs=2,
                              learning_rate=0.5, warmup_steps=10, beta1=0.5, dataset_path="/data")
    assert message == ("--batch_size, --epochs, --learning_rate and --warmup_steps only apply with --mode=train; "
                       "--beta1 only applies with --optimizer=adam; --dataset_path only applies with "
                       "--dataset_type=split_binary or split_tfrecords; remove them or change those flags")
    message = assert_rejected("epochs", present={"mode", "restore_checkpoint_path", "epochs", "max_steps"},
                              mode="eval", restore_checkpoint_path="/tmp/ck", epochs=2, max_steps=10)
    assert message == "--epochs and --max_steps only apply with --mode=train; remove them or change those flags"


@pytest.mark.parametrize("name,setting", [
    ("beta1", dict(optimizer="adam")), ("beta2", dict(optimizer="adam")),
    ("num_cross_layers", dict(interaction="cross")), ("cross_layer_projection_dim", dict(interaction="cross")),
    ("epochs", dict(mode="train")), ("max_steps", dict(mode="train")), ("evals_per_epoch", dict(mode="train")),
    ("save_checkpoint_path", dict(mode="train")), ("synthetic_rows", dict(mode="train")),
    ("inference_batch_sizes", dict(mode="inference")), ("inference_steps", dict(mode="inference")),
    ("batch_size", dict(mode="train")), ("learning_rate", dict(mode="train")),
    ("warmup_steps", dict(mode="train")), ("decay_steps", dict(mode="train")),
    ("decay_start_step", dict(mode="train", decay_steps=10)), ("print_freq", dict(mode="train")),
    ("valid_batch_size", dict(mode="train")), ("valid_batch_size", dict(mode="eval", restore_checkpoint_path="/t")),
    ("synthetic_eval_rows", dict(mode="train")),
    ("synthetic_eval_rows", dict(mode="eval", restore_checkpoint_path="/t")),
    ("shuffle_batch_order", dict(mode="train")), ("train_last_partial_batch", dict(mode="train")),
    ("auc_thresholds", dict(mode="train")), ("auc_thresholds", dict(mode="eval", restore_checkpoint_path="/t")),
    ("restore_mode", dict(restore_checkpoint_path="/t")),
    ("restore_lr_schedule", dict(restore_checkpoint_path="/t", restore_mode="continue")),
    ("embedding_store_path", dict(embedding_memory_budget_gb=2.5)),
    ("embedding_cache_policy", dict(embedding_memory_budget_gb=2.5)),
    ("skip_checkpoint_checksums", dict(restore_checkpoint_path="/t")),
    ("skip_checkpoint_checksums", dict(mode="eval", restore_checkpoint_path="/t")),
])
def test_flag_set_where_it_applies_is_accepted(name, setting):
    value = {"beta1": 0.5, "beta2": 0.99, "num_cross_layers": 2, "cross_layer_projection_dim": 16, "epochs": 2,
             "max_steps": 10, "evals_per_epoch": 2, "save_checkpoint_path": "/tmp/ck", "synthetic_rows": 2 ** 20,
             "inference_batch_sizes": ["1", "2"], "inference_steps": 7, "batch_size": 4096, "learning_rate": 0.5,
             "warmup_steps": 10, "decay_steps": 10, "decay_start_step": 60000, "print_freq": 10,
             "valid_batch_size": 4096, "synthetic_eval_rows": 4096, "shuffle_batch_order": False,
             "train_last_partial_batch": True, "auc_thresholds": 8000, "restore_mode": "weights",
             "restore_lr_schedule": "continue", "embedding_store_path": "/tmp/store",
             "embedding_cache_policy": "lfu", "skip_checkpoint_checksums": True}[name]
    cfg = build(**dict(setting, **{name: value}))
    expected = [int(x) for x in value] if isinstance(value, list) else value
    assert cfg.value(name) == expected


# --------------------------------------------------------------------------------------------
# The reference's flag values and forms.

@pytest.mark.parametrize("given,interaction", [("dot_custom_cuda", "dot_custom"), ("dot_tensorflow", "dot_tensorflow"),
                                               ("dot_custom", "dot_custom"), ("dot", "dot"), ("cross", "cross")])
def test_reference_interaction_names(given, interaction):
    assert build(interaction=given).model.interaction == interaction


def test_reference_interaction_names_are_flag_values():
    from run import flags as run_flags
    assert {"dot_custom_cuda", "dot_tensorflow"} <= set(run_flags.FLAGS["interaction"].parser.enum_values)


def test_reference_dot_names_keep_the_dot_rules():
    assert_rejected("bottom_mlp_dims", "--embedding_dim", interaction="dot_tensorflow", embedding_dim=["64"])
    assert_rejected("interaction", "no XLA kernel", interaction="dot_custom_cuda", xla=True)


def test_placement_flags_apply_at_several_ranks():
    cfg = build(world_size=2, dist_strategy="basic", column_slice_threshold=10, row_slice_threshold=1000,
                data_parallel_threshold=5, data_parallel_input=True)
    p = cfg.parallelism
    assert (p.dist_strategy, p.column_slice_threshold, p.row_slice_threshold, p.data_parallel_threshold,
            p.data_parallel_input) == ("basic", 10, 1000, 5, True)
    assert build(present=set(), world_size=1, dist_strategy="basic").parallelism.dist_strategy == "basic"   # not set


def test_embedding_dim_json_file(tmp_path):
    widths = tmp_path / "widths.json"
    widths.write_text("[4, 8, 2, 6]")
    cfg = build(synthetic_cardinalities=FOUR_CARDS, interaction="cross", embedding_dim=[str(widths)])
    assert cfg.model.embedding_dims == [4, 8, 2, 6]
    named = tmp_path / "dims"   # any existing file, as the reference (os.path.exists)
    named.write_text("[16, 16, 16, 16]")
    cfg = build(synthetic_cardinalities=FOUR_CARDS, bottom_mlp_dims=["16"], embedding_dim=[str(named)])
    assert cfg.model.embedding_dims == [16] * 4
    widths.write_text("[4, 8, 2]")
    assert_rejected("embedding_dim", "3 values but there are 4", synthetic_cardinalities=FOUR_CARDS,
                    interaction="cross", embedding_dim=[str(widths)])


@pytest.mark.parametrize("content,fragment", [("[4, 8,", "not valid JSON"), ('{"a": 4}', "JSON list of integers"),
                                              ('[4, "8", 2, 6]', "JSON list of integers"),
                                              ("[4, 8.5, 2, 6]", "JSON list of integers")])
def test_embedding_dim_bad_json_file(tmp_path, content, fragment):
    widths = tmp_path / "widths.json"
    widths.write_text(content)
    message = assert_rejected("embedding_dim", fragment, synthetic_cardinalities=FOUR_CARDS, interaction="cross",
                              embedding_dim=[str(widths)])
    assert str(widths) in message


@pytest.mark.parametrize("dataset_path,feature_spec,path", [
    ("/data/criteo", "", "/data/criteo/feature_spec.yaml"),
    ("/data/criteo", "feature_spec.yaml", "/data/criteo/feature_spec.yaml"),   # the reference's form
    ("/data/criteo", "other.yaml", "/data/criteo/other.yaml"),
    ("/data/criteo", "/specs/criteo.yaml", "/specs/criteo.yaml"),
    ("", "specs/criteo.yaml", "specs/criteo.yaml"),
])
def test_feature_spec_path(dataset_path, feature_spec, path):
    from run.config import feature_spec_path
    assert feature_spec_path(dataset_path, feature_spec) == path


# --------------------------------------------------------------------------------------------
# --model: the flags it does not take, its hyper-parameters.

MODEL_FILE = os.path.join(ROOT, "examples", "dlrm.py")


def test_model_file_refuses_the_flags_it_does_not_take_in_one_line():
    message = assert_rejected("num_cross_layers", "does not take",
                              present={"model", "num_cross_layers", "interaction", "embedding_dim"},
                              model=MODEL_FILE, num_cross_layers=2, interaction="cross")
    assert message == (f"--model={MODEL_FILE} does not take --embedding_dim, --interaction and --num_cross_layers (the "
                       "model file sets its own shape): remove them")
    # AMP and XLA: the model file's compile takes them (tests/test_ranking_precision.py)
    cfg = build(present={"model", "amp", "loss_scale", "xla"}, model=MODEL_FILE, amp=True, loss_scale=8.0, xla=True)
    assert (cfg.runtime.amp, cfg.runtime.loss_scale, cfg.runtime.xla) == (True, 8.0, True)
    assert_rejected("model", "no such file", present={"model"}, model="/nonexistent/model.py")
    assert build(present={"model", "dist_strategy"}, world_size=2, model=MODEL_FILE).model.model == MODEL_FILE


def test_model_file_takes_tables_on_disk_the_input_layout_and_the_tables_flags():
    tiers = dict(embedding_memory_budget_gb=0.001, embedding_store_path="/tmp/store", embedding_cache_policy="lfu")
    cfg = build(present={"model"} | set(tiers), model=MODEL_FILE, **tiers)
    assert (cfg.storage.embedding_memory_budget_gb, cfg.storage.embedding_cache_policy) == (0.001, "lfu")
    assert build(present={"model"} | set(tiers), world_size=2, model=MODEL_FILE, **tiers).parallelism \
        .data_parallel_input is False
    assert_rejected("data_parallel_input", "does not work with --embedding_memory_budget_gb",
                    present={"model", "data_parallel_input"} | set(tiers), world_size=2, model=MODEL_FILE,
                    data_parallel_input=True, **tiers)
    flags = dict(embedding_trainable=False, embedding_zeros_initializer=True, cpu_offloading_threshold_gb=1)
    cfg = build(present={"model"} | set(flags), model=MODEL_FILE, **flags)
    assert (cfg.training.embedding_trainable, cfg.model.embedding_zeros_initializer,
            cfg.storage.cpu_offloading_threshold_gb) == (False, True, 1)


def test_model_hyper_parameters_yaml_then_name_value(tmp_path):
    params = tmp_path / "p.yaml"
    params.write_text("hidden: [64, 32]\ndropout: 0.5\n")
    cfg = build(present={"model", "model_params", "model_param"}, model=MODEL_FILE, model_params=str(params),
                model_param=["dropout=0", "name=wide", "top=[8, 1]"])
    assert cfg.model.hparams == {"hidden": [64, 32], "dropout": 0, "name": "wide", "top": [8, 1]}
    assert_rejected("model_param", "expected name=value", present={"model", "model_param"}, model=MODEL_FILE,
                    model_param=["hidden"])
    params.write_text("- 1\n- 2\n")
    assert_rejected("model_params", "expected a YAML mapping", present={"model", "model_params"}, model=MODEL_FILE,
                    model_params=str(params))
    assert_rejected("model_params", "cannot read", present={"model", "model_params"}, model=MODEL_FILE,
                    model_params=str(tmp_path / "missing.yaml"))
