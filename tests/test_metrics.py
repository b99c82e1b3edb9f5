"""Exact AUC (ties included) against a brute-force pairwise count; logloss against its formula."""
import math

import numpy as np
import pytest

from utils.metrics import log_loss, roc_auc


def brute_force_auc(labels, scores):
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_pairwise_count_with_ties(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, 300)
    scores = rng.integers(0, 12, 300) / 4.0    # many ties
    assert roc_auc(labels, scores) == pytest.approx(brute_force_auc(labels, scores), abs=1e-12)


def test_auc_known_values():
    assert roc_auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert roc_auc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
    assert roc_auc([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5]) == 0.5
    assert roc_auc([0, 1, 1], [0.2, 0.1, 0.3]) == 0.5
    assert math.isnan(roc_auc([1, 1], [0.1, 0.2]))


def test_log_loss_from_logits():
    labels = np.array([1, 0, 1, 0])
    logits = np.array([2.0, -1.0, -3.0, 40.0])
    p = 1 / (1 + np.exp(-logits[:3]))
    expected_first3 = -(np.log(p[0]) + np.log(1 - p[1]) + np.log(p[2]))
    # The 4th term (y=0, z=40) is log(1 + e^40) ~= 40, computed without overflow or log(0).
    assert log_loss(labels, logits) == pytest.approx((expected_first3 + 40.0) / 4, rel=1e-9)
