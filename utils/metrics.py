"""Exact evaluation metrics over every sample (NumPy)."""
from typing import Callable, Optional, Sequence

import numpy as np


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC: the probability that a random positive scores above a random negative,
    ties counting one half (Mann-Whitney U with average ranks). NaN if a class is absent."""
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    # Average 1-based rank of each distinct score: end of its run minus half the run's extra length.
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0
    rank_sum = avg_rank[inverse][labels].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def thresholded_auc(labels: np.ndarray, logits: np.ndarray, num_thresholds: int) -> float:
    """The reference's approximate ROC AUC (Keras `AUC(num_thresholds, curve="ROC",
    summation_method="interpolation", from_logits=True)`): true and false positive rates of
    p = sigmoid(logits) > t at the N thresholds t_i = i/(N-1) (t_0 just below 0, t_{N-1} just above
    1), joined by trapezoids. labels, logits: [n]. NaN if a class is absent."""
    labels = np.asarray(labels).astype(bool).ravel()
    p = np.exp(-np.logaddexp(0.0, -np.asarray(logits, dtype=np.float64).ravel()))
    # The highest i with p > t_i (0 for p = 0): every sample counts as positive at thresholds 0..i.
    highest = np.maximum(np.ceil(p * (num_thresholds - 1)) - 1, 0).astype(np.int64)
    rates = []
    for cls in (labels, ~labels):
        if not cls.any():
            return float("nan")
        counts = np.bincount(highest[cls], minlength=num_thresholds)
        rates.append(np.cumsum(counts[::-1])[::-1] / cls.sum())   # [N]: rate above each threshold
    tpr, fpr = rates
    return float(np.sum((fpr[:-1] - fpr[1:]) * (tpr[:-1] + tpr[1:]) / 2.0))


def log_loss(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross-entropy computed stably from logits: softplus(z) - y * z."""
    y = np.asarray(labels, dtype=np.float64).ravel()
    z = np.asarray(logits, dtype=np.float64).ravel()
    return float(np.mean(np.logaddexp(0.0, z) - y * z))


def output_figures(logits: np.ndarray, labels: np.ndarray, heads: Optional[Sequence[str]] = None,
                   scores: Optional[Sequence[str]] = None,
                   more: Optional[Callable[[int, np.ndarray, np.ndarray], dict]] = None) -> dict:
    """The figures of a model's outputs, logits and labels [n, H] (H = len(heads), or 1 without
    heads): per output by its score, "auc" (default: a logit of a binary label: "auc", "logloss",
    and `more(h, labels[:, h], logits[:, h])`'s) or "rmse" (a value: its root mean squared error
    against the label), named "<head>_<figure>" for a model with heads ("click_auc"); "auc" and
    "logloss" are the first "auc" output's (None without one)."""
    scores = list(scores or ["auc"] * (len(heads) if heads else 1))
    metrics = {"auc": None, "logloss": None}
    for h, (head, score) in enumerate(zip(heads or [None], scores)):
        out, y = logits[:, h], labels[:, h]
        if score == "rmse":
            figures = {"rmse": float(np.sqrt(np.mean(np.square(out.astype(np.float64) - y))))}
        else:
            figures = {"auc": roc_auc(y, out), "logloss": log_loss(y, out), **(more(h, y, out) if more else {})}
        metrics.update(figures if head is None else {f"{head}_{k}": v for k, v in figures.items()})
    first = [head for head, score in zip(heads or [], scores) if score == "auc"][:1]
    if first:
        metrics.update(auc=metrics[f"{first[0]}_auc"], logloss=metrics[f"{first[0]}_logloss"])
    return metrics
