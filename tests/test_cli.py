"""End to end: the entry points (subprocesses), and every flag's effect on a run (in process,
through run.config.build_config + run_loop.run on tiny models)."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import run.loop as run_loop
from utils import logger as run_logger
from utils.errors import CheckpointError
from tests.support.checks import log_records
from tests.support.cli import ENV, SCRIPT_ARGS, TINY, TINY_STEPS, config, run_script, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Parameters of TINY (dot): tables (20+50+7+30)*8 = 856; bottom 3*16+16 + 16*8+8 = 200;
# dot output 8 + 5*4/2 = 18 -> padded to 24; top 24*16+16 + 16*1+1 = 417.
TINY_PARAMS = 856 + 200 + 417


def model_line(text):
    lines = [line for line in text.splitlines() if line.startswith("model: ")]
    assert len(lines) == 1, text
    return lines[0]


def parameters(text):
    return int(re.search(r"([\d,]+) parameters", model_line(text)).group(1).replace(",", ""))


@pytest.fixture
def out(capsys):
    """The run's printed lines."""
    return capsys


def build_model(out, **overrides):
    """Builds (only) the run for `overrides`; returns the printed parameter count and model line."""
    out.readouterr()
    r = run_loop.Run(config(**overrides))
    r.log.close()
    text = out.readouterr().out
    return parameters(text), model_line(text)


# --------------------------------------------------------------------------------------------
# Entry points, as subprocesses.


@pytest.mark.parametrize("script,args,flag", [
    ("dlrm.py", ["--beta1=0.5"], "--beta1"),                      # DLRM's default optimizer is SGD
    ("dcnv2.py", ["--num_cross_layers=0"], "--num_cross_layers"),
    ("main.py", ["--mode=eval"], "--restore_checkpoint_path"),
    ("dlrm.py", ["--embedding_dim=64"], "--bottom_mlp_dims"),     # dot needs bottom last == 64
    ("dlrm.py", ["--mode=eval", "--restore_checkpoint_path=x", "--learning_rate=1"], "--learning_rate"),
    ("dlrm.py", ["--dist_strategy=basic"], "--dist_strategy"),     # placement at one rank
    ("dlrm.py", ["--restore_mode=continue"], "--restore_mode"),    # nothing to restore
    ("dlrm.py", ["--restore_checkpoint_path=x", "--restore_lr_schedule=continue"], "--restore_lr_schedule"),
])
def test_bad_combination_exits_2_with_one_error_line(script, args, flag):
    proc = run_script(script, "--dataset_type=synthetic", *args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and flag in last, proc.stderr
    assert "Traceback" not in proc.stderr


def test_resuming_a_finished_run_exits_2_with_one_error_line(tmp_path):
    """A run whose "training steps 4..4" would train nothing is an error naming the way out, not exit 0."""
    ck = tmp_path / "ck"
    first = run_script("dlrm.py", *SCRIPT_ARGS, f"--save_checkpoint_path={ck}")
    assert first.returncode == 0, first.stderr
    again = run_script("dlrm.py", *SCRIPT_ARGS, f"--save_checkpoint_path={ck}", f"--restore_checkpoint_path={ck}")
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    last = again.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --restore_mode=resume: ") and "has trained 4 of the 4 steps" in last, last
    assert "nothing left to train" in last and "--restore_mode=continue" in last
    assert "training steps" not in again.stdout
    assert sorted(os.listdir(ck)) == ["ckpt-4", "latest"]


def test_main_rejects_unknown_positional_argument():
    proc = run_script("main.py", "trian", timeout=60)
    assert proc.returncode not in (0, 2) and proc.returncode == 1, proc.stderr
    assert "unexpected arguments: trian" in proc.stderr


@pytest.mark.parametrize("script,line,params,last_lr", [
    # DLRM: dot, SGD, lr 24 with 8000 warmup steps -> step 4 trains with 24 * 4/8000.
    ("dlrm.py", "model: dot interaction, 4 tables", TINY_PARAMS, "lr 0.012"),
    # DCNv2: 3 low-rank (512) cross layers on x0 = 8 + 4*8 = 40; Adam, lr 1e-4 with 100 warmup steps.
    ("dcnv2.py", "model: cross interaction, 4 tables", 856 + 200 + 3 * (40 * 512 * 2 + 40) + 40 * 16 + 16 + 17,
     "lr 4e-06"),
])
def test_entry_point_trains_with_its_model_defaults(script, line, params, last_lr, tmp_path):
    proc = run_script(script, *SCRIPT_ARGS, f"--log_path={tmp_path / 'log.json'}")
    assert proc.returncode == 0, proc.stderr
    # The reference's schedules: warmup 8000 (DLRM) or 100 (DCNv2), both decaying from step 48000 over 24000.
    schedule = {k: log_records(tmp_path / "log.json")[0][k] for k in ("warmup_steps", "decay_start_step", "decay_steps")}
    assert schedule == dict(warmup_steps=8000 if script == "dlrm.py" else 100, decay_start_step=48000,
                            decay_steps=24000)
    assert model_line(proc.stdout).startswith(line)
    assert parameters(proc.stdout) == params
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and steps[-1].startswith("step 4/4") and steps[-1].endswith(last_lr), proc.stdout
    assert re.search(r"eval at step 4: auc 0\.\d+", proc.stdout), proc.stdout


TF_START_UP_LINES = ("oneDNN custom operations are on", "Could not find cuda drivers",
                     "All log messages before absl::InitializeLog()")


@pytest.mark.parametrize("level", ["0", "3"])
def test_tensorflow_start_up_lines_at_most_once_and_none_at_a_level_above_0(level):
    """TensorFlow's two libraries each logged them, through absl, which ignores the level."""
    proc = subprocess.run([sys.executable, "dlrm.py", "--mode=train", *SCRIPT_ARGS], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL=level))
    assert proc.returncode == 0, proc.stderr
    for text in TF_START_UP_LINES:
        assert proc.stderr.count(text) <= (1 if level == "0" else 0), proc.stderr


