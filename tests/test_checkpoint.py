"""Checkpoints: resume equals an uninterrupted run; saves are atomic; mismatches are named."""
import os

import numpy as np
import pytest

import main
from nn import checkpoint
from tests.configs import tiny_config


def load_all(root):
    manifest = checkpoint.read_manifest(root)
    return manifest, {n: checkpoint.read_tensor(root, n) for n in manifest["tensors"]}


@pytest.mark.parametrize("optimizer", ["adam", "adagrad"])
def test_resume_equals_uninterrupted(tmp_path, optimizer):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    main.run(tiny_config(optimizer=optimizer, save_checkpoint_path=full))
    main.run(tiny_config(optimizer=optimizer, save_checkpoint_path=part, max_steps=17))
    assert checkpoint.read_manifest(part)["step"] == 17
    resumed = main.run(tiny_config(optimizer=optimizer, save_checkpoint_path=part, restore_checkpoint_path=part))
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
    main.run(tiny_config(save_checkpoint_path=root, checkpoint_every_n_steps=15))
    assert sorted(d for d in os.listdir(root) if d.startswith("ckpt-")) == ["ckpt-30", "ckpt-40"]
    assert open(os.path.join(root, "latest")).read().strip() == "ckpt-40"


def test_crash_mid_save_leaves_previous_checkpoint_usable(tmp_path, monkeypatch):
    root = str(tmp_path / "ck")
    main.run(tiny_config(save_checkpoint_path=root, max_steps=10))
    before = load_all(root)[1]
    calls = []

    def failing_save(f, array):
        calls.append(1)
        if len(calls) > 3:
            raise OSError("disk full")
        np.lib.format.write_array(f, np.asanyarray(array))

    monkeypatch.setattr(checkpoint.np, "save", failing_save)
    with pytest.raises(OSError):
        main.run(tiny_config(save_checkpoint_path=root, restore_checkpoint_path=root))
    monkeypatch.undo()
    manifest, after = load_all(root)
    assert manifest["step"] == 10
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    # ... and it still restores into a model.
    result = main.run(tiny_config(mode="eval", restore_checkpoint_path=root))
    assert result["samples"] == 1000


def test_mismatched_checkpoint_is_named(tmp_path):
    root = str(tmp_path / "ck")
    main.run(tiny_config(save_checkpoint_path=root, max_steps=2))
    with pytest.raises(checkpoint.CheckpointError, match="embedding_dim"):
        main.run(tiny_config(mode="eval", restore_checkpoint_path=root, embedding_dim=["4"], bottom_mlp_dims=["16", "4"]))
    with pytest.raises(checkpoint.CheckpointError, match="optimizer=adam.*optimizer=sgd"):
        main.run(tiny_config(mode="eval", restore_checkpoint_path=root, optimizer="sgd"))
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint here"):
        main.run(tiny_config(mode="eval", restore_checkpoint_path=str(tmp_path)))
    manifest = checkpoint.read_manifest(root)
    victim = os.path.join(manifest["path"], manifest["tensors"]["top_mlp/dense_0/kernel"]["pieces"][0]["file"])
    np.save(victim, np.zeros((3, 3), np.float32))
    with pytest.raises(checkpoint.CheckpointError, match=r"top_mlp/dense_0/kernel has shape \(3, 3\), the manifest says"):
        main.run(tiny_config(mode="eval", restore_checkpoint_path=root))


def test_resuming_a_finished_run_trains_nothing_and_reports(tmp_path):
    root = str(tmp_path / "ck")
    done = main.run(tiny_config(save_checkpoint_path=root))
    again = main.run(tiny_config(restore_checkpoint_path=root))
    assert again["steps"] == 40 and again["auc"] == done["auc"]
