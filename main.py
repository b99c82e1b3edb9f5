"""Train, evaluate or benchmark a DLRM / DCNv2 model (DLRM defaults; see dlrm.py, dcnv2.py), or
the model a model file builds (--model=FILE: docs/models.md).

    python main.py --mode=train --batch_size=4096 --embedding_dim=16 ...
    python main.py --model=examples/wide_and_deep.py --model_param dropout=0.2 ...
"""
import os
import sys

from absl import app

from run import flags as run_flags
from utils import launcher, preemption
from utils.errors import CheckpointError, ConfigError, NonFiniteError, StoreError
from utils.tensorflow_startup import import_tensorflow

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    F = run_flags.FLAGS
    if not F.preemption_grace_s > 0:
        print(f"error: --preemption_grace_s must be > 0 (seconds), got {F.preemption_grace_s}", file=sys.stderr)
        sys.exit(2)
    # SIGTERM/SIGINT: one line and exit code 143/130; in training after a checkpoint (utils.preemption)
    preemption.exit_on_signal(lambda: _main(F), "nothing saved (outside training's steps)", F.preemption_grace_s)


def _main(F):
    size = launcher.world_size()
    try:   # the flags' errors before TensorFlow starts, where the launcher names the rank count
        cfg = run_flags.config_from_flags(size) if size else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    import_tensorflow()   # first, so that its start-up lines honour TF_CPP_MIN_LOG_LEVEL
    from parallel_embedding.collectives import make_collectives
    from run.runtime import configure_tensorflow
    try:   # before the collectives: their first op starts TensorFlow, and they pick a GPU
        configure_tensorflow(F.cpu, F.inter_op_parallelism, F.intra_op_parallelism, F.tfdata_debug)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    comm = make_collectives()
    from parallel_embedding.dynamic_table import op_error
    from run.loop import run   # after the collectives, which pick this rank's GPU
    try:
        if cfg is None or comm.size != size:
            cfg = run_flags.config_from_flags(comm.size)
        run(cfg, comm)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (NonFiniteError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:   # a dynamic table too small, a lost rank: one line, not a traceback per collective
        line = op_error(e)
        if line:
            print(f"error: {line}", file=sys.stderr)
            sys.exit(2)
        failure = comm.failure(e)
        if failure is None or preemption.received() is not None:
            raise
        print(f"error: {failure}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
