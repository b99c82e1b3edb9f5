"""The command line at 2 and 3 Gloo ranks: training equals one process on the same global
batches (per-step loss and the final evaluation); a checkpoint written at 2 ranks resumes at 1
and at 3 ranks exactly as an uninterrupted run; a rank that dies or hangs ends the run with one
error line within a bounded time, leaving the last checkpoint usable; a global batch that does
not divide over the ranks is refused."""
import re
import signal
import socket
import subprocess

import pytest

from tests.support.horovod_run import Ranks, horovodrun
from tests.support.runs import (DATA, MODEL, PLACEMENT, STEPS, assert_same_losses, assert_same_run, one_process,
                                records, succeeded, wait_for)


@pytest.fixture(scope="module")
def dlrm_one_process(tmp_path_factory):
    """The uninterrupted single-process DLRM run: its log records."""
    log = tmp_path_factory.mktemp("one") / "log.json"
    succeeded(one_process("dlrm.py", *MODEL, *DATA, f"--log_path={log}"))   # placement flags: refused at one rank
    return records(log)


@pytest.mark.slow
def test_dlrm_two_ranks_then_resumed_at_one_and_three_ranks(tmp_path, dlrm_one_process):
    ckpt = tmp_path / "ckpt"
    first = succeeded(horovodrun(2, ["dlrm.py", *MODEL, *DATA, *PLACEMENT, "--max_steps=6",
                                     f"--save_checkpoint_path={ckpt}", f"--log_path={tmp_path / 'two.json'}"]))
    assert_same_losses(records(tmp_path / "two.json"), dlrm_one_process, range(1, 7))
    # Rank 0 alone prints the plan: table 0 in row slices on both ranks, table 2 on every rank.
    lines = first.stdout.splitlines()
    assert any(" 0  row " in line for line in lines) and any(" 2  replicated " in line for line in lines), first.stdout
    assert first.stdout.count("embedding plan:") == 1

    resumed_one = tmp_path / "one.json"
    succeeded(one_process("dlrm.py", *MODEL, *DATA, f"--restore_checkpoint_path={ckpt}", f"--log_path={resumed_one}"))
    assert_same_run(records(resumed_one), dlrm_one_process, range(7, STEPS + 1))

    resumed_three = tmp_path / "three.json"
    out = succeeded(horovodrun(3, ["dlrm.py", *MODEL, *DATA, *PLACEMENT, f"--restore_checkpoint_path={ckpt}",
                                   f"--log_path={resumed_three}"]))
    assert "written at 2 rank(s)" in out.stdout
    assert_same_run(records(resumed_three), dlrm_one_process, range(7, STEPS + 1))


@pytest.mark.slow
def test_dcnv2_data_parallel_input_two_ranks_matches_one_process(tmp_path):
    args = ["dcnv2.py", *MODEL, *DATA, "--num_cross_layers=2", "--cross_layer_projection_dim=4"]
    succeeded(one_process(*args, f"--log_path={tmp_path / 'one.json'}"))
    succeeded(horovodrun(2, [*args, "--data_parallel_input", "--dist_strategy=memory_optimized",
                             f"--log_path={tmp_path / 'two.json'}"]))
    assert_same_run(records(tmp_path / "two.json"), records(tmp_path / "one.json"), range(1, STEPS + 1))


def test_batch_not_divisible_by_the_ranks_is_refused():
    out = horovodrun(2, ["dlrm.py", *MODEL, *DATA, "--batch_size=95"])
    assert out.returncode != 0
    assert "error: --batch_size (95) must be divisible by the number of ranks (2)" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_lost_rank_ends_the_run_and_keeps_the_last_checkpoint(tmp_path, fault):
    """Rank 1 is killed (its connections close) or stopped (it stays connected but silent, so
    the other side waits for Gloo's timeout, 5 s here); rank 0 must exit on its own with one
    error line, and the last checkpoint must restore. That a stopped rank is found by the
    timeout is read from Gloo's own line, not from the time rank 0 took after the signal: rank
    0 may have been waiting for rank 1 (slow on a loaded machine) before it was stopped."""
    ckpt = tmp_path / "ckpt"
    ranks = Ranks(2, ["dlrm.py", *MODEL, *DATA, "--synthetic_rows=9600000", "--checkpoint_every_n_steps=10",
                      f"--save_checkpoint_path={ckpt}"], str(tmp_path), env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "5"})
    try:
        wait_for(lambda: (ckpt / "latest").exists() or ranks.processes[0].poll() is not None, 240,
                 "the first checkpoint")
        victim = ranks.processes[1]
        victim.send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        try:
            code = ranks.processes[0].wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still running 60 s after rank 1 was {fault}:\n{ranks.output(0)[-2000:]}")
        output = ranks.output(0)
    finally:
        ranks.close()
    assert code == 1, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    state = "has exited" if fault == "killed" else "is stopped"
    assert len(errors) == 1 and errors[0].startswith(
        f"error: rank 1 of 2 {state} (process {victim.pid} on {socket.gethostname()}); rank 0 saw the collective "), \
        output[-3000:]
    assert "Traceback" not in output
    if fault == "hung":   # Gloo's timeout, 5 s: its line (Horovod's background loop logs it)
        assert re.search(r"Timed out waiting 5000ms for (recv|send) operation", output), output[-3000:]

    evaluated = succeeded(one_process("dlrm.py", *MODEL, "--mode=eval", "--synthetic_eval_rows=500",
                                      f"--restore_checkpoint_path={ckpt}"))
    assert "restored" in evaluated.stdout and "auc" in evaluated.stdout


@pytest.mark.parametrize("size, lost", [(2, "rank 1 of 2 (on host1)"), (3, "a peer rank")])
def test_a_lost_rank_on_another_host_is_named_only_when_it_is_the_only_peer(size, lost):
    """No process of another host can be looked at: at 2 ranks the lost one is the other rank, at
    more it is not known which (a rank that fails may be one that saw another fail); Gloo's peer
    address names the host of the connection that failed, with its ranks."""
    from horovod.common.exceptions import HorovodInternalError
    from parallel_embedding.collectives import HorovodCollectives
    comm = object.__new__(HorovodCollectives)   # the state __init__ gathers, without starting Horovod
    comm.rank, comm.size = 0, size
    comm._processes = [(f"host{r}", 100 + r, ["127.0.0.1", f"10.0.0.{r}"]) for r in range(size)]
    line = comm.failure(HorovodInternalError("Horovod has been shut down. This was caused by an exception on "
                                             "one of the ranks or an attempt to allreduce ..."))
    assert line == (f"{lost} died, hung or became unreachable (HOROVOD_GLOO_TIMEOUT_SECONDS bounds the wait); "
                    "rank 0 saw a collective operation fail (Horovod has been shut down)")
    if size == 3:
        gloo = comm.failure(HorovodInternalError("[third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection "
                                                 "closed by peer [10.0.0.2]:52614"))
        assert gloo.startswith("a peer rank died, hung or became unreachable (HOROVOD_GLOO_TIMEOUT_SECONDS bounds "
                               "the wait), first seen on the connection to host2 (10.0.0.2: rank 2); rank 0 saw "), gloo
    eager = comm.failure(HorovodInternalError("{{function_node __wrapped__HorovodAllgather_device_/job:localhost/"
                                              "replica:0/task:0/device:CPU:0}} Horovod has been shut down. This was"))
    assert eager.endswith("rank 0 saw the collective 'HorovodAllgather' fail (Horovod has been shut down)")
