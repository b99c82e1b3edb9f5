"""dlrm.py and dcnv2.py reproduce, bit for bit, the checkpoints and losses they wrote before the
built-in models were rewritten on the ranking/ API (one path): a few steps of tiny
synthetic runs (DLRM with SGD, DCNv2 with Adam, DLRM with a table on disk), float32 on the CPU
with one thread, each checkpoint's every .npy piece and its manifest (less the run's random
lineage id), and every step's loss and the evaluation's AUC and log loss from the JSON log,
against tests/data/builtin_checkpoints/ (written at commit bef252e; its README says how). Off the CPU
it was written on, each value within float32 rounding and the manifest less its checksums
(tests/support/recorded.py).

    python -m tests.test_builtin_checkpoints write    # rewrites the fixture (only from bef252e's code)
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from tests.support.recorded import assert_values_as_recorded, recording_cpu
from tests.support.warm_python import PYTHON

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "data", "builtin_checkpoints")
COMMON = ["--cpu", "--intra_op_parallelism=1", "--inter_op_parallelism=1", "--dataset_type=synthetic",
          "--synthetic_num_numerical=3", "--batch_size=32",
          "--valid_batch_size=32", "--synthetic_rows=128", "--synthetic_eval_rows=128", "--print_freq=1", "--seed=7",
          "--warmup_steps=0"]
# name -> (entry point, its flags besides COMMON); STORE: the run's directory for tables on disk (table 3).
SMALL = ["--synthetic_cardinalities=20,50,7,30", "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1"]
RUNS = {
    "dlrm": ("dlrm.py", SMALL + ["--learning_rate=0.5"]),
    "dcnv2": ("dcnv2.py", SMALL + ["--num_cross_layers=2", "--cross_layer_projection_dim=4", "--learning_rate=0.01"]),
    "dlrm_disk": ("dlrm.py", ["--synthetic_cardinalities=20,50,7,400", "--embedding_dim=8", "--bottom_mlp_dims=8",
                              "--top_mlp_dims=8,1", "--learning_rate=0.5", "--embedding_memory_budget_gb=0.000012",
                              "--embedding_store_path=STORE"]),
}


def train(name: str, out: str) -> str:
    """Runs RUNS[name] writing into `out`: its checkpoint (out/<name>/ckpt-4) and losses.json
    (per step the loss; the evaluation's auc and logloss); returns that directory."""
    script, args = RUNS[name]
    work = os.path.join(out, name + "_work")
    os.makedirs(os.path.join(work, "store"))
    args = [a.replace("STORE", os.path.join(work, "store")) for a in COMMON + args]
    log = os.path.join(work, "log.json")
    proc = subprocess.run([*PYTHON, script, *args, f"--save_checkpoint_path={work}/ck", f"--log_path={log}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr
    assert ("1 unit(s) on disk" in proc.stdout) == any("STORE" in a for a in RUNS[name][1]), proc.stdout
    with open(log) as f:
        records = [json.loads(line) for line in f]
    losses = {"steps": [r["loss"] for r in records if r["kind"] == "step"],
              "eval": [{k: r[k] for k in ("auc", "logloss")} for r in records if r["kind"] == "eval"]}
    target = os.path.join(out, name)
    shutil.copytree(os.path.join(work, "ck", "ckpt-4"), target)
    with open(os.path.join(target, "losses.json"), "w") as f:
        json.dump(losses, f, indent=1)
    shutil.rmtree(work)
    return target


def _manifest(path: str) -> dict:
    """A manifest less its lineage's run ids (random per run); off the recording CPU less its
    pieces' checksums too."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    for entry in manifest["state"]["lineage"]:
        entry.pop("run")
    if not recording_cpu():
        manifest.pop("crc32")
    return manifest


@pytest.mark.parametrize("name", sorted(RUNS))
def test_entry_point_writes_the_fixtures_checkpoint_and_losses(name, tmp_path):
    got, want = train(name, str(tmp_path)), os.path.join(FIXTURE, name)
    assert sorted(os.listdir(got)) == sorted(os.listdir(want))
    with open(os.path.join(got, "losses.json")) as g, open(os.path.join(want, "losses.json")) as w:
        got_losses, want_losses = json.load(g), json.load(w)
    assert_values_as_recorded(got_losses["steps"], want_losses["steps"], "losses")
    assert [sorted(e) for e in got_losses["eval"]] == [sorted(e) for e in want_losses["eval"]]
    for g, w in zip(got_losses["eval"], want_losses["eval"]):
        assert_values_as_recorded([g[k] for k in sorted(w)], [w[k] for k in sorted(w)], "evaluation")
    assert _manifest(got) == _manifest(want)
    for file in sorted(os.listdir(want)):
        if file.endswith(".npy"):
            if recording_cpu():
                with open(os.path.join(got, file), "rb") as g, open(os.path.join(want, file), "rb") as w:
                    assert g.read() == w.read(), file
            else:
                assert_values_as_recorded(np.load(os.path.join(got, file)), np.load(os.path.join(want, file)), file)


if __name__ == "__main__" and sys.argv[1:] == ["write"]:
    shutil.rmtree(FIXTURE, ignore_errors=True)
    os.makedirs(FIXTURE)
    for run in RUNS:
        print(train(run, FIXTURE))
