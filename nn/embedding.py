"""Embedding tables: one float32 table per categorical feature, read sparsely."""
from typing import List, Sequence

import tensorflow as tf

from nn.initializers import table_uniform


class EmbeddingTables(tf.Module):
    """DLRM's sparse arch: F tables; ids list of F [B] -> list of F [B, D_f] float32.

    The trainer differentiates with respect to the returned rows and updates only those rows.

    >>> tables = EmbeddingTables([1000, 20], [16, 16], seed=(1, 100))
    >>> [e.shape for e in tables([tf.constant([3, 7]), tf.constant([0, 19])])]
    [TensorShape([2, 16]), TensorShape([2, 16])]
    """

    def __init__(self, cardinalities: Sequence[int], dims: Sequence[int], seed, name="embedding"):
        super().__init__(name=name)
        self.tables = [tf.Variable(table_uniform(rows, dim, (seed[0], seed[1] + f)), name=f"{name}/table_{f}")
                       for f, (rows, dim) in enumerate(zip(cardinalities, dims))]
        self._lookup = tf.function(self._lookup_impl, jit_compile=True)

    def __call__(self, ids: List[tf.Tensor], training: bool = False) -> List[tf.Tensor]:
        """Training: one XLA-compiled function for all gathers (faster on large batches);
        otherwise plain gathers (lower latency on small batches; they reject bad ids themselves)."""
        if not training:
            return self._gather(ids)
        rows, id_range = self._lookup(list(ids))
        # XLA clamps out-of-range gathers silently: check the ids' range instead (one [F, 2] test).
        cardinalities = tf.constant([int(t.shape[0]) for t in self.tables], id_range.dtype)
        in_range = tf.logical_and(id_range[:, 0] >= 0, id_range[:, 1] < cardinalities)
        check = tf.debugging.Assert(tf.reduce_all(in_range), [
            "embedding ids out of range [0, cardinality) in features (0-based):",
            tf.where(tf.logical_not(in_range))[:, 0], "min/max ids:", id_range, "cardinalities:", cardinalities],
            summarize=64)
        with tf.control_dependencies([check]):
            return [tf.identity(r) for r in rows]

    def _gather(self, ids):
        return [tf.gather(table, i) for table, i in zip(self.tables, ids)]

    def _lookup_impl(self, ids):
        rows = self._gather(ids)
        id_range = tf.stack([tf.stack([tf.reduce_min(i), tf.reduce_max(i)]) for i in ids])
        return rows, id_range
