"""The reference's flags for loss scaling, frozen/zero tables, profiling, host-memory offloading and
TensorFlow's start-up settings (--cpu, thread pools, tf.data debug mode)."""
import glob
import json
import os

import numpy as np
import pytest

import run.loop as run_loop
from tests.support.cli import SCRIPT_ARGS, TINY, TINY_STEPS, config, run_script, train
from tests.support.checks import log_records
from run.config import build_config
from utils.errors import ConfigError
from run.runtime import PROFILED_STEPS, StepProfiler, offloading_line


@pytest.mark.parametrize("overrides,world_size,message", [
    (dict(loss_scale=1024.0), 1, "--loss_scale only applies with --amp"),
    (dict(amp=True, loss_scale=0.0), 1, "--loss_scale must be positive"),
    (dict(embedding_trainable=False, mode="eval", restore_checkpoint_path="x"), 1,
     "--embedding_trainable only applies with --mode=train"),
    (dict(profiler_start_step=-1, log_path="x.json"), 1, "--profiler_start_step must be >= 0"),
    (dict(profiler_start_step=3), 1, "--profiler_start_step needs --log_path"),
    (dict(profiled_rank=1), 2, "--profiled_rank only applies with --profiler_start_step"),
    (dict(profiler_start_step=3, log_path="x.json", profiled_rank=2), 2, "--profiled_rank=2: there is no such rank"),
    (dict(cpu_offloading_threshold_gb=-1), 1, "--cpu_offloading_threshold_gb must be >= 0"),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) if isinstance(o, dict) else str(o))
def test_bad_values_are_refused_naming_the_flag(overrides, world_size, message):
    with pytest.raises(ConfigError) as e:
        build_config(dict(TINY, **overrides), present=set(overrides), world_size=world_size)
    assert str(e.value).startswith(message), e.value


# --------------------------------------------------------------------------------------------
# --loss_scale

def test_loss_scale_on_the_cpu_is_refused():
    """--amp on the CPU computes in bfloat16, which has float32's range: no loss scaling."""
    with pytest.raises(ConfigError, match="--loss_scale applies to float16 AMP.*bfloat16"):
        run_loop.Run(config(amp=True, loss_scale=256.0))


def test_loss_scale_is_the_static_float16_scale(monkeypatch):
    import tensorflow as tf
    import ranking.precision
    monkeypatch.setattr(ranking.precision, "amp_dtype", lambda: tf.float16)   # as on a GPU
    r = run_loop.Run(config(amp=True, loss_scale=256.0, max_steps=4))
    assert r.trainer.loss_scale.static == 256.0
    result = r.train()
    r.log.close()
    assert result["steps"] == 4 and np.isfinite(result["logloss"])
    assert float(r.trainer.loss_scale.value.numpy()) == 256.0
    dynamic = run_loop.Run(config(amp=True, max_steps=4))
    assert dynamic.trainer.loss_scale.static is None
    dynamic.log.close()


# --------------------------------------------------------------------------------------------
# --embedding_trainable, --embedding_zeros_initializer

def test_embedding_trainable_false_freezes_the_tables_only():
    r = run_loop.Run(config(embedding_trainable=False))
    tables = [v.numpy().copy() for v in r.model.table_variables]
    dense = [v.numpy().copy() for v in r.model.dense_variables]
    result = r.train()
    r.log.close()
    assert result["steps"] == TINY_STEPS
    for v, t in zip(r.model.table_variables, tables):
        np.testing.assert_array_equal(v.numpy(), t)
    for v, d in zip(r.model.dense_variables, dense):
        assert not np.array_equal(v.numpy(), d), v.name
    slots = r.model.embeddings.layers[0].embedding.optimizer.variables_by_name()
    assert slots and not any(np.any(v.numpy()) for name, v in slots.items() if "table" in name), list(slots)


def test_embedding_zeros_initializer():
    zeros, default = run_loop.Run(config(embedding_zeros_initializer=True)), run_loop.Run(config())
    for r in (zeros, default):
        r.log.close()
    assert all(not np.any(v.numpy()) for v in zeros.model.table_variables)
    assert all(np.any(v.numpy()) for v in default.model.table_variables)
    for z, d in zip(zeros.model.dense_variables, default.model.dense_variables):   # only the tables differ
        np.testing.assert_array_equal(z.numpy(), d.numpy())
    result = zeros.train()
    assert result["steps"] == TINY_STEPS and np.isfinite(result["logloss"])
    assert all(np.any(v.numpy()) for v in zeros.model.table_variables)   # the tables learn from zero


# --------------------------------------------------------------------------------------------
# --profiler_start_step, --profiled_rank

def test_profiler_writes_a_tensorboard_profile(tmp_path, capsys):
    log = tmp_path / "run.json"
    result = train(log_path=str(log), profiler_start_step=3)
    assert result["steps"] == TINY_STEPS
    tb = str(tmp_path / "run_tb")
    profiles = glob.glob(os.path.join(tb, "plugins", "profile", "*", "*.xplane.pb"))
    assert len(profiles) == 1 and os.path.getsize(profiles[0]) > 0, os.listdir(tb)
    out = capsys.readouterr().out
    assert f"profile of training steps 3..{TINY_STEPS - 1} (rank 0) written to " in out   # cut at the end
    assert log_records(log)[0]["profiler_start_step"] == 3


