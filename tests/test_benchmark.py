"""The throughput benchmark runs our real train step on a (tiny) shared-format workload."""
import json
import math
import os
import subprocess
import sys

import pytest
from tests.support.horovod_run import horovodrun
from tests.support.warm_python import PYTHON

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YARDSTICK = os.path.join(os.path.dirname(ROOT), "shared", "bench", "yardstick", "yardstick.py")

TINY_WORKLOADS = """
defaults: {threads: 2, warmup_steps: 1, timed_steps: 2, pool_batches: 2, seed: 1}
workloads:
  dlrm-kaggle: {model: dlrm, embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [16, 1], num_dense: 13,
                cardinalities: [100, 7, 30], optimizer: {name: sgd, lr: 0.1}, batch_size: 64}
  dcnv2-nvidia: {model: dcnv2, embedding_dim: 8, num_dense: 13, num_tables: 3, rows_per_table: 50,
                 bottom_mlp: [16, 8], cross_layers: 2, cross_projection_dim: 4, top_mlp: [16, 1],
                 optimizer: {name: sgd, lr: 0.1}, batch_size: 64}
"""


def run_benchmark(tmp_path, flags):
    """The benchmark's JSON lines on the tiny workloads."""
    (tmp_path / "yardstick").mkdir()
    (tmp_path / "yardstick" / "yardstick.py").symlink_to(YARDSTICK)   # it reads ../workloads.yaml
    (tmp_path / "workloads.yaml").write_text(TINY_WORKLOADS)
    out = subprocess.run([*PYTHON, os.path.join(ROOT, "benchmarks", "train_throughput.py"),
                          "--bench_dir", str(tmp_path)] + flags,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()]


@pytest.mark.skipif(not os.path.isfile(YARDSTICK), reason="../shared/bench is not beside this checkout")
@pytest.mark.parametrize("workload,flags", [("dlrm-kaggle", []), ("dcnv2-nvidia", ["--amp", "1"])])
def test_benchmark_prints_one_json_record(tmp_path, workload, flags):
    record = run_benchmark(tmp_path, ["--workload", workload] + flags)[-1]
    assert record["workload"] == workload and record["batch"] == 64 and record["timed_steps"] == 2
    assert record["impl"] == "ours" + ("-amp" if flags else "")
    assert record["samples_per_s"] > 0 and record["achieved_gflops"] > 0


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(YARDSTICK), reason="../shared/bench is not beside this checkout")
def test_scaling_runs_two_ranks_against_one(tmp_path):
    one, two, summary = run_benchmark(tmp_path, ["--scaling", "--rounds", "1"])
    assert (one["ranks"], one["threads"], two["ranks"], two["threads"]) == (1, 2, 2, 1)
    assert one["alltoall_bytes_per_step"] == 0
    # 3 tables of width 8 on 2 ranks: each rank sends the other 32 rows of its width, both ways.
    assert two["alltoall_bytes_per_step"] == 2 * 4 * 32 * 24
    # dense weights: bottom 13-16-8 (360), top 16-16-1 (289: 8 + 6 pairs, padded to 16);
    # the allreduce moves 2 (N-1)/N of them.
    assert two["allreduce_bytes_per_step"] == 4 * 649
    assert summary["ratio"] == round(two["samples_per_s"] / one["samples_per_s"], 3)


@pytest.mark.skipif(not os.path.isfile(YARDSTICK), reason="../shared/bench is not beside this checkout")
def test_checks_adds_the_safety_checks_costs(tmp_path):
    plain = run_benchmark(tmp_path, ["--workload", "dlrm-kaggle"])[-1]
    (tmp_path / "checks").mkdir()
    record = run_benchmark(tmp_path / "checks", ["--workload", "dlrm-kaggle", "--checks", "1"])[-1]
    costs = {"loader_batch_ms", "loader_check_ms", "loader_check_cpu_ms", "loader_check_pct_of_step",
             "grad_check_ms", "grad_check_pct_of_step"}
    assert not costs & set(plain) and costs <= set(record)
    assert record["loader_batch_ms"] > 0 and record["grad_check_ms"] > 0
    assert record["grad_check_pct_of_step"] == pytest.approx(100 * record["grad_check_ms"] / record["step_ms_median"],
                                                             rel=0.02)


@pytest.mark.skipif(not os.path.isfile(YARDSTICK), reason="../shared/bench is not beside this checkout")
@pytest.mark.parametrize("fresh", [0, 1])
def test_dynamic_times_the_largest_tables_dynamic_against_static(tmp_path, fresh):
    record, = run_benchmark(tmp_path, ["--workload", "dlrm-kaggle", "--dynamic", "2", "--rounds", "2",
                                       "--fresh_ids", str(fresh)])
    assert record["impl"] == "dynamic-vs-static" and record["rounds"] == 2 and record["fresh_ids"] == fresh
    assert record["dynamic_tables"] == {"0": 100, "2": 30}   # the two largest of 100, 7, 30, capacity = rows
    assert record["static_samples_per_s"] > 0 and record["dynamic_samples_per_s"] > 0
    counts = record["dynamic_counts"]["embedding/table_0"]
    assert counts["refused"] == 0 and counts["evicted"] == counts["admitted"] - counts["live"]
    # the pool's 2 batches of 64 ids cycle (at most 100 distinct: all hits after the first pass); fresh ids: 5 steps
    # of new ids, 320 ids in 100 rows
    assert counts["evicted"] > 0 if fresh else 0 < counts["admitted"] == counts["live"] <= 100


