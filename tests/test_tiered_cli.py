"""The disk tier from the command line (--embedding_memory_budget_gb, --embedding_store_path): a run
with tables on disk writes the same checkpoints, bit for bit, as the same run in memory, at 1 and 2
Gloo ranks (row and column slices, multi-hot, LRU and LFU caches); checkpoints move between the tiers
and rank counts; evaluation gives the same metrics; a dynamic table beside tables on disk changes none
of that; the store's failures end the run with one error line.

BUDGET is 107,374 bytes a rank. With Adam's 2 slots a row of width 8 takes 96 bytes: at 1 rank tables
0 (3,000 rows, 288,000 bytes) and 2 (2,000 rows, 192,000 bytes) go to disk, each with a cache of at
least 2 x (64 + 64) rows (two training and two evaluation batches in flight) of 96 + 32 bytes plus an
index of 4 bytes a row: 90,048 bytes with tables 1 and 3. At 2 ranks their row shards (or, in DCNv2,
table 0's row shards and table 2's column slices) go to disk on both ranks."""
import os
import re
import subprocess

import pytest

from storage import checkpoint
from tests.support.horovod_run import ROOT, horovodrun
from tests.support.runs import one_process, records, succeeded, wait_for
from tests.support.warm_python import PYTHON
from tests.support.checks import (BUDGET, assert_same_checkpoint, assert_same_run_folders, disk_units, error_lines,
                                  log_records, one_error, tiered)

MODEL = ["--dataset_type=synthetic", "--synthetic_cardinalities=3000,40,2000,7", "--synthetic_num_numerical=3",
         "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--optimizer=adam", "--seed=3"]
# 24 steps of 64, the schedule's warm-up and decay inside them; evaluations after 12 (with the next training
# batch staged in the caches) and 24.
DATA = ["--learning_rate=0.01", "--batch_size=64", "--valid_batch_size=64", "--synthetic_rows=1536",
        "--synthetic_eval_rows=500", "--warmup_steps=2", "--decay_start_step=16", "--decay_steps=8",
        "--print_freq=4", "--evals_per_epoch=2"]
ROW_SLICES = "--row_slice_threshold=1000"   # tables 0 and 2 in row shards at 2 ranks
STORE_FIGURES = ("cache_hit_rate", "store_mb_read_per_step", "store_wait_ms_per_step")


def train(out, *args, ranks=1, script="dlrm.py", log=True):
    """Trains `script` with MODEL, DATA and `args` into out/ckpt (log out/log.json): its output."""
    args = [script, *MODEL, *DATA, *args, f"--save_checkpoint_path={out / 'ckpt'}"]
    args += [f"--log_path={out / 'log.json'}"] if log else []
    return succeeded(one_process(*args) if ranks == 1 else horovodrun(ranks, args))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """24 steps at 1 rank, in memory and on disk (checkpoints after 12 and 24): {name: (dir, stdout)}."""
    runs = {}
    for name in ("memory", "disk"):
        out = tmp_path_factory.mktemp(name)
        flags = tiered(out / "store") if name == "disk" else []
        runs[name] = out, train(out, *flags, "--checkpoint_every_n_steps=12").stdout
    return runs


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, one_rank):
    """One-rank memory's checkpoint of step 12 resumed at 2 ranks with row shards, in memory and on disk,
    checkpoints after 18 and 24: {name: (dir, stdout)}."""
    start = one_rank["memory"][0] / "ckpt" / "ckpt-12"
    runs = {}
    for name in ("memory", "disk"):
        out = tmp_path_factory.mktemp(f"two_{name}")
        flags = tiered(out / "store") if name == "disk" else []
        runs[name] = out, train(out, ROW_SLICES, *flags, "--checkpoint_every_n_steps=6",
                                f"--restore_checkpoint_path={start}", ranks=2).stdout
    return runs


def test_one_rank_on_disk_equals_memory(one_rank):
    (memory, memory_out), (disk, disk_out) = one_rank["memory"], one_rank["disk"]
    units = disk_units(disk_out)
    assert set(units) == {(0, 0), (0, 2)} and disk_units(memory_out) == {}, disk_out
    assert 256 <= units[(0, 0)] < 3000 // 4 and 256 <= units[(0, 2)] < 2000 // 4, units
    assert_same_run_folders(disk, memory)

    progress = [line for line in disk_out.splitlines() if line.startswith("step ")]
    assert len(progress) == 6 and all("cache hits" in line for line in progress), disk_out
    assert "cache hits" not in memory_out
    steps = [r for r in log_records(disk / "log.json") if r["kind"] == "step"]
    assert all(set(STORE_FIGURES) <= set(r) for r in steps)
    assert min(r["cache_hit_rate"] for r in steps) < 1 and sum(r["store_rows_written"] for r in steps) > 0
    assert os.listdir(disk / "store") == []


