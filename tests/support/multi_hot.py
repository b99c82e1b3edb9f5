"""Multi-hot test ids: a pure function of (feature, global sample index), like the synthetic data."""
import numpy as np
import tensorflow as tf


def multi_hot_ids(cardinality: int, max_hotness: int, feature: int, start: int, n: int) -> tf.RaggedTensor:
    """Ids of samples [start, start + n): sample i has (3i + feature) % (max_hotness + 1) ids (empty
    rows included), drawn uniformly (duplicates in a row included)."""
    lengths = [(3 * i + feature) % (max_hotness + 1) for i in range(start, start + n)]
    values = [np.random.default_rng([feature, i]).integers(0, cardinality, k) for i, k in
              zip(range(start, start + n), lengths)]
    return tf.RaggedTensor.from_row_lengths(np.concatenate(values + [np.zeros(0, np.int64)]), lengths)