def test_profiler_window():
    cfg = config(log_path="x.json", profiler_start_step=3)
    p = StepProfiler(cfg, 0, 0, 1000)
    assert (p.start, p.stop) == (3, 3 + PROFILED_STEPS)
    assert StepProfiler(cfg, 1, 0, 1000).start is None   # not the profiled rank
    assert StepProfiler(config(), 0, 0, 1000).start is None
    for first, total in ((0, 3), (4, 1000)):
        with pytest.raises(ConfigError, match=rf"--profiler_start_step=3 is not a step of this run "
                                              rf"\(it trains steps {first}\.\.{total - 1}\)"):
            StepProfiler(cfg, 0, first, total)


# --------------------------------------------------------------------------------------------
# --cpu_offloading_threshold_gb

def test_cpu_offloading_threshold_is_reported_with_the_plan(tmp_path, capsys):
    log = tmp_path / "run.json"
    train(log_path=str(log), cpu_offloading_threshold_gb=75, max_steps=1)
    out = capsys.readouterr().out
    tables = (20 + 50 + 7 + 30) * 8 * 4   # bytes of TINY's tables
    line = f"--cpu_offloading_threshold_gb=75: rank 0's tables take {tables / 2 ** 30:.3g} GiB, all in host memory"
    assert line in out
    assert out.index("embedding plan:") < out.index(line) < out.index("model: ")
    assert log_records(log)[0]["cpu_offloading_threshold_gb"] == 75
    train(max_steps=1)
    assert "--cpu_offloading_threshold_gb" not in capsys.readouterr().out


def test_cpu_offloading_threshold_on_a_gpu():
    """A GPU run keeps its tables in GPU memory up to the threshold, as the reference; above it the
    largest go to host memory (run.runtime.tier_options; tests/test_planner_tiers.py)."""
    assert offloading_line(2, 2 ** 31, 3, on_gpu=True).endswith("all in GPU memory (at most the threshold)")
    assert offloading_line(2, 2 ** 31 + 1, 3, on_gpu=True) == (
        "--cpu_offloading_threshold_gb=2: rank 3's tables take 2 GiB; the largest go to host memory until those "
        "left in GPU memory take at most the threshold (the plan's tier column)")


# --------------------------------------------------------------------------------------------
# --cpu, --inter_op_parallelism, --intra_op_parallelism, --tfdata_debug: set before TensorFlow starts.

SPY = """
import json, os, sys
from absl import app
import main
from parallel_embedding import collectives
make = collectives.make_collectives

def spy():   # what holds when main.py makes the collectives (whose first op starts TensorFlow)
    import tensorflow as tf
    threads = tf.config.threading
    state = dict(inter=threads.get_inter_op_parallelism_threads(), intra=threads.get_intra_op_parallelism_threads(),
                 cuda=os.environ.get("CUDA_VISIBLE_DEVICES"), gpus=len(tf.config.list_physical_devices("GPU")))
    eager = []   # only in tf.data debug mode does a map's function run eagerly, per element
    list(tf.data.Dataset.range(2).map(lambda x: (eager.append(tf.executing_eagerly()), x)[1]))
    state["tfdata_eager"] = any(eager)
    print("AT COLLECTIVES " + json.dumps(state), flush=True)
    return make()

collectives.make_collectives = spy
sys.argv[0] = "main.py"
app.run(main.main)
"""


def spy_run(*flags):
    proc = run_script("-c", SPY, *SCRIPT_ARGS, *flags, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("AT COLLECTIVES ")]
    return proc, json.loads(lines[0][len("AT COLLECTIVES "):]) if lines else None


def test_tensorflow_settings_apply_before_the_collectives():
    proc, state = spy_run("--cpu", "--inter_op_parallelism=3", "--intra_op_parallelism=2", "--tfdata_debug")
    assert proc.returncode == 0, proc.stderr
    assert state == dict(inter=3, intra=2, cuda="-1", gpus=0, tfdata_eager=True), state
    assert "eval at step 4: auc" in proc.stdout     # and the run trains with them
    proc, state = spy_run()
    assert proc.returncode == 0, proc.stderr
    assert state["inter"] == state["intra"] == 0 and state["tfdata_eager"] is False
    assert state["cuda"] == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_negative_thread_count_exits_2_with_one_error_line():
    proc = run_script("main.py", "--dataset_type=synthetic", "--intra_op_parallelism=-1", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == \
        "error: --intra_op_parallelism must be >= 0 (0: TensorFlow's choice), got -1"


def test_tfdata_debug_makes_the_same_batches_in_the_training_thread():
    """--tfdata_debug's pipeline (no tf.data, no prefetch thread) trains and evaluates on the same batches."""
    debug, plain = train(tfdata_debug=True), train()
    for key in ("auc", "logloss", "oracle_auc", "samples", "steps"):
        assert debug[key] == plain[key], key


def test_two_ranks_profile_rank_1_with_threads_set_before_horovod(tmp_path):
    """Under horovodrun the thread counts are set before HorovodCollectives' first op (TensorFlow
    refuses them afterwards), frozen tables train at two ranks, and only --profiled_rank profiles."""
    from tests.support.horovod_run import horovodrun
    log = tmp_path / "run.json"
    proc = horovodrun(2, ["main.py", *SCRIPT_ARGS, "--cpu", "--inter_op_parallelism=2", "--intra_op_parallelism=1",
                          "--embedding_trainable=false", "--profiler_start_step=1", "--profiled_rank=1",
                          f"--log_path={log}"], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[1]<stdout>:profile of training steps 1..3 (rank 1) written to" in proc.stdout, proc.stdout
    assert "[0]<stdout>:profile" not in proc.stdout
    assert len(glob.glob(str(tmp_path / "run_tb" / "plugins" / "profile" / "*" / "*.xplane.pb"))) == 1
    assert log_records(log)[-1]["kind"] == "final"
