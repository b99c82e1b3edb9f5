"""Dynamic tables at 2 Gloo ranks (dlrm.py under horovodrun): a table in hash shards spread over
the ranks, another whole on one rank, equal one process holding the same shards on the same
global batches (per-step losses; the tables' ids, admission, eviction and counts exactly, their
values within float tolerance), with model-parallel and with data-parallel input (and the table in
3 hash shards under eviction, rank 0 owning two), and a checkpoint written at 2 ranks resumes at 1
rank as the uninterrupted run. Each hash shard's owner receives only its shards' ids (routed:
tests/test_dynamic_routing.py counts the traffic)."""
import json

import numpy as np
import pytest

from storage import checkpoint
from tests.support.horovod_run import horovodrun
from tests.support.runs import MODEL, DATA, STEPS, one_process, records, succeeded

# Table 0 (300 ids) in 2 hash shards of 30 rows, LRU with K = 2 (evicting); table 3 (30 ids) whole, LFU.
DYNAMIC = ["--dynamic_tables=0:60:2:lru:0:2,cat_3:30:1:lfu"]
EXACT = ("ids", "totals", "counts", "candidates", "updated_at", "iterations")   # the maps' state: bit for bit


def _tensors(path):
    return {n: checkpoint.read_tensor(path, n) for n in checkpoint.read_manifest(path)["tensors"]}


def assert_same_tables(got, want, prefix="embedding/", present=("table_0/shard_1/ids", "table_3/counts")):
    """Checkpoints `got` and `want` (name -> array) hold the same tables under `prefix`, `present`
    among them: the maps' state (EXACT) bit for bit, the values within float tolerance."""
    names = sorted(n for n in want if n.startswith(prefix))
    assert names == sorted(n for n in got if n.startswith(prefix))
    assert all(prefix + n in names for n in present)
    for name in names:
        if name.rsplit("/", 1)[-1] in EXACT:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        else:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The uninterrupted one-process run: its checkpoints at steps 6 and 12 and its log, `<one>.json`."""
    one = tmp_path_factory.mktemp("dynamic") / "one"
    succeeded(one_process("dlrm.py", *MODEL, *DATA, *DYNAMIC, f"--log_path={one}.json",
                          f"--save_checkpoint_path={one}", "--checkpoint_every_n_steps=6"))
    return one


@pytest.mark.slow
def test_two_ranks_equal_one_process_and_resume_at_one(tmp_path, one):
    two, resumed = (tmp_path / n for n in ("two", "resumed"))
    run = succeeded(horovodrun(2, ["dlrm.py", *MODEL, *DATA, *DYNAMIC, "--max_steps=6", f"--log_path={two}.json",
                                   f"--save_checkpoint_path={two}"]))
    want = records(f"{one}.json")
    got = records(f"{two}.json")
    for s in range(1, 7):
        assert got["step"][s] == pytest.approx(want["step"][s], rel=1e-5, abs=1e-6), s
    assert_same_tables(_tensors(str(two)), _tensors(f"{one}/ckpt-6"))
    assert "embedding/table_0: " in run.stdout and " evicted, " in run.stdout
    # the counts on the progress line are the table's over both ranks: as one process's
    lines = [json.loads(line) for line in open(f"{one}.json")]
    one_counts = {k: v for r in lines if r["kind"] == "step" and r["step"] == 6 for k, v in r.items() if "table_" in k}
    two_counts = {k: v for r in map(json.loads, open(f"{two}.json")) if r["kind"] == "step" and r["step"] == 6
                  for k, v in r.items() if "table_" in k}
    assert one_counts == two_counts and one_counts["embedding/table_0/evicted"] > 0

    succeeded(one_process("dlrm.py", *MODEL, *DATA, *DYNAMIC, f"--restore_checkpoint_path={two}",
                          f"--log_path={resumed}.json", f"--save_checkpoint_path={resumed}"))
    got = records(f"{resumed}.json")
    for s in range(7, STEPS + 1):
        assert got["step"][s] == pytest.approx(want["step"][s], rel=1e-5, abs=1e-6), s
    assert_same_tables(_tensors(str(resumed)), _tensors(f"{one}/ckpt-{STEPS}"))


@pytest.mark.slow
def test_two_ranks_with_data_parallel_input_equal_one_process(tmp_path, one):
    """Each rank reads its local batch of every feature; the ids reach the shards' owners by the
    all-to-all of ids first."""
    two = tmp_path / "two"
    succeeded(horovodrun(2, ["dlrm.py", *MODEL, *DATA, *DYNAMIC, "--data_parallel_input", "--max_steps=6",
                             f"--log_path={two}.json", f"--save_checkpoint_path={two}"]))
    want, got = records(f"{one}.json"), records(f"{two}.json")
    for s in range(1, 7):
        assert got["step"][s] == pytest.approx(want["step"][s], rel=1e-5, abs=1e-6), s
    assert_same_tables(_tensors(str(two)), _tensors(f"{one}/ckpt-6"))


@pytest.mark.slow
def test_three_hash_shards_at_two_ranks_under_eviction_equal_one_process(tmp_path):
    """Table 0 in 3 hash shards (rank 0 owns two), evicting, data-parallel input: each owner
    receives only its shards' ids (routed), and the maps equal one process's bit for bit."""
    dynamic = ["--dynamic_tables=0:60:2:lru:0:3,cat_3:30:1:lfu"]
    one, two = tmp_path / "one", tmp_path / "two"
    succeeded(one_process("dlrm.py", *MODEL, *DATA, *dynamic, "--max_steps=6", f"--log_path={one}.json",
                          f"--save_checkpoint_path={one}"))
    succeeded(horovodrun(2, ["dlrm.py", *MODEL, *DATA, *dynamic, "--data_parallel_input", "--max_steps=6",
                             f"--log_path={two}.json", f"--save_checkpoint_path={two}"]))
    want, got = records(f"{one}.json"), records(f"{two}.json")
    for s in range(1, 7):
        assert got["step"][s] == pytest.approx(want["step"][s], rel=1e-5, abs=1e-6), s
    assert_same_tables(_tensors(str(two)), _tensors(str(one)), present=("table_0/shard_2/ids", "table_3/counts"))
    counts = [r for r in map(json.loads, open(f"{one}.json")) if r["kind"] == "step" and r["step"] == 6]
    assert counts[0]["embedding/table_0/evicted"] > 0
