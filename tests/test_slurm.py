"""slurm_multinode.sh under a real SLURM (tests/slurm_cluster.py: munged, slurmctld and a slurmd
on this host): `sbatch slurm_multinode.sh python dlrm.py ...`, as users submit it, trains DLRM at
2 and 3 ranks with the losses and AUC of `horovodrun -np 2/3` with the same flags; a job stopped
by `scancel --signal=TERM --batch` (what `#SBATCH --signal=B:TERM@...` sends before the time
limit) checkpoints, requeues itself, resumes from its checkpoint and ends with the uninterrupted
run's checkpoint."""
import json
import os
import sys
import time

import numpy as np
import pytest

from storage import checkpoint
from tests.horovod_run import ROOT, horovodrun
from tests.slurm_cluster import SlurmCluster, missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

SLURM = os.path.join(ROOT, "slurm_multinode.sh")
VENV = os.path.dirname(os.path.dirname(sys.executable))
ARGS = ["--dataset_type=synthetic", "--synthetic_cardinalities=20,50,7,30", "--synthetic_num_numerical=3",
        "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--batch_size=48",
        "--valid_batch_size=240", "--synthetic_eval_rows=240", "--print_freq=1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
    yield c
    c.close()


def logged(path):
    """(losses by step, the last evaluation's AUC) of a --log_path file."""
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "step"}, records[-1]["auc"]


def sbatch(cluster, tmp_path, ranks, args, env=None, wait=True):
    """`sbatch --oversubscribe slurm_multinode.sh python dlrm.py ARGS` with RANKS_PER_NODE=ranks
    and VENV (the test's environment, at the same path on the node); the job's id and output file."""
    out = str(tmp_path / "job-%j.out")
    job = cluster.submit("--oversubscribe", "--open-mode=append", f"--chdir={ROOT}", f"--output={out}", SLURM,
                         "python", "dlrm.py", *args, env={"RANKS_PER_NODE": str(ranks), "VENV": VENV, **(env or {})})
    out = out.replace("%j", str(job))
    if wait:
        fields = cluster.wait(job)
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", open(out).read()[-3000:]
    return job, out


@pytest.mark.parametrize("ranks", [2, 3])
def test_sbatch_trains_as_horovodrun_on_one_host(cluster, tmp_path, ranks):
    args = ARGS + ["--synthetic_rows=1440"]
    _, out = sbatch(cluster, tmp_path, ranks, args + [f"--log_path={tmp_path / 'slurm.json'}"])
    text = open(out).read()
    assert f"1 node(s) x {ranks} rank(s)" in text and f"horovodrun -np {ranks} -H {cluster.node}:{ranks} --gloo" in text
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
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    fields = cluster.wait(job, restarts=1)
    text = open(out).read()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", text[-3000:]
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
