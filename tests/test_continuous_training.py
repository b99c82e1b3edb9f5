"""The daily loop end to end (tools/continuous_training.sh on generated Criteo days): day 0
preprocessed, trained, exported and served; days 1 (at 2 Gloo ranks) and 2 preprocessed with the
growing vocabularies, trained on from the day before and exported as deltas, which the running
server applies while a client keeps sending requests: no request fails, and afterwards the server
answers exactly as a model served from the full export of the last checkpoint."""
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

import pytest

from deployment.client import ServingClient, free_ports
from deployment.exporter.repository import write_repository
from deployment.serving.live import Model
from storage import checkpoint
from tests.support.horovod_run import ROOT
from tests.support.serving import start_server, stop_server
from tests.support import warm_python

SCRIPT = os.path.join(ROOT, "tools", "continuous_training.sh")
TRAIN_FLAGS = ("--embedding_dim=8 --bottom_mlp_dims=16,8 --top_mlp_dims=16,1 --optimizer=adagrad --learning_rate=0.02 "
               "--batch_size=512 --valid_batch_size=2048 --warmup_steps=0 --decay_start_step=0 --print_freq=10")


def day(work, n, launch=""):
    env = dict(os.environ, PYTHON=warm_python.executable(), ROWS="12000", CAPACITY="1.3", TRAIN_FLAGS=TRAIN_FLAGS,
               LAUNCH=launch, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(["bash", SCRIPT, str(work), str(n)], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


class Client(threading.Thread):
    """Sends the same requests over and over until stopped; keeps (model_version, logits) per response."""

    def __init__(self, port, layout):
        super().__init__(daemon=True)
        rng = np.random.default_rng(0)
        self.numerical = rng.normal(size=(32, layout["num_numerical"])).astype(np.float32)
        self.categorical = np.stack([rng.integers(0, c, 32) for c in layout["cardinalities"]], 1).astype(np.int64)
        self.client = ServingClient("grpc", f"localhost:{port}", "dlrm")
        self.responses, self.errors, self.stop = [], [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                out = self.client.infer(self.numerical, self.categorical, ("logits", "model_version"))
                self.responses.append((int(out["model_version"][0, 0]), out["logits"]))
            except Exception as e:
                self.errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)

    def wait_for_version(self, step, timeout=120):
        deadline = time.monotonic() + timeout
        while not self.responses or self.responses[-1][0] != step:
            assert time.monotonic() < deadline, f"step {step} never served; errors {self.errors[:3]}"
            time.sleep(0.1)


@pytest.mark.slow
def test_days_trained_exported_as_deltas_and_served_live(tmp_path):
    work = tmp_path / "work"
    day(work, 0)
    info = json.loads((work / "repository" / "export.json").read_text())
    ports = free_ports(3)
    log = tmp_path / "server.log"
    server = start_server(log, ports, f"--model_repository={work / 'repository'}", f"--updates={work / 'updates'}",
                          "--poll_seconds=0.2")
    try:
        ServingClient("grpc", f"localhost:{ports[1]}", "dlrm").wait_ready(180)
        client = Client(ports[1], info["layout"])
        client.start()
        client.wait_for_version(info["step"])
        steps = [info["step"]]
        for n, launch in ((1, f"{warm_python.executable()} {os.path.dirname(sys.executable)}/horovodrun -np 2 -H localhost:2 --gloo"), (2, "")):
            output = day(work, n, launch)
            assert f"vocabulary generation {n}:" in output
            delta = json.loads((work / "updates" / f"day_{n}" / "delta.json").read_text())
            assert delta["base"]["step"] == steps[-1]
            steps.append(delta["new"]["step"])
            client.wait_for_version(steps[-1])
        time.sleep(1.0)
        client.stop.set()
        client.join()
    finally:
        stop_server(server, ports, log)
    assert client.errors == []
    served = [v for v, _ in client.responses]
    assert sorted(set(served)) == steps and served == sorted(served)
    assert checkpoint.read_manifest(str(work / "checkpoints" / f"ckpt-{steps[1]}"))["world_size"] == 2
    vocab = json.loads((work / "data" / "day_2" / "vocab" / "vocab.json").read_text())
    assert vocab["generation"] == 2
    # The last version served equals a model served from the full export of the last checkpoint.
    write_repository(str(work / "checkpoints"), str(tmp_path / "full"), forms=["tables"])
    expected = Model(str(tmp_path / "full")).infer(client.numerical, client.categorical)
    assert int(expected["model_version"][0, 0]) == steps[-1]
    for version, logits in client.responses[-3:]:
        np.testing.assert_array_equal(logits, expected["logits"])
    lines = log.read_text().splitlines()
    assert sum("applied update" in line for line in lines) == 2, lines[-10:]
