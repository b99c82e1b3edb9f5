"""Binding each local rank to its share of the host's CPUs (parallel_embedding.collectives),
checked in fresh processes so this one keeps its CPUs."""
import json
import os
import subprocess
import sys

import pytest

from tests.support.horovod_run import ROOT

PROBE = """
import json, os, sys, threading
from parallel_embedding.collectives import pin_to_local_share
go = threading.Event()
threading.Thread(target=go.wait, daemon=True).start()   # a thread that exists before the call ...
share = pin_to_local_share(int(sys.argv[1]), int(sys.argv[2]))
seen = {}
def record():
    seen["after"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=record); t.start(); t.join()   # ... and one started after it
print(json.dumps({"share": share, "main": sorted(os.sched_getaffinity(0)), "thread": seen["after"],
                  "threads": sorted({tuple(sorted(os.sched_getaffinity(int(t))))
                                     for t in os.listdir("/proc/self/task")})}))
go.set()
"""


def probe(local_rank, local_size, prefix=()):
    out = subprocess.run([*prefix, sys.executable, "-c", PROBE, str(local_rank), str(local_size)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_local_ranks_get_disjoint_equal_shares_covering_the_host():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) != os.cpu_count() or len(cpus) < 2:
        pytest.skip("this process may not use every CPU of the host")
    n = 2
    shares = [probe(r, n) for r in range(n)]
    for r, got in enumerate(shares):
        assert got["share"] == cpus[r * len(cpus) // n:(r + 1) * len(cpus) // n]
        assert got["main"] == got["thread"] == got["share"]
        assert got["threads"] == [got["share"]]   # every thread of the process, earlier ones too
    assert sorted(sum((s["share"] for s in shares), [])) == cpus


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_no_binding_for_one_local_rank_or_cpus_already_divided():
    cpus = sorted(os.sched_getaffinity(0))
    alone = probe(0, 1)
    assert alone["share"] is None and alone["main"] == cpus
    if len(cpus) == os.cpu_count() and len(cpus) >= 2:
        bound = probe(1, 2, prefix=("taskset", "-c", str(cpus[0])))   # a launcher bound it already
        assert bound["share"] is None and bound["main"] == [cpus[0]]


RANK_AFFINITY = """
import json, os
from parallel_embedding.collectives import HorovodCollectives
comm = HorovodCollectives()
print("AFFINITY", json.dumps([comm.rank, sorted(os.sched_getaffinity(0))]), flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
@pytest.mark.parametrize("setting", ["auto", "off"])
def test_horovod_ranks_bind_unless_turned_off(tmp_path, setting):
    """Two Gloo ranks get the two halves of the CPUs; DLRM_CPU_AFFINITY=off leaves them alone."""
    from tests.support.horovod_run import horovodrun
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) != os.cpu_count() or len(cpus) < 2:
        pytest.skip("this process may not use every CPU of the host")
    script = tmp_path / "affinity.py"
    script.write_text(RANK_AFFINITY)
    out = horovodrun(2, [str(script)], timeout=300, env={"DLRM_CPU_AFFINITY": setting})
    assert out.returncode == 0, out.stderr[-2000:]
    got = dict(json.loads(line.split("AFFINITY ", 1)[1]) for line in out.stdout.splitlines() if "AFFINITY " in line)
    half = len(cpus) // 2
    want = {0: cpus[:half], 1: cpus[half:]} if setting == "auto" else {0: cpus, 1: cpus}
    assert got == want
