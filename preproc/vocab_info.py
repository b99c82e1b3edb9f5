"""vocab/vocab.json: the capacities, thresholds and generations of an output's vocabularies (the
driver's side of preproc.vocab; layout in its docstring). Outputs without it (older ones) read
as generation 0 with their spec's cardinalities as capacities and their metadata's thresholds.
"""
import json
import math
import os
from fractions import Fraction
from typing import Dict, Optional

from dataloading.feature_spec import SPEC_FILE, FeatureSpec
from preproc import vocab
from utils.errors import ConfigError, DatasetError

INFO_FILE = "vocab.json"


def capacity(size: int, headroom: Fraction, rows: Optional[int], feature: str) -> int:
    """A feature's capacity (table rows) for a first vocabulary of `size` = K + 1 ids: `rows` when
    given, else ceil(headroom x size)."""
    if rows is None:
        return math.ceil(headroom * size)
    if rows < size:
        raise ConfigError(f"--vocab_capacity: {feature} needs at least {size} rows ({size - 1} values + id 0), "
                          f"got {rows}")
    return rows


def first(capacities: Dict[str, int], thresholds: Dict[str, int], sizes: Dict[str, int]) -> dict:
    """vocab.json of first vocabularies of `sizes` = K + 1 ids per feature."""
    return {"generation": 0, "features": {
        f: {"capacity": capacities[f], "threshold": thresholds[f],
            "generations": [{"generation": 0, "first_id": 1, "end_id": sizes[f]}]} for f in capacities}}


def grown(info: dict, thresholds: Dict[str, int], sizes: Dict[str, int]) -> dict:
    """vocab.json after one more growth to `sizes` = ids in use + 1 per feature."""
    generation, features = info["generation"] + 1, {}
    for f, old in info["features"].items():
        added = {"generation": generation, "first_id": old["generations"][-1]["end_id"], "end_id": sizes[f]}
        features[f] = dict(old, threshold=thresholds[f], generations=old["generations"] + [added])
    return {"generation": generation, "features": features}


def save(root: str, info: dict):
    os.makedirs(os.path.join(root, vocab.VOCAB_DIR), exist_ok=True)
    with open(os.path.join(root, vocab.VOCAB_DIR, INFO_FILE), "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)


def load(root: str, features) -> dict:
    """The vocab.json of an earlier output; for older outputs without one, generation 0 with its
    spec's cardinalities as capacities and its metadata's thresholds."""
    info_path = os.path.join(root, vocab.VOCAB_DIR, INFO_FILE)
    if os.path.exists(info_path):
        with open(info_path) as f:
            return json.load(f)
    spec_path = os.path.join(root, SPEC_FILE)
    if not os.path.exists(spec_path):
        raise DatasetError(f"--vocab_from {root}: neither {vocab.VOCAB_DIR}/{INFO_FILE} nor {SPEC_FILE} there")
    spec = FeatureSpec.from_yaml(spec_path)
    thresholds = spec.metadata.get("frequency_threshold") or {}
    return first({f: spec.features[f].cardinality for f in features}, {f: int(thresholds.get(f, 0)) for f in features},
                 {f: len(vocab.load(root, f)) + 1 for f in features})
