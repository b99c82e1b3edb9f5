"""slurm_multinode.sh under a real SLURM over three hosts (tests/support/slurm_cluster.py: munged, and
slurmctld and a slurmd per host on tests/support/netns_hosts.py's hosts, which reach each other over ssh
and their own addresses): `sbatch -N 2 slurm_multinode.sh python dlrm.py ...`, as users submit
it, trains DLRM at 2 ranks over 2 hosts and at 3 over 3 with the losses and AUC of `horovodrun
-np 2/3` on one host with the same flags; a 2-node job stopped by `scancel --signal=TERM --batch`
(what `#SBATCH --signal=B:TERM@...` sends before the time limit, to the first node's batch
script alone) checkpoints, requeues itself, resumes from its checkpoint and ends with the
uninterrupted run's checkpoint."""
import json
import os
import sys
import time

import numpy as np
import pytest

from storage import checkpoint
from tests.support.horovod_run import ROOT, horovodrun
from tests.support.netns_hosts import INTERFACE, Hosts
from tests.support.slurm_cluster import ENDED, SlurmCluster, missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

SLURM = os.path.join(ROOT, "slurm_multinode.sh")
VENV = os.path.dirname(os.path.dirname(sys.executable))
ARGS = ["--dataset_type=synthetic", "--synthetic_cardinalities=20,50,7,30", "--synthetic_num_numerical=3",
        "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--batch_size=48",
        "--valid_batch_size=240", "--synthetic_eval_rows=240", "--print_freq=1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    hosts = Hosts(str(tmp_path_factory.mktemp("hosts")), ("hosta", "hostb", "hostc"))
    try:
        c = SlurmCluster(str(tmp_path_factory.mktemp("slurm")), hosts)
        yield c
        c.close()
    finally:
        hosts.close()


def logged(path):
    """(losses by step, the last evaluation's AUC) of a --log_path file."""
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "step"}, records[-1]["auc"]


def sbatch(cluster, tmp_path, nodes, args, env=None, wait=True, options=()):
    """`sbatch -N nodes --oversubscribe slurm_multinode.sh python dlrm.py ARGS` with a rank per
    node, VENV (the test's environment, at the same path on every node) and horovodrun's
    `--network-interface eth1`; the job's id and output file."""
    out = str(tmp_path / "job-%j.out")
    job = cluster.submit("-N", str(nodes), *options, "--oversubscribe", "--open-mode=append", f"--chdir={ROOT}",
                         f"--output={out}", SLURM, "python", "dlrm.py", *args,
                         env={"RANKS_PER_NODE": "1", "VENV": VENV, "HOROVODRUN_ARGS": f"--network-interface {INTERFACE}",
                              **(env or {})})
    out = out.replace("%j", str(job))
    if wait:
        fields = cluster.wait(job)
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", open(out).read()[-3000:]
    return job, out


