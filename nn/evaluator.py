"""Evaluation (exact metrics over every sample) and inference latency measurement."""
import time
from typing import Callable, Dict, Iterable, Optional, Sequence

import numpy as np
import tensorflow as tf

from utils.metrics import log_loss, roc_auc, thresholded_auc


def evaluate(predict: Callable, batches: Iterable, comm, auc_thresholds: Optional[int] = None) -> Dict[str, float]:
    """Runs `predict(numerical, categorical) -> logits` over this rank's part of every batch and
    returns AUC and logloss over all ranks' real rows (and those of the ground-truth oracle
    logits shipped with the batches), computed once on rank 0 and shared with every rank; with
    `auc_thresholds`, also the reference's approximate AUC (`auc_thresholded`)."""
    logits, labels, oracle = [], [], []
    for numerical, categorical, y, oracle_logits, valid in batches:
        n = int(valid)
        logits.append(predict(numerical, categorical).numpy()[:n])
        labels.append(y.numpy()[:n])
        oracle.append(oracle_logits.numpy()[:n])
    local = tuple(np.concatenate(x) for x in (logits, labels, oracle))
    gathered = comm.allgather_object(local, "evaluation_predictions")
    metrics = None
    if comm.rank == 0:   # AUC and logloss do not depend on the order of the samples
        logits, labels, oracle = (np.concatenate(x) for x in zip(*gathered))
        metrics = {"auc": roc_auc(labels, logits), "logloss": log_loss(labels, logits),
                   "oracle_auc": roc_auc(labels, oracle), "oracle_logloss": log_loss(labels, oracle),
                   "samples": int(labels.size)}
        if auc_thresholds:
            metrics["auc_thresholded"] = thresholded_auc(labels, logits, auc_thresholds)
    return comm.broadcast_object(metrics, "evaluation_metrics")


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
