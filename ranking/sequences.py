"""Sequence features' ids: a user's history, most recent id last, at most L ids a sample kept.

Shapes: `b` samples, `L` a feature's maximum length (FeatureConfig input_shape (batch, L)).

    kept, truncated = recent_ids(ids, L)      ids ragged [b, None] or dense [b, k] (ids < 0 padding)
                                              -> ragged [b, None], each row its last min(len, L) ids;
                                              truncated: the ids dropped (int64 [])
    positions = by_position(kept, L)          -> ragged [L b, None]: row j b + i holds sample i's
                                              j-th kept id, or nothing past its length (the L inputs
                                              of b rows a table looks up: HybridEmbedding)
    mask = SequenceMask(L)(ids)               [b, L] bool: True at each sample's kept positions

A sequence longer than L keeps its most recent L ids (the last ones); an empty one is valid (all
positions masked, rows zero).
"""
from typing import Tuple, Union

import keras
import tensorflow as tf

from utils.errors import ConfigError


def recent_ids(ids: Union[tf.Tensor, tf.RaggedTensor], max_length: int,
               where: str = "sequence") -> Tuple[tf.RaggedTensor, tf.Tensor]:
    """(each sample's last min(length, L) ids as ragged [b, None], how many ids were dropped).
    A dense [b, k] input's ids < 0 are padding, wherever they are; a ragged input has none.
    `where` names the feature in the error of an input of another rank."""
    if not isinstance(ids, tf.RaggedTensor):
        ids = _dense(ids, where)
        ids = tf.ragged.boolean_mask(ids, ids >= 0)
    lengths = ids.row_lengths()
    dropped = tf.maximum(lengths - max_length, 0)
    kept = tf.ragged.range(ids.row_starts() + dropped, ids.row_limits())
    return (tf.RaggedTensor.from_row_splits(tf.gather(ids.values, kept.values), kept.row_splits),
            tf.reduce_sum(dropped))


def _dense(ids, where: str) -> tf.Tensor:
    """A sequence's dense ids [b, k]; a ConfigError naming `where` for another rank."""
    ids = tf.convert_to_tensor(ids)
    if ids.shape.rank != 2:
        raise ConfigError(f"{where}: a sequence's ids are ragged [b, None] or dense [b, k], got shape {ids.shape}")
    return ids


def by_position(kept: tf.RaggedTensor, max_length: int) -> tf.RaggedTensor:
    """Ragged [b, None] of at most L ids a row -> ragged [L b, None] of at most one id a row,
    position-major: row j b + i holds sample i's j-th id (none past its length)."""
    mask = tf.transpose(tf.sequence_mask(kept.row_lengths(), max_length))   # [L, b]
    padded = tf.transpose(kept.to_tensor(shape=[None, max_length]))          # [L, b]
    return tf.RaggedTensor.from_row_lengths(tf.boolean_mask(padded, mask),
                                            tf.reshape(tf.cast(mask, tf.int64), [-1]))


class SequenceMask(keras.layers.Layer):
    """A sequence feature's ids (ragged [b, None], or dense [b, k] with ids < 0 as padding) ->
    [b, L] bool, True at the positions HybridEmbedding fills (the most recent L ids, in order)."""

    def __init__(self, max_length: int, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
            raise ConfigError(f"SequenceMask: max_length must be a positive integer, got {max_length!r}")
        self.max_length = max_length

    def call(self, ids):
        if isinstance(ids, tf.RaggedTensor):
            lengths = ids.row_lengths()
        else:   # static shapes (an XLA-compiled dense part is fed the ids padded)
            lengths = tf.reduce_sum(tf.cast(_dense(ids, f"layer {self.name!r}") >= 0, tf.int64), axis=1)
        return tf.sequence_mask(tf.minimum(lengths, self.max_length), self.max_length)

    def compute_output_spec(self, ids):
        return keras.KerasTensor((None, self.max_length), "bool")

    def get_config(self):
        return dict(super().get_config(), max_length=self.max_length)