@pytest.mark.parametrize("args,starts_tensorflow", [
    (["deployment/serve.py", "--model_repository=MISSING"], True),
    (["deployment/deploy.py", "--checkpoint=MISSING", "--output=OUT"], True),
    (["deployment/evaluate_accuracy.py", "--dataset_type=split_binary", "--dataset_path=MISSING"], True),
    (["deployment/evaluate_latency.py", "--dataset_type=split_binary", "--dataset_path=MISSING"], True),
    (["dataloading/to_tfrecords.py", "--dataset_path=MISSING", "--output=OUT"], True),
    (["preproc/criteo.py", "--input=MISSING", "--output=OUT"], False),   # Spark and pyarrow only
], ids=lambda a: a[0] if isinstance(a, list) else None)
def test_other_entry_points_print_tensorflow_start_up_lines_at_most_once(args, starts_tensorflow, tmp_path):
    """Each starts TensorFlow (or not) and stops at the missing path with one error line; at level 0,
    where the start-up lines pass, each shows once."""
    args = [a.replace("MISSING", str(tmp_path / "missing")).replace("OUT", str(tmp_path / "out")) for a in args]
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0"))
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].startswith("error: "), proc.stderr
    counts = [proc.stderr.count(text) for text in TF_START_UP_LINES]
    assert max(counts) <= 1 and (sum(counts) > 0) == starts_tensorflow, proc.stderr
    if "Could not find cuda drivers" in proc.stderr:   # then cuInit's failure says nothing more
        assert "failed call to cuInit" not in proc.stderr, proc.stderr