@pytest.mark.slow
def test_two_ranks_row_shards_on_disk_equal_memory(two_ranks):
    (memory, memory_out), (disk, disk_out) = two_ranks["memory"], two_ranks["disk"]
    assert set(disk_units(disk_out)) == {(0, 0), (1, 0), (0, 2), (1, 2)} and disk_units(memory_out) == {}, disk_out
    assert " 0  row " in disk_out and " 2  row " in disk_out
    assert "written at 1 rank(s)" in disk_out and "cache hits" in disk_out
    for step in (18, 24):
        assert_same_checkpoint(disk / "ckpt" / f"ckpt-{step}", memory / "ckpt" / f"ckpt-{step}")
    assert os.listdir(disk / "store") == []


@pytest.mark.slow
def test_dcnv2_two_ranks_column_slices_multi_hot_lfu_on_disk_equals_memory(tmp_path):
    """Table 0 in row shards, table 2 (multi-hot, up to 2 ids a sample) in a column slice per rank."""
    args = ["--row_slice_threshold=20000", "--column_slice_threshold=10000",
            "--synthetic_dataset_hotness=1,1,2,1", "--num_cross_layers=2", "--cross_layer_projection_dim=4",
            "--max_steps=8"]
    memory = train(tmp_path / "memory", *args, ranks=2, script="dcnv2.py", log=False).stdout
    disk = train(tmp_path / "disk", *args, *tiered(tmp_path / "store"), "--embedding_cache_policy=lfu", ranks=2,
                 script="dcnv2.py", log=False).stdout
    assert set(disk_units(disk)) == {(0, 0), (1, 0), (0, 2), (1, 2)} and disk_units(memory) == {}, disk
    assert " 2  column " in disk and "cache hits" in disk
    assert_same_checkpoint(tmp_path / "disk" / "ckpt", tmp_path / "memory" / "ckpt")
    assert os.listdir(tmp_path / "store") == []


def test_checkpoints_move_between_tiers_and_rank_counts(tmp_path, two_ranks):
    """Memory at 1 rank -> disk at 2 ranks equals memory -> memory (two_ranks); the step-18
    checkpoints of those 2-rank runs (equal) resumed at 1 rank, the disk tier's in memory and the
    memory's on disk, give the same model."""
    from_disk = train(tmp_path / "from_disk", f"--restore_checkpoint_path={two_ranks['disk'][0] / 'ckpt' / 'ckpt-18'}",
                      log=False).stdout
    to_disk = train(tmp_path / "to_disk", *tiered(tmp_path / "store"),
                    f"--restore_checkpoint_path={two_ranks['memory'][0] / 'ckpt' / 'ckpt-18'}", log=False).stdout
    assert set(disk_units(to_disk)) == {(0, 0), (0, 2)} and disk_units(from_disk) == {}, to_disk
    assert "written at 2 rank(s)" in to_disk and "resuming at batch 18" in to_disk, to_disk
    assert_same_checkpoint(tmp_path / "to_disk" / "ckpt", tmp_path / "from_disk" / "ckpt")


def test_eval_and_inference_on_disk(tmp_path, one_rank):
    """--mode=eval with tables on disk gives the metrics of the final evaluation of the in-memory
    run that wrote the checkpoint (same model, same evaluation data); --mode=inference runs."""
    memory, _ = one_rank["memory"]
    common = [*MODEL, f"--restore_checkpoint_path={memory / 'ckpt'}", *tiered(tmp_path / "s")]
    out = succeeded(one_process("dlrm.py", *common, "--mode=eval", "--valid_batch_size=64", "--synthetic_eval_rows=500",
                                f"--log_path={tmp_path / 'eval.json'}"))
    assert set(disk_units(out.stdout)) == {(0, 0), (0, 2)}, out.stdout
    got, want = records(tmp_path / "eval.json")["eval"], records(memory / "log.json")["eval"]
    assert (got["auc"], got["logloss"], got["samples"]) == (want["auc"], want["logloss"], 500)

    out = succeeded(one_process("dlrm.py", *common, "--mode=inference", "--inference_batch_sizes=1,64",
                                "--inference_steps=2"))
    assert set(disk_units(out.stdout)) == {(0, 0), (0, 2)}, out.stdout
    assert [line.split(" | ")[0] for line in out.stdout.splitlines() if re.match(r"\d+ \| ", line)] == ["1", "64"]
    assert os.listdir(tmp_path / "s") == []


