"""Independent NumPy references the tests compare with: ROC AUC by its definition over every
(positive, negative) pair, the dot interaction and the cross network written out, and Keras'
thresholded AUC threshold by threshold."""
import numpy as np


def pairwise_auc(labels, scores) -> float:
    """ROC AUC as its definition: over every (positive, negative) pair, 1 where the positive
    scores higher, 1/2 where they tie; mean. labels, scores: [n]."""
    labels, scores = np.asarray(labels).ravel() > 0.5, np.asarray(scores, np.float64).ravel()
    pos, neg = scores[labels][:, None], scores[~labels][None, :]
    return float(np.mean((pos > neg) + 0.5 * (pos == neg)))


def numpy_dot_interaction(bottom, embeddings):
    """DLRM's dot interaction: bottom [B, D] and F x [B, D] -> [B, D + (F+1)F/2], zero-padded to a
    multiple of 8 columns."""
    vectors = np.stack([bottom] + embeddings, axis=1)            # [B, F+1, D]
    n = vectors.shape[1]
    pairs = [np.sum(vectors[:, i] * vectors[:, j], axis=1) for i in range(n) for j in range(i)]
    out = np.concatenate([bottom, np.stack(pairs, axis=1)], axis=1)
    pad = (-out.shape[1]) % 8
    return np.concatenate([out, np.zeros((out.shape[0], pad))], axis=1)


def numpy_cross(x0, layers):
    """DCNv2's cross network on x0 [B, d]: per layer (matrices, bias), x = x0 (x M.. + bias) + x."""
    x = x0
    for mats, bias in layers:
        h = x
        for m in mats:
            h = h @ m
        x = x0 * (h + bias) + x
    return x


def direct_thresholded_auc(labels, logits, num_thresholds):
    """The reference's approximation written out threshold by threshold: Keras's thresholds
    (epsilon 1e-7 below 0 and above 1), rates of sigmoid(logits) > t, trapezoids."""
    labels = np.asarray(labels, dtype=bool)
    with np.errstate(over="ignore"):   # exp(800) = inf: p = 0
        p = 1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=np.float64)))
    thresholds = [-1e-7] + [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)] + [1 + 1e-7]
    tpr = np.array([np.sum(labels & (p > t)) / labels.sum() for t in thresholds])
    fpr = np.array([np.sum(~labels & (p > t)) / (~labels).sum() for t in thresholds])
    return sum((fpr[i] - fpr[i + 1]) * (tpr[i] + tpr[i + 1]) / 2 for i in range(num_thresholds - 1))
