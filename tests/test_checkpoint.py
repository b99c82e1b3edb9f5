"""Checkpoints: resume equals an uninterrupted run; saves are atomic; mismatches are named."""
import json
import os

import numpy as np
import pytest

import run.loop as run_loop
from storage import checkpoint
from tests.support.configs import tiny_config
from utils.errors import CheckpointError, ConfigError


def load_all(root):
    manifest = checkpoint.read_manifest(root)
    return manifest, {n: checkpoint.read_tensor(root, n) for n in manifest["tensors"]}


@pytest.mark.parametrize("optimizer", ["adam", "adagrad"])
def test_resume_equals_uninterrupted(tmp_path, optimizer):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run_loop.run(tiny_config(optimizer=optimizer, save_checkpoint_path=full))
    run_loop.run(tiny_config(optimizer=optimizer, save_checkpoint_path=part, max_steps=17))
    assert checkpoint.read_manifest(part)["step"] == 17
    resumed = run_loop.run(tiny_config(optimizer=optimizer, save_checkpoint_path=part, restore_checkpoint_path=part))
    assert resumed["steps"] == 40
    m_full, v_full = load_all(full)
    m_part, v_part = load_all(part)
    assert m_full["step"] == m_part["step"] == 40
    assert set(v_full) == set(v_part)
    assert any("/m" in n or "accumulator" in n for n in v_full)   # optimizer slots are saved
    for name in v_full:
        np.testing.assert_array_equal(v_part[name], v_full[name], err_msg=name)


def test_periodic_checkpoints_keep_two_and_latest(tmp_path):
    root = str(tmp_path / "ck")
    run_loop.run(tiny_config(save_checkpoint_path=root, checkpoint_every_n_steps=15))
    assert sorted(d for d in os.listdir(root) if d.startswith("ckpt-")) == ["ckpt-30", "ckpt-40"]
    assert open(os.path.join(root, "latest")).read().strip() == "ckpt-40"


