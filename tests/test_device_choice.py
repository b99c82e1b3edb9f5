"""Each process takes one GPU, its local rank's, with memory growth, before TensorFlow's first op
(TensorFlow refuses a device choice after it): dlrm.py at 1 process and at 2 Gloo ranks on a
host faked to have 2 GPUs (tests/support/fake_gpus.py), which records the choice and whether any op had
initialised TensorFlow before it."""
import json
import re

import pytest

from tests.support.horovod_run import horovodrun
from tests.support.runs import DATA, MODEL, one_process, succeeded

# dlrm.py, run with TensorFlow's device calls faked first.
FAKED_DLRM = ("import runpy, sys, tests.support.fake_gpus; sys.argv[0] = 'dlrm.py'; "
              "runpy.run_path('dlrm.py', run_name='__main__')")


def choice(gpu):
    """The calls use_one_gpu makes for `gpu`, none of them after an op."""
    name = f"/physical_device:GPU:{gpu}"
    return [{"call": "set_visible_devices", "devices": [name], "initialized": False},
            {"call": "set_memory_growth(True)", "devices": [name], "initialized": False}]


def test_one_process_takes_the_first_gpu_before_any_op():
    out = succeeded(one_process("-c", FAKED_DLRM, *MODEL, *DATA))
    calls = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("DEVICE_CHOICE ")]
    assert calls == choice(0)


@pytest.mark.slow
def test_each_rank_takes_its_local_gpu_before_any_op():
    out = horovodrun(2, ["-c", FAKED_DLRM, *MODEL, *DATA], timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    calls = {0: [], 1: []}
    for rank, record in re.findall(r"^\[(\d)\]<stdout>:DEVICE_CHOICE (.*)$", out.stdout, re.M):
        calls[int(rank)].append(json.loads(record))
    assert calls == {0: choice(0), 1: choice(1)}