def test_benchmarks_print_tensorflow_start_up_lines_at_most_once():
    """A benchmark that starts TensorFlow itself (no absl app.run): each line once, and no cuInit failure
    after "Could not find cuda drivers" (its device enumeration runs inside the filter)."""
    proc = subprocess.run([sys.executable, "benchmarks/interaction_op.py", "--shapes", "8,2,8", "--rounds", "1",
                           "--calls", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0"))
    assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[-1])["batch"] == 8, proc.stderr
    assert max(proc.stderr.count(text) for text in TF_START_UP_LINES) == 1, proc.stderr
    if "Could not find cuda drivers" in proc.stderr:
        assert "failed call to cuInit" not in proc.stderr, proc.stderr


def test_tensorflow_start_up_filter_keeps_errors_and_other_lines():
    from utils.tensorflow_startup import keep
    info = "I0000 00:00:1795710367.056414   27486 port.cc:153] oneDNN custom operations are on."
    warning = "W0000 00:00:1795710367.056414   27486 x.cc:1] a warning"
    error = "E0000 00:00:1795710367.056414   27486 cuda_platform.cc:52] failed call to cuInit"
    seen = set()
    assert [keep(line, 1, seen) for line in (info, warning, error, error, "Traceback (most recent call last):")] == [
        False, True, True, False, True]
    assert [keep(line, 3, set()) for line in (info, warning, error)] == [False, False, True]
    assert [keep(line, 0, seen) for line in (info, info.replace("367.05", "368.25"))] == [True, False]
    no_driver = ("I0000 00:00:1795710367.056414   27486 cudart_stub.cc:31] Could not find cuda drivers on your "
                 "machine, GPU will not be used.")
    for level, passed in ((2, [False, False]), (0, [True, False])):   # no driver: cuInit's failure says no more
        seen = set()
        assert [keep(line, level, seen) for line in (no_driver, error)] == passed


# --------------------------------------------------------------------------------------------
# Logging and stdout.

def test_logger_prints_to_the_current_stdout(capsys):
    run_logger.RunLogger().print("to the current stdout")
    assert "to the current stdout" in capsys.readouterr().out


@pytest.mark.parametrize("print_freq,steps", [(1, list(range(1, 13))), (5, [5, 10, 12]), (100, [12])])
def test_print_freq(out, print_freq, steps):
    train(print_freq=print_freq)
    lines = [line for line in out.readouterr().out.splitlines() if line.startswith("step ")]
    assert [int(re.match(r"step (\d+)/12 ", line).group(1)) for line in lines] == steps


def test_log_path_writes_json_records_and_tensorboard(tmp_path):
    import tensorflow as tf
    log = tmp_path / "logs" / "run.json"
    result = train(log_path=str(log), print_freq=4)
    records = log_records(log)
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "params" and kinds[-1] == "final"
    assert kinds.count("step") == 3 and kinds.count("eval") == 1
    params = records[0]
    assert params["parameters"] == TINY_PARAMS and params["batch_size"] == 128 and params["embedding_dims"] == [8] * 4
    # what the run read, not what it did not: a synthetic dot-interaction Adam run at one rank
    assert params["synthetic_rows"] > 0 and params["interaction"] == "dot" and params["beta1"] == 0.9
    assert not {"num_cross_layers", "cross_layer_projection_dim", "dataset_path", "feature_spec", "dist_strategy",
                "row_slice_threshold", "restore_mode", "model_param", "inference_steps"} & set(params)
    assert [r["step"] for r in records if r["kind"] == "step"] == [4, 8, 12]
    assert records[-1]["steps"] == 12 and records[-1]["auc"] == result["auc"]
    # The reference's DLLogger keys: training steps alone (after the first, which traces), the last evaluation.
    final = records[-1]
    evaluation = [r for r in records if r["kind"] == "eval"][-1]
    assert final["auc"] == evaluation["auc"] and final["validation_loss"] == evaluation["logloss"]
    assert final["throughput"] == pytest.approx(128 * 1000 / final["mean_step_time_ms"])
    assert 0 < final["mean_step_time_ms"] * 11 < 1000 * (final["train_seconds"] - evaluation["seconds"])
    tb = run_logger.tensorboard_dir(str(log))
    assert tb == str(tmp_path / "logs" / "run_tb")
    events = [f for f in os.listdir(tb) if f.startswith("events.out.tfevents")]
    assert events, os.listdir(tb)
    tags = {v.tag for f in events for e in tf.compat.v1.train.summary_iterator(os.path.join(tb, f))
            for v in e.summary.value}
    assert {"step/loss", "step/lr", "eval/auc", "final/auc"} <= tags


def test_no_log_path_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train(max_steps=2)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------------
# How long training runs, and when it evaluates.

@pytest.mark.parametrize("overrides,steps", [
    (dict(), TINY_STEPS),
    (dict(max_steps=7), 7),
    (dict(epochs=2), 2 * TINY_STEPS),
    (dict(epochs=2, max_steps=15), 15),
    (dict(synthetic_rows=128 * 5 + 100), 5),       # the partial batch is dropped
])
def test_steps_run(overrides, steps):
    result = train(**overrides)
    assert result["steps"] == steps


@pytest.mark.parametrize("overrides,eval_steps", [
    (dict(evals_per_epoch=0), [12]),
    (dict(evals_per_epoch=3), [4, 8, 12]),
    (dict(evals_per_epoch=2, epochs=2), [6, 12, 18, 24]),
    (dict(evals_per_epoch=0, epochs=2), [24]),
    (dict(evals_per_epoch=2, max_steps=9), [6, 9]),
])
def test_evals_per_epoch(tmp_path, overrides, eval_steps):
    log = tmp_path / "log.json"
    train(log_path=str(log), **overrides)
    assert [r["step"] for r in log_records(log) if r["kind"] == "eval"] == eval_steps


# --------------------------------------------------------------------------------------------
# Checkpoints.

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """TINY trained for 12 steps, checkpointed every 5 steps and at the end."""
    ck = tmp_path_factory.mktemp("trained") / "ck"
    result = train(save_checkpoint_path=str(ck), checkpoint_every_n_steps=5)
    return result, str(ck)


def test_checkpoint_every_n_steps_keeps_two_newest(trained):
    _, ck = trained
    # saved at 5 and 10, and at the end (12); the two newest are kept
    assert sorted(d for d in os.listdir(ck) if d.startswith("ckpt-")) == ["ckpt-10", "ckpt-12"]
    assert open(os.path.join(ck, "latest")).read().strip() == "ckpt-12"
    with open(os.path.join(ck, "ckpt-12", "manifest.json")) as f:
        assert json.load(f)["step"] == 12


def test_save_checkpoint_path_saves_at_the_end_only_by_default(tmp_path, out):
    ck = tmp_path / "ck"
    train(save_checkpoint_path=str(ck), max_steps=7)
    assert sorted(os.listdir(ck)) == ["ckpt-7", "latest"]
    assert out.readouterr().out.count("saved checkpoint") == 1


def test_checkpoint_every_n_steps_saves_each_time(tmp_path, out):
    ck = tmp_path / "ck"
    train(save_checkpoint_path=str(ck), checkpoint_every_n_steps=3, max_steps=7)
    saved = re.findall(r"saved checkpoint \S+ckpt-(\d+)", out.readouterr().out)
    assert saved == ["3", "6", "7"]
    assert sorted(os.listdir(ck)) == ["ckpt-6", "ckpt-7", "latest"]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_eval_of_restored_checkpoint_matches_end_of_training(trained, out, optimizer):
    """Evaluation reads the weights and their step, whatever --optimizer says (trained with adam)."""
    result, ck = trained
    metrics = run_loop.run(config(mode="eval", restore_checkpoint_path=ck, optimizer=optimizer))
    assert re.search(r"restored \S+ckpt-12 at step 12", out.readouterr().out)
    assert metrics["samples"] == 500
    assert metrics["auc"] == result["auc"] and metrics["logloss"] == result["logloss"]


def test_restore_a_checkpoint_directory_itself(trained):
    _, ck = trained
    metrics = run_loop.run(config(mode="eval", restore_checkpoint_path=os.path.join(ck, "ckpt-10")))
    assert metrics["samples"] == 500
    at_12 = run_loop.run(config(mode="eval", restore_checkpoint_path=ck))
    assert metrics["logloss"] != at_12["logloss"]


def test_resume_training_from_checkpoint_matches_uninterrupted(trained):
    result, ck = trained
    resumed = train(restore_checkpoint_path=os.path.join(ck, "ckpt-10"))
    assert resumed["steps"] == 12
    assert resumed["auc"] == pytest.approx(result["auc"], abs=1e-6)
    assert resumed["logloss"] == pytest.approx(result["logloss"], rel=1e-5)


@pytest.mark.parametrize("overrides,setting", [
    (dict(embedding_dim=["4"], bottom_mlp_dims=["16", "4"]), "embedding_dim"),
    (dict(mode="train", optimizer="sgd"), "optimizer"),
    (dict(mode="train", optimizer="adagrad"), "optimizer"),
    (dict(synthetic_cardinalities=["20", "50", "7", "31"]), "cardinalities"),
    (dict(top_mlp_dims=["32", "1"]), "top_mlp_dims"),
    (dict(interaction="cross"), "interaction"),
])
def test_restore_with_different_model_fails_naming_the_setting(trained, overrides, setting):
    """Evaluating (or resuming, for the optimizer's state) a checkpoint of another model."""
    _, ck = trained
    with pytest.raises(CheckpointError) as info:
        run_loop.run(config(**dict(dict(mode="eval"), **overrides),
                            restore_checkpoint_path=os.path.join(ck, "ckpt-10")))
    message = str(info.value)
    assert f"written with {setting}=" in message and f"this run has {setting}=" in message, message
    assert "\n" not in message


def test_restore_missing_checkpoint_fails(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        run_loop.run(config(mode="eval", restore_checkpoint_path=str(tmp_path)))


# --------------------------------------------------------------------------------------------
# Evaluation data.

def test_valid_batch_size_does_not_change_the_metrics(trained):
    result, ck = trained
    for valid_batch_size in (64, 333, 1000):   # 333 does not divide the 500 samples
        metrics = run_loop.run(config(mode="eval", restore_checkpoint_path=ck, valid_batch_size=valid_batch_size))
        assert metrics["samples"] == 500
        assert metrics["auc"] == pytest.approx(result["auc"], abs=1e-12)
        assert metrics["logloss"] == pytest.approx(result["logloss"], rel=1e-6)


def test_synthetic_eval_rows(trained):
    result, ck = trained
    metrics = run_loop.run(config(mode="eval", restore_checkpoint_path=ck, synthetic_eval_rows=777))
    assert metrics["samples"] == 777
    assert metrics["auc"] != result["auc"]


# --------------------------------------------------------------------------------------------
# Training hyper-parameters and data: each changes the trained result.

@pytest.fixture(scope="module")
def baseline():
    return train()


def test_seed(baseline):
    again = train(seed=TINY["seed"])
    assert again["auc"] == baseline["auc"] and again["logloss"] == baseline["logloss"]
    other = train(seed=TINY["seed"] + 1)
    assert other["logloss"] != baseline["logloss"]
    assert other["oracle_auc"] != baseline["oracle_auc"]     # the data depends on the seed too


@pytest.mark.parametrize("overrides", [
    dict(learning_rate=0.03), dict(optimizer="sgd"), dict(optimizer="adagrad"), dict(beta1=0.5),
    dict(beta2=0.9), dict(warmup_steps=0), dict(warmup_steps=6), dict(decay_start_step=9),
    dict(decay_steps=3), dict(decay_steps=0), dict(batch_size=64),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_training_flags_change_the_result(baseline, overrides):
    result = train(**overrides)
    assert result["oracle_auc"] == baseline["oracle_auc"]     # same data, same evaluation
    assert result["logloss"] != baseline["logloss"]


def test_learning_rate_schedule_flags(tmp_path):
    log = tmp_path / "log.json"
    train(log_path=str(log), print_freq=1, learning_rate=0.002, warmup_steps=3, decay_start_step=6, decay_steps=4)
    lrs = [r["lr"] for r in log_records(log) if r["kind"] == "step"]
    # update k (0-based): warmup (k+1)/3, constant, then ((6+4-k)/4)^2 decay to zero, held
    expected = [0.002 * f for f in (1 / 3, 2 / 3, 1, 1, 1, 1, 1, (3 / 4) ** 2, (2 / 4) ** 2, (1 / 4) ** 2, 0, 0)]
    assert lrs == pytest.approx(expected, rel=1e-5, abs=1e-12)


@pytest.mark.parametrize("overrides", [dict(synthetic_alpha=0.0), dict(synthetic_alpha=2.0),
                                       dict(synthetic_num_numerical=5),
                                       dict(synthetic_cardinalities=["20", "50", "7", "300"])],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_synthetic_data_flags_change_the_data(baseline, overrides):
    result = train(**overrides)
    assert result["steps"] == TINY_STEPS and result["samples"] == 500
    assert result["oracle_auc"] != baseline["oracle_auc"]


# --------------------------------------------------------------------------------------------
# Model shape: the parameter count in the model line.

@pytest.mark.parametrize("overrides,params", [
    (dict(), TINY_PARAMS),
    (dict(synthetic_num_numerical=5), TINY_PARAMS + 2 * 16),
    # a fifth table of 11 rows; dot output 8 + 15 = 23 -> still padded to 24
    (dict(synthetic_cardinalities=["20", "50", "7", "30", "11"]), TINY_PARAMS + 11 * 8),
    (dict(synthetic_cardinalities=["20", "50", "7", "300"]), TINY_PARAMS + 270 * 8),
    # width 4: dot output 4 + 10 = 14 -> padded to 16
    (dict(embedding_dim=["4"], bottom_mlp_dims=["16", "4"]), 107 * 4 + (3 * 16 + 16 + 16 * 4 + 4) + (16 * 16 + 16 + 17)),
    # cross: x0 = 8 + 4*8 = 40; low rank layer: U 40x4, V 4x40, bias 40; top 40*16+16 + 17
    (dict(interaction="cross"), 856 + 200 + 2 * (40 * 4 * 2 + 40) + 673),
    (dict(interaction="cross", num_cross_layers=3), 856 + 200 + 3 * (40 * 4 * 2 + 40) + 673),
    (dict(interaction="cross", cross_layer_projection_dim=6), 856 + 200 + 2 * (40 * 6 * 2 + 40) + 673),
    (dict(interaction="cross", cross_layer_projection_dim=0), 856 + 200 + 2 * (40 * 40 + 40) + 673),
    # per-feature widths 4, 8, 2, 6: tables 80+400+14+180; x0 = 8 + 20 = 28; top 28*16+16 + 17
    (dict(interaction="cross", embedding_dim=["4", "8", "2", "6"]),
     674 + 200 + 2 * (28 * 4 * 2 + 28) + 481),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) if isinstance(o, dict) else str(o))
def test_model_flags_set_the_parameter_count(out, overrides, params):
    count, line = build_model(out, **overrides)
    assert count == params, line
    interaction = overrides.get("interaction", "dot")
    assert line.startswith(f"model: {interaction} interaction, {len(config(**overrides).data.cardinalities)} tables")


def test_per_feature_embedding_dims_with_cross_train(out):
    result = train(interaction="cross", embedding_dim=["4", "8", "2", "6"], max_steps=3)
    assert result["steps"] == 3 and np.isfinite(result["logloss"])
    assert parameters(out.readouterr().out) == 674 + 200 + 2 * (28 * 4 * 2 + 28) + 481


# --------------------------------------------------------------------------------------------
# Compute flags.

def test_amp(out):
    import tensorflow as tf
    result = train(amp=True, max_steps=3)
    dtype = "float16" if tf.config.list_physical_devices("GPU") else "bfloat16"
    line = model_line(out.readouterr().out)
    assert f"compute dtype {dtype}," in line
    assert result["steps"] == 3 and np.isfinite(result["logloss"])
    assert "compute dtype float32," in build_model(out)[1]


def test_xla(out):
    plain = train(max_steps=3)
    out.readouterr()
    result = train(xla=True, max_steps=3)
    assert model_line(out.readouterr().out).endswith("xla True, 1 rank")
    assert result["steps"] == 3
    assert result["logloss"] == pytest.approx(plain["logloss"], rel=1e-3)
    assert build_model(out)[1].endswith("xla False, 1 rank")
    # What only XLA does: the run's train step holds the MLPs' matmuls in XLA-compiled functions.
    from tests.support.compiled import xla_compiled_ops
    for xla in (True, False):
        r = run_loop.Run(config(xla=xla))
        r.log.close()
        numerical, categorical, labels, _, _ = next(iter(r._eval_data()))
        assert ("MatMul" in xla_compiled_ops(r.trainer.train_step, numerical, categorical, labels)) == xla


def test_run_eagerly(out):
    """--run_eagerly: the step's Python runs at every step, eagerly (once, while tracing, without)."""
    import tensorflow as tf
    for run_eagerly, calls in ((True, [True] * 3), (False, [False])):
        r = run_loop.Run(config(run_eagerly=run_eagerly, max_steps=3, evals_per_epoch=0))
        seen, forward = [], r.model.keras_model.step_on

        def recorded(*args, **options):   # the training step of the model
            seen.append(tf.executing_eagerly())
            return forward(*args, **options)
        r.model.keras_model.step_on = recorded
        assert r.train()["steps"] == 3
        r.log.close()
        assert seen == calls


@pytest.mark.parametrize("interaction,kernel", [("dot_tensorflow", "TensorFlow ops"), ("dot_custom_cuda", "the op"),
                                                ("dot", "the op")])
def test_reference_interaction_names(out, interaction, kernel):
    """dot_tensorflow never uses the custom op (same model as dot); dot_custom_cuda is dot_custom."""
    r = run_loop.Run(config(interaction=interaction))
    r.log.close()
    assert (r.model.keras_model.get_layer("interaction").engine._op is None) == (kernel == "TensorFlow ops")
    assert parameters(out.readouterr().out) == TINY_PARAMS
    assert r.model_config.signature()["interaction"] == "dot"


def test_auc_thresholds(out, tmp_path):
    """--auc_thresholds: the reference's approximate AUC of the evaluated predictions beside the exact one."""
    from tests.support.references import direct_thresholded_auc
    from utils.metrics import roc_auc
    r = run_loop.Run(config(auc_thresholds=50, max_steps=2, log_path=str(tmp_path / "log.json")))
    result = r.train()
    r.log.close()
    logits, labels = [], []
    for numerical, categorical, y, _, valid in r._eval_data():
        logits.append(r.trainer.predict(numerical, categorical).numpy()[:int(valid)])
        labels.append(y.numpy()[:int(valid)])
    logits, labels = np.concatenate(logits), np.concatenate(labels)
    assert result["auc"] == roc_auc(labels, logits)
    assert result["auc_thresholded"] == pytest.approx(direct_thresholded_auc(labels, logits, 50), abs=1e-12)
    assert result["auc_thresholded"] != result["auc"]
    assert re.search(r"eval at step 2: auc 0\.\d+ \| logloss \S+ \| oracle_auc \S+ \| auc_thresholded 0\.\d+",
                     out.readouterr().out)
    assert [r["auc_thresholded"] for r in log_records(tmp_path / "log.json") if r["kind"] == "eval"] == \
        [result["auc_thresholded"]]
    assert "auc_thresholded" not in train(max_steps=2)


# --------------------------------------------------------------------------------------------
# Inference.

def test_inference(monkeypatch, tmp_path):
    import nn.evaluator
    calls = []
    measure = nn.evaluator.measure_latency

    def counting(predict, batch, steps, *args, **kwargs):
        def counted(*args):
            calls[-1] += 1
            return predict(*args)
        calls.append(0)
        return measure(counted, batch, steps, *args, **kwargs)

    monkeypatch.setattr(nn.evaluator, "measure_latency", counting)
    log = tmp_path / "log.json"
    results = run_loop.run(config(mode="inference", inference_batch_sizes=["1", "16", "33"], inference_steps=7,
                              log_path=str(log)))
    assert [r["batch_size"] for r in results] == [1, 16, 33]
    for r in results:
        assert set(r) == {"batch_size", "samples_per_s", "mean_ms", "p50_ms", "p90_ms", "p99_ms"}
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] and r["mean_ms"] > 0 and r["samples_per_s"] > 0
    assert calls == [7 + 5] * 3          # inference_steps timed predictions after 5 warm-up ones
    assert [r["batch_size"] for r in log_records(log) if r["kind"] == "inference"] == [1, 16, 33]


def test_inference_from_checkpoint(trained, out):
    _, ck = trained
    results = run_loop.run(config(mode="inference", restore_checkpoint_path=ck, inference_batch_sizes=["4"]))
    assert [r["batch_size"] for r in results] == [4]
    assert re.search(r"restored \S+ckpt-12 at step 12", out.readouterr().out)


def test_default_dataset_needs_a_path():
    """The default dataset type is split_binary (as in the reference): without files, one line
    says what to pass."""
    proc = run_script("dlrm.py", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --dataset_type=split_binary needs --dataset_path")


@pytest.mark.parametrize("launched", [{}, {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}], ids=["one", "rank"])
def test_a_broken_flag_rule_answers_before_tensorflow_is_imported(launched):
    """A rule of run.config broken (not only a flag absl refuses): its one line, exit status 2,
    and TensorFlow never imported (a fresh interpreter: the import is the subject)."""
    code = ("import atexit, runpy, sys; atexit.register(lambda: print('tensorflow' in sys.modules)); "
            "sys.argv = ['dlrm.py', '--dataset_type=synthetic', '--batch_size=-5']; "
            "runpy.run_path('dlrm.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(ENV, **launched))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: --batch_size must be positive, got -5"], proc.stderr
    assert proc.stdout.split() == ["False"]
