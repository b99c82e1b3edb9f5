"""deployment/deploy.py: checkpoints (one process and 2 Gloo ranks; DLRM one-hot, DCNv2 with
unequal dims and multi-hot features) -> Triton model repositories whose SavedModels, loaded in a
fresh process, predict what the training-time model predicts."""
import json
import os

import numpy as np
import pytest
from google.protobuf import text_format
from tensorflow.core.protobuf import saved_model_pb2

import run.loop as run_loop
from deployment.repository_format import PAD, ServingLayout, categorical_matrix
from tests.support.configs import TINY, tiny_config
from tests.support.horovod_run import horovodrun
from tests.support.datasets import write_dataset
from tests.test_dataset_cli import MODEL
from run.config import build_config
from tests.support.exports import deploy, reference, served

DCN = ["--interaction=cross", "--embedding_dim=4,8,6,5", "--num_cross_layers=2", "--cross_layer_projection_dim=4"]


def check_round_trip(cfg, checkpoint, tmp_path, rows=300):
    result = deploy(f"--checkpoint={checkpoint}", f"--output={tmp_path / 'repo'}", "--model_name=m",
                    "--host_table_mb=0.0005")
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads((tmp_path / "repo" / "export.json").read_text())
    layout = ServingLayout(**info["layout"])
    batch, logits = reference(cfg, checkpoint, rows)
    out = served(str(tmp_path / "repo"), batch, layout, tmp_path)
    np.testing.assert_allclose(out["logits"][:, 0], logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["predictions"][:, 0], 1 / (1 + np.exp(-logits)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["ensemble_logits"], out["logits"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out["ensemble_predictions"].shape, (rows, 1))
    for model in ("m", "m_sparse"):   # tables above --host_table_mb, and only those, are kept in host memory
        proto = saved_model_pb2.SavedModel()
        proto.ParseFromString((tmp_path / "repo" / model / "1" / "model.savedmodel" / "saved_model.pb").read_bytes())
        devices = {n.variable.name: n.variable.device for n in proto.meta_graphs[0].object_graph_def.nodes
                   if n.HasField("variable")}
        host = [f"table_{f}" for f in info["host_tables"]]
        assert sorted(v for v, d in devices.items() if d) == host and all(devices[v].endswith("CPU:0") for v in host)
    return info, layout


def test_dlrm_export_round_trip(tmp_path):
    cfg = tiny_config(save_checkpoint_path=str(tmp_path / "ckpt"), max_steps=10)
    run_loop.run(cfg)
    info, layout = check_round_trip(cfg, str(tmp_path / "ckpt"), tmp_path)
    assert info["models"] == ["m", "m_dense", "m_sparse"] and info["step"] == 10
    assert info["host_tables"] == [0, 1, 3] and layout.categorical_width == 4   # bytes 640, 1600, 224, 960
    check_configs(tmp_path / "repo", "m", layout)


@pytest.mark.slow
def test_dcnv2_multi_hot_unequal_dims_written_at_two_ranks(tmp_path):
    """A DCNv2 checkpoint written by 2 Gloo ranks (tables split over them), multi-hot features
    (sum of rows, -1 padding) and per-feature widths."""
    data = write_dataset(tmp_path / "data", {"c0": 3, "c3": 2})
    args = ["dlrm.py", "--dataset_type=split_binary", f"--dataset_path={data}", *MODEL, *DCN, "--max_steps=6",
            "--evals_per_epoch=0", f"--save_checkpoint_path={tmp_path / 'ckpt'}"]
    run = horovodrun(2, args, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cfg = build_config(dict(TINY, dataset_type="split_binary", dataset_path=data, interaction="cross",
                            embedding_dim=["4", "8", "6", "5"], num_cross_layers=2, cross_layer_projection_dim=4,
                            bottom_mlp_dims=["16", "8"], seed=7), present={"dataset_type", "dataset_path"})
    info, layout = check_round_trip(cfg, str(tmp_path / "ckpt"), tmp_path)
    assert info["written_at_ranks"] == 2 and info["step"] == 6 and info["host_tables"] == [1, 3]
    assert layout.columns == [(0, 3), (3, 4), (4, 5), (5, 7)] and layout.embedding_dims == [4, 8, 6, 5]
    check_configs(tmp_path / "repo", "m", layout)


def check_configs(repo, name, layout):
    """Every config.pbtxt parses as Triton's ModelConfig; tensors and the ensemble's wiring agree
    with the SavedModels' signatures."""
    from tritonclient.grpc import model_config_pb2
    configs = {}
    for model in (name, f"{name}_sparse", f"{name}_dense", f"{name}_ensemble"):
        configs[model] = text_format.Parse((repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        assert configs[model].name == model and configs[model].max_batch_size == 65536
    shapes = {"numerical_features": [layout.num_numerical], "categorical_features": [layout.categorical_width],
              "embeddings": [sum(layout.embedding_dims)], "predictions": [1], "logits": [1]}
    for model, config in configs.items():
        for tensor in list(config.input) + list(config.output):
            assert list(tensor.dims) == shapes[tensor.name], (model, tensor.name)
    steps = configs[f"{name}_ensemble"].ensemble_scheduling.step
    assert [s.model_name for s in steps] == [f"{name}_sparse", f"{name}_dense"]
    assert dict(steps[0].output_map) == {"embeddings": "embeddings"}
    assert set(steps[1].input_map) == {"numerical_features", "embeddings"}
    assert configs[name].platform == "tensorflow_savedmodel" and configs[name].dynamic_batching is not None


def test_layout_pads_multi_hot_rows_and_refuses_too_many_ids():
    from dataloading.split_binary import RaggedIds
    hotness = [None, 3, 2]
    matrix = categorical_matrix([np.array([1, 2]), RaggedIds(np.array([4, 0, 3]), np.array([0, 3, 3])),
                                 RaggedIds(np.array([7, 6]), np.array([0, 1, 2]))], hotness)
    np.testing.assert_array_equal(matrix, [[1, 4, 0, 3, 7, PAD], [2, PAD, PAD, PAD, 6, PAD]])
    with pytest.raises(ValueError, match="categorical feature 2: a row has 3 ids, more than its max_hotness 2"):
        categorical_matrix([np.array([1]), RaggedIds(np.array([4]), np.array([0, 1])),
                            RaggedIds(np.array([7, 6, 5]), np.array([0, 3]))], hotness)


def test_out_of_range_ids_fail_naming_the_feature(tmp_path):
    import tensorflow as tf
    from deployment.exporter.saved_models import serving_modules
    from storage.checkpoint import read_manifest
    cfg = tiny_config(save_checkpoint_path=str(tmp_path / "ckpt"), max_steps=2)
    run_loop.run(cfg)
    manifest = read_manifest(str(tmp_path / "ckpt"))
    serve = serving_modules(manifest, 1 << 30)["monolithic"].serve
    numerical = tf.zeros([2, 3])
    assert serve(numerical, tf.constant([[1, 2, 3, 4], [0, 0, 0, 0]], tf.int64))["logits"].shape == (2, 1)
    for bad in ([[1, 2, 3, 30], [0, 0, 0, 0]], [[1, 2, -1, 4], [0, 0, 0, 0]]):   # cardinalities 20, 50, 7, 30
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"embedding ids out of range"):
            serve(numerical, tf.constant(bad, tf.int64))


def test_deploy_errors_are_one_line(tmp_path):
    missing = deploy(f"--checkpoint={tmp_path / 'none'}", f"--output={tmp_path / 'repo'}")
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'none'}: no checkpoint here (neither manifest.json nor latest)"]
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "keep").write_text("x")
    cfg = tiny_config(save_checkpoint_path=str(tmp_path / "ckpt"), max_steps=2)
    run_loop.run(cfg)
    exists = deploy(f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'repo'}")
    assert exists.returncode == 2 and exists.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'repo'} already exists; pass --overwrite to replace it"]
    assert (tmp_path / "repo" / "keep").read_text() == "x"
    bad = deploy(f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'repo'}", "--max_batch_size=0")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["error: --max_batch_size must be positive, got 0"]
    ok = deploy(f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'repo'}", "--overwrite",
                "--forms=monolithic", "--instance_kind=cpu")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "repo")) == ["dlrm", "export.json"]
    assert "kind: KIND_CPU" in (tmp_path / "repo" / "dlrm" / "config.pbtxt").read_text()
    nested = deploy(f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'a' / 'b' / 'repo'}",
                    "--forms=monolithic")   # its folders made, as mkdir -p
    assert nested.returncode == 0, nested.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "a" / "b" / "repo")) == ["dlrm", "export.json"]
    (tmp_path / "file").write_text("x")
    blocked = deploy(f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'file' / 'repo'}")
    assert blocked.returncode == 2 and blocked.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'file' / 'repo'}: cannot create its folder {tmp_path / 'file'}: File exists"]
