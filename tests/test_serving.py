"""deployment/serve.py runs a real Triton server (ports as flags) for a model trained on a
multi-hot split-binary dataset; tritonclient requests over HTTP and gRPC get the training-time
model's predictions, evaluate_accuracy.py reports the offline metrics, evaluate_latency.py
measures, malformed requests get error responses while the server keeps serving, the native
frontend's Prometheus metrics count each request, and the server stops cleanly."""
import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

import run.loop as run_loop
from deployment.client import ServingClient, error_line, free_ports, open_eval_data, request_batches
from tests.support.configs import TINY
from tests.support.horovod_run import ROOT
from tests.support.datasets import write_dataset
from tests.support.exports import reference
from run.config import build_config
from tests.support.serving import port_flags, scrape, script, start_server, stop_server

MAX_BATCH = 256
FRONTENDS = ["triton", "native"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(config, checkpoint, data, repository): a DLRM on multi-hot files, exported."""
    tmp = tmp_path_factory.mktemp("serving")
    data = write_dataset(tmp / "data", {"c0": 3, "c3": 2})
    cfg = build_config(dict(TINY, dataset_type="split_binary", dataset_path=data, max_steps=8,
                            save_checkpoint_path=str(tmp / "ckpt")),
                       present={"dataset_type", "dataset_path", "max_steps", "save_checkpoint_path"})
    run_loop.run(cfg)
    exported = script("deploy.py", f"--checkpoint={tmp / 'ckpt'}", f"--output={tmp / 'repo'}", "--forms=monolithic",
                      f"--max_batch_size={MAX_BATCH}", "--instance_kind=cpu")
    assert exported.returncode == 0, exported.stderr[-3000:]
    return cfg, str(tmp / "ckpt"), data, tmp / "repo"


@pytest.fixture(scope="module", params=FRONTENDS)
def served(trained, request, tmp_path_factory):
    """(config, checkpoint, data, ports, frontend): the export being served by each frontend."""
    cfg, checkpoint, data, repo = trained
    log = tmp_path_factory.mktemp(request.param) / "server.log"
    ports = free_ports(3)
    server = start_server(log, ports, f"--model_repository={repo}", f"--frontend={request.param}")
    try:
        ServingClient("http", f"localhost:{ports[0]}", "dlrm").wait_ready(120)
        yield cfg, checkpoint, data, ports, request.param
    finally:
        stop_server(server, ports, log)


def data_flags(data):
    return ["--dataset_type=split_binary", f"--dataset_path={data}"]


def eval_dataset(data):
    """The split-binary dataset at `data`, opened as the clients open it from their flags."""
    flags = types.SimpleNamespace(dataset_type="split_binary", dataset_path=data, feature_spec="", eval_mapping="test",
                                  seed=0, synthetic_alpha=0.0, synthetic_eval_rows=0)
    return open_eval_data(flags)[0]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_predictions_equal_the_training_time_model(served, protocol):
    cfg, checkpoint, data, ports, _ = served
    _, expected = reference(cfg, checkpoint, 200)
    client = ServingClient(protocol, f"localhost:{ports[0 if protocol == 'http' else 1]}", "dlrm")
    numerical, categorical, _ = next(request_batches(eval_dataset(data), 200, 200))
    out = client.infer(numerical, categorical, ("logits", "predictions"))
    np.testing.assert_allclose(out["logits"][:, 0], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["predictions"][:, 0], 1 / (1 + np.exp(-expected)), rtol=1e-5, atol=1e-6)
    client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_evaluate_accuracy_equals_offline_evaluation(served, protocol, tmp_path):
    cfg, checkpoint, data, ports, _ = served
    restored = dataclasses.replace(cfg.checkpoints, restore_checkpoint_path=checkpoint, save_checkpoint_path="")
    offline = run_loop.run(dataclasses.replace(cfg, mode="eval", checkpoints=restored,
                                           evaluation=dataclasses.replace(cfg.evaluation, valid_batch_size=128)))
    url = f"localhost:{ports[0 if protocol == 'http' else 1]}"
    result = script("evaluate_accuracy.py", *data_flags(data), f"--protocol={protocol}", f"--url={url}",
                    "--batch_size=200", f"--output_json={tmp_path / 'm.json'}")
    assert result.returncode == 0, result.stderr[-3000:]
    served_metrics = json.loads((tmp_path / "m.json").read_text())
    assert served_metrics["samples"] == offline["samples"] == 500
    assert served_metrics["auc"] == pytest.approx(offline["auc"], abs=1e-6)
    assert served_metrics["logloss"] == pytest.approx(offline["logloss"], abs=1e-6)
    assert f"served dlrm over {protocol}: auc {offline['auc']:.5f}" in result.stdout


def test_evaluate_latency_reports_each_batch_size(served, tmp_path):
    _, _, data, ports, _ = served
    result = script("evaluate_latency.py", *data_flags(data), "--protocol=http", f"--url=localhost:{ports[0]}",
                    "--batch_sizes=1,64", "--concurrency=2", "--requests=30", "--warmup_requests=2",
                    f"--output_json={tmp_path / 'l.json'}")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "l.json").read_text().splitlines()]
    assert [r["batch_size"] for r in records] == [1, 64] and all(r["concurrency"] == 2 for r in records)
    for r in records:
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] and r["samples_per_s"] > 0
    too_big = script("evaluate_latency.py", *data_flags(data), f"--url=localhost:{ports[0]}", "--batch_sizes=512")
    assert too_big.returncode == 2 and too_big.stderr.strip().splitlines()[-1] == (
        f"error: --batch_sizes 512 exceeds model 'dlrm''s max_batch_size {MAX_BATCH}")


def tensors(api, **inputs):
    """name=(array, datatype) -> tritonclient inputs (binary data)."""
    out = []
    for name, (value, datatype) in inputs.items():
        out.append(api.InferInput(name, list(value.shape), datatype))
        out[-1].set_data_from_numpy(value)
    return out


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_get_errors_and_the_server_keeps_serving(served, protocol):
    """Triton's checks and messages (both frontends), and the model's; after each, a good request
    on the same connection gets the same answer as before."""
    from tritonclient.utils import InferenceServerException
    cfg, _, data, ports, _ = served
    client = ServingClient(protocol, f"localhost:{ports[0 if protocol == 'http' else 1]}", "dlrm")
    numerical, categorical, _ = next(request_batches(eval_dataset(data), 8, 8))   # width 3 + 1 + 1 + 2 = 7
    good = client.infer(numerical, categorical)["logits"]
    out_of_range = categorical.copy()
    out_of_range[2, 4] = 7   # feature 2 has 7 rows
    nan = numerical.copy()
    nan[0, 0] = np.nan
    api = client.api
    big = MAX_BATCH + 1
    cases = {   # message: (model, inputs, requested outputs)
        "unexpected shape for input 'categorical_features'": (
            "dlrm", dict(numerical_features=(numerical, "FP32"), categorical_features=(categorical[:, :6], "INT64")),
            ()),
        "data-type is 'FP64', but model 'dlrm' expects 'FP32'": (
            "dlrm", dict(numerical_features=(numerical.astype(np.float64), "FP64"),
                         categorical_features=(categorical, "INT64")), ()),
        "data-type is 'INT32', but model 'dlrm' expects 'INT64'": (
            "dlrm", dict(numerical_features=(numerical, "FP32"),
                         categorical_features=(categorical.astype(np.int32), "INT32")), ()),
        "embedding ids out of range [0, cardinality) in features (0-based):] [2]": (
            "dlrm", dict(numerical_features=(numerical, "FP32"), categorical_features=(out_of_range, "INT64")), ()),
        "numerical_features holds NaN or infinite values": (
            "dlrm", dict(numerical_features=(nan, "FP32"), categorical_features=(categorical, "INT64")), ()),
        f"batch-size must be <= {MAX_BATCH}": (
            "dlrm", dict(numerical_features=(np.repeat(numerical, 40, 0)[:big], "FP32"),
                         categorical_features=(np.repeat(categorical, 40, 0)[:big], "INT64")), ()),
        "Request for unknown model: 'nope' is not found": (
            "nope", dict(numerical_features=(numerical, "FP32"), categorical_features=(categorical, "INT64")), ()),
        "expected 2 inputs but got 1 inputs for model 'dlrm'": ("dlrm", dict(numerical_features=(numerical, "FP32")),
                                                                ()),
        "unexpected inference input 'ids' for model 'dlrm'": (
            "dlrm", dict(numerical_features=(numerical, "FP32"), ids=(categorical, "INT64")), ()),
        "unexpected inference output 'scores' for model 'dlrm'": (
            "dlrm", dict(numerical_features=(numerical, "FP32"), categorical_features=(categorical, "INT64")),
            ("scores",)),
    }
    for message, (model, inputs, outputs) in cases.items():
        with pytest.raises(InferenceServerException) as error:
            client.client.infer(model, tensors(api, **inputs), outputs=[api.InferRequestedOutput(o) for o in outputs])
        assert message in error_line(error.value), error_line(error.value)
        np.testing.assert_array_equal(client.infer(numerical, categorical)["logits"], good)   # still serving
    client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_only_the_requested_outputs_come_back(served, protocol):
    """The outputs named (all of them when none is), as binary data or (HTTP) JSON values."""
    _, _, data, ports, _ = served
    client = ServingClient(protocol, f"localhost:{ports[0 if protocol == 'http' else 1]}", "dlrm")
    numerical, categorical, _ = next(request_batches(eval_dataset(data), 5, 5))
    api = client.api
    inputs = tensors(api, numerical_features=(numerical, "FP32"), categorical_features=(categorical, "INT64"))
    full = client.client.infer("dlrm", inputs)
    names = lambda result: sorted(o["name"] if isinstance(o, dict) else o.name  # noqa: E731
                                  for o in (result.get_response()["outputs"] if protocol == "http"
                                            else result.get_response().outputs))
    assert names(full) == ["logits", "model_version", "predictions"]
    np.testing.assert_allclose(full.as_numpy("predictions"), 1 / (1 + np.exp(-full.as_numpy("logits"))), rtol=1e-6)
    assert full.as_numpy("model_version").tolist() == [[8]] * 5
    one = client.client.infer("dlrm", inputs, outputs=[api.InferRequestedOutput("predictions")])
    assert names(one) == ["predictions"]
    np.testing.assert_array_equal(one.as_numpy("predictions"), full.as_numpy("predictions"))
    if protocol == "http":   # tensors as JSON values, both ways
        as_json = [api.InferInput(t.name(), t.shape(), t.datatype()) for t in inputs]
        for tensor, value in zip(as_json, (numerical, categorical)):
            tensor.set_data_from_numpy(value, binary_data=False)
        result = client.client.infer("dlrm", as_json, outputs=[api.InferRequestedOutput("logits", binary_data=False)])
        assert "data" in result.get_response()["outputs"][0]
        np.testing.assert_allclose(result.as_numpy("logits"), full.as_numpy("logits"), rtol=1e-6)
    client.close()


def test_concurrent_requests_each_get_their_own_answer(served):
    """4 clients (2 HTTP, 2 gRPC) send different batches at once: each response is its request's."""
    _, _, data, ports, _ = served
    batches = list(request_batches(eval_dataset(data), 200, 25))
    client = ServingClient("grpc", f"localhost:{ports[1]}", "dlrm")
    expected = [client.infer(n, c)["logits"] for n, c, _ in batches]
    client.close()
    failures = []

    def send(k):
        protocol = ("http", "grpc")[k % 2]
        c = ServingClient(protocol, f"localhost:{ports[0 if protocol == 'http' else 1]}", "dlrm")
        for i in range(40):
            j = (i + k) % len(batches)
            if not np.array_equal(c.infer(*batches[j][:2])["logits"], expected[j]):
                failures.append((k, i))
        c.close()

    threads = [threading.Thread(target=send, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_serve_a_checkpoint_directly(served, tmp_path):
    """--checkpoint exports to a temporary repository and serves it; --max_batch_size overrides
    the export's."""
    _, checkpoint, data, served_ports, frontend = served
    ports = free_ports(3)
    server = start_server(tmp_path / "server.log", ports, f"--checkpoint={checkpoint}", "--model_name=ranker",
                          "--max_batch_size=16", f"--frontend={frontend}")
    try:
        client = ServingClient("grpc", f"localhost:{ports[1]}", "ranker")
        client.wait_ready(120)
        assert client.max_batch_size() == 16
        assert client.input_shapes() == {"numerical_features": [3], "categorical_features": [7]}
        numerical, categorical, _ = next(request_batches(eval_dataset(data), 16, 16))
        reference = ServingClient("grpc", f"localhost:{served_ports[1]}", "dlrm").infer(numerical, categorical)
        np.testing.assert_array_equal(client.infer(numerical, categorical)["logits"], reference["logits"])
        client.close()
    finally:
        stop_server(server, ports, tmp_path / "server.log")


def check_histogram(samples, name, labels):
    """The buckets of histogram `name`{`labels`} cumulative, their bounds increasing to +Inf, whose
    count is _count's; returns _count."""
    prefix = f'{name}_bucket{{{labels},le="'
    buckets = [(k[len(prefix):-2], v) for k, v in samples.items() if k.startswith(prefix)]
    bounds = [float(b) for b, _ in buckets]
    assert bounds[-1] == float("inf") and bounds == sorted(set(bounds)), bounds
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and counts[-1] == samples[f"{name}_count{{{labels}}}"], buckets
    return counts[-1]


def test_native_metrics_count_each_inference_request(trained, tmp_path):
    """GET /metrics of the native frontend after successful and refused requests over both
    protocols: each inference request counted once by protocol and status (other calls not),
    the samples of the successful ones, their latency histogram per protocol, the export's step."""
    from tritonclient.utils import InferenceServerException
    _, _, data, repo = trained
    ports = free_ports(3)
    log = tmp_path / "server.log"
    server = start_server(log, ports, f"--model_repository={repo}")
    try:
        clients = {protocol: ServingClient(protocol, f"localhost:{port}", "dlrm")
                   for protocol, port in zip(("http", "grpc"), ports)}
        clients["grpc"].wait_ready(120)
        numerical, categorical, _ = next(request_batches(eval_dataset(data), 64, 64))
        ids = categorical.copy()
        ids[:, 4] = 7   # feature 2 has 7 rows
        sizes = {"http": [1, 5, 17, 64], "grpc": [3, 64]}
        good = dict(numerical_features=(numerical, "FP32"), categorical_features=(categorical, "INT64"))
        out_of_range = ("dlrm", dict(good, categorical_features=(ids, "INT64")))
        bad = {"http": [out_of_range, ("nope", good), ("dlrm", dict(numerical_features=(numerical, "FP32"),
                                                                     ids=(categorical, "INT64")))],
               "grpc": [out_of_range, ("nope", good)]}
        for protocol, client in clients.items():
            assert client.max_batch_size() == MAX_BATCH and client.input_shapes()   # not inference requests
            for size in sizes[protocol]:
                client.infer(numerical[:size], categorical[:size])
            for model, inputs in bad[protocol]:
                with pytest.raises(InferenceServerException):
                    client.client.infer(model, tensors(client.api, **inputs))
            client.close()
        samples, types = scrape(ports[2])
    finally:
        stop_server(server, ports, log)
    model = 'model="dlrm"'
    for protocol in ("http", "grpc"):
        for status, count in (("success", len(sizes[protocol])), ("refused", len(bad[protocol])), ("failed", 0)):
            assert samples[f'dlrm_inference_requests_total{{{model},protocol="{protocol}",status="{status}"}}'] \
                == count, (protocol, status)
        labels = f'{model},protocol="{protocol}"'
        assert check_histogram(samples, "dlrm_inference_request_duration_seconds", labels) == len(sizes[protocol])
        assert samples[f"dlrm_inference_request_duration_seconds_sum{{{labels}}}"] > 0
    assert samples[f"dlrm_inference_samples_total{{{model}}}"] == sum(map(sum, sizes.values()))
    assert samples[f"dlrm_model_version_step{{{model}}}"] == 8
    assert types == {"dlrm_inference_requests_total": "counter", "dlrm_inference_samples_total": "counter",
                     "dlrm_inference_request_duration_seconds": "histogram", "dlrm_model_version_step": "gauge"}


def test_sigterm_taken_by_any_thread_stops_the_native_server(trained, tmp_path):
    """The kernel may hand a process' SIGTERM to any thread not blocking it: sent to one of the
    server's other threads (tgkill), the server still stops with status 0."""
    repo = trained[3]
    log, ports = tmp_path / "server.log", free_ports(3)
    server = start_server(log, ports, f"--model_repository={repo}", "--frontend=native")
    try:
        ServingClient("http", f"localhost:{ports[0]}", "dlrm").wait_ready(120)

        def takes_sigterm(tid):   # SigBlk: the thread's blocked signals, a hex mask
            with open(f"/proc/{server.pid}/task/{tid}/status") as f:
                blocked = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
            return not blocked & (1 << (signal.SIGTERM - 1))
        others = [int(t) for t in os.listdir(f"/proc/{server.pid}/task") if int(t) != server.pid]
        tid = next(t for t in others if takes_sigterm(t))
        assert ctypes.CDLL(None, use_errno=True).tgkill(server.pid, tid, signal.SIGTERM) == 0
        assert server.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_serve_flag_errors_are_one_line(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    for args, message in (([], "error: give one of --model_repository and --checkpoint"),
                          ([f"--model_repository={tmp_path}", "--address=127.0.0.1", f"--grpc_port={port}"],
                           f"error: --grpc_port={port}: cannot listen on 127.0.0.1:{port} (Address already in use)"),
                          ([f"--model_repository={tmp_path}", "--http_port=9000", "--metrics_port=9000"],
                           "error: --http_port, --grpc_port, --metrics_port must differ, got [8001, 9000, 9000]"),
                          ([f"--model_repository={tmp_path}", "--http_port=9001", "--grpc_port=9001"],
                           "error: --http_port, --grpc_port, --metrics_port must differ, got [8002, 9001, 9001]"),
                          ([f"--model_repository={tmp_path}", "--metrics_port=9002", "--max_queue_delay_us=5"],
                           "error: --max_queue_delay_us: no effect with --frontend=native (no dynamic batching); it "
                           "is --frontend=triton's"),
                          ([f"--model_repository={tmp_path}", "--triton_variable_length"],
                           "error: --triton_variable_length: no effect with --frontend=native, which always takes "
                           "variable-length ids"),
                          ([f"--model_repository={tmp_path}", "--frontend=triton", "--triton_variable_length",
                            "--max_queue_delay_us=5"],
                           "error: --max_queue_delay_us: no effect with --triton_variable_length (each request is "
                           "served as it comes, unbatched)"),
                          ([f"--model_repository={tmp_path}", "--poll_seconds=2"],
                           "error: --poll_seconds: no effect without --updates"),
                          ([f"--model_repository={tmp_path}", *port_flags(free_ports(3))],
                           f"error: {tmp_path}: not a model repository written by deployment/deploy.py "
                           "(no export.json)"),
                          ([f"--model_repository={tmp_path}", "--max_batch_size=0"],
                           "error: --max_batch_size must be positive, got 0")):
        result = script("serve.py", *args)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [message], result.stderr
    busy.close()


def test_synthetic_data_flags_open_the_runs_evaluation_data():
    """The clients' synthetic data (from main.py's data flags) is the evaluation data of the run
    those flags describe."""
    from dataloading.open import open_dataset
    from run.assembly import dataset_request
    cfg = build_config(dict(TINY, synthetic_alpha=0.7, seed=9, synthetic_eval_rows=300))
    flags = types.SimpleNamespace(dataset_type="synthetic", synthetic_cardinalities=TINY["synthetic_cardinalities"],
                                  synthetic_num_numerical=3, synthetic_labels=1, synthetic_history_length=0,
                                  synthetic_alpha=0.7, seed=9, synthetic_eval_rows=300,
                                  dataset_path="", feature_spec="", eval_mapping="test")
    dataset, rows = open_eval_data(flags)
    expected, expected_rows = open_dataset(dataset_request(cfg))
    assert rows == expected_rows["eval"] == 300
    for x, y in zip(next(request_batches(dataset, rows, rows)), next(request_batches(expected, 300, 300))):
        np.testing.assert_array_equal(x, y)


def test_a_server_that_cannot_load_the_model_stops_with_one_line(trained, tmp_path):
    """The Python-backend stub given an environment without numpy: the model cannot load."""
    _, checkpoint, _, _ = trained
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    ports = free_ports(3)
    result = subprocess.run([sys.executable, "deployment/serve.py", f"--checkpoint={checkpoint}", "--frontend=triton",
                             "--address=127.0.0.1", *port_flags(ports)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", DLRM_TRITON_STUB_ENV=str(tmp_path / "bare")))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the Triton server failed: [400] load failed for model 'dlrm': version 1 is at UNAVAILABLE state: "
        "Internal: ModuleNotFoundError: No module named 'numpy'")
