"""Synthetic click data with a known answer.

Every value is a pure function of (seed, split, feature, global sample index), computed with a
counter-based hash, so any batch of any size can be produced on any rank in any order, and the
same sample always has the same ids, numericals and label.

Labels come from a hidden ground-truth logistic model:

    logit = bias + sum_f a_f[c_f] + w . x + sum_{(i, j) in pairs} <u_i[c_i], u_j[c_j]>

with per-category effects `a_f`, numerical weights `w` and low-rank pairwise category
interactions `u` (all drawn from the hash), and label ~ Bernoulli(sigmoid(logit)). The oracle
logit of every sample is available, so the best achievable AUC is known. With `labels` H > 1,
label h is drawn from its own logit of the same form over the same features (its effects,
weights and interactions from hash streams of its own; label 0's are those of one label), so
the H labels are learnable from the same inputs, each by its own head.

Features with a `max_hotness` h are multi-hot: each row has 0..h ids (`multi_hot`), the first of
a non-empty row being the one-hot id the labels use.

With `history` L > 0 the last feature is each sample's history: 0..L earlier items (most recent
last) of feature 0's vocabulary, feature 0 being the candidate item. The terms above read the
other features only; the logit adds the candidate's affinity to its closest item in the history,

    + s_h * max_j <v[c_0], v[h_j]> / sqrt(dim v)      (0 for an empty history)

with latent item vectors `v` from the hash: a term no pooled (summed or averaged) history
represents, which target attention over the items can.
"""
import dataclasses
import functools
from typing import Dict, List, Optional, Sequence

import numpy as np

from dataloading.split_binary import RaggedIds

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_SPLITS = {"train": 1, "eval": 2}
# Hash streams: distinct constants so no two quantities share random numbers.
_IDS, _NUMERICAL, _LABEL, _EFFECT, _WEIGHT, _LATENT, _HOTNESS, _MORE_IDS, _AFFINITY = range(1, 10)
_STREAMS = 16   # label h > 0 draws its label, effects, weights and interactions from these streams + 16 h

_LATENT_DIM = 4
_MAX_PAIRS = 6
_CATEGORICAL_VARIANCE = 1.0   # logit variance from per-category effects
_NUMERICAL_VARIANCE = 0.6     # ... from the numerical features
_PAIR_VARIANCE = 1.2          # ... from the pairwise interactions
_BIAS = -1.0
_AFFINITY_SCALE = 3.0         # s_h: the history's affinity term
HISTORY = "history"           # the history feature's name (run/config.py names the synthetic features)


def with_history(cardinalities: Sequence[int], max_hotness: Optional[Sequence[Optional[int]]],
                 history: int):
    """The features' (cardinalities, max_hotness) with, for `history` L > 0, the history feature
    appended: feature 0's cardinality, max_hotness L (None: all one-hot, without a history)."""
    if history <= 0:
        return list(cardinalities), None if max_hotness is None else list(max_hotness)
    hotness = list(max_hotness) if max_hotness is not None else [None] * len(cardinalities)
    return list(cardinalities) + [cardinalities[0]], hotness + [history]


def label_names(count: int) -> List[str]:
    """The names of `count` synthetic labels: "label", then "label_1", "label_2", ..."""
    return ["label"] + [f"label_{h}" for h in range(1, count)]


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrap-around arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MUL1
    x = x ^ (x >> np.uint64(27))
    x = x * _MUL2
    return x ^ (x >> np.uint64(31))


def _hash(*keys) -> np.ndarray:
    """Hashes a sequence of integer scalars/arrays (broadcast together) to uint64."""
    h = np.uint64(0)
    with np.errstate(over="ignore"):
        for k in keys:
            h = _mix(h + _GOLDEN + np.asarray(k, dtype=np.uint64))
    return h


def _uniform(*keys) -> np.ndarray:
    """Uniform floats in [0, 1) from a hash of `keys`."""
    return (_hash(*keys) >> np.uint64(11)).astype(np.float64) * (1.0 / 2 ** 53)


def _normal(*keys) -> np.ndarray:
    """Standard normal floats (Box-Muller on two hashed uniforms)."""
    u1 = 1.0 - _uniform(*keys, 0)
    u2 = _uniform(*keys, 1)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def power_law_ids(u: np.ndarray, cardinality: int, alpha: float) -> np.ndarray:
    """Maps uniforms in [0, 1) to ids in [0, cardinality), P(id = k) roughly ~ (k + 1)^-alpha.

    Inverse CDF of the continuous density ~ (x + 1)^-alpha on [0, cardinality); alpha = 0 gives
    uniform ids.
    """
    n = float(cardinality)
    if alpha == 1.0:
        x = np.power(n + 1.0, u) - 1.0
    else:
        a = 1.0 - alpha
        x = np.power(u * ((n + 1.0) ** a - 1.0) + 1.0, 1.0 / a) - 1.0
    return np.minimum(x.astype(np.int64), cardinality - 1)


