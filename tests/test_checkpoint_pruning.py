"""Checkpoint pruning by write order (--keep_checkpoints), the best checkpoint by evaluation AUC
(--keep_best_checkpoint, ROOT/best), and saves of a step already in ROOT that never lose `latest`."""
import json
import os
import re
import subprocess

import numpy as np
import pytest

import run.loop as run_loop
import nn.evaluator
from storage import checkpoint
from tests.support.configs import tiny_config
from tests.support.horovod_run import ROOT
from utils.errors import CheckpointError, ConfigError
from tests.support.warm_python import PYTHON


def checkpoints(root):
    return sorted(d for d in os.listdir(root) if d.startswith("ckpt-"))


def pointer(root, name="latest"):
    with open(os.path.join(root, name)) as f:
        return f.readline().strip()


def test_restoring_an_older_checkpoint_keeps_the_newest_write(tmp_path):
    """Steps 30 and 40 in ROOT, then a run restored from an older checkpoint saves step 20 there:
    the newest write and `latest` survive (pruning by step number deleted it)."""
    root, older = str(tmp_path / "ck"), str(tmp_path / "older")
    run_loop.run(tiny_config(save_checkpoint_path=root, checkpoint_every_n_steps=15))
    run_loop.run(tiny_config(save_checkpoint_path=older, max_steps=10))
    run_loop.run(tiny_config(save_checkpoint_path=root, restore_checkpoint_path=older, max_steps=20))
    assert checkpoints(root) == ["ckpt-20", "ckpt-40"]
    assert pointer(root) == "ckpt-20"
    assert checkpoint.read_manifest(root)["step"] == 20


def test_saving_a_step_already_in_root_is_a_new_write(tmp_path):
    """--keep_checkpoints=3; restored from ckpt-20 with another learning rate, the run saves step
    30 again: a new directory beside the old ckpt-30 (nothing renamed over), the three newest
    writes kept, and ROOT (its `latest`) evaluates to the model just trained."""
    root = str(tmp_path / "ck")
    run_loop.run(tiny_config(save_checkpoint_path=root, checkpoint_every_n_steps=10, keep_checkpoints=3))
    assert checkpoints(root) == ["ckpt-20", "ckpt-30", "ckpt-40"]
    old_30 = checkpoint.read_tensor(os.path.join(root, "ckpt-30"), "top_mlp/dense_0/kernel")
    again = run_loop.run(tiny_config(save_checkpoint_path=root, restore_checkpoint_path=os.path.join(root, "ckpt-20"),
                                 max_steps=30, learning_rate=0.01, keep_checkpoints=3))
    newest = pointer(root)
    assert newest == "ckpt-30-5" and checkpoints(root) == ["ckpt-30", "ckpt-30-5", "ckpt-40"]
    assert [checkpoint.read_manifest(os.path.join(root, d))["sequence"] for d in checkpoints(root)] == [3, 5, 4]
    np.testing.assert_array_equal(checkpoint.read_tensor(os.path.join(root, "ckpt-30"), "top_mlp/dense_0/kernel"),
                                  old_30)
    assert not np.array_equal(checkpoint.read_tensor(root, "top_mlp/dense_0/kernel"), old_30)
    restored = run_loop.run(tiny_config(mode="eval", restore_checkpoint_path=root))
    assert (restored["auc"], restored["logloss"]) == (again["auc"], again["logloss"])


def test_failed_save_of_a_step_already_in_root_keeps_latest(tmp_path, monkeypatch):
    """The save of step 10 over an existing ckpt-10 (its weights retrained from step 0) fails when
    its directory would be moved into place: `latest` still names a complete checkpoint of step
    10, unchanged."""
    root = str(tmp_path / "ck")
    run_loop.run(tiny_config(save_checkpoint_path=root, max_steps=10))
    before = checkpoint.read_tensor(root, "top_mlp/dense_0/kernel")
    rename = os.rename

    def failing_rename(src, dst):
        if os.path.basename(src).startswith(".tmp-ckpt-"):
            raise OSError("disk gone")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError):
        run_loop.run(tiny_config(save_checkpoint_path=root, restore_checkpoint_path=os.path.join(root, "ckpt-10"),
                             restore_mode="weights", max_steps=10))
    monkeypatch.undo()
    assert checkpoint.read_manifest(root)["step"] == 10
    np.testing.assert_array_equal(checkpoint.read_tensor(root, "top_mlp/dense_0/kernel"), before)


@pytest.fixture
def scripted_auc(monkeypatch):
    """Evaluations report the given AUCs (or another `figure`) in turn (the rest of the metrics are real)."""
    evaluate = nn.evaluator.evaluate

    def script(values, figure="auc"):
        values = list(values)

        def scripted(*args, **kwargs):
            return dict(evaluate(*args, **kwargs), **{figure: values.pop(0)})
        monkeypatch.setattr(nn.evaluator, "evaluate", scripted)
    return script


