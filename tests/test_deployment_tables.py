"""deployment/deploy.py --forms=tables: the dense SavedModel, built without the tables, and one
.npy file per table streamed from a checkpoint written at 2 ranks (row, column and replicated
pieces), which a lookup in NumPy turns into the monolithic export's predictions; the limit on
tables held in memory, and the repository written whole or not at all. The checkpoint is the
built-in DCNv2's as the run builds it (examples/dcnv2.py handed its tables: tests/support/builtin.py)."""
import json
import os
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from deployment.exporter.model_layout import table_tensor
from deployment.exporter.repository import ExportError, write_repository
from deployment.repository_format import PAD, ServingLayout
from nn.model_config import ModelConfig, table_configs
from parallel_embedding.planner import plan_tables
from storage import checkpoint
from tests.support.builtin import builtin_config, builtin_model
from tests.support.horovod_run import ROOT
from utils.errors import CheckpointError
from tests.support.warm_python import PYTHON

CONFIG = ModelConfig(tables=table_configs(cardinalities=[20, 50, 7, 30], dims=[4, 8, 6, 5],
                                          max_hotness=[3, None, None, 2], multi_hot_combiner="mean"),
                     num_numerical=3, bottom_mlp_dims=(16, 8), top_mlp_dims=(16, 1), interaction="cross",
                     num_cross_layers=2, cross_layer_projection_dim=4)
CFG = builtin_config(CONFIG, seed=3)   # the run's configuration of CONFIG


class ThreadRank:
    """Rank `rank` of ranks run as threads sharing `group` (a barrier and a box): what
    checkpoint.save and ranking.Model.compile (its broadcast) need of collectives."""

    def __init__(self, rank: int, size: int, group: dict):
        self.rank, self.size, self._group = rank, size, group

    def barrier(self, name):
        self._group["barrier"].wait(timeout=120)

    def broadcast_object(self, obj, name):
        if self.rank == 0:
            self._group["value"] = obj
        self.barrier(name)
        return self._group["value"]

    def allgather_object(self, obj, name):
        self.barrier(name)   # every rank has read the previous gather
        self._group[self.rank] = obj
        self.barrier(name)
        return [self._group[r] for r in range(self.size)]

    def broadcast_variables(self, variables):
        for v, value in zip(variables, self.broadcast_object([v.numpy() for v in variables], "variables")):
            v.assign(value)
        self.barrier("variables")   # every rank has read rank 0's values


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint of CONFIG's weights (seeded initial weights) written by 2 ranks: table 1 cut in
    rows, table 3 in columns, table 2 replicated, table 0 whole on one rank."""
    plan = plan_tables(CONFIG.cardinalities, CONFIG.embedding_dims, 2, column_slice_threshold=100,
                       row_slice_threshold=300, data_parallel_threshold=45)
    assert [t.kind for t in plan.tables] == ["whole", "row", "replicated", "column"]
    group = {"barrier": threading.Barrier(2)}
    ranks = [ThreadRank(r, 2, group) for r in range(2)]
    models = [builtin_model(CFG, plan, rank) for rank in ranks]
    root = str(tmp_path_factory.mktemp("ckpt"))

    def save(model, rank):
        model.compile(optimizer="sgd")   # every rank starts from rank 0's Keras weights
        return checkpoint.save(root, model.checkpoint_entries(weights_only=True), 4, CONFIG.signature(), rank)

    with ThreadPoolExecutor(2) as pool:
        paths = [s.result() for s in [pool.submit(save, m, rank) for m, rank in zip(models, ranks)]]
    assert checkpoint.read_manifest(paths[0])["world_size"] == 2
    return paths[0]


def one_process_model():
    """The checkpoint's model (the same seed) on one process, compiled."""
    model = builtin_model(CFG)
    model.compile(optimizer="sgd")
    return model


def npy_files(repo):
    return {f: np.load(repo / "m_tables" / f"table_{f}.npy", mmap_mode="r") for f in range(len(CONFIG.tables))}