_TABLE_CACHE_ELEMENTS = 1 << 24   # per-category effects of smaller features are tabulated once


@functools.lru_cache(maxsize=256)
def _effect_table(seed: int, stream: int, feature: int, cardinality: int, width: int) -> np.ndarray:
    """_normal(seed, stream, feature, c, k) for every category c and k < width: [cardinality, width]."""
    return _normal(seed, stream, feature, np.arange(cardinality, dtype=np.uint64)[:, None],
                   np.arange(width, dtype=np.uint64)[None, :])


def _effects(seed: int, stream: int, feature: int, cardinality: int, ids: np.ndarray, width: int) -> np.ndarray:
    """Per-category hashed normals [n, width] of `ids`, from a cached table when it is small."""
    if cardinality * width <= _TABLE_CACHE_ELEMENTS:
        return _effect_table(seed, stream, feature, cardinality, width)[ids]
    return _normal(seed, stream, feature, ids[:, None], np.arange(width, dtype=np.uint64)[None, :])


@dataclasses.dataclass(frozen=True)
class SyntheticDataset:
    """Random-access synthetic dataset; see the module docstring for the label model."""
    has_oracle = True   # oracle_logits are the ground truth's
    cardinalities: List[int]
    num_numerical: int
    alpha: float = 0.0
    seed: int = 0
    hotness: Optional[Sequence[Optional[int]]] = None   # per feature: max_hotness (None: one-hot)
    labels: int = 1   # H: labels per sample
    history: int = 0   # L > 0: the last feature is the history (the module docstring)

    def __post_init__(self):
        if self.history and (len(self.cardinalities) < 2 or self.cardinalities[-1] != self.cardinalities[0]
                             or self.max_hotness[-1] != self.history):
            raise ValueError(f"history {self.history}: the last feature is a history of feature 0's items "
                             f"(its cardinality, max_hotness {self.history}); got cardinalities "
                             f"{self.cardinalities}, max_hotness {self.max_hotness}")

    @property
    def _planted(self) -> int:
        """The features the planted terms read: all, or all but the history."""
        return len(self.cardinalities) - (1 if self.history else 0)

    @property
    def label_names(self) -> List[str]:
        return label_names(self.labels)

    @property
    def pairs(self):
        """The categorical feature pairs with a planted interaction."""
        f = self._planted
        return [(i, i + 1) for i in range(0, f - 1, 2)][:_MAX_PAIRS]

    @property
    def max_hotness(self) -> List[Optional[int]]:
        return list(self.hotness) if self.hotness else [None] * len(self.cardinalities)

    @property
    def id_dtype(self):
        return np.int32 if max(self.cardinalities) <= np.iinfo(np.int32).max else np.int64

    def batch(self, split: str, start: int, size: int, features=None) -> Dict[str, np.ndarray]:
        """Samples [start, start + size) of `split` ("train" or "eval").

        Returns numerical [n, num_numerical] float32, categorical: list of F arrays [n] of ids
        (RaggedIds for multi-hot features; None for those not in `features`, default all), labels
        [n] float32 (0/1) and oracle_logits [n] float32 (the ground truth's logit); [n, H] both
        with H `labels`.
        """
        s = _SPLITS[split]
        idx = np.arange(start, start + size, dtype=np.uint64)
        ids = [self._one_hot(split, start, size, f) for f in range(self._planted)]
        feats = np.arange(self.num_numerical, dtype=np.uint64)
        numerical = _normal(self.seed, _NUMERICAL, s, idx[:, None], feats[None, :])
        logits = [self._logits(ids, numerical, h) for h in range(self.labels)]
        if self.history:
            history = self.multi_hot(split, start, size, self._planted, self.history)
            logits = [z + self._affinity(ids[0], *history, h) for h, z in enumerate(logits)]
        labels = [_uniform(self.seed, _LABEL + _STREAMS * h, s, idx) < 1.0 / (1.0 + np.exp(-z)) for h, z in
                  enumerate(logits)]
        labels, logits = (labels[0], logits[0]) if self.labels == 1 else (np.stack(labels, 1), np.stack(logits, 1))
        wanted = sorted(set(range(len(self.cardinalities)) if features is None else features))
        categorical = [None] * len(self.cardinalities)
        for f, c in zip(wanted, self.categorical(split, start, size, wanted)):
            categorical[f] = c
        return {
            "numerical": numerical.astype(np.float32),
            "categorical": categorical,
            "labels": labels.astype(np.float32),
            "oracle_logits": logits.astype(np.float32),
        }

    def categorical(self, split: str, start: int, size: int, features) -> List:
        """Ids [size] of samples [start, start + size) for each of `features` (indices); RaggedIds
        of `multi_hot` ids for multi-hot features."""
        hot = self.max_hotness
        out = []
        for f in features:
            if hot[f]:
                ids, lengths = self.multi_hot(split, start, size, f, hot[f])
                out.append(RaggedIds(ids, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)))
            else:
                out.append(self._one_hot(split, start, size, f))
        return out

    def _one_hot(self, split: str, start: int, size: int, feature: int) -> np.ndarray:
        """The planted (one-hot) ids [size] of `feature`."""
        idx = np.arange(start, start + size, dtype=np.uint64)
        return power_law_ids(_uniform(self.seed, _IDS, _SPLITS[split], feature, idx), self.cardinalities[feature],
                             self.alpha).astype(self.id_dtype)

    def multi_hot(self, split: str, start: int, size: int, feature: int, max_hotness: int):
        """Multi-hot ids of `feature` for samples [start, start + size): (ids [K], row lengths
        [size]). A row has 0..max_hotness ids (uniformly many); the first id of a non-empty row is
        the one-hot id the planted model uses, the others follow the same power law."""
        s = _SPLITS[split]
        idx = np.arange(start, start + size, dtype=np.uint64)
        lengths = (_hash(self.seed, _HOTNESS, s, feature, idx) % np.uint64(max_hotness + 1)).astype(np.int64)
        slots = np.arange(max_hotness, dtype=np.uint64)[None, :]
        ids = power_law_ids(_uniform(self.seed, _MORE_IDS, s, feature, idx[:, None], slots),
                            self.cardinalities[feature], self.alpha).astype(self.id_dtype)
        ids[:, 0] = self._one_hot(split, start, size, feature)
        return ids[slots < lengths[:, None].astype(np.uint64)], lengths

    def _affinity(self, candidates, history, lengths, label: int):
        """s_h * max_j <v[c], v[h_j]> / sqrt(dim v) per sample [n] (0 for an empty history)."""
        card, shift = self.cardinalities[0], _STREAMS * label
        v = _effects(self.seed, _AFFINITY + shift, 0, card, candidates, _LATENT_DIM)            # [n, k]
        sample = np.repeat(np.arange(len(lengths)), lengths)
        dots = np.sum(v[sample] * _effects(self.seed, _AFFINITY + shift, 0, card, history, _LATENT_DIM), 1)
        best = np.full(len(lengths), -np.inf)
        np.maximum.at(best, sample, dots / np.sqrt(_LATENT_DIM))
        return np.where(lengths > 0, _AFFINITY_SCALE * best, 0.0)

    def _logits(self, ids, numerical, label: int = 0):
        """Label `label`'s logits [n]: its streams are the first label's shifted by _STREAMS per label."""
        shift = _STREAMS * label
        f = len(ids)
        logit = np.full(numerical.shape[0], _BIAS)
        a_scale = np.sqrt(_CATEGORICAL_VARIANCE / f)
        for k, (c, card) in enumerate(zip(ids, self.cardinalities)):
            logit += a_scale * _effects(self.seed, _EFFECT + shift, k, card, c, 1)[:, 0]
        if self.num_numerical:   # a feature spec may have none
            w = _normal(self.seed, _WEIGHT + shift, np.arange(self.num_numerical)) * \
                np.sqrt(_NUMERICAL_VARIANCE / self.num_numerical)
            logit += numerical @ w
        if self.pairs:
            # <u_i, u_j> with N(0, s^2) entries has variance L * s^4.
            s = (_PAIR_VARIANCE / len(self.pairs) / _LATENT_DIM) ** 0.25
            cards = self.cardinalities
            for i, j in self.pairs:
                ui = _effects(self.seed, _LATENT + shift, i, cards[i], ids[i], _LATENT_DIM)
                uj = _effects(self.seed, _LATENT + shift, j, cards[j], ids[j], _LATENT_DIM)
                logit += s * s * np.sum(ui * uj, axis=1)
        return logit