def test_keep_best_checkpoint(tmp_path, scripted_auc, capsys):
    """Evaluations at steps 10, 20, 30, 40 with AUCs 0.6, 0.8, 0.7, 0.75 and --keep_checkpoints=1:
    step 20 is checkpointed when evaluated and kept beside the newest (40); ROOT/best names it and
    restores it. A later run into ROOT keeps it until a model beats 0.8."""
    root = str(tmp_path / "ck")
    scripted_auc([0.6, 0.8, 0.7, 0.75])
    run_loop.run(tiny_config(save_checkpoint_path=root, evals_per_epoch=4, keep_best_checkpoint=True,
                         keep_checkpoints=1))
    assert re.findall(r"saved checkpoint \S+/(ckpt-\d+)", capsys.readouterr().out) == ["ckpt-10", "ckpt-20",
                                                                                        "ckpt-40"]
    assert checkpoints(root) == ["ckpt-20", "ckpt-40"]
    assert (pointer(root), pointer(root, "best")) == ("ckpt-40", "ckpt-20")
    assert checkpoint.best_value(root) == 0.8
    assert checkpoint.read_manifest(os.path.join(root, "best"))["step"] == 20
    scripted_auc([0.5])
    run_loop.run(tiny_config(mode="eval", restore_checkpoint_path=os.path.join(root, "best")))
    assert f"restored {root}/ckpt-20 at step 20" in capsys.readouterr().out

    scripted_auc([0.79, 0.81])   # resumed from step 20: evaluations at 30 and 40
    run_loop.run(tiny_config(save_checkpoint_path=root, restore_checkpoint_path=os.path.join(root, "best"),
                         evals_per_epoch=4, keep_best_checkpoint=True, keep_checkpoints=1))
    assert pointer(root, "best") == "ckpt-40-4" and checkpoint.best_value(root) == 0.81
    assert checkpoints(root) == ["ckpt-40-4"]


def test_keep_best_checkpoint_by_the_lowest_logloss(tmp_path, scripted_auc, capsys):
    """--keep_best_metric=logloss: evaluations at steps 10, 20, 30, 40 with loglosses 0.6, 0.5,
    0.55, 0.52 keep step 20's; a later run choosing by AUC into the same ROOT is one line."""
    root = str(tmp_path / "ck")
    scripted_auc([0.6, 0.5, 0.55, 0.52], "logloss")
    run_loop.run(tiny_config(save_checkpoint_path=root, evals_per_epoch=4, keep_best_checkpoint=True,
                             keep_best_metric="logloss"))
    assert f"best checkpoint: {root}/ckpt-20 (logloss 0.50000)" in capsys.readouterr().out
    assert pointer(root, "best") == "ckpt-20" and checkpoint.best_value(root, "logloss") == 0.5
    with pytest.raises(CheckpointError) as info:
        run_loop.run(tiny_config(save_checkpoint_path=root, keep_best_checkpoint=True))
    assert str(info.value) == (f"{root}/best: the best checkpoint was chosen by logloss, not auc; give "
                               "--keep_best_metric=logloss, or another --save_checkpoint_path")
    with pytest.raises(ConfigError, match=r"^--keep_best_metric chooses the checkpoint --keep_best_checkpoint keeps; "
                                          r"give that too, or remove it$"):
        tiny_config(save_checkpoint_path=root, keep_best_metric="logloss")


