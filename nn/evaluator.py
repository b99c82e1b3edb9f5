"""Evaluation (exact metrics over every sample) and inference latency measurement."""
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from utils.metrics import log_loss, output_figures, roc_auc, thresholded_auc


def evaluate(predict: Callable, batches: Iterable, comm, oracle: bool = False,
             auc_thresholds: Optional[int] = None, heads: Optional[Sequence[str]] = None,
             scores: Optional[Sequence[str]] = None,
             stopped: Optional[Callable[[int], bool]] = None,
             more: Optional[Callable[[np.ndarray, np.ndarray], Dict[str, float]]] = None) -> Optional[Dict[str, float]]:
    """Runs `predict(numerical, categorical) -> logits` over this rank's part of every batch and
    returns AUC and logloss over all ranks' real rows (with `oracle`, also those of the ground-truth
    oracle logits the batches carry: synthetic data only; with `auc_thresholds`, also the
    reference's approximate AUC, `auc_thresholded`). The columns (logit, label[, oracle]) are
    gathered onto rank 0 alone, which computes the metrics and shares them with every rank.
    A model with `heads` H (its logits, labels and oracle logits [b, H], in the order of `heads`)
    gives each figure per head as "<head>_<figure>" ("click_auc"). `scores`: per output (the
    one, or each head) "auc" (default: a logit of a binary label, the figures above) or "rmse" (a
    value, e.g. a rating: its root mean squared error against the label, "rmse" alone). "auc" and
    "logloss" are the first "auc" output's (None without one): utils.metrics.output_figures.
    `stopped(k)`, asked after the k-th batch by every rank (it may be a collective): whether to
    stop there, returning None. `more(logits, labels)` ([all rows, H] each, on rank 0): figures
    beside these (a model file's metrics), a name of these' kept as these give it."""
    width = len(heads) if heads else 1
    columns = []
    for k, (numerical, categorical, y, oracle_logits, valid) in enumerate(batches, 1):
        n = int(valid)
        parts = [predict(numerical, categorical).numpy()[:n], y.numpy()[:n]]
        parts += [oracle_logits.numpy()[:n]] if oracle else []
        columns.append(np.concatenate([np.reshape(p, [n, width]) for p in parts], axis=1))
        if stopped is not None and stopped(k):
            return None
    local = np.concatenate(columns) if columns else np.zeros([0, (3 if oracle else 2) * width], np.float32)
    gathered = comm.gather(local, "evaluation_columns")   # [all rows, 2 or 3 per head] on rank 0
    metrics = None
    if comm.rank == 0:   # AUC and logloss do not depend on the order of the samples
        def more_of(h, labels, logits):   # output h's figures besides its AUC and logloss
            figures = {}
            if oracle:
                truth = gathered[:, 2 * width + h]
                figures.update(oracle_auc=roc_auc(labels, truth), oracle_logloss=log_loss(labels, truth))
            if auc_thresholds:
                figures["auc_thresholded"] = thresholded_auc(labels, logits, auc_thresholds)
            return figures
        metrics = {"auc": None, "logloss": None, "samples": int(len(gathered))}
        metrics.update(output_figures(gathered[:, :width], gathered[:, width:2 * width], heads, scores, more_of))
        if more is not None:
            metrics.update({k: v for k, v in more(gathered[:, :width], gathered[:, width:2 * width]).items()
                            if k not in metrics})
    return comm.broadcast_object(metrics, "evaluation_metrics")


def printed_metrics(oracle: bool, thresholded: bool, heads: Optional[Sequence[str]] = None,
                    scores: Optional[Sequence[str]] = None, more: Sequence[str] = ()) -> List[str]:
    """The keys of `evaluate`'s figures an evaluation line shows (a model with heads: each head's;
    `scores` as `evaluate`'s; then `more`'s, not already among them)."""
    keys = ["auc", "logloss"] + (["oracle_auc"] if oracle else []) + (["auc_thresholded"] if thresholded else [])
    scores = scores or ["auc"] * (len(heads) if heads else 1)
    per_output = [keys if score == "auc" else ["rmse"] for score in scores]
    shown = per_output[0] if not heads else [f"{head}_{k}" for head, ks in zip(heads, per_output) for k in ks]
    return shown + [k for k in more if k not in shown and k not in ("auc", "logloss")]


def measure_latency(predict: Callable, batch: dict, steps: int, global_batch: int, warmup: int = 5) -> Dict[str, float]:
    """Times `steps` synchronous predictions of one global batch (`batch` is this rank's part);
    latency figures in milliseconds."""
    numerical = tf.constant(batch["numerical"])
    categorical = [tf.constant(c) for c in batch["categorical"]]
    for _ in range(warmup):
        predict(numerical, categorical).numpy()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        predict(numerical, categorical).numpy()
        times.append(time.perf_counter() - t0)
    return latency_figures(times, global_batch)


def latency_figures(times: Sequence[float], batch_size: int, wall_s: float = None) -> Dict[str, float]:
    """Throughput and latency (milliseconds) of requests of `batch_size` samples that took `times`
    seconds each, over `wall_s` seconds in all (default: one after the other)."""
    ms = 1000.0 * np.asarray(times)
    wall_s = float(np.sum(times)) if wall_s is None else wall_s
    return {"batch_size": batch_size, "samples_per_s": batch_size * len(times) / wall_s,
            "mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
            "p90_ms": float(np.percentile(ms, 90)), "p99_ms": float(np.percentile(ms, 99))}


def format_metrics(metrics: Dict[str, float], keys: Sequence[str] = ("auc", "logloss", "oracle_auc")) -> str:
    return " | ".join(f"{k} {metrics[k]:.5f}" for k in keys)
