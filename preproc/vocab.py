"""Categorical vocabularies: frequent values -> ids 1..K by descending count (ties: smaller value
first); missing values and values seen fewer than the threshold share id 0. Each feature has a
capacity C >= K + 1 (the spec's cardinality, the embedding table's rows), fixed when the first
vocabulary is made; later data grows the vocabulary into ids K + 1..C - 1 (`grow`).

Kept beside the dataset so later data can be encoded with the same ids:
    vocab/<feature>.npy  structured ENTRY records in id order (row k holds id k + 1): value uint64,
                         count int64 (summed over every dataset that counted it), generation int32
                         (0: the first vocabulary, g: added by the g-th growth)
    vocab/vocab.json     {"generation": g, "features": {feature: {"capacity": C, "threshold": t,
                         "generations": [{"generation": g, "first_id": a, "end_id": b}, ...]}}}
                         (ids [a, b) were added by generation g; t: the latest threshold)
(preproc.vocab_info owns vocab.json). Files without the generation field (older outputs) read
as generation 0.
"""
import os
from typing import Dict

import numpy as np
import pandas as pd

VOCAB_DIR = "vocab"
ENTRY = np.dtype([("value", "<u8"), ("count", "<i8"), ("generation", "<i4")])


def frequent(table: tuple, threshold: int, known=None) -> tuple:
    """The (values, counts) seen at least `threshold` times, and every value `known` (an Encoder)
    holds."""
    keep = table[1] >= threshold
    if known is not None:
        keep |= known(table[0]) > 0
    return table[0][keep], table[1][keep]


def rank(values: np.ndarray, counts: np.ndarray, threshold: int, generation: int = 0) -> np.ndarray:
    """The vocabulary (ENTRY records in id order) from total counts of distinct values."""
    keep = counts >= threshold
    values, counts = values[keep], counts[keep]
    order = np.lexsort((values, -counts))
    out = np.zeros(len(order), ENTRY)
    out["value"], out["count"], out["generation"] = values[order], counts[order], generation
    return out


def grow(entries: np.ndarray, values: np.ndarray, counts: np.ndarray, threshold: int, capacity: int,
         generation: int):
    """Adds new data's counts of distinct values to a vocabulary: known values keep their ids (counts
    added); unknown ones seen at least `threshold` times get the next ids (as `rank` orders them)
    while ids < `capacity` are left. Returns (entries, report: added, past_capacity (distinct
    values), past_capacity_rows (their counts))."""
    ids = Encoder(entries)(values)
    known = ids > 0
    entries = entries.copy()
    entries["count"][ids[known] - 1] += counts[known]
    new = rank(values[~known], counts[~known], threshold, generation)
    room = max(capacity - 1 - len(entries), 0)
    report = {"added": min(room, len(new)), "past_capacity": max(len(new) - room, 0),
              "past_capacity_rows": int(new["count"][room:].sum())}
    return np.concatenate([entries, new[:room]]), report


def path(root: str, feature: str) -> str:
    return os.path.join(root, VOCAB_DIR, f"{feature}.npy")


def save(root: str, feature: str, entries: np.ndarray):
    os.makedirs(os.path.join(root, VOCAB_DIR), exist_ok=True)
    np.save(path(root, feature), entries)


def load(root: str, feature: str) -> np.ndarray:
    """ENTRY records; files without generations (older outputs) read as generation 0."""
    stored = np.load(path(root, feature))
    if stored.dtype == ENTRY:
        return stored
    out = np.zeros(len(stored), ENTRY)
    out["value"], out["count"] = stored["value"], stored["count"]
    return out


class Encoder:
    """value -> id lookup of one feature (a hash index, built once)."""

    def __init__(self, entries: np.ndarray):
        self.index = pd.Index(entries["value"], dtype="uint64")
        self.cardinality = len(entries) + 1

    def __call__(self, values: np.ndarray) -> np.ndarray:
        return self.index.get_indexer(values) + 1      # not found: -1 -> 0


_ENCODERS: Dict[tuple, Encoder] = {}


def encoder(root: str, feature: str) -> Encoder:
    """The feature's Encoder, cached for the life of the worker process."""
    key = (os.path.abspath(root), feature, os.path.getmtime(path(root, feature)))
    if key not in _ENCODERS:
        _ENCODERS[key] = Encoder(load(root, feature))
    return _ENCODERS[key]