def test_keep_best_checkpoint_chooses_on_the_validation_mapping(tmp_path, scripted_auc, capsys):
    """Data with train, validation and test mappings, evaluations at steps 2, 4, 6, 8: each
    evaluation of the test rows (AUCs 0.9, 0.6, 0.6, 0.6) is followed by one of the validation
    rows (0.5, 0.8, 0.7, 0.75), printed and logged as such; the best checkpoint is step 4's, the
    best on validation (step 2's is the best on test)."""
    from dataloading.feature_spec import split_binary_spec
    from dataloading.generate_dataset import generate
    spec = split_binary_spec(["n0"], {"c0": 20}, mappings=("train", "validation", "test"),
                             base_dir=str(tmp_path / "data"))
    generate(spec, 8 * 128, 300, seed=1, alpha=1.0)
    root, log = str(tmp_path / "ck"), str(tmp_path / "log.json")
    scripted_auc([0.9, 0.5, 0.6, 0.8, 0.6, 0.7, 0.6, 0.75])
    run_loop.run(tiny_config(dataset_type="split_binary", dataset_path=str(tmp_path / "data"),
                             save_checkpoint_path=root,
                             evals_per_epoch=4, keep_best_checkpoint=True, log_path=log))
    out = capsys.readouterr().out
    aucs = [("0.90000", "0.50000"), ("0.60000", "0.80000"), ("0.60000", "0.70000"), ("0.60000", "0.75000")]
    assert re.findall(r"^(eval|validation) at step (\d+): auc ([\d.]+)", out, re.M) == [
        (split, str(step), auc) for step, pair in zip((2, 4, 6, 8), aucs)
        for split, auc in zip(("eval", "validation"), pair)], out
    assert f"best checkpoint: {root}/ckpt-4 (validation auc 0.80000)" in out
    assert pointer(root, "best") == "ckpt-4" and checkpoint.best_value(root) == 0.8
    logged = [json.loads(line) for line in open(log)]
    assert [(e["kind"], e["step"], e["samples"]) for e in logged if e["kind"] in ("eval", "validation")] == [
        (split, step, 300) for step in (2, 4, 6, 8) for split in ("eval", "validation")]
    by_step = {}
    for e in logged:
        if e["kind"] in ("eval", "validation"):
            by_step.setdefault(e["step"], {})[e["kind"]] = e["logloss"]
    assert all(losses["eval"] != losses["validation"] for losses in by_step.values())   # other rows


def test_keep_best_checkpoint_with_the_validation_mapping_as_eval_mapping(tmp_path, scripted_auc, capsys):
    """--eval_mapping=validation: the evaluations are on validation, once each, as today."""
    from dataloading.feature_spec import split_binary_spec
    from dataloading.generate_dataset import generate
    spec = split_binary_spec(["n0"], {"c0": 20}, mappings=("train", "validation", "test"),
                             base_dir=str(tmp_path / "data"))
    generate(spec, 8 * 128, 300, seed=1, alpha=1.0)
    root = str(tmp_path / "ck")
    scripted_auc([0.5, 0.8, 0.7, 0.75])
    run_loop.run(tiny_config(dataset_type="split_binary", dataset_path=str(tmp_path / "data"),
                             save_checkpoint_path=root,
                             evals_per_epoch=4, keep_best_checkpoint=True, eval_mapping="validation"))
    out = capsys.readouterr().out
    assert "validation at step" not in out and out.count("eval at step") == 4
    assert pointer(root, "best") == "ckpt-4" and f"best checkpoint: {root}/ckpt-4 (auc 0.80000)" in out


def test_keep_best_checkpoint_without_evaluation_rows_is_refused(tmp_path):
    from dataloading.feature_spec import split_binary_spec
    from dataloading.generate_dataset import generate
    spec = split_binary_spec(["n0"], {"c0": 20}, base_dir=str(tmp_path / "data"))
    generate(spec, 512, 0, seed=1, alpha=1.0)
    cfg = tiny_config(dataset_type="split_binary", dataset_path=str(tmp_path / "data"),
                      save_checkpoint_path=str(tmp_path / "ck"), keep_best_checkpoint=True)
    with pytest.raises(ConfigError, match="--keep_best_checkpoint needs an evaluation; --eval_mapping=test has no"):
        run_loop.run(cfg)
    assert not os.path.exists(tmp_path / "ck")


def test_best_pointer_on_the_command_line(tmp_path):
    """dlrm.py --keep_best_checkpoint writes ROOT/best; --restore_checkpoint_path=ROOT/best reads it;
    without --save_checkpoint_path the flag is refused with one line, exit 2."""
    root = str(tmp_path / "ck")
    model = ["--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--dataset_type=synthetic",
             "--synthetic_cardinalities=20,50,7,30", "--synthetic_num_numerical=3", "--synthetic_eval_rows=1000",
             "--valid_batch_size=500", "--optimizer=adam"]
    train = ["--batch_size=128", "--synthetic_rows=2560", "--learning_rate=0.003", "--warmup_steps=5",
             "--decay_start_step=10", "--decay_steps=10"]

    def run(*args):
        return subprocess.run([*PYTHON, "dlrm.py", *model, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=600)
    out = run(*train, "--keep_best_checkpoint")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "error: --keep_best_checkpoint needs --save_checkpoint_path (checkpoints are kept only in training)")
    out = run(*train, f"--save_checkpoint_path={root}", "--keep_best_checkpoint")
    assert out.returncode == 0, out.stderr
    printed = float(re.search(r"eval at step 20: auc (\S+)", out.stdout).group(1))
    assert pointer(root, "best") == "ckpt-20" and round(checkpoint.best_value(root), 5) == printed
    out = run("--mode=eval", f"--restore_checkpoint_path={root}/best")
    assert out.returncode == 0 and f"restored {root}/ckpt-20 at step 20" in out.stdout, out.stdout + out.stderr
