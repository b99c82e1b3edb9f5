"""Batch streams over a random-access dataset, with a deterministic order and prefetching.

Training batch `k` of epoch `e` is dataset batch `order_e[k]`, where `order_e` is a
permutation drawn from (seed, e): resuming at any step reproduces the same stream.
Evaluation reads every sample in order, the last partial batch included.
"""
from typing import Iterator

import numpy as np
import tensorflow as tf


def epoch_order(seed: int, epoch: int, num_batches: int) -> np.ndarray:
    """Batch order of one training epoch (a permutation of range(num_batches))."""
    return np.random.default_rng([seed, epoch]).permutation(num_batches)


def train_batches(dataset, batch_size: int, steps_per_epoch: int, seed: int, start_step: int,
                  end_step: int) -> Iterator[dict]:
    """Training batches for global steps [start_step, end_step)."""
    for step in range(start_step, end_step):
        epoch, k = divmod(step, steps_per_epoch)
        if k == 0 or step == start_step:
            order = epoch_order(seed, epoch, steps_per_epoch)
        yield dataset.batch("train", int(order[k]) * batch_size, batch_size)


def eval_batches(dataset, rows: int, batch_size: int) -> Iterator[dict]:
    """Every evaluation sample in order; the last batch may be smaller."""
    for start in range(0, rows, batch_size):
        yield dataset.batch("eval", start, min(batch_size, rows - start))


def prefetched(batches: Iterator[dict], dataset, depth: int = 2) -> tf.data.Dataset:
    """Wraps a batch iterator over `dataset` in tf.data with background prefetching.

    Elements: (numerical [b, n] float32, tuple of F ids [b], labels [b] float32,
    oracle_logits [b] float32).
    """
    ids = tf.TensorSpec([None], tf.as_dtype(dataset.id_dtype))
    signature = (tf.TensorSpec([None, dataset.num_numerical], tf.float32),
                 tuple([ids] * len(dataset.cardinalities)),
                 tf.TensorSpec([None], tf.float32), tf.TensorSpec([None], tf.float32))

    def generate():
        for b in batches:
            yield b["numerical"], tuple(b["categorical"]), b["labels"], b["oracle_logits"]

    return tf.data.Dataset.from_generator(generate, output_signature=signature).prefetch(depth)
