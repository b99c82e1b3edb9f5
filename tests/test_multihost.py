"""horovodrun over two hosts (tests/support/netns_hosts.py: network namespaces with their own addresses,
hostnames and sshd, on this machine's file system): `horovodrun -np 4 -H hosta:2,hostb:2
--network-interface eth1`, started on hosta, reaches hostb's ranks over ssh and Gloo over the
hosts' own addresses, and trains DLRM with the losses and AUC of `horovodrun -np 4` on one host;
a rank killed on hostb stops the job with lines naming the rank and its host, the last checkpoint
readable."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from storage import checkpoint
from tests.support.horovod_run import ROOT, horovodrun
from tests.support.netns_hosts import INTERFACE, Hosts, missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
ARGS = ["--dataset_type=synthetic", "--synthetic_cardinalities=20,50,7,30", "--synthetic_num_numerical=3",
        "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--batch_size=48",
        "--valid_batch_size=240", "--synthetic_eval_rows=240", "--print_freq=1"]
ENV = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    h = Hosts(str(tmp_path_factory.mktemp("hosts")))
    yield h
    h.close()


def over_two_hosts(hosts, args, **kwargs):
    """`horovodrun -np 4 -H hosta:2,hostb:2 --network-interface eth1 --gloo python dlrm.py ARGS`
    run on hosta (plain interpreters: a rank's process starts on its own host)."""
    command = [HOROVODRUN, "-np", "4", "-H", "hosta:2,hostb:2", "--network-interface", INTERFACE, "--gloo",
               sys.executable, "dlrm.py", *args]
    if kwargs.pop("background", False):
        return hosts.popen("hosta", *command, cwd=ROOT, env=ENV, **kwargs)
    return hosts.run("hosta", *command, cwd=ROOT, env=ENV)


def logged(path):
    """(losses by step, the last evaluation's AUC, the params record) of a --log_path file."""
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "step"}, records[-1]["auc"], records[0]


def test_horovodrun_over_two_hosts_trains_as_on_one_host(hosts, tmp_path):
    args = ARGS + ["--synthetic_rows=1440"]
    out = over_two_hosts(hosts, args + [f"--log_path={tmp_path / 'hosts.json'}"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "ranks by host: hosta 0, 1; hostb 2, 3" in out.stdout
    reference = horovodrun(4, ["dlrm.py", *args, f"--log_path={tmp_path / 'one.json'}"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    (got, auc, params), (want, want_auc, _) = logged(tmp_path / "hosts.json"), logged(tmp_path / "one.json")
    assert params["hosts"] == {"hosta": [0, 1], "hostb": [2, 3]}
    assert sorted(got) == sorted(want) == list(range(1, 31))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
    assert auc == pytest.approx(want_auc, abs=1e-6)


def rank_process(hosts, host, rank):
    """The pid of rank `rank`'s dlrm.py on `host` (its environment's HOROVOD_RANK)."""
    for pid in hosts.pids(host):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if env.get(b"HOROVOD_RANK") == str(rank).encode() and b"dlrm.py" in command:
            return pid
    return None


def test_a_rank_killed_on_one_host_is_named_with_its_host(hosts, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "out.log"
    args = ARGS + ["--synthetic_rows=96000", f"--save_checkpoint_path={ckpt}", "--checkpoint_every_n_steps=20"]
    with open(log, "w") as f:
        job = over_two_hosts(hosts, args, background=True, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while "step 45/" not in log.read_text():
        assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    pid = rank_process(hosts, "hostb", 3)
    assert pid, log.read_text()[-3000:]
    os.kill(pid, signal.SIGKILL)
    assert job.wait(timeout=120) != 0
    text = log.read_text()
    errors = [line for line in text.splitlines() if "error:" in line]
    assert [line for line in errors if "rank 3 of 4 has exited" in line and "on hostb)" in line], text[-3000:]
    # hosta's ranks cannot look at hostb's processes: they name the host of the connection that failed.
    assert all("rank 3 of 4 has exited" in line or "connection to hostb (10.213.0.2: ranks 2, 3)" in line
               for line in errors), errors
    manifest = checkpoint.read_manifest(str(ckpt))
    assert manifest["step"] >= 40 and manifest["step"] % 20 == 0
    for name in manifest["tensors"]:
        assert np.isfinite(checkpoint.read_tensor(str(ckpt), name)).all(), name
