"""The throughput benchmark runs our real train step on a (tiny) shared-format workload."""
import json
import os
import subprocess
import sys

import pytest

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


@pytest.mark.skipif(not os.path.isfile(YARDSTICK), reason="../shared/bench is not beside this checkout")
@pytest.mark.parametrize("workload,flags", [("dlrm-kaggle", []), ("dcnv2-nvidia", ["--amp", "1"])])
def test_benchmark_prints_one_json_record(tmp_path, workload, flags):
    (tmp_path / "yardstick").mkdir()
    (tmp_path / "yardstick" / "yardstick.py").symlink_to(YARDSTICK)   # it reads ../workloads.yaml
    (tmp_path / "workloads.yaml").write_text(TINY_WORKLOADS)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_throughput.py"),
                          "--workload", workload, "--bench_dir", str(tmp_path)] + flags,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["workload"] == workload and record["batch"] == 64 and record["timed_steps"] == 2
    assert record["impl"] == "ours" + ("-amp" if flags else "")
    assert record["samples_per_s"] > 0 and record["achieved_gflops"] > 0