def test_crash_mid_save_leaves_previous_checkpoint_usable(tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    run_loop.run(tiny_config(save_checkpoint_path=root, max_steps=10))
    before = load_all(root)[1]
    calls = []

    def failing_save(f, array):
        calls.append(1)
        if len(calls) > 3:
            raise OSError("disk full")
        np.lib.format.write_array(f, np.asanyarray(array))

    monkeypatch.setattr(checkpoint.np, "save", failing_save)
    with pytest.raises(OSError):
        run_loop.run(tiny_config(save_checkpoint_path=root, restore_checkpoint_path=root))
    monkeypatch.undo()
    manifest, after = load_all(root)
    assert manifest["step"] == 10
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    # ... and it still restores into a model.
    result = run_loop.run(tiny_config(mode="eval", restore_checkpoint_path=root))
    assert result["samples"] == 1000


def test_mismatched_checkpoint_is_named(tmp_path):
    root = str(tmp_path / "ck")
    run_loop.run(tiny_config(save_checkpoint_path=root, max_steps=2))
    with pytest.raises(CheckpointError, match="embedding_dim"):
        run_loop.run(tiny_config(mode="eval", restore_checkpoint_path=root, embedding_dim=["4"], bottom_mlp_dims=["16", "4"]))
    with pytest.raises(CheckpointError, match="optimizer=adam.*optimizer=sgd"):   # resuming: its state
        run_loop.run(tiny_config(restore_checkpoint_path=root, optimizer="sgd", max_steps=3))
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        run_loop.run(tiny_config(mode="eval", restore_checkpoint_path=str(tmp_path)))
    manifest = checkpoint.read_manifest(root)
    victim = os.path.join(manifest["path"], manifest["tensors"]["top_mlp/dense_0/kernel"]["pieces"][0]["file"])
    np.save(victim, np.zeros((3, 3), np.float32))
    with pytest.raises(CheckpointError, match=r"top_mlp/dense_0/kernel has shape \(3, 3\), the manifest says"):
        run_loop.run(tiny_config(mode="eval", restore_checkpoint_path=root))


def test_resuming_a_finished_run_is_one_error_line(tmp_path):
    root = str(tmp_path / "ck")
    run_loop.run(tiny_config(save_checkpoint_path=root))
    before = load_all(root)[1]
    with pytest.raises(ConfigError) as info:
        run_loop.run(tiny_config(save_checkpoint_path=root, restore_checkpoint_path=root))
    message = str(info.value)
    assert "--restore_mode=resume" in message and "nothing left to train" in message and "\n" not in message
    assert "has trained 40 of the 40 steps" in message
    manifest, after = load_all(root)
    assert manifest["step"] == 40 and all(np.array_equal(after[n], before[n]) for n in before)


@pytest.mark.slow
def test_resume_into_the_next_epoch_equals_the_uninterrupted_run(tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run_loop.run(tiny_config(save_checkpoint_path=full, epochs=2))
    run_loop.run(tiny_config(save_checkpoint_path=part))
    assert checkpoint.read_manifest(part)["state"]["data"] == {
        "definition": checkpoint.read_manifest(full)["state"]["data"]["definition"], "epoch": 1, "offset": 0}
    assert run_loop.run(tiny_config(save_checkpoint_path=part, restore_checkpoint_path=part, epochs=2))["steps"] == 80
    v_full, v_part = load_all(full)[1], load_all(part)[1]
    for name in v_full:
        np.testing.assert_array_equal(v_part[name], v_full[name], err_msg=name)


@pytest.mark.parametrize("overrides,setting", [
    (dict(batch_size=64), "batch_size=128, this run has batch_size=64"),
    (dict(seed=6), "seed=5, this run has seed=6"),
    (dict(shuffle_batch_order=False), "shuffle_batch_order=True, this run has shuffle_batch_order=False"),
    (dict(train_last_partial_batch=True), "train_last_partial_batch=False"),
    (dict(synthetic_rows=128 * 30), "train_rows=5120, this run has train_rows=3840"),
    (dict(synthetic_alpha=0.5), "synthetic_alpha=1.05, this run has synthetic_alpha=0.5"),
])
def test_resume_with_other_data_settings_is_refused_naming_the_setting(tmp_path, overrides, setting):
    root = str(tmp_path / "ck")
    run_loop.run(tiny_config(save_checkpoint_path=root, max_steps=3))
    with pytest.raises(ConfigError) as info:
        run_loop.run(tiny_config(restore_checkpoint_path=root, **overrides))
    message = str(info.value)
    assert setting in message and "--restore_mode=continue" in message and "\n" not in message, message


def lr_records(log_path):
    with open(log_path) as f:
        return {r["step"]: r["lr"] for r in map(json.loads, f) if r["kind"] == "step"}


def documented_lr(step, lr=0.003, warmup=5, decay_start=20, decay=60):
    """nn/lr_schedule.py's documented formula, for update `step` (0-based)."""
    return lr * min(1.0, (step + 1) / warmup, min(1.0, max(0.0, (decay_start + decay - step) / decay)) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize("lr_schedule,origin", [("restart", 40), ("continue", 0)])
def test_continue_training_counts_its_own_data_and_sets_the_schedule(tmp_path, lr_schedule, origin):
    """One more epoch of the same data with --restore_mode=continue: 40 more steps from the
    restored state (an epoch of 40 batches), the learning rate of update k being
    schedule(k - origin); resumed after an interruption, the continued run ends identical."""
    root, full, part = (str(tmp_path / n) for n in ("ck", "full", "part"))
    schedule = dict(decay_steps=60)
    run_loop.run(tiny_config(save_checkpoint_path=root, **schedule))
    cont = dict(schedule, restore_checkpoint_path=root, restore_mode="continue", restore_lr_schedule=lr_schedule)
    log = str(tmp_path / "log.json")
    result = run_loop.run(tiny_config(save_checkpoint_path=full, log_path=log, print_freq=1, **cont))
    assert result["steps"] == 80 and checkpoint.read_manifest(full)["step"] == 80
    lrs = lr_records(log)
    assert sorted(lrs) == list(range(41, 81))
    for step, lr in lrs.items():
        assert lr == pytest.approx(documented_lr(step - 1 - origin), rel=1e-6), step
    assert checkpoint.read_manifest(full)["state"]["schedule_origin"] == origin
    run_loop.run(tiny_config(save_checkpoint_path=part, max_steps=15, **cont))
    assert checkpoint.read_manifest(part)["step"] == 55
    run_loop.run(tiny_config(save_checkpoint_path=part, restore_checkpoint_path=part, **schedule))
    v_full, v_part = load_all(full)[1], load_all(part)[1]
    for name in v_full:
        np.testing.assert_array_equal(v_part[name], v_full[name], err_msg=name)


def test_continue_on_the_same_data_equals_the_uninterrupted_unshuffled_run(tmp_path):
    """Without shuffling every epoch has the same batch order, so one epoch continued from a
    one-epoch checkpoint (optimizer state and schedule kept) is the second epoch of a 2-epoch run."""
    root, full = str(tmp_path / "ck"), str(tmp_path / "full")
    flags = dict(shuffle_batch_order=False, decay_steps=60)
    run_loop.run(tiny_config(save_checkpoint_path=full, epochs=2, **flags))
    run_loop.run(tiny_config(save_checkpoint_path=root, **flags))
    run_loop.run(tiny_config(save_checkpoint_path=root, restore_checkpoint_path=root, restore_mode="continue",
                         restore_lr_schedule="continue", **flags))
    v_full, v_cont = load_all(full)[1], load_all(root)[1]
    for name in v_full:
        np.testing.assert_array_equal(v_cont[name], v_full[name], err_msg=name)


def test_weights_mode_restores_the_weights_with_a_fresh_optimizer(tmp_path):
    """--restore_mode=weights equals a fresh run (here with another optimizer) whose model
    variables were assigned the checkpoint's tensors by hand."""
    root, tuned, ref = (str(tmp_path / n) for n in ("ck", "tuned", "ref"))
    run_loop.run(tiny_config(save_checkpoint_path=root, max_steps=10))
    trained = load_all(root)[1]
    run = run_loop.Run(tiny_config(restore_checkpoint_path=root, restore_mode="weights", optimizer="adagrad",
                               save_checkpoint_path=tuned))
    assert int(run.trainer.step.numpy()) == 0
    assert run.train()["steps"] == 40
    run.log.close()
    reference = run_loop.Run(tiny_config(optimizer="adagrad", save_checkpoint_path=ref))
    emb = reference.model.embeddings.layers[0].embedding
    weights = {v.name.split(":")[0] for v in reference.model.dense_variables} | {emb.table_name(f) for f in range(4)}
    for e in reference.trainer.checkpoint_entries():   # one process: each table is one variable
        if e.name in weights:
            e.variable.assign(trained[e.name])
    reference.train()
    reference.log.close()
    v_tuned, v_ref = load_all(tuned)[1], load_all(ref)[1]
    assert set(v_tuned) == set(v_ref)
    for name in v_ref:
        np.testing.assert_array_equal(v_tuned[name], v_ref[name], err_msg=name)
