"""deployment/deploy.py --delta_from: a model trained on (--restore_mode=continue, at 1 and 2 ranks)
exported as the rows it updated since an earlier export plus its dense model. Applied to the
earlier export's table files, a delta (or a chain of two) gives the full export of the new
checkpoint exactly; a delta holds exactly the rows updated since its base; deltas that do not
apply are refused in one line."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import tensorflow as tf

import run.loop as run_loop
from deployment.exporter.repository import ExportError, write_delta_repository, write_repository
from deployment.repository_format import export_version, read_delta
from parallel_embedding import UPDATED_AT
from storage import checkpoint
from utils.errors import CheckpointError
from tests.support.configs import tiny_config
from tests.test_checkpoint_integrity import flip, piece_path
from tests.support.horovod_run import ROOT, horovodrun
from tests.support.warm_python import PYTHON

CARDS = ["3000", "5000", "7", "400"]   # large enough that a few steps leave most rows untouched


def train(tmp_path, name, steps, restore="", mode="continue", seed=5, **flags):
    cfg = tiny_config(synthetic_cardinalities=CARDS, save_checkpoint_path=str(tmp_path / name), max_steps=steps,
                      evals_per_epoch=0, seed=seed, restore_checkpoint_path=restore,
                      **({"restore_mode": mode} if restore else {}), **flags)
    run_loop.run(cfg)
    return str(tmp_path / name)


def tables(repo):
    info = json.loads(open(os.path.join(repo, "m_tables", "tables.json")).read())
    return [np.load(os.path.join(repo, "m_tables", t["file"])) for t in info["tables"]]


def applied(base_tables, directory):
    """The tables after applying the delta in `directory` to `base_tables` (copies)."""
    d = read_delta(directory)
    out = [t.copy() for t in base_tables]
    for f in d.features:
        ids, rows = d.rows(f)
        out[f][ids] = rows
    return out


def dense_outputs(saved_model, inputs):
    f = tf.saved_model.load(saved_model).signatures["serving_default"]
    return {k: v.numpy() for k, v in f(**inputs).items()}


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """Day 0 trained 10 steps and exported in full; day 1 continued 4 steps from it, day 2 3 more."""
    tmp = tmp_path_factory.mktemp("days")
    ckpts = [train(tmp, "day0", 10)]
    ckpts.append(train(tmp, "day1", 4, restore=ckpts[0], seed=6))
    ckpts.append(train(tmp, "day2", 3, restore=ckpts[1], seed=7))
    repos = [str(tmp / f"repo{k}") for k in range(3)]
    for ckpt, repo in zip(ckpts, repos):
        write_repository(ckpt, repo, "m", forms=["tables"])
    return tmp, ckpts, repos


def test_a_delta_applied_to_its_base_gives_the_full_export(days):
    tmp, ckpts, repos = days
    info = write_delta_repository(ckpts[1], str(tmp / "delta1"), repos[0], "m")
    d = read_delta(str(tmp / "delta1"))
    assert d.base == export_version(repos[0]) and d.new == export_version(repos[1])
    assert d.base.step == 10 and d.new.step == 14 and d.base.run != d.new.run
    before, after = tables(repos[0]), tables(repos[1])
    for got, want in zip(applied(before, str(tmp / "delta1")), after):
        np.testing.assert_array_equal(got, want)
    manifest = checkpoint.read_manifest(ckpts[1])
    for f, t in enumerate(info["tables"]):   # exactly the rows updated at steps 11..14, a small part of the big tables
        updated = checkpoint.read_tensor(ckpts[1], f"embedding/table_{f}/updated_at")[:, 0]
        ids, _ = d.rows(t["feature"])
        np.testing.assert_array_equal(ids, np.flatnonzero(updated > 10))
        changed = np.flatnonzero((before[f] != after[f]).any(axis=1))
        assert set(changed) <= set(ids)
    assert [t["feature"] for t in info["tables"]] == [0, 1, 2, 3]
    assert info["tables"][1]["count"] < int(CARDS[1]) // 4 and manifest["step"] == 14
    rng = np.random.default_rng(0)
    inputs = {"numerical_features": tf.constant(rng.normal(size=(64, 3)), tf.float32),
              "embeddings": tf.constant(rng.normal(size=(64, 32)), tf.float32)}
    new_dense = dense_outputs(d.dense_model, inputs)
    full = dense_outputs(os.path.join(repos[1], "m_dense", "1", "model.savedmodel"), inputs)
    old = dense_outputs(os.path.join(repos[0], "m_dense", "1", "model.savedmodel"), inputs)
    np.testing.assert_array_equal(new_dense["logits"], full["logits"])
    assert not np.array_equal(new_dense["logits"], old["logits"])


def test_a_chain_of_two_deltas(days):
    tmp, ckpts, repos = days
    write_delta_repository(ckpts[1], str(tmp / "chain1"), repos[0], "m")
    write_delta_repository(ckpts[2], str(tmp / "chain2"), str(tmp / "chain1"), "m")   # based on the delta
    assert read_delta(str(tmp / "chain2")).base == read_delta(str(tmp / "chain1")).new
    for got, want in zip(applied(applied(tables(repos[0]), str(tmp / "chain1")), str(tmp / "chain2")),
                         tables(repos[2])):
        np.testing.assert_array_equal(got, want)


def test_deltas_that_do_not_apply_are_refused(days):
    tmp, ckpts, repos = days
    with pytest.raises(ExportError, match=r"was not trained on from .*repo1 \(step 14"):
        write_delta_repository(ckpts[0], str(tmp / "backwards"), repos[1])
    branch = train(tmp, "branch", 2, restore=ckpts[0], seed=9)   # another run from day 0: not from day 1
    with pytest.raises(ExportError, match="was not trained on from"):
        write_delta_repository(branch, str(tmp / "branch_delta"), repos[1])
    fresh = train(tmp, "weights", 2, restore=ckpts[0], mode="weights")   # weights only: a new model
    with pytest.raises(ExportError, match="was not trained on from"):
        write_delta_repository(fresh, str(tmp / "weights_delta"), repos[0])
    assert not any(p.name.startswith(("backwards", "branch_delta", "weights_delta", ".")) for p in tmp.iterdir())
    other = tiny_config(synthetic_cardinalities=["3000", "5000", "7", "401"], save_checkpoint_path=str(tmp / "other"),
                        max_steps=2, evals_per_epoch=0)
    run_loop.run(other)
    with pytest.raises(ExportError, match="another model"):
        write_delta_repository(str(tmp / "other"), str(tmp / "other_delta"), repos[0])
    result = subprocess.run([*PYTHON, "deployment/deploy.py", f"--checkpoint={ckpts[0]}",
                             f"--delta_from={repos[1]}", f"--output={tmp / 'cli_delta'}", "--forms=tables"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: --forms: no effect with --delta_from (a delta holds rows and the dense model)"]


@pytest.mark.parametrize("name", [f"embedding/table_1/{UPDATED_AT}", "embedding/table_1", "top_mlp/dense_0/kernel"])
def test_a_delta_of_a_changed_checkpoint_is_refused_unless_verification_is_skipped(days, tmp_path, name):
    """Each reader of a delta (rows' updated_at, the updated rows, the dense model) verifies the
    pieces it reads; verify=False (deploy.py --skip_checkpoint_checksums) writes the delta."""
    tmp, ckpts, repos = days
    root = str(tmp_path / "day1")
    shutil.copytree(ckpts[1], root)
    flip(piece_path(root, name))
    with pytest.raises(CheckpointError, match=f"tensor {name} changed on disk since it was written"):
        write_delta_repository(root, str(tmp_path / "refused"), repos[0], "m")
    assert not os.path.exists(tmp_path / "refused")
    info = write_delta_repository(root, str(tmp_path / "delta"), repos[0], "m", verify=False)
    assert info["new"]["step"] == 14 and read_delta(str(tmp_path / "delta")).new.step == 14


@pytest.mark.slow
def test_a_delta_from_a_run_at_two_ranks(days, tmp_path):
    """Day 1 trained at 2 Gloo ranks from the 1-rank day 0 (tables cut in rows and columns): its delta
    applied to day 0's export gives its full export."""
    _, ckpts, repos = days
    args = ["dlrm.py", "--dataset_type=synthetic", f"--synthetic_cardinalities={','.join(CARDS)}",
            "--synthetic_num_numerical=3", f"--synthetic_rows={128 * 40}", "--synthetic_eval_rows=1000",
            "--batch_size=128", "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1",
            "--optimizer=adam", "--learning_rate=0.003", "--seed=6", "--max_steps=4", "--evals_per_epoch=0",
            "--row_slice_threshold=30000", "--column_slice_threshold=10000",
            f"--restore_checkpoint_path={ckpts[0]}", "--restore_mode=continue",
            f"--save_checkpoint_path={tmp_path / 'day1'}"]
    run = horovodrun(2, args, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    write_repository(str(tmp_path / "day1"), str(tmp_path / "repo1"), "m", forms=["tables"])
    write_delta_repository(str(tmp_path / "day1"), str(tmp_path / "delta"), repos[0], "m")
    for got, want in zip(applied(tables(repos[0]), str(tmp_path / "delta")), tables(str(tmp_path / "repo1"))):
        np.testing.assert_array_equal(got, want)
    assert checkpoint.read_manifest(str(tmp_path / "day1"))["world_size"] == 2


def test_a_delta_from_tables_on_disk(days, tmp_path):
    """Day 1 trained with its two largest tables on disk behind small caches (their updated_at kept
    in host memory, set as batches are staged): the delta applied to day 0's export gives its full export."""
    _, ckpts, repos = days
    store = tmp_path / "store"
    store.mkdir()
    day1 = train(tmp_path, "day1", 4, restore=ckpts[0], seed=6, embedding_memory_budget_gb=0.0004,
                 embedding_store_path=str(store))
    write_repository(day1, str(tmp_path / "repo1"), "m", forms=["tables"])
    info = write_delta_repository(day1, str(tmp_path / "delta"), repos[0], "m")
    for got, want in zip(applied(tables(repos[0]), str(tmp_path / "delta")), tables(str(tmp_path / "repo1"))):
        np.testing.assert_array_equal(got, want)
    assert info["tables"][1]["count"] < int(CARDS[1]) // 4
