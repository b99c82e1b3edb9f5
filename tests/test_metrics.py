"""Exact AUC (ties included) against a brute-force pairwise count; logloss against its formula."""
import math

import numpy as np
import pytest

from utils.metrics import log_loss, roc_auc, thresholded_auc
from tests.support.references import direct_thresholded_auc


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


@pytest.mark.parametrize("num_thresholds", [2, 3, 10, 200, 8000])
@pytest.mark.parametrize("seed", range(3))
def test_thresholded_auc_matches_the_approximation_written_out(seed, num_thresholds):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, 2000)
    logits = rng.normal(size=2000) * 2 + labels          # informative scores
    logits[:50] = 60.0                                    # p = 1 and p = 0 after rounding
    logits[50:100] = -800.0
    got = thresholded_auc(labels, logits, num_thresholds)
    assert got == pytest.approx(direct_thresholded_auc(labels, logits, num_thresholds), abs=1e-12)


def test_thresholded_auc_is_the_keras_metric_of_the_reference():
    import tensorflow as tf
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 2, 5000)
    logits = (rng.normal(size=5000) + labels).astype(np.float32)
    for n in (10, 200, 8000):
        keras_auc = tf.keras.metrics.AUC(num_thresholds=n, curve="ROC", summation_method="interpolation",
                                         from_logits=True)
        keras_auc.update_state(labels, logits)
        assert thresholded_auc(labels, logits, n) == pytest.approx(float(keras_auc.result()), abs=1e-5), n


def test_thresholded_auc_approaches_the_exact_auc():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 2, 20000)
    logits = rng.normal(size=20000) + labels
    exact = roc_auc(labels, logits)
    errors = [abs(thresholded_auc(labels, logits, n) - exact) for n in (10, 100, 8000)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-4
    assert math.isnan(thresholded_auc([1, 1], [0.1, 0.2], 100))
