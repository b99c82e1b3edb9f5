"""Categorical vocabularies: frequent values -> ids 1..K by descending count (ties: smaller value
first); missing values and values seen fewer than the threshold share id 0 (cardinality K + 1).

Kept as `vocab/<feature>.npy` beside the dataset (structured: value uint64, count int64, in id
order: row k holds id k + 1), so later data can be encoded with the same ids.
"""
import os
from typing import Dict

import numpy as np
import pandas as pd

VOCAB_DIR = "vocab"
ENTRY = np.dtype([("value", "<u8"), ("count", "<i8")])


def frequent(table: tuple, threshold: int) -> tuple:
    """The (values, counts) seen at least `threshold` times."""
    keep = table[1] >= threshold
    return table[0][keep], table[1][keep]


def rank(values: np.ndarray, counts: np.ndarray, threshold: int) -> np.ndarray:
    """The vocabulary (ENTRY records in id order) from total counts of distinct values."""
    keep = counts >= threshold
    values, counts = values[keep], counts[keep]
    order = np.lexsort((values, -counts))
    out = np.empty(len(order), ENTRY)
    out["value"], out["count"] = values[order], counts[order]
    return out


def path(root: str, feature: str) -> str:
    return os.path.join(root, VOCAB_DIR, f"{feature}.npy")


def save(root: str, feature: str, entries: np.ndarray):
    os.makedirs(os.path.join(root, VOCAB_DIR), exist_ok=True)
    np.save(path(root, feature), entries)


def load(root: str, feature: str) -> np.ndarray:
    return np.load(path(root, feature))


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
