"""Per-rank batch streams over a random-access dataset, in a deterministic order, prefetched.

Training batch `k` of epoch `e` is the global batch `order_e[k]`, where `order_e` is a
permutation drawn from (seed, e) (or the file order, without shuffling): resuming at any step,
at any world size, reproduces the same global batches. Each rank reads only its part of a
global batch of B samples (`RankInput`): numericals and labels of its b = B / N rows, and per
categorical feature the ids the embedding layer asks for. Evaluation reads every sample in
order; the last batch is padded to a multiple of N and each element says how many of its rows
are real.

A dataset offers `batch(split, start, size, features)` (numerical, labels, oracle_logits and
the ids of `features`) and `categorical(split, start, size, features)`; multi-hot ids are
RaggedIds (dataloading.split_binary), fed to the model as tf.RaggedTensor.
"""
import dataclasses
from typing import Iterator, Optional, Sequence

import numpy as np
import tensorflow as tf

from dataloading.split_binary import RaggedIds
from utils.errors import DatasetError


@dataclasses.dataclass(frozen=True)
class RankInput:
    """What rank `rank` of `size` reads: per feature, the scope of its ids: "global" (ids of all B
    rows), "local" (ids of its b rows) or "none" (an empty array)."""
    rank: int
    size: int
    scopes: Sequence[str]

    @classmethod
    def single_process(cls, num_features: int) -> "RankInput":
        return cls(0, 1, ("local",) * num_features)


def epoch_order(seed: int, epoch: int, num_batches: int) -> np.ndarray:
    """Batch order of one training epoch (a permutation of range(num_batches))."""
    return np.random.default_rng([seed, epoch]).permutation(num_batches)


def steps_per_epoch(rows: int, batch_size: int, world_size: int, last_partial: bool) -> int:
    """Training batches per epoch: the full ones, plus the last partial one if asked for (its
    size rounded down to a multiple of the ranks; none if that leaves nothing)."""
    full = rows // batch_size
    return full + int(last_partial and (rows - full * batch_size) >= world_size)


def _pad(x, n: int):
    """`x` ([m, ...] array or RaggedIds of m rows) padded to n rows with zeros / empty rows."""
    if isinstance(x, RaggedIds):
        extra = n - (len(x.row_splits) - 1)
        return RaggedIds(x.values, np.concatenate([x.row_splits, np.full(extra, x.row_splits[-1])]))
    return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)]) if len(x) < n else x


def _no_ids(multi_hot: bool, dtype):
    return RaggedIds(np.zeros([0], dtype), np.zeros([1], np.int64)) if multi_hot else np.zeros([0], dtype)


def rank_batch(dataset, split: str, start: int, size: int, view: RankInput, end: Optional[int] = None) -> dict:
    """This rank's part of the global batch of samples [start, start + size); size % N == 0.

    Returns the dataset's batch dict for the local rows [start + r*b, start + (r+1)*b), with
    "categorical" holding the ids `view` asks for. Samples at or after `end` (default: none)
    are padding: zeros, empty multi-hot rows.
    """
    b = size // view.size
    first = start + view.rank * b
    real = (lambda s, n: n) if end is None else (lambda s, n: max(0, min(n, end - s)))
    local = [f for f, scope in enumerate(view.scopes) if scope == "local"]
    wanted = [f for f, scope in enumerate(view.scopes) if scope == "global"]
    batch = dataset.batch(split, first, real(first, b), local)
    batch = {k: (v if k == "categorical" else _pad(v, b)) for k, v in batch.items()}
    global_ids = dict(zip(wanted, dataset.categorical(split, start, real(start, size), wanted)))
    hot = dataset.max_hotness
    batch["categorical"] = [
        _pad(batch["categorical"][f], b) if scope == "local" else
        _pad(global_ids[f], size) if scope == "global" else
        _no_ids(bool(hot[f]), dataset.id_dtype)
        for f, scope in enumerate(view.scopes)]
    return batch


