"""Hybrid parallelism at 2 and 3 Gloo ranks equals one process on the same global batches: the
run's step (run.run_model.RunTrainer) over the built-in DLRM / DCNv2 (examples/dlrm.py, dcnv2.py).

Each case (one-hot or multi-hot ids) runs in `tests/support/multirank_worker.py` under horovodrun:
forward logits and the loss at every step, then every variable (table shards, optimizer slots,
dense weights) after several steps, against the single-process model with the same initial
weights, within 1e-5.
"""
import json

import pytest

from tests.support.horovod_run import horovodrun

SMALL = [50, 80, 120, 30]

CASES = {
    2: [
        dict(name="dlrm-basic-sgd", cardinalities=SMALL, dims=[8] * 4, interaction="dot", optimizer="sgd",
             strategy="basic", expect_kinds=["whole"]),
        dict(name="dlrm-balanced-adagrad-dp-input", cardinalities=SMALL, dims=[8] * 4, interaction="dot",
             optimizer="adagrad", strategy="memory_balanced", data_parallel_input=True, expect_kinds=["whole"]),
        dict(name="dcnv2-optimized-adam-columns", cardinalities=SMALL, dims=[8, 16, 4, 8], interaction="cross",
             optimizer="adam", strategy="memory_optimized", column_slice_threshold=600,
             expect_kinds=["column", "whole"]),
        dict(name="dlrm-rows-replicated-adam-dp-input", cardinalities=[2000, 80, 12, 30], dims=[8] * 4,
             interaction="dot", optimizer="adam", row_slice_threshold=4000, data_parallel_threshold=100,
             data_parallel_input=True, expect_kinds=["replicated", "row", "whole"]),
        dict(name="dcnv2-one-table-sgd", cardinalities=[300], dims=[16], interaction="cross", optimizer="sgd",
             expect_kinds=["column"]),
        dict(name="dlrm-multi-hot-rows-replicated-adagrad", cardinalities=[2000, 80, 12, 30], dims=[8] * 4,
             interaction="dot", optimizer="adagrad", row_slice_threshold=4000, data_parallel_threshold=100,
             hotness=[3, 1, 4, 2], combiners=["sum", "sum", "mean", "mean"],
             expect_kinds=["replicated", "row", "whole"]),
        dict(name="dcnv2-multi-hot-columns-adam-dp-input", cardinalities=SMALL, dims=[8, 16, 4, 8],
             interaction="cross", optimizer="adam", column_slice_threshold=600, data_parallel_input=True,
             hotness=[2, 5, 1, 3], combiners=["mean", "sum", "sum", "mean"], expect_kinds=["column", "whole"]),
        dict(name="dlrm-multi-hot-on-one-rank-sgd-dp-input", cardinalities=SMALL, dims=[8] * 4, interaction="dot",
             optimizer="sgd", strategy="basic", data_parallel_input=True, hotness=[3, 1, 1, 1],
             combiners=["sum", "sum", "sum", "sum"], expect_kinds=["whole"]),
    ],
    3: [
        dict(name="dcnv2-basic-adagrad", cardinalities=SMALL, dims=[8, 4, 16, 8], interaction="cross",
             optimizer="adagrad", strategy="basic", expect_kinds=["whole"]),
        dict(name="dlrm-balanced-sgd-columns-dp-input", cardinalities=SMALL, dims=[8] * 4, interaction="dot",
             optimizer="sgd", column_slice_threshold=500, data_parallel_input=True,
             expect_kinds=["column", "whole"]),
        dict(name="dlrm-huge-table-rows-adam", cardinalities=[5000, 40, 12], dims=[8] * 3, interaction="dot",
             optimizer="adam", strategy="memory_optimized", row_slice_threshold=10000,
             data_parallel_threshold=100, expect_kinds=["column", "replicated", "row"]),
        dict(name="dcnv2-two-tables-adam-dp-input", cardinalities=[70, 90], dims=[8, 8], interaction="cross",
             optimizer="adam", data_parallel_input=True, expect_kinds=["column", "whole"]),
        dict(name="dlrm-multi-hot-rows-replicated-adam-dp-input", cardinalities=[5000, 40, 12, 60], dims=[8] * 4,
             interaction="dot", optimizer="adam", row_slice_threshold=10000, data_parallel_threshold=100,
             data_parallel_input=True, hotness=[4, 2, 3, 1], combiners=["mean", "sum", "mean", "sum"],
             expect_kinds=["column", "replicated", "row", "whole"]),
        dict(name="dcnv2-multi-hot-basic-sgd-columns", cardinalities=SMALL, dims=[8, 4, 16, 8], interaction="cross",
             optimizer="sgd", strategy="basic", column_slice_threshold=500, hotness=[3, 3, 1, 2],
             expect_kinds=["column", "whole"]),
    ],
}


@pytest.fixture(scope="module")
def results():
    """Runs each world size's cases in one horovodrun; returns {case name: per-rank results} and
    {world size: the end of its output if it failed}."""
    found, failed = {}, {}
    for np_, cases in CASES.items():
        out = horovodrun(np_, ["tests/support/multirank_worker.py", json.dumps(cases)])
        if out.returncode:
            failed[np_] = f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        for line in out.stdout.splitlines():
            if "RESULT " in line:
                per_rank = json.loads(line.split("RESULT ", 1)[1])
                found[per_rank[0]["case"]] = per_rank
    return found, failed


@pytest.mark.parametrize("np_,case", [(n, c) for n, cases in CASES.items() for c in cases],
                         ids=[f"{n}ranks-{c['name']}" for n, cases in CASES.items() for c in cases])
@pytest.mark.slow
def test_matches_single_process(results, np_, case):
    found, failed = results
    assert case["name"] in found, f"{np_} ranks failed at or before this case:\n{failed.get(np_)}"
    per_rank = found[case["name"]]
    assert [r["rank"] for r in per_rank] == list(range(np_))
    assert all(r["max_error"] <= 1e-5 for r in per_rank), per_rank
