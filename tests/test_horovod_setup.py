"""The set-up's Horovod build works: two Gloo ranks allreduce and all-to-all inside tf.function."""
from tests.support.horovod_run import horovodrun

SCRIPT = """
import horovod.tensorflow as hvd, tensorflow as tf
hvd.init()
@tf.function
def f(x):
    return hvd.allreduce(x, op=hvd.Sum), hvd.alltoall(tf.stack([x, 10.0 * x]))
s, a = f(tf.constant(float(hvd.rank() + 1)))
print("rank", hvd.rank(), "of", hvd.size(), "sum", float(s), "alltoall", a.numpy().tolist())
"""


def test_horovodrun_two_gloo_ranks():
    out = horovodrun(2, ["-c", SCRIPT], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = sorted(line.split(":", 1)[1] for line in out.stdout.splitlines() if "rank" in line and ":" in line)
    # rank r sends [r+1, 10(r+1)]: rank 0 receives the first entries, rank 1 the second ones.
    assert lines == ["rank 0 of 2 sum 3.0 alltoall [1.0, 2.0]", "rank 1 of 2 sum 3.0 alltoall [10.0, 20.0]"], out.stdout
