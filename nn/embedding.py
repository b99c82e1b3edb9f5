"""Embedding tables: one float32 table per categorical feature, read sparsely."""
from typing import List, Sequence

import tensorflow as tf

from nn.initializers import table_uniform


class EmbeddingTables(tf.Module):
    """DLRM's sparse arch: F tables; ids list of F [B] -> list of F [B, D_f] float32.

    Lookups read the variable with a gather, so gradients are IndexedSlices over the looked-up
    rows only and an optimizer step touches nothing else.

    >>> tables = EmbeddingTables([1000, 20], [16, 16], seed=(1, 100))
    >>> [e.shape for e in tables([tf.constant([3, 7]), tf.constant([0, 19])])]
    [TensorShape([2, 16]), TensorShape([2, 16])]
    """

    def __init__(self, cardinalities: Sequence[int], dims: Sequence[int], seed, name="embedding"):
        super().__init__(name=name)
        self.tables = [tf.Variable(table_uniform(rows, dim, (seed[0], seed[1] + f)), name=f"{name}/table_{f}")
                       for f, (rows, dim) in enumerate(zip(cardinalities, dims))]

    def __call__(self, ids: List[tf.Tensor]) -> List[tf.Tensor]:
        return [tf.gather(table, i) for table, i in zip(self.tables, ids)]
