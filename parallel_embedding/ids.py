"""One feature's ids as the tables read them: flat ids with the sample each belongs to and its
combiner weight (`FlatIds`, `flatten_ids`), the combining of their rows into the samples' and its
gradient (`combine`, `spread`), and the range check every lookup runs first (`check_ids`)."""
from typing import NamedTuple, Optional, Sequence, Union

import tensorflow as tf


class FlatIds(NamedTuple):
    """One feature's ids for n samples (batch rows) as K ids: one-hot (K = n, `sample` None) or multi-hot."""
    ids: tf.Tensor                     # [K]
    sample: Optional[tf.Tensor]        # [K] the sample each id belongs to
    weights: Optional[tf.Tensor]       # [K] its combiner weight (None: 1)
    num_samples: Optional[tf.Tensor]   # n


def flatten_ids(ids: Union[tf.Tensor, tf.RaggedTensor], combiner: str) -> FlatIds:
    if not isinstance(ids, tf.RaggedTensor):
        return FlatIds(ids, None, None, None)
    sample = ids.value_rowids()
    weights = None
    if combiner == "mean":
        lengths = tf.cast(tf.maximum(ids.row_lengths(), 1), tf.float32)
        weights = tf.gather(1.0 / lengths, sample)
    return FlatIds(ids.values, sample, weights, ids.nrows())


def combine(gathered: tf.Tensor, flat: FlatIds) -> tf.Tensor:
    """[K, w] rows of the K ids -> [n, w] rows of the n samples (the combiner)."""
    if flat.sample is None:
        return gathered
    if flat.weights is not None:
        gathered = gathered * flat.weights[:, None]
    return tf.math.unsorted_segment_sum(gathered, flat.sample, flat.num_samples)


def spread(grad: tf.Tensor, flat: FlatIds) -> tf.Tensor:
    """The gradient of `combine`: [n, w] -> [K, w]."""
    if flat.sample is None:
        return grad
    grad = tf.gather(grad, flat.sample)
    return grad if flat.weights is None else grad * flat.weights[:, None]


def num_samples(ids) -> tf.Tensor:
    return tf.cast(ids.nrows(), tf.int32) if isinstance(ids, tf.RaggedTensor) else tf.shape(ids)[0]


def check_ids(features: Sequence[Union[int, str]], ids: Sequence[tf.Tensor], cardinalities: Sequence[int]) -> list:
    """Assertions that every id of `features` (their flat ids and cardinalities, in the same
    order) is in [0, cardinality), to run before any gather: XLA clamps out-of-range gathers
    silently, a GPU gather returns zeros, and a row shard skips ids outside its range by design.
    `features`: their indices, or names where one has none (ids a model computes)."""
    if not features:
        return []
    named = any(isinstance(f, str) for f in features)
    id_range = tf.stack([tf.stack([tf.reduce_min(tf.cast(i, tf.int64)), tf.reduce_max(tf.cast(i, tf.int64))])
                         for i in ids])
    cardinalities = tf.constant(list(cardinalities), tf.int64)
    in_range = tf.logical_and(id_range[:, 0] >= 0, id_range[:, 1] < cardinalities)
    return [tf.debugging.Assert(tf.reduce_all(in_range), [
        "embedding ids out of range [0, cardinality) in features (0-based):",
        tf.boolean_mask(tf.constant([str(f) for f in features]) if named else tf.constant(list(features), tf.int64),
                        tf.logical_not(in_range)),
        "min/max ids:", id_range, "cardinalities:", cardinalities], summarize=64)]