@pytest.mark.slow
def test_dynamic_quality_trains_the_exact_vocabulary_and_each_capacity(tmp_path):
    out = subprocess.run([*PYTHON, os.path.join(ROOT, "benchmarks", "dynamic_quality.py"), "--rows", "6000",
                          "--test_rows", "2000", "--columns", "C3,C12", "--capacities", "50,100", "--batch_size",
                          "256", "--work", str(tmp_path / "work"), "--clean"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    data, *runs = [json.loads(line) for line in lines if line.startswith("{")]
    assert data["columns"] == {"C3": "cat_2", "C12": "cat_11"} and min(data["distinct_ids"].values()) > 100
    top = data["train_lookups_in_top_ids"]
    assert list(top) == ["50%", "100%"] and 0.5 < top["50%"] < top["100%"] == 1.0   # Zipf: the frequent half
    assert 0 < data["test_lookups_unseen_in_training"] < 1
    distinct = sum(data["distinct_ids"].values())
    assert [r["run"] for r in runs] == ["exact vocabulary", "dynamic 50%", "dynamic 100%"]
    exact, half, whole = runs
    assert exact["capacity"] is None and exact["admitted"] == 0 and all(0 < r["auc"] < 1 for r in runs)
    assert exact["steps"] == half["steps"] == whole["steps"] == 6000 // 256
    # room for every distinct id: none evicted (the last partial batch is not trained: some never admitted)
    assert whole["capacity"] == distinct and whole["evicted"] == 0 and whole["admitted"] == whole["live"] <= distinct
    assert distinct / 2 <= half["capacity"] <= distinct / 2 + 2 and half["live"] == half["capacity"]
    assert 0 < half["evicted"] == half["admitted"] - half["live"] and half["refused"] == 0
    table = lines[-5:]
    assert table[0].startswith("| run | seed | rows of the 2 tables | test AUC |") and len(table) == 5
    assert not (tmp_path / "work").exists()


def test_dynamic_checkpoint_saves_and_restores_a_table_on_disk(tmp_path):
    out = subprocess.run([*PYTHON, os.path.join(ROOT, "benchmarks", "dynamic_checkpoint.py"), "--dir",
                          str(tmp_path / "work"), "--rows", "4000", "--dim", "8", "--batch", "1000"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert (record["rows"], record["dim"], record["parts"]) == (4000, 8, 3)
    # its figures present and finite (times rounded to 0.01 s read 0.0 on a fast machine)
    figures = ("save_s", "restore_s", "save_peak_mib", "save_peak_anon_mib", "restore_peak_mib", "restore_peak_anon_mib")
    assert all(math.isfinite(record[k]) and record[k] >= 0 for k in figures), record
    assert not (tmp_path / "work").exists()


def test_warm_start_times_fresh_and_forked_runs():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "warm_start.py"), "--pairs", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["run"] for r in records] == ["fresh", "warm"], out.stdout
    assert all(math.isfinite(r["wall_s"]) and r["wall_s"] >= 0 for r in records)
    assert math.isfinite(records[0]["cpu_s"]) and records[1]["cpu_s"] is None


def test_din_step_times_the_sequence_model_against_plain_keras():
    out = subprocess.run([*PYTHON, os.path.join(ROOT, "benchmarks", "din_step.py"), "--batch", "64", "--max_length",
                          "20", "--mean_length", "5", "--items", "500", "--steps", "2", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r.get("model") for r in records[:2]] == ["project", "keras"] and records[2]["summary"]
    assert all(math.isfinite(r["samples_per_s"]) and math.isfinite(r["mean_loss"]) for r in records[:2])
    assert records[2]["max_length"] == 20 and math.isfinite(records[2]["ratio"])


def test_sequence_exchange_sends_only_the_rows_that_hold_ids():
    """At 2 ranks, the all-to-alls of a history carry exactly its ids, their lengths and their rows
    and gradients (counted from the lengths by the benchmark, in NumPy), not every position's."""
    out = horovodrun(2, [os.path.join(ROOT, "benchmarks", "sequence_exchange.py"), "--batch", "16",
                         "--max_length", "6", "--mean_length", "2", "--items", "300", "--steps", "2", "--warmup", "1"],
                     timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line.split("<stdout>:", 1)[1]) for line in out.stdout.splitlines() if "<stdout>:{" in line]
    assert sorted(r["rank"] for r in records) == [0, 1]
    for r in records:
        assert r["bytes_per_step"] == r["bytes_of_ids"], r
        for name in ("embedding_ids", "embedding_rows", "embedding_grads"):
            assert r["bytes_of_ids"][name] < r["bytes_padded"][name], r
        assert math.isfinite(r["step_ms_median"]) and 0 < r["mean_length_kept"] <= 6