@pytest.mark.slow
def test_dynamic_table_beside_tables_on_disk_equals_memory_and_moves_between_tiers(tmp_path):
    """--dynamic_tables beside --embedding_memory_budget_gb: table 1 dynamic (32 rows for its 40 ids,
    K = 2: admitting, evicting and refusing) in memory, tables 0 and 2 on disk, the budget counting
    the dynamic table's rows, slots and id map. The run equals the same run in memory bit for bit;
    each one's step-12 checkpoint resumed in the other tier ends as both (step 24)."""
    dynamic = "--dynamic_tables=1:32:2"
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    memory_out = train(memory, dynamic, "--checkpoint_every_n_steps=12").stdout
    disk_out = train(disk, dynamic, *tiered(tmp_path / "store"), "--checkpoint_every_n_steps=12").stdout
    assert set(disk_units(disk_out)) == {(0, 0), (0, 2)} and disk_units(memory_out) == {}, disk_out
    assert re.search(r"\n0\s+1\s+dynamic\s.*\smemory\s", disk_out), disk_out
    assert_same_run_folders(disk, memory)
    last = [r for r in log_records(disk / "log.json") if r["kind"] == "step"][-1]
    assert last["embedding/table_1/evicted"] > 0 and last["embedding/table_1/refused"] > 0 and last["cache_hit_rate"] < 1

    to_disk = train(tmp_path / "to_disk", dynamic, *tiered(tmp_path / "store_2"),
                    f"--restore_checkpoint_path={memory / 'ckpt' / 'ckpt-12'}", log=False).stdout
    from_disk = train(tmp_path / "from_disk", dynamic, f"--restore_checkpoint_path={disk / 'ckpt' / 'ckpt-12'}",
                      log=False).stdout
    assert set(disk_units(to_disk)) == {(0, 0), (0, 2)} and disk_units(from_disk) == {}, to_disk
    assert "resuming at batch 12" in to_disk and "resuming at batch 12" in from_disk, from_disk
    for out in ("to_disk", "from_disk"):
        assert_same_checkpoint(tmp_path / out / "ckpt", memory / "ckpt" / "ckpt-24")
    assert os.listdir(tmp_path / "store") == [] and os.listdir(tmp_path / "store_2") == []


@pytest.mark.slow
def test_two_ranks_dynamic_hash_shards_beside_row_shards_on_disk_equal_memory(tmp_path):
    """At 2 Gloo ranks: table 1 dynamic in 2 hash shards (16 rows each, one per rank, evicting), tables
    0 and 2 in row shards on disk on both ranks: the same checkpoint as in memory, bit for bit."""
    args = [ROW_SLICES, "--dynamic_tables=1:32:2:lru:0:2", "--max_steps=8"]
    memory = train(tmp_path / "memory", *args, ranks=2, log=False).stdout
    disk = train(tmp_path / "disk", *args, *tiered(tmp_path / "store"), ranks=2, log=False).stdout
    assert set(disk_units(disk)) == {(0, 0), (1, 0), (0, 2), (1, 2)} and disk_units(memory) == {}, disk
    assert_same_checkpoint(tmp_path / "disk" / "ckpt", tmp_path / "memory" / "ckpt")
    saved = checkpoint.read_tensor(str(tmp_path / "disk" / "ckpt"), "embedding/table_1/shard_1/totals")
    assert saved[0, 1] > 0   # evictions
    assert os.listdir(tmp_path / "store") == []


def test_budget_too_small_and_missing_store_are_one_error_line(tmp_path):
    line = one_error(one_process("dlrm.py", *MODEL, *DATA, "--embedding_memory_budget_gb=0.00001",
                                 f"--embedding_store_path={tmp_path}"), 2)
    assert line.startswith("error: --embedding_memory_budget_gb=1e-05: ") and "the smallest plan needs 90048 bytes" \
        in line, line
    missing = tmp_path / "missing"
    line = one_error(one_process("dlrm.py", *MODEL, *DATA, BUDGET, f"--embedding_store_path={missing}"), 2)
    assert f"--embedding_store_path={missing}" in line and "no such directory" in line, line


def test_store_deleted_while_training_and_a_second_run_on_the_store(tmp_path):
    """A second run on the store of a running one exits 2; the store's files deleted under the
    first end it with one error line (exit 1), its last checkpoint intact."""
    store, ckpt, log = tmp_path / "store", tmp_path / "ckpt", tmp_path / "first.log"
    args = ["dlrm.py", *MODEL, *DATA, "--synthetic_rows=1280000", *tiered(store)]
    with open(log, "w") as out:
        first = subprocess.Popen([*PYTHON, *args, "--checkpoint_every_n_steps=10",
                                  f"--save_checkpoint_path={ckpt}"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (ckpt / "latest").exists() or first.poll() is not None, 120, "the first checkpoint")
        assert first.poll() is None
        files = sorted(os.listdir(store))
        assert len(files) == 2 and all(f.endswith(".bin") for f in files), files

        line = one_error(one_process(*args, "--max_steps=2"), 2)
        assert "another run" in line and str(store) in line, line

        for f in files:
            os.remove(store / f)
        code = first.wait(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    with open(log) as f:
        output = f.read()
    assert code == 1 and "Traceback" not in output, output[-3000:]
    errors = error_lines(output)
    assert len(errors) == 1 and "was deleted during the run" in errors[0], output[-3000:]
    assert any(str(store / f) in errors[0] for f in files), errors
    assert os.listdir(store) == []

    evaluated = succeeded(one_process("dlrm.py", *MODEL, "--mode=eval", "--synthetic_eval_rows=500",
                                      f"--restore_checkpoint_path={ckpt}"))
    assert "restored" in evaluated.stdout and "auc" in evaluated.stdout
