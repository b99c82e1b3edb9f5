"""deployment/deploy.py --model=FILE needs no memory for the model's tables: a model file whose
table sizes come from the features' cardinalities, trained by main.py with its 2^24 x 16 table
(1 GiB) on disk (--embedding_memory_budget_gb), exports in the tables form under a limit of
private memory (RLIMIT_DATA: heap and anonymous mappings, not the checkpoint files read) of the
table's own bytes: the exporter builds the model with one-row tables (ranking.Features'
`one_row_tables`) and streams the checkpoint's rows. The same limit also holds for the check of
the tables' shapes against the checkpoint, still one line. The tables' one row each is checked
on the model itself too."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.horovod_run import ROOT

ROWS, DIM = 1 << 24, 16
TABLE_BYTES = ROWS * DIM * 4
MODEL = """
import keras, ranking

def build_model(features, hparams):
    x = features.inputs()
    emb = features.embedding(features.feature_configs(DIM))([x[f] for f in features.names])
    h = keras.layers.Concatenate(name="cat")(emb + [x["numerical"]])
    return ranking.Model(x, keras.layers.Dense(1, name="logit")(h), name="big")
"""
# The exporting process' private memory at most the table's bytes (its threads few, so that their
# stacks are not counted against it on a machine of many cores).
LIMITED = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_DATA, (int(sys.argv[1]),) * 2); "
           "os.execv(sys.executable, [sys.executable, 'deployment/deploy.py'] + sys.argv[2:])")
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
           OMP_NUM_THREADS="1")


def model_file(path, dim):
    path.parent.mkdir(exist_ok=True)
    path.write_text(MODEL.replace("DIM", str(dim)))
    return str(path)


def deploy_limited(*args):
    return subprocess.run([sys.executable, "-c", LIMITED, str(TABLE_BYTES), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=ENV)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """big.py trained two steps with its big table on disk: (tmp, model file, checkpoint root)."""
    tmp = tmp_path_factory.mktemp("big")
    path = model_file(tmp / "big.py", DIM)
    (tmp / "store").mkdir()
    result = subprocess.run(
        [sys.executable, "main.py", f"--model={path}", "--cpu", "--intra_op_parallelism=1",
         "--inter_op_parallelism=1", "--dataset_type=synthetic", f"--synthetic_cardinalities={ROWS},10",
         "--synthetic_num_numerical=2", "--batch_size=32", "--valid_batch_size=32", "--synthetic_rows=64",
         "--synthetic_eval_rows=32", "--warmup_steps=0", "--embedding_memory_budget_gb=0.1",
         f"--embedding_store_path={tmp / 'store'}", f"--save_checkpoint_path={tmp / 'ckpt'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "on disk" in result.stdout
    return tmp, path, tmp / "ckpt"


@pytest.mark.slow
def test_a_table_larger_than_the_memory_limit_exports(trained):
    tmp, path, ckpt = trained
    result = deploy_limited(f"--checkpoint={ckpt}", f"--output={tmp / 'repo'}", f"--model={path}", "--forms=tables")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp / "repo" / "big_tables" / "tables.json") as f:
        tables = json.load(f)["tables"]
    assert [(t["rows"], t["dim"]) for t in tables] == [(ROWS, DIM), (10, DIM)]
    exported = np.load(tmp / "repo" / "big_tables" / tables[0]["file"], mmap_mode="r")
    saved = np.load(ckpt / "ckpt-2" / f"embedding_tables.table_0.r0-{ROWS}.c0-{DIM}.npy", mmap_mode="r")
    rows = np.random.default_rng(0).integers(0, ROWS, 1000)
    np.testing.assert_array_equal(exported[rows], saved[rows])


def test_a_table_shape_unlike_the_checkpoints_is_one_line(trained):
    tmp, _, ckpt = trained
    other = model_file(tmp / "other" / "big.py", 8)   # the same file name, a narrower table
    result = deploy_limited(f"--checkpoint={ckpt}", f"--output={tmp / 'repo8'}", f"--model={other}")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: --model={other}: table embedding_tables/table_0 is ({ROWS}, {DIM}) in {ckpt}/ckpt-2, the model "
        f"builds it ({ROWS}, 8)"], result.stderr[-2000:]
    assert not os.path.exists(tmp / "repo8")


def test_one_row_tables_keep_the_models_shapes():
    """Features(one_row_tables=True): each table variable [1, D] (a dynamic one's static); the
    layers' configs as the model gives them."""
    from parallel_embedding.planner import DynamicOptions
    from ranking import CategoricalFeature, Features
    features = Features([CategoricalFeature("a", ROWS), CategoricalFeature("b", 7, 3),
                         CategoricalFeature("c", 0, dynamic=DynamicOptions(ROWS, shards=2))], 2, one_row_tables=True)
    wide = features.embedding(features.feature_configs(1, prefix="wide_"), name="wide")
    deep = features.embedding(features.feature_configs([16, 4, 8]), name="deep")
    assert [(t.vocabulary_size, t.embedding_dim) for t in wide.tables + deep.tables] == [
        (ROWS, 1), (7, 1), (ROWS, 1), (ROWS, 16), (7, 4), (ROWS, 8)]
    assert deep.tables[2].dynamic == DynamicOptions(ROWS, shards=2)
    assert [tuple(v.shape) for v in wide.table_variables + deep.table_variables] == [
        (1, 1), (1, 1), (1, 1), (1, 16), (1, 4), (1, 8)]
    assert [t.kind for t in deep.embedding.plan.tables] == ["whole"] * 3
    assert deep.embedding.table_name(1) == "deep_tables/table_1"
