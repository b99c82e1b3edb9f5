"""SIGTERM and SIGINT sent to real dlrm.py processes (run/preemption.py): training finishes its
step, writes a checkpoint (every rank at the same step, whichever ranks got the signal), says one
line and exits with 143 (SIGTERM) or 130 (SIGINT); the same command with --restore_checkpoint_path
goes on exactly as an uninterrupted run. A second signal, or the grace period running out, ends
the process at once, the previous checkpoint intact and no temporary folder left; an evaluation
stops at its next batch, with one line (within training after a checkpoint of its step)."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from storage import checkpoint
from tests.support.horovod_run import ROOT, Ranks, _environment

MODEL = ["--dataset_type=synthetic", "--synthetic_cardinalities=300,50,7,30,90", "--synthetic_num_numerical=3",
         "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--optimizer=adam", "--seed=7"]
STEPS = 1500   # small batches, many steps: the signal lands mid-training
DATA = ["--learning_rate=0.01", "--batch_size=8", f"--synthetic_rows={8 * STEPS}", "--synthetic_eval_rows=300",
        "--valid_batch_size=300", "--warmup_steps=2", "--decay_steps=0", "--print_freq=1", "--evals_per_epoch=0"]
# One large table (3 x 96 MB with Adam's slots): its checkpoint takes long enough to be caught mid-write.
LARGE = ["--synthetic_cardinalities=3000000,50,7,30,90"]
STOPPED = "stopped by SIG"


def start(args, out_path, env=None):
    out = open(out_path, "w")
    return subprocess.Popen([sys.executable, "dlrm.py", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            env=_environment(env))


def wait_for(path, text, process, timeout=240):
    """Waits until the file at `path` holds `text` (a process's output), failing if `process` ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                if text in f.read():
                    return
        assert process.poll() is None, f"ended ({process.returncode}) before {text!r}:\n{read(path)[-3000:]}"
        time.sleep(0.02)
    raise AssertionError(f"no {text!r} in {timeout} s")


def read(path):
    with open(path) as f:
        return f.read()


def stop_lines(output):
    return [line for line in output.splitlines() if STOPPED in line]


def losses(log_path):
    with open(log_path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "step"}


def leftovers(root):
    return [d for d in os.listdir(root) if d.startswith(".")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted single-process run: its losses and final checkpoint."""
    tmp = tmp_path_factory.mktemp("whole")
    result = subprocess.run([sys.executable, "dlrm.py", *MODEL, *DATA, f"--save_checkpoint_path={tmp / 'ckpt'}",
                             f"--log_path={tmp / 'log.json'}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env=_environment(None))
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(tmp / "log.json"), str(tmp / "ckpt")


def resumed_equals_uninterrupted(tmp_path, ckpt, stopped_at, uninterrupted, atol=1e-6):
    """The same command with --restore_checkpoint_path goes on from step `stopped_at` exactly as
    the uninterrupted run: the same losses, the same final checkpoint (to `atol`: a checkpoint
    trained partly at 2 ranks differs from one process's by the order of its sums)."""
    whole_losses, whole_ckpt = uninterrupted
    result = subprocess.run([sys.executable, "dlrm.py", *MODEL, *DATA, f"--save_checkpoint_path={ckpt}",
                             f"--restore_checkpoint_path={ckpt}", f"--log_path={tmp_path / 'resumed.json'}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600, env=_environment(None))
    assert result.returncode == 0, result.stderr[-3000:]
    got = losses(tmp_path / "resumed.json")
    assert sorted(got) == list(range(stopped_at + 1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(whole_losses[step], rel=1e-5, abs=1e-6), step
    a, b = checkpoint.read_manifest(ckpt), checkpoint.read_manifest(whole_ckpt)
    assert a["step"] == b["step"] == STEPS and set(a["tensors"]) == set(b["tensors"])
    for name in b["tensors"]:
        np.testing.assert_allclose(checkpoint.read_tensor(ckpt, name), checkpoint.read_tensor(whole_ckpt, name),
                                   rtol=1e-5, atol=atol, err_msg=name)


def stopped_step(line, ckpt):
    """The step the one stop line names, checking the checkpoint it names is ROOT's newest."""
    step = int(line.split("after step ")[1].split(":")[0])
    assert f"saved checkpoint {os.path.join(ckpt, f'ckpt-{step}')} " in line, line
    assert checkpoint.read_manifest(ckpt)["step"] == step
    assert 0 < step < STEPS
    return step


@pytest.mark.slow
def test_sigterm_checkpoints_and_the_same_command_resumes_exactly(tmp_path, uninterrupted):
    ckpt = str(tmp_path / "ckpt")
    p = start([*MODEL, *DATA, f"--save_checkpoint_path={ckpt}"], tmp_path / "out")
    wait_for(tmp_path / "out", "step 1/", p)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 143
    output = read(tmp_path / "out")
    assert time.monotonic() - t0 < 30 and "Traceback" not in output
    [line] = stop_lines(output)
    assert line.startswith("stopped by SIGTERM after step ")
    assert leftovers(ckpt) == []
    resumed_equals_uninterrupted(tmp_path, ckpt, stopped_step(line, ckpt), uninterrupted)


def test_sigint_without_a_checkpoint_path_stops_with_one_line_no_traceback(tmp_path):
    p = start([*MODEL, *DATA], tmp_path / "out")
    wait_for(tmp_path / "out", "step 1/", p)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=60) == 130
    output = read(tmp_path / "out")
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    [line] = stop_lines(output)
    assert line.startswith("stopped by SIGINT after step ") and "nothing saved (no --save_checkpoint_path)" in line


@pytest.mark.slow
def test_a_second_signal_mid_save_exits_at_once_leaving_the_previous_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    p = start([*MODEL, *DATA, *LARGE, f"--save_checkpoint_path={ckpt}", "--checkpoint_every_n_steps=5"],
              tmp_path / "out")
    wait_for(tmp_path / "out", "saved checkpoint", p)
    previous = checkpoint.read_manifest(ckpt)
    # The next periodic save writes its temporary folder: signal twice while it is there.
    deadline = time.monotonic() + 120
    while not glob.glob(os.path.join(ckpt, ".tmp-ckpt-*")):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.001)
    # Back to back, before the step boundary acts on the first (two of one kind might merge into one).
    # Pending together, the kernel hands over SIGINT first: the second is the one the exit code names.
    p.send_signal(signal.SIGTERM)
    p.send_signal(signal.SIGINT)
    code = p.wait(timeout=30)
    assert code in (130, 143)
    output = read(tmp_path / "out")
    assert "Traceback" not in output
    second = {130: "SIGINT", 143: "SIGTERM"}[code]
    lines = [s for s in output.splitlines() if s.startswith(f"stopped at once: a second signal ({second})")]
    assert len(lines) == 1, output[-3000:]
    line = lines[0]
    assert leftovers(ckpt) == []
    newest = checkpoint.read_manifest(ckpt)
    # The save under way was abandoned (the previous checkpoint stays the newest), or it had
    # completed before the second signal arrived: either way whole, and latest names it.
    if "was removed" in line:
        assert newest["path"] == previous["path"]
    assert newest["step"] >= previous["step"]
    for name in newest["tensors"]:
        checkpoint.read_tensor(newest["path"], name)


def test_the_grace_period_running_out_removes_the_unfinished_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    p = start([*MODEL, *DATA, *LARGE, f"--save_checkpoint_path={ckpt}", "--preemption_grace_s=0.3"],
              tmp_path / "out")
    wait_for(tmp_path / "out", "step 1/", p)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 143
    output = read(tmp_path / "out")
    assert "Traceback" not in output
    lines = [s for s in output.splitlines() if s.startswith("stopped at once: the grace period")]
    assert len(lines) == 1, output[-3000:]
    line = lines[0]
    assert "--preemption_grace_s=0.3" in line
    assert leftovers(ckpt) == [] if os.path.isdir(ckpt) else True
    assert not os.path.exists(os.path.join(ckpt, "latest"))   # the only save was never completed


def test_eval_interrupted_stops_with_one_line(tmp_path, uninterrupted):
    _, ckpt = uninterrupted
    p = start([*MODEL, "--mode=eval", f"--restore_checkpoint_path={ckpt}", "--synthetic_eval_rows=2000000",
               "--valid_batch_size=64"], tmp_path / "out")
    wait_for(tmp_path / "out", "restored ", p)
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    code = p.wait(timeout=60)
    output = read(tmp_path / "out")
    assert code == 143, output[-3000:]
    assert "Traceback" not in output and "eval at step" not in output
    [line] = stop_lines(output)
    assert line.startswith("stopped by SIGTERM: ")


def test_an_evaluation_within_training_interrupted_checkpoints_its_step_and_stops(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    p = start([*MODEL, *DATA, "--synthetic_rows=800", "--evals_per_epoch=2", "--synthetic_eval_rows=2000000",
               "--valid_batch_size=64", f"--save_checkpoint_path={ckpt}"], tmp_path / "out")
    wait_for(tmp_path / "out", "step 50/", p)   # the evaluation after step 50 of 100 begins
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    code = p.wait(timeout=60)
    output = read(tmp_path / "out")
    assert code == 143, output[-3000:]
    assert "Traceback" not in output and "eval at step" not in output and "step 51/" not in output
    [line] = stop_lines(output)
    assert line.startswith(f"stopped by SIGTERM after step 50: saved checkpoint {os.path.join(ckpt, 'ckpt-50')} ")
    assert checkpoint.read_manifest(ckpt)["step"] == 50 and leftovers(ckpt) == []


def rank_processes(launcher: subprocess.Popen):
    """horovodrun's rank processes (those whose environment holds HOROVOD_RANK), by rank."""
    found = {}
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            env = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "HOROVOD_RANK" in env and "dlrm.py" in " ".join(child.cmdline()):
            found[int(env["HOROVOD_RANK"])] = child
    return found


@pytest.mark.slow
def test_two_ranks_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path, uninterrupted):
    ckpt = str(tmp_path / "ckpt")
    ranks = Ranks(2, ["dlrm.py", *MODEL, *DATA, f"--save_checkpoint_path={ckpt}"], str(tmp_path))
    try:
        wait_for(ranks.logs[0], "step 1/", ranks.processes[0])
        ranks.processes[1].send_signal(signal.SIGTERM)   # Kubernetes may signal one process only
        assert [p.wait(timeout=120) for p in ranks.processes] == [143, 143]
    finally:
        ranks.close()
    out0, out1 = ranks.output(0), ranks.output(1)
    assert "Traceback" not in out0 + out1 and stop_lines(out1) == []   # rank 0 alone says it
    [line] = stop_lines(out0)
    assert line.startswith("stopped by SIGTERM after step ")   # rank 0 learnt of rank 1's signal
    assert leftovers(ckpt) == []
    resumed_equals_uninterrupted(tmp_path, ckpt, stopped_step(line, ckpt), uninterrupted, atol=1e-5)


def launched(tmp_path, ckpt):
    """`python launch.py -np 2 ... python dlrm.py` (the ranks plain interpreters: the launcher signals
    its own descendants), once its ranks have trained a step: the launcher, its ranks by rank."""
    with open(tmp_path / "out", "w") as out:
        p = subprocess.Popen([sys.executable, "launch.py", "-np", "2", "-H", "localhost:2", sys.executable, "dlrm.py",
                              *MODEL, *DATA, f"--save_checkpoint_path={ckpt}"], cwd=ROOT, stdout=out,
                             stderr=subprocess.STDOUT, env=_environment(None))
    wait_for(tmp_path / "out", "step 1/", p)
    ranks = rank_processes(p)
    assert sorted(ranks) == [0, 1]
    return p, ranks


def launched_stop(tmp_path, ckpt, p, signame):
    """The launched job's output once it has stopped on `signame`: one line from rank 0 (none from rank
    1, no traceback), the launcher's last, every rank exiting the signal's code, the checkpoint whole."""
    code = {"SIGTERM": 143, "SIGINT": 130}[signame]
    assert p.wait(timeout=120) == code
    output = read(tmp_path / "out")
    assert "Traceback" not in output and "stopped at once" not in output, output[-3000:]
    [line] = [s for s in stop_lines(output) if s.startswith("[")]   # the ranks' lines: "[rank]<stream>:..."
    assert line.startswith(f"[0]<stderr>:stopped by {signame} after step ")
    assert output.splitlines()[-1] == (f"launch: stopped by {signame}: ranks 0, 1 exited {code}; "
                                       f"rank 0's line names the checkpoint")
    step = stopped_step(line[line.index(STOPPED):], ckpt)
    assert leftovers(ckpt) == []
    manifest = checkpoint.read_manifest(ckpt)
    for name in manifest["tensors"]:
        checkpoint.read_tensor(manifest["path"], name)
    return step


@pytest.mark.slow
def test_launch_py_ctrl_c_gives_the_ranks_their_save_past_horovodruns_5_s(tmp_path):
    """Ctrl-C reaches the launcher alone; its ranks finish their step, save and exit 130 even when
    that takes longer than the 5 s horovodrun itself allows before SIGKILL (rank 1 stopped 7 s)."""
    ckpt = str(tmp_path / "ckpt")
    p, ranks = launched(tmp_path, ckpt)
    try:
        ranks[1].suspend()
        p.send_signal(signal.SIGINT)
        time.sleep(7)
        assert p.poll() is None and ranks[0].is_running()
        ranks[1].resume()
        launched_stop(tmp_path, ckpt, p, "SIGINT")
    finally:
        if p.poll() is None:
            p.kill()
    assert "launch: SIGINT received: passed to the ranks on this host (2)" in read(tmp_path / "out")


@pytest.mark.slow
def test_launch_py_sigterm_to_every_process_stops_once(tmp_path):
    """As SLURM signals every process of a job: the launcher and both ranks get SIGTERM at once; the
    launcher's own copy passed on is the same stop, not a second signal."""
    ckpt = str(tmp_path / "ckpt")
    p, ranks = launched(tmp_path, ckpt)
    try:
        for r in ranks.values():
            r.send_signal(signal.SIGTERM)
        p.send_signal(signal.SIGTERM)
        launched_stop(tmp_path, ckpt, p, "SIGTERM")
    finally:
        if p.poll() is None:
            p.kill()


def test_launch_py_refuses_what_it_cannot_run_and_reports_a_failure_in_one_line():
    import launch
    assert launch.main(["--mpi", "-np", "2", "python", "x.py"]) == 2
    assert launch.main(["--min-np", "1", "-np", "2", "python", "x.py"]) == 2
    job = launch.Job()
    job.exits = {0: (143, 2.0), 1: (143, 1.0)}
    assert job.outcome()[0] == 143
    job.exits = {0: (130, 2.0), 1: (0, 1.0)}
    assert job.outcome() == (130, "launch: stopped by SIGINT: rank 0 exited 130 (rank 1 had finished); "
                                  "rank 0's line names the checkpoint")
    job.exits = {0: (143, 2.0), 1: (1, 1.0), 2: (0, 0.5)}
    assert job.outcome() == (1, "error: rank 1 exited 1 first; the other ranks were then stopped "
                                "(exit codes: rank 0 143, rank 1 1, rank 2 0)")
    job.exits = {0: (0, 1.0), 1: (0, 1.0)}
    assert job.outcome() == (0, None)


def test_export_interrupted_stops_with_one_line_and_writes_nothing(tmp_path, uninterrupted):
    _, ckpt = uninterrupted
    out = str(tmp_path / "repo")
    with open(tmp_path / "out", "w") as f:
        p = subprocess.Popen([sys.executable, "deployment/deploy.py", f"--checkpoint={ckpt}", f"--output={out}"],
                             cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=_environment(None))
    deadline = time.monotonic() + 240
    while not os.path.exists(os.path.join(tmp_path, ".repo.tmp-export")):   # the export under way
        assert time.monotonic() < deadline and p.poll() is None, read(tmp_path / "out")[-3000:]
        time.sleep(0.005)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 143
    output = read(tmp_path / "out")
    assert "Traceback" not in output
    [line] = stop_lines(output)
    assert line == f"stopped by SIGTERM: the export to {out} unfinished (nothing written there)"
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.slow
def test_preprocessing_interrupted_stops_with_one_line_and_leaves_nothing(tmp_path):
    from preproc import generate
    generate.write(generate.generate(100000, seed=3), str(tmp_path / "day.csv"))
    out = tmp_path / "out"
    with open(tmp_path / "log", "w") as f:
        p = subprocess.Popen([sys.executable, "preproc/criteo.py", f"--input={tmp_path / 'day.csv'}",
                              f"--output={out}"], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             env=_environment(None))
    deadline = time.monotonic() + 240
    while not glob.glob(str(out / ".preproc-tmp-*")):   # the job under way
        assert time.monotonic() < deadline and p.poll() is None, read(tmp_path / "log")[-3000:]
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 143
    output = read(tmp_path / "log")
    assert "Traceback" not in output
    [line] = stop_lines(output)
    assert line.startswith(f"stopped by SIGTERM: preprocessing into {out} unfinished (its temporary files removed)")
    assert not out.exists()   # the folder it made, emptied, is gone


def test_a_rank_stopped_first_waits_for_the_others_before_horovodrun_hears_of_it():
    """horovodrun ends every rank still running once one exits non-zero, and such a rank's code
    reads as finished: after a stop, launch.py hands a stopped rank's code back only once the
    others have exited too (at most launch.OTHERS_S), so each reports its own."""
    import threading
    import launch
    job = launch.Job()
    job.received.append((signal.SIGTERM, time.monotonic()))
    returned = {}

    def rank(r, delay):
        def execute(command, **kwargs):
            time.sleep(delay)
            return 143
        code = job.execute(execute)("dlrm.py", index=r)
        returned[r] = (code, time.monotonic())

    threads = [threading.Thread(target=rank, args=(r, delay)) for r, delay in ((0, 0.3), (1, 1.3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert returned[0][0] == returned[1][0] == 143
    assert returned[0][1] >= returned[1][1] - 0.05   # rank 0's code came back once rank 1 had exited
    job = launch.Job()   # no stop received: a failed rank's code goes back at once
    start = time.monotonic()
    assert job.execute(lambda command, **kwargs: 143)("dlrm.py", index=0) == 143
    assert time.monotonic() - start < 1
