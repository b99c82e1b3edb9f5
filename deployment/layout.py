"""The serving interface of an exported model: tensor names, the categorical input's columns,
and dataset batches turned into request tensors.

Requests carry two tensors (Triton's batch dimension first):
    numerical_features    [B, num_numerical] float32
    categorical_features  [B, W] int64: one column per one-hot feature, max_hotness columns per
                          multi-hot feature holding its ids, padded with -1 (PAD) in any slot
and get back `predictions` [B, 1] (click probability) and `logits` [B, 1], both float32. The
ensemble's sparse model maps categorical_features to `embeddings` [B, sum of the features'
dims] (feature order), which its dense model takes with numerical_features.
"""
import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np

from nn.model_config import ModelConfig

NUMERICAL = "numerical_features"
CATEGORICAL = "categorical_features"
EMBEDDINGS = "embeddings"
PREDICTIONS = "predictions"
LOGITS = "logits"
PAD = -1


@dataclasses.dataclass(frozen=True)
class ServingLayout:
    """What a client must know to build requests for a model."""
    cardinalities: List[int]
    max_hotness: List[Optional[int]]
    embedding_dims: List[int]
    num_numerical: int

    @classmethod
    def of(cls, model: ModelConfig) -> "ServingLayout":
        return cls(model.cardinalities, [t.max_hotness for t in model.tables], model.embedding_dims,
                   model.num_numerical)

    @property
    def columns(self) -> List[Tuple[int, int]]:
        """Per categorical feature, its columns [start, end) of categorical_features."""
        return columns(self.max_hotness)

    @property
    def categorical_width(self) -> int:
        return categorical_width(self.max_hotness)


def columns(max_hotness: Sequence[Optional[int]]) -> List[Tuple[int, int]]:
    """Per categorical feature (its max_hotness, None for one-hot), its columns [start, end)."""
    ends = np.cumsum([h or 1 for h in max_hotness]).tolist()
    return [(end - (h or 1), end) for end, h in zip(ends, max_hotness)]


def categorical_width(max_hotness: Sequence[Optional[int]]) -> int:
    """W, the width of categorical_features."""
    return sum(h or 1 for h in max_hotness)


def categorical_matrix(categorical: Sequence, max_hotness: Sequence[Optional[int]]) -> np.ndarray:
    """A dataset batch's ids (per feature: [n] ids, or RaggedIds of a multi-hot feature) as
    categorical_features [n, W] int64."""
    spans = columns(max_hotness)
    n = len(categorical[0]) if max_hotness[0] is None else len(categorical[0].row_splits) - 1
    out = np.full((n, categorical_width(max_hotness)), PAD, np.int64)
    for f, ((start, end), ids) in enumerate(zip(spans, categorical)):
        if max_hotness[f] is None:
            out[:, start] = ids
            continue
        lengths = np.diff(ids.row_splits)
        if lengths.size and lengths.max() > end - start:
            raise ValueError(f"categorical feature {f}: a row has {lengths.max()} ids, more than its "
                             f"max_hotness {end - start}")
        rows = np.repeat(np.arange(n), lengths)
        slots = np.arange(len(ids.values)) - np.repeat(ids.row_splits[:-1], lengths)
        out[rows, start + slots] = ids.values
    return out
