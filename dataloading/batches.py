"""Per-rank batch streams over a random-access dataset, in a deterministic order, prefetched.

Training batch `k` of epoch `e` is the global batch `order_e[k]`, where `order_e` is a
permutation drawn from (seed, e): resuming at any step, at any world size, reproduces the same
global batches. Each rank reads only its part of a global batch of B samples (`RankInput`):
numericals and labels of its b = B / N rows, and per categorical feature the ids the embedding
layer asks for. Evaluation reads every sample in order; the last batch is padded to a multiple
of N and each element says how many of its rows are real.
"""
import dataclasses
from typing import Iterator, Sequence

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class RankInput:
    """What rank `rank` of `size` reads: per feature "global" (ids of all B rows), "local"
    (ids of its b rows) or "none" (an empty array)."""
    rank: int
    size: int
    features: Sequence[str]

    @classmethod
    def single_process(cls, num_features: int) -> "RankInput":
        return cls(0, 1, ("local",) * num_features)


def epoch_order(seed: int, epoch: int, num_batches: int) -> np.ndarray:
    """Batch order of one training epoch (a permutation of range(num_batches))."""
    return np.random.default_rng([seed, epoch]).permutation(num_batches)


def rank_batch(dataset, split: str, start: int, size: int, view: RankInput) -> dict:
    """This rank's part of the global batch of samples [start, start + size); size % N == 0.

    Returns the dataset's batch dict for the local rows [start + r*b, start + (r+1)*b), with
    "categorical" replaced by the ids `view` asks for.
    """
    b = size // view.size
    batch = dataset.batch(split, start + view.rank * b, b)
    wanted = [f for f, rows in enumerate(view.features) if rows == "global"]
    global_ids = dict(zip(wanted, dataset.categorical(split, start, size, wanted)))
    empty = np.zeros([0], batch["categorical"][0].dtype)
    batch["categorical"] = [batch["categorical"][f] if rows == "local" else global_ids.get(f, empty)
                            for f, rows in enumerate(view.features)]
    return batch


def train_batches(dataset, batch_size: int, steps_per_epoch: int, seed: int, start_step: int,
                  end_step: int, view: RankInput) -> Iterator[dict]:
    """This rank's parts of the training batches for global steps [start_step, end_step)."""
    for step in range(start_step, end_step):
        epoch, k = divmod(step, steps_per_epoch)
        if k == 0 or step == start_step:
            order = epoch_order(seed, epoch, steps_per_epoch)
        batch = rank_batch(dataset, "train", int(order[k]) * batch_size, batch_size, view)
        batch["valid"] = batch_size // view.size
        yield batch


def eval_batches(dataset, rows: int, batch_size: int, view: RankInput) -> Iterator[dict]:
    """Every evaluation sample in order, in batches of `batch_size`; the last one is padded with
    the samples that follow to a multiple of N, and "valid" counts this rank's real rows."""
    for start in range(0, rows, batch_size):
        size = min(batch_size, rows - start)
        padded = -(-size // view.size) * view.size
        b = padded // view.size
        batch = rank_batch(dataset, "eval", start, padded, view)
        batch["valid"] = min(max(size - view.rank * b, 0), b)
        yield batch


def prefetched(batches: Iterator[dict], dataset, depth: int = 2) -> tf.data.Dataset:
    """Wraps a batch iterator over `dataset` in tf.data with background prefetching.

    Elements: (numerical [b, n] float32, tuple of F id arrays (see RankInput), labels [b]
    float32, oracle_logits [b] float32, valid: the number of real rows, int32).
    """
    ids = tf.TensorSpec([None], tf.as_dtype(dataset.id_dtype))
    signature = (tf.TensorSpec([None, dataset.num_numerical], tf.float32),
                 tuple([ids] * len(dataset.cardinalities)),
                 tf.TensorSpec([None], tf.float32), tf.TensorSpec([None], tf.float32),
                 tf.TensorSpec([], tf.int32))

    def generate():
        for b in batches:
            yield b["numerical"], tuple(b["categorical"]), b["labels"], b["oracle_logits"], np.int32(b["valid"])

    return tf.data.Dataset.from_generator(generate, output_signature=signature).prefetch(depth)