def train_batches(dataset, view: RankInput, *, rows: int, batch_size: int, seed: int, start_step: int,
                  end_step: int, shuffle: bool = True, last_partial: bool = False) -> Iterator[dict]:
    """This rank's parts of the training batches for global steps [start_step, end_step) over
    `rows` training samples (see steps_per_epoch); batch order shuffled per epoch if `shuffle`."""
    steps = steps_per_epoch(rows, batch_size, view.size, last_partial)
    for step in range(start_step, end_step):
        epoch, k = divmod(step, steps)
        if k == 0 or step == start_step:
            order = epoch_order(seed, epoch, steps) if shuffle else np.arange(steps)
        start = int(order[k]) * batch_size
        size = min(batch_size, (rows - start) // view.size * view.size)
        batch = rank_batch(dataset, "train", start, size, view)
        batch["valid"] = size // view.size
        yield batch


def eval_batches(dataset, view: RankInput, *, rows: int, batch_size: int, split: str = "eval") -> Iterator[dict]:
    """Every sample of `split` (default the evaluation rows) in order, in batches of `batch_size`;
    the last one is padded to a multiple of N, and "valid" counts this rank's real rows."""
    for start in range(0, rows, batch_size):
        size = min(batch_size, rows - start)
        padded = -(-size // view.size) * view.size
        b = padded // view.size
        batch = rank_batch(dataset, split, start, padded, view, end=rows)
        batch["valid"] = min(max(size - view.rank * b, 0), b)
        yield batch


def ids_tensor(x):
    """One feature's ids as the model takes them: a tf.RaggedTensor for RaggedIds, else the array."""
    return tf.RaggedTensor.from_row_splits(x.values, x.row_splits) if isinstance(x, RaggedIds) else x


def prefetched(batches: Iterator[dict], dataset, depth: int = 2, synchronous: bool = False) -> Iterator[tuple]:
    """Iterates a batch iterator over `dataset` through tf.data with background prefetching; a
    DatasetError raised by the reader (a bad value) is raised here, after the batches before it.

    Elements: (numerical [b, n] float32, tuple of F ids (see RankInput; multi-hot features:
    tf.RaggedTensor [rows, None]), labels [b] float32 ([b, H] for a dataset of H `label_names`),
    oracle_logits float32 as the labels, valid: the number of real rows, int32). `synchronous`
    (--tfdata_debug): the same tensors, each batch made when the loop asks for it, in its thread,
    without tf.data (whose debug mode breaks from_generator in TensorFlow 2.21: its callback is
    lost at the next garbage collection).
    """
    dtype = tf.as_dtype(dataset.id_dtype)
    ids = [tf.RaggedTensorSpec([None, None], dtype, row_splits_dtype=tf.int64) if hot else tf.TensorSpec([None], dtype)
           for hot in dataset.max_hotness]
    heads = len(dataset.label_names)
    labels = tf.TensorSpec([None] if heads == 1 else [None, heads], tf.float32)
    signature = (tf.TensorSpec([None, dataset.num_numerical], tf.float32), tuple(ids), labels, labels,
                 tf.TensorSpec([], tf.int32))

    failure = []

    def generate():   # an exception here would reach the consumer as a TensorFlow error: end, keep it
        try:
            for b in batches:
                yield (b["numerical"], tuple(ids_tensor(c) for c in b["categorical"]), b["labels"],
                       b["oracle_logits"], np.int32(b["valid"]))
        except DatasetError as e:
            failure.append(e)

    if synchronous:
        tensor = lambda x: x if isinstance(x, tf.RaggedTensor) else tf.convert_to_tensor(x)  # noqa: E731
        yield from (tf.nest.map_structure(tensor, element) for element in generate())
    else:
        yield from tf.data.Dataset.from_generator(generate, output_signature=signature).prefetch(depth)
    if failure:
        raise failure[0]
