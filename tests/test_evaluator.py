"""Evaluation gathers the (logit, label[, oracle]) columns onto rank 0 only, by `Collectives.gather`
(no pickled objects), and its AUC and logloss equal a brute-force reference over every real row;
the oracle's metrics only when asked for (synthetic data)."""
import json

import numpy as np
import pytest

from nn.evaluator import evaluate
from parallel_embedding.collectives import SingleProcess
from tests.support.horovod_run import horovodrun
from tests.support.evaluator_rows import batches, rank_rows


def reference_metrics(logits, labels):
    """AUC over every (positive, negative) pair, ties counting one half; mean cross-entropy."""
    pos, neg = logits[labels == 1].astype(np.float64), logits[labels == 0].astype(np.float64)
    auc = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (pos.size * neg.size)
    p = 1 / (1 + np.exp(-logits.astype(np.float64)))
    logloss = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    return auc, logloss


def predict(numerical, categorical):
    return numerical[:, 0]


class NoPickles(SingleProcess):
    def allgather_object(self, obj, name):
        raise AssertionError(f"{name}: evaluation must not gather Python objects")


@pytest.mark.parametrize("oracle", [True, False])
def test_one_process(oracle):
    logits, labels, oracle_logits = rank_rows(0)
    metrics = evaluate(predict, batches(logits, labels, oracle_logits), NoPickles(), oracle=oracle)
    auc, logloss = reference_metrics(logits, labels)
    assert metrics["samples"] == len(logits)
    assert metrics["auc"] == pytest.approx(auc, abs=1e-12) and metrics["logloss"] == pytest.approx(logloss, rel=1e-9)
    if oracle:
        assert (metrics["oracle_auc"], metrics["oracle_logloss"]) == pytest.approx(
            reference_metrics(oracle_logits, labels), rel=1e-9)
    else:
        assert not any(k.startswith("oracle") for k in metrics)


@pytest.mark.parametrize("ranks", [1, 2])
def test_gloo_ranks_gather_onto_rank_0(ranks):
    out = horovodrun(ranks, ["tests/support/evaluator_worker.py"], timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in out.stdout.splitlines()
                      if "RESULT " in line), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(ranks))
    every = [rank_rows(r) for r in range(ranks)]
    logits, labels, oracle = (np.concatenate(x) for x in zip(*every))
    np.testing.assert_array_equal(results[0]["gathered"], np.stack([logits, labels], axis=1))
    assert all(r["gathered"] == [] for r in results[1:])   # nothing sent to the other ranks
    auc, logloss = reference_metrics(logits, labels)
    oracle_auc, oracle_logloss = reference_metrics(oracle, labels)
    for r in results:
        m = r["metrics"]
        assert m["samples"] == len(logits)
        assert m["auc"] == pytest.approx(auc, abs=1e-12) and m["logloss"] == pytest.approx(logloss, rel=1e-9)
        assert (m["oracle_auc"], m["oracle_logloss"]) == pytest.approx((oracle_auc, oracle_logloss), rel=1e-9)