@pytest.mark.parametrize("ranks", [2, 3])
def test_sbatch_over_hosts_trains_as_horovodrun_on_one_host(cluster, tmp_path, ranks):
    args = ARGS + ["--synthetic_rows=1440"]
    _, out = sbatch(cluster, tmp_path, ranks, args + [f"--log_path={tmp_path / 'slurm.json'}"])
    text = open(out).read()
    nodes = cluster.nodes[:ranks]
    assert f"{ranks} node(s) x 1 rank(s)" in text, text[-3000:]
    assert f"horovodrun -np {ranks} -H {','.join(n + ':1' for n in nodes)} --gloo" in text, text[-3000:]
    assert "ranks by host: " + "; ".join(f"{n} {r}" for r, n in enumerate(nodes)) in text, text[-3000:]
    reference = horovodrun(ranks, ["dlrm.py", *args, f"--log_path={tmp_path / 'horovodrun.json'}"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    (got, auc), (want, want_auc) = logged(tmp_path / "slurm.json"), logged(tmp_path / "horovodrun.json")
    assert sorted(got) == sorted(want) == list(range(1, 31))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
    assert auc == pytest.approx(want_auc, abs=1e-6)


@pytest.mark.slow
def test_a_terminated_job_checkpoints_requeues_and_resumes_as_if_uninterrupted(cluster, tmp_path):
    args = ARGS + ["--synthetic_rows=19200"]   # 400 steps
    whole = horovodrun(2, ["dlrm.py", *args, f"--save_checkpoint_path={tmp_path / 'whole'}"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    job, out = sbatch(cluster, tmp_path, 2, args + [f"--save_checkpoint_path={ckpt}"],
                      env={"REQUEUE": "1", "RESUME_FROM": str(ckpt)}, wait=False)
    deadline = time.monotonic() + 300
    while "step 50/400" not in (open(out).read() if os.path.exists(out) else ""):
        assert time.monotonic() < deadline and cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), \
            open(out).read()[-3000:] if os.path.exists(out) else "no output"
        time.sleep(0.1)
    signalled = cluster.run("scancel", "--signal=TERM", "--batch", str(job))
    assert signalled.returncode == 0, signalled.stderr
    while not (cluster.job(job).get("Restarts") == "1" and cluster.job(job)["JobState"] in ("PENDING", "RUNNING")):
        assert time.monotonic() < deadline, open(out).read()[-3000:]   # requeued: pending ~2 minutes (BeginTime)
        time.sleep(0.1)
    # Started at once rather than after the requeue's 2-minute hold, but in a later second than the
    # first run's end: slurmd refuses a credential made in the second its predecessor was revoked.
    requeued = time.time()
    cluster.wait_idle()
    time.sleep(max(0.0, int(requeued) + 2 - time.time()))
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    fields = cluster.wait(job, restarts=1)
    text = open(out).read()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", f"{fields}\n{text[-3000:]}"
    assert "SIGTERM received: passed to this node's ranks" in text and "requeued (scontrol requeue)" in text
    assert "stopped by SIGTERM after step " in text, text[-3000:]
    stopped = int(text.split("stopped by SIGTERM after step ")[1].split(":")[0])
    assert 50 <= stopped < 400 and f"saved checkpoint {ckpt / f'ckpt-{stopped}'}" in text
    assert f"--restore_checkpoint_path={ckpt}" in text.split("requeued (scontrol requeue)")[1], text[-3000:]
    a, b = checkpoint.read_manifest(str(ckpt)), checkpoint.read_manifest(str(tmp_path / "whole"))
    assert a["step"] == b["step"] == 400 and set(a["tensors"]) == set(b["tensors"])
    for name in b["tensors"]:
        np.testing.assert_allclose(checkpoint.read_tensor(str(ckpt), name),
                                   checkpoint.read_tensor(str(tmp_path / "whole"), name), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.mark.slow
def test_the_time_limits_signal_checkpoints_and_requeues(cluster, tmp_path):
    """The signal `--signal=B:TERM@150` asks for, sent by SLURM itself as the time limit nears,
    stops a 2-node job with a checkpoint and the script requeues it. The limit is brought near once
    the ranks train (`scontrol update TimeLimit=`, to 90-150 s ahead): SLURM looks at time limits
    every 30 s, so the signal comes within 30 s, at least 60 s before the limit."""
    ckpt = tmp_path / "ckpt"
    job, out = sbatch(cluster, tmp_path, 2, ARGS + ["--synthetic_rows=9600000", f"--save_checkpoint_path={ckpt}"],
                      env={"REQUEUE": "1", "RESUME_FROM": str(ckpt)}, wait=False,
                      options=["--time=30", "--signal=B:TERM@150"])
    deadline = time.monotonic() + 420
    while "step 1/" not in (open(out).read() if os.path.exists(out) else ""):
        assert time.monotonic() < deadline and cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), \
            open(out).read()[-3000:] if os.path.exists(out) else "no output"
        time.sleep(0.2)
    hours, minutes, seconds = (int(x) for x in cluster.job(job)["RunTime"].split(":"))
    elapsed = 3600 * hours + 60 * minutes + seconds
    assert cluster.run("scontrol", "update", f"JobId={job}", f"TimeLimit={-(-(elapsed + 90) // 60)}").returncode == 0
    while cluster.job(job).get("Restarts") != "1":   # through COMPLETING and REQUEUED to PENDING
        assert time.monotonic() < deadline and cluster.job(job)["JobState"] not in ENDED, open(out).read()[-3000:]
        time.sleep(0.2)
    cluster.run("scancel", str(job))
    text = open(out).read()
    assert "SIGTERM received: passed to this node's ranks" in text and "requeued (scontrol requeue)" in text, text[-3000:]
    assert "stopped by SIGTERM after step " in text, text[-3000:]
    stopped = int(text.split("stopped by SIGTERM after step ")[1].split(":")[0])
    assert f"saved checkpoint {ckpt / f'ckpt-{stopped}'}" in text
    assert checkpoint.read_manifest(str(ckpt))["step"] == stopped


@pytest.mark.parametrize("moment", ["before the launch", "while the ranks start"])
def test_a_signal_before_the_ranks_have_started_still_stops_the_job(cluster, tmp_path, moment):
    """SIGTERM to the batch script as soon as the job runs (the script launches nothing), or once
    it has launched horovodrun, which is still starting the ranks (the script passes the signal
    on once this node's ranks are there): either way the job ends, with 143."""
    job, out = sbatch(cluster, tmp_path, 2, ARGS + ["--synthetic_rows=9600000"], wait=False)
    deadline = time.monotonic() + 60
    while not (cluster.job(job).get("JobState") == "RUNNING" if moment == "before the launch" else
               os.path.exists(out) and "launching: " in open(out).read()):
        assert time.monotonic() < deadline, cluster.job(job)
        time.sleep(0.02)
    assert cluster.run("scancel", "--signal=TERM", "--batch", str(job)).returncode == 0
    fields = cluster.wait(job, timeout=120)
    text = open(out).read()
    assert fields["ExitCode"] == "143:0", text[-3000:]
    assert "SIGTERM received" in text and "step 1/" not in text, text[-3000:]
