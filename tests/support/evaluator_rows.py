"""The evaluator tests' rows: each rank's own logits (many tied), labels and oracle logits, and
their batches as dataloading.batches.prefetched yields them (the last padded with rows that must
not count)."""
import numpy as np
import tensorflow as tf

BATCH = 16


def rank_rows(rank: int):
    """Rank r's real rows: (logits, labels, oracle logits), float32; the logits on a 0.25 grid, so
    many tie."""
    rng = np.random.default_rng(rank)
    n = 37 + 11 * rank
    logits = np.round(rng.normal(size=n) * 4) / 4
    labels = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return logits.astype(np.float32), labels, rng.normal(size=n).astype(np.float32)


def batches(logits, labels, oracle):
    """Batches as dataloading.batches.prefetched yields them, the logits in the numerical column
    (the test's predict returns it); the last one padded with rows that must not count."""
    def padded(x, start, fill):
        part = x[start:start + BATCH]
        return tf.constant(np.concatenate([part, np.full(BATCH - len(part), fill, np.float32)]))

    for start in range(0, len(logits), BATCH):
        yield (padded(logits, start, 99.0)[:, None], (), padded(labels, start, 1.0), padded(oracle, start, -99.0),
               tf.constant(min(BATCH, len(logits) - start), tf.int32))
