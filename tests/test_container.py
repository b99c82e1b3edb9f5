"""The CPU image (`docker build --target cpu -t dlrm-tf2:cpu .`) run for real: `horovodrun -np 2`
inside a container trains DLRM with the losses and AUC of the same command here, and
`serve.py` in a container, its HTTP port published on the host's 127.0.0.1, answers the host's
requests with the predictions of the model it serves. The checkout is mounted over the image's
copy of it, so the image's environment runs this checkout's code. Skipped where no Docker daemon
answers or it has no dlrm-tf2:cpu image (its build takes about 10 minutes on 2 cores, which the
suite does not spend: docs/launchers.md#the-container)."""
import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

from deployment.client import ServingClient, free_ports, request_batches
from tests.support.horovod_run import ROOT, horovodrun
from tests import test_serving
from tests.test_serving import eval_dataset, reference

trained = test_serving.trained   # the fixture: a DLRM on multi-hot files, exported
IMAGE = os.environ.get("DLRM_TEST_IMAGE", "dlrm-tf2:cpu")
WORKDIR = "/workspace/dlrm"


def _missing():
    if not shutil.which("docker"):
        return "no docker command"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if info.returncode != 0:
        return f"no Docker daemon answers ({(info.stderr.strip().splitlines() or ['docker info failed'])[-1]})"
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        return f"no {IMAGE} image: build it with `docker build --target cpu -t {IMAGE} .`"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))

ARGS = ["--dataset_type=synthetic", "--synthetic_cardinalities=20,50,7,30", "--synthetic_num_numerical=3",
        "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--batch_size=48",
        "--valid_batch_size=240", "--synthetic_eval_rows=240", "--synthetic_rows=1440", "--print_freq=1"]


def docker_run(*args, timeout=600):
    return subprocess.run(["docker", "run", "--rm", "-v", f"{ROOT}:{WORKDIR}", *args], capture_output=True,
                          text=True, timeout=timeout)


def logged(path):
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "step"}, records[-1]["auc"]


def test_two_ranks_in_the_container_train_as_here(tmp_path):
    out = docker_run("-v", f"{tmp_path}:/out", IMAGE, "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo",
                     "python3", "dlrm.py", *ARGS, "--log_path=/out/container.json")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    here = horovodrun(2, ["dlrm.py", *ARGS, f"--log_path={tmp_path / 'here.json'}"])
    assert here.returncode == 0, here.stderr[-3000:]
    (got, auc), (want, want_auc) = logged(tmp_path / "container.json"), logged(tmp_path / "here.json")
    assert sorted(got) == sorted(want) == list(range(1, 31))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    assert auc == pytest.approx(want_auc, abs=1e-5)


def test_serve_in_a_container_answers_the_host(trained):
    cfg, checkpoint, data, repo = trained
    port = free_ports(1)[0]
    name = f"dlrm-tf2-test-{os.getpid()}"
    server = subprocess.run(["docker", "run", "-d", "--rm", "--name", name, "-v", f"{ROOT}:{WORKDIR}",
                             "-v", f"{repo}:/models:ro", "-p", f"127.0.0.1:{port}:8000", IMAGE,
                             "python3", "deployment/serve.py", "--model_repository=/models", "--address=0.0.0.0",
                             "--http_port=8000"], capture_output=True, text=True, timeout=60)
    assert server.returncode == 0, server.stderr
    try:
        client = ServingClient("http", f"localhost:{port}", "dlrm")
        deadline = time.monotonic() + 120
        while True:
            try:
                client.wait_ready(5)
                break
            except Exception:
                logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True).stdout
                assert time.monotonic() < deadline, logs[-3000:]
        numerical, categorical, _ = next(request_batches(eval_dataset(data), 200, 200))
        out = client.infer(numerical, categorical, ("logits",))
        client.close()
    finally:
        stopped = subprocess.run(["docker", "stop", "-t", "30", name], capture_output=True, text=True, timeout=90)
    assert stopped.returncode == 0, stopped.stderr
    _, expected = reference(cfg, checkpoint, 200)
    np.testing.assert_allclose(out["logits"][:, 0], expected, rtol=1e-5, atol=1e-5)