def test_table_files_equal_the_checkpoint_read_a_block_at_a_time(ckpt, tmp_path, monkeypatch):
    """Blocks of a few rows that cross the pieces' bounds; no table is read whole."""
    monkeypatch.setattr(checkpoint, "BLOCK_BYTES", 100)   # 3 to 6 rows of these tables
    reads = []
    region = checkpoint._read_region

    def read_region(ckpt_dir, entry, tensor, rows=None):
        value = region(ckpt_dir, entry, tensor, rows)
        if entry.name.startswith("embedding/"):
            reads.append((entry.name, value.nbytes))
        return value

    def whole(*args):
        raise AssertionError("a table read whole")

    monkeypatch.setattr(checkpoint, "_read_region", read_region)
    monkeypatch.setattr(checkpoint, "read_tensor", whole)
    info = write_repository(ckpt, str(tmp_path / "repo"), "m", forms=["tables"])
    monkeypatch.undo()
    assert reads and max(nbytes for _, nbytes in reads) <= 100
    for f, table in enumerate(CONFIG.tables):   # rows per block: 100 // (4 D_f), at least one block a table
        assert sum(name == table_tensor(f) for name, _ in reads) == -(-table.cardinality // (100 // (4 * table.dim)))
    assert sorted(os.listdir(tmp_path / "repo")) == ["export.json", "m_dense", "m_tables"]
    assert info["forms"] == ["tables"] and info["models"] == ["m_dense"] and info["host_tables"] == []
    files = npy_files(tmp_path / "repo")
    for f, table in enumerate(CONFIG.tables):
        with open(tmp_path / "repo" / "m_tables" / f"table_{f}.npy", "rb") as fh:
            assert np.lib.format.read_magic(fh) == (1, 0)
        assert files[f].dtype == np.float32 and files[f].shape == (table.cardinality, table.dim)
        np.testing.assert_array_equal(files[f], checkpoint.read_tensor(ckpt, table_tensor(f)))
    assert info["table_files"] == {"directory": "m_tables", "tables": 4, "bytes": sum(
        os.path.getsize(tmp_path / "repo" / "m_tables" / f"table_{f}.npy") for f in range(4))}
    proto = saved_model_pb2.SavedModel()   # the dense SavedModel holds the dense weights, no table
    proto.ParseFromString((tmp_path / "repo" / "m_dense" / "1" / "model.savedmodel" / "saved_model.pb").read_bytes())
    names = sorted(n.variable.name for n in proto.meta_graphs[0].object_graph_def.nodes if n.HasField("variable"))
    model = one_process_model()
    assert names == sorted(v.name.split(":")[0] for v in model.dense_variables)
    assert model.checkpoint_names(weights_only=True) == set(names) | {table_tensor(f) for f in range(4)}


def test_tables_json(ckpt, tmp_path):
    write_repository(ckpt, str(tmp_path / "repo"), "m", forms=["tables"])
    info = json.loads((tmp_path / "repo" / "m_tables" / "tables.json").read_text())
    assert sorted(os.listdir(tmp_path / "repo" / "m_tables")) == ["table_0.npy", "table_1.npy", "table_2.npy",
                                                                    "table_3.npy", "tables.json"]
    assert info == {
        "format": "dlrm-table-files", "version": 1, "checkpoint": ckpt, "step": 4, "pad_id": -1,
        "dense_model": {"name": "m_dense", "inputs": {"numerical_features": [3], "embeddings": [23]}},
        "tables": [
            {"feature": 0, "file": "table_0.npy", "rows": 20, "dim": 4, "dtype": "float32", "max_hotness": 3,
             "combiner": "mean", "categorical_columns": [0, 3], "embedding_columns": [0, 4]},
            {"feature": 1, "file": "table_1.npy", "rows": 50, "dim": 8, "dtype": "float32", "max_hotness": None,
             "combiner": "sum", "categorical_columns": [3, 4], "embedding_columns": [4, 12]},
            {"feature": 2, "file": "table_2.npy", "rows": 7, "dim": 6, "dtype": "float32", "max_hotness": None,
             "combiner": "sum", "categorical_columns": [4, 5], "embedding_columns": [12, 18]},
            {"feature": 3, "file": "table_3.npy", "rows": 30, "dim": 5, "dtype": "float32", "max_hotness": 2,
             "combiner": "mean", "categorical_columns": [5, 7], "embedding_columns": [18, 23]}]}


def numpy_embeddings(files, categorical, info):
    """The embeddings [B, 23] of categorical_features [B, 7], gathered from the table files as
    tables.json describes them: a multi-hot row is the mean of its ids' rows (zeros without ids)."""
    out = []
    for t in info["tables"]:
        a, b = t["categorical_columns"]
        ids = categorical[:, a:b]
        table = files[t["feature"]]
        if t["max_hotness"] is None:
            out.append(table[ids[:, 0]])
            continue
        rows = np.stack([np.where((ids[:, k] != PAD)[:, None], table[np.maximum(ids[:, k], 0)], 0)
                         for k in range(b - a)])
        out.append(rows.sum(0) / np.maximum((ids != PAD).sum(1), 1)[:, None])
    return np.concatenate(out, axis=1).astype(np.float32)


def test_dense_model_and_table_files_predict_as_the_monolithic_model(ckpt, tmp_path):
    info = write_repository(ckpt, str(tmp_path / "repo"), "m", forms=["monolithic", "tables"])
    assert info["models"] == ["m", "m_dense"] and info["forms"] == ["monolithic", "tables"]
    layout = ServingLayout(**info["layout"])
    rng = np.random.default_rng(0)
    n = 64
    categorical = np.concatenate([rng.integers(0, c, (n, h or 1)) for c, h in
                                  zip(layout.cardinalities, layout.max_hotness)], axis=1)
    multi_hot = np.concatenate([np.full(h or 1, h is not None) for h in layout.max_hotness])
    categorical[(rng.random(categorical.shape) < 0.3) & multi_hot] = PAD
    categorical[0, 0:3] = PAD   # a row without ids
    numerical = rng.normal(size=(n, 3)).astype(np.float32)

    def serve(model, **tensors):
        f = tf.saved_model.load(str(tmp_path / "repo" / model / "1" / "model.savedmodel")).signatures["serving_default"]
        return {k: v.numpy() for k, v in f(**{k: tf.constant(v) for k, v in tensors.items()}).items()}

    mono = serve("m", numerical_features=numerical, categorical_features=categorical.astype(np.int64))
    tables = json.loads((tmp_path / "repo" / "m_tables" / "tables.json").read_text())
    embeddings = numpy_embeddings(npy_files(tmp_path / "repo"), categorical, tables)
    dense = serve("m_dense", numerical_features=numerical, embeddings=embeddings)
    np.testing.assert_allclose(dense["logits"], mono["logits"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dense["predictions"], mono["predictions"], rtol=1e-6, atol=1e-6)
    # the training model's dense part, on the same embeddings
    parts = [tf.constant(numerical)] + tf.split(embeddings, layout.embedding_dims, axis=1)
    expected = one_process_model().dense_part()(parts)
    np.testing.assert_allclose(dense["logits"][:, 0], expected.numpy()[:, 0], rtol=1e-5, atol=1e-5)
    assert np.std(dense["logits"]) > 1e-3


def test_in_memory_forms_are_refused_above_the_limit(ckpt, tmp_path):
    """Tables of 672 floats: 2688 bytes."""
    with pytest.raises(ExportError) as e:
        write_repository(ckpt, str(tmp_path / "repo"), "m", forms=["tables", "ensemble"], max_tables_bytes=2000)
    assert str(e.value) == ("the tables take 2.5e-06 GiB, more than --max_tables_in_memory_gb (1.86e-06 GiB), and "
                            "--forms=ensemble holds every table in memory: use --forms=tables (the dense SavedModel "
                            "and one .npy file per table)")
    assert not os.path.exists(tmp_path / "repo")
    info = write_repository(ckpt, str(tmp_path / "repo"), "m", max_tables_bytes=2688)   # default forms: they fit
    assert info["forms"] == ["monolithic", "ensemble"] and info["table_files"] is None


def deploy(*args):
    return subprocess.run([*PYTHON, "deployment/deploy.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def test_deploy_refuses_in_one_line_and_chooses_the_tables_form(ckpt, tmp_path):
    out = tmp_path / "repo"
    refused = deploy(f"--checkpoint={ckpt}", f"--output={out}", "--forms=monolithic", "--max_tables_in_memory_gb=1e-6")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: the tables take 2.5e-06 GiB, more than --max_tables_in_memory_gb (9.99e-07 GiB), and "
        "--forms=monolithic holds every table in memory: use --forms=tables (the dense SavedModel and one .npy file "
        "per table)"]
    chosen = deploy(f"--checkpoint={ckpt}", f"--output={out}", "--max_tables_in_memory_gb=1e-6")
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    size = sum(os.path.getsize(out / "dcnv2_tables" / f"table_{f}.npy") for f in range(4))
    assert chosen.stdout.strip().splitlines()[-1] == (
        f"exported {ckpt} (step 4, written at 2 rank(s)) to {out}: SavedModels dcnv2_dense; table files "
        f"{out / 'dcnv2_tables'} (4 tables, {size / 2 ** 30:.3g} GiB); tables form chosen: the tables take more "
        f"than --max_tables_in_memory_gb (9.99e-07 GiB)")
    assert sorted(os.listdir(out)) == ["dcnv2_dense", "dcnv2_tables", "export.json"]
    assert 'name: "dcnv2_dense"' in (out / "dcnv2_dense" / "config.pbtxt").read_text()


def test_a_failed_export_leaves_no_partial_repository(ckpt, tmp_path):
    """Table 2's piece is unreadable: tables 0 and 1 were written; the previous repository stays."""
    broken = tmp_path / "ckpt"
    shutil.copytree(ckpt, broken)
    piece = checkpoint.read_manifest(str(broken))["tensors"][table_tensor(2)]["pieces"][0]["file"]
    (broken / piece).write_bytes(b"not an array")
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "keep").write_text("x")
    with pytest.raises(CheckpointError, match=f"{broken / piece}: cannot read tensor {table_tensor(2)}"):
        write_repository(str(broken), str(tmp_path / "repo"), "m", forms=["tables"], overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "repo"] and os.listdir(tmp_path / "repo") == ["keep"]
