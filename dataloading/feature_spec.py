"""The dataset description `feature_spec.yaml`, in the schema of NVIDIA's DLRM/DCNv2 reference.

    feature_spec:   name -> {dtype, cardinality (categorical), max_hotness (multi-hot categorical),
                    hotness (the reference's name: > 1 is max_hotness, 1 one-hot), alpha (the power-law
                    exponent of --synthetic_dataset_use_feature_spec's ids), raw_ids (categorical:
                    true for raw 64-bit ids, int64, with no cardinality)}
    channel_spec:   categorical: [names] (table order), numerical: [names], label: [names] (one, or
                    several for a model with a head per label: main.py --model=FILE)
    source_spec:    mapping name (train, test, ...) -> list of chunks
                    {type: split_binary, features: [names], files: [paths], offsets: [paths]}
    metadata:       anything

Paths are relative to the spec's directory. A split-binary chunk holds features of one dtype as
headerless row-major records [rows, len(features)]; when it lists several files, the rows
continue from one file to the next. A multi-hot feature (one with `max_hotness`) sits alone in
its chunk: each file holds its ids back to back, and the matching `offsets` file holds rows + 1
int64 offsets into it (row i is ids[offsets[i]:offsets[i + 1]], empty rows allowed). Chunks of
`type: csv` (the input of dataloading/transcode.py) hold comma-separated columns instead (a
multi-hot feature's field: its ids joined by a delimiter, with no offsets files), and their
cardinalities may be `auto`.

A raw-id feature (`raw_ids: true`, written by `preproc --raw_id_columns`) holds 64-bit keys of
the log's values instead of ids in [0, cardinality): dtype int64, no cardinality (None in
`cardinalities`), every int64 value in its domain; only a dynamic table (whose capacity is the
run's setting) can take it.

Loading validates everything and raises `DatasetError` with one line naming the spec, the key
and the feature or file. `split_binary_spec` builds the standard layout for writers.
"""
import dataclasses
import os
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import yaml

from utils.errors import DatasetError

CATEGORICAL, NUMERICAL, LABEL = "categorical", "numerical", "label"
CHANNELS = (CATEGORICAL, NUMERICAL, LABEL)
SPLIT_BINARY, CSV = "split_binary", "csv"
ID_DTYPES = ("int8", "int16", "int32", "int64")
NUMERICAL_DTYPES = ("float16", "float32")
LABEL_DTYPES = ("bool",)
OFFSETS_DTYPE = np.dtype(np.int64)
RAW_ID_DTYPE = "int64"
AUTO = "auto"
SPEC_FILE = "feature_spec.yaml"


def id_dtype(cardinality: int) -> str:
    """The smallest of int8/16/32/64 that holds every id in [0, cardinality)."""
    for name in ID_DTYPES:
        if cardinality - 1 <= np.iinfo(name).max:
            return name
    raise DatasetError(f"cardinality {cardinality} does not fit in int64")


@dataclasses.dataclass
class Feature:
    dtype: Optional[str] = None
    cardinality: Union[int, str, None] = None   # categorical: a positive int, or "auto" in csv specs
    max_hotness: Optional[int] = None           # set: multi-hot (values + offsets files)
    hotness: Optional[int] = None               # the reference's key; parsing sets max_hotness from it
    alpha: Optional[float] = None               # the reference's key: synthetic ids' power-law exponent
    raw_ids: Optional[bool] = None              # categorical: true: raw 64-bit ids (int64, no cardinality)

    @property
    def multi_hot(self) -> bool:
        return self.max_hotness is not None


@dataclasses.dataclass
class Chunk:
    type: str
    features: List[str]
    files: List[str]
    offsets: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class FeatureSpec:
    features: Dict[str, Feature]
    channels: Dict[str, List[str]]
    source: Dict[str, List[Chunk]]
    metadata: dict = dataclasses.field(default_factory=dict)
    base_dir: str = "."

    # Reading and writing ------------------------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str, chunk_type: Optional[str] = SPLIT_BINARY) -> "FeatureSpec":
        """Loads and validates a spec whose chunks must all be of `chunk_type` (None: source_spec
        is not read, as for the reference's split_tfrecords datasets)."""
        try:
            with open(path) as f:
                raw = yaml.safe_load(f)
        except OSError as e:
            raise DatasetError(f"cannot read the feature spec {path}: {e.strerror}")
        except yaml.YAMLError as e:
            raise DatasetError(f"{path}: not valid YAML ({' '.join(str(e).split())})")
        return cls.from_dict(raw, os.path.dirname(os.path.abspath(path)), chunk_type, where=path)

    @classmethod
    def from_dict(cls, raw, base_dir: str = ".", chunk_type: str = SPLIT_BINARY,
                  where: str = SPEC_FILE) -> "FeatureSpec":
        spec = _parse(raw, base_dir, where)
        _validate(spec, chunk_type, where)
        return spec

    def to_dict(self) -> dict:
        features = {}
        for name, feature in self.features.items():
            features[name] = {k: v for k, v in dataclasses.asdict(feature).items() if v is not None}
        source = {m: [{k: v for k, v in dataclasses.asdict(c).items() if v or k != "offsets"} for c in chunks]
                  for m, chunks in self.source.items()}
        return {"feature_spec": features, "channel_spec": {c: list(self.channels[c]) for c in CHANNELS},
                "source_spec": source, "metadata": dict(self.metadata)}

    def to_yaml(self, path: str):
        """Writes the spec to `path` (via a temporary file, so a reader never sees half a spec)."""
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)
        os.replace(tmp, path)

    # Views ---------------------------------------------------------------------------------------

    @property
    def categorical(self) -> List[str]:
        return list(self.channels[CATEGORICAL])

    @property
    def numerical(self) -> List[str]:
        return list(self.channels[NUMERICAL])

    @property
    def label(self) -> str:
        """The first label (the only one of a one-label spec)."""
        return self.channels[LABEL][0]

    @property
    def labels(self) -> List[str]:
        """Every label, in the order of channel_spec.label."""
        return list(self.channels[LABEL])

    @property
    def cardinalities(self) -> List[int]:
        return [self.features[f].cardinality for f in self.categorical]

    @property
    def raw_id_features(self) -> List[str]:
        """The categorical features holding raw 64-bit ids (`raw_ids: true`), in table order."""
        return [f for f in self.categorical if self.features[f].raw_ids]

    @property
    def max_hotness(self) -> List[Optional[int]]:
        """Per categorical feature: its max_hotness, None for one-hot features."""
        return [self.features[f].max_hotness for f in self.categorical]

    def dtype(self, feature: str) -> np.dtype:
        """The feature's dtype on disk (the spec's, or the default of its channel)."""
        f = self.features[feature]
        if f.dtype:
            return np.dtype(f.dtype)
        if feature in self.channels[CATEGORICAL]:
            return np.dtype(RAW_ID_DTYPE if f.raw_ids else id_dtype(f.cardinality))
        return np.dtype("float16" if feature in self.channels[NUMERICAL] else "bool")

    def mapping(self, name: str) -> List[Chunk]:
        if name not in self.source:
            raise DatasetError(f"source_spec has no mapping {name!r} (it has {', '.join(self.source)})")
        return self.source[name]

    def path(self, file: str) -> str:
        return os.path.join(self.base_dir, file)


def split_binary_spec(numerical: Sequence[str], categorical: Dict[str, Optional[int]],
                      label: Union[str, Sequence[str]] = "label",
                      mappings: Sequence[str] = ("train", "test"), max_hotness: Dict[str, int] = None,
                      numerical_dtype: str = "float16", base_dir: str = ".") -> FeatureSpec:
    """The standard split-binary layout: per mapping M, M/numerical.bin (all numerical features,
    one chunk; none without numerical features), M/label.bin (`label`: one name, or several: one chunk
    [rows, labels]), and M/<feature>.bin per categorical feature (plus M/<feature>.offsets.bin for
    the multi-hot ones); ids in the smallest dtype that holds them. A categorical feature of
    cardinality None holds raw ids (int64, `raw_ids: true`)."""
    max_hotness = max_hotness or {}
    labels = [label] if isinstance(label, str) else list(label)
    features = {n: Feature(numerical_dtype) for n in numerical}
    features.update({c: Feature(RAW_ID_DTYPE, raw_ids=True, max_hotness=max_hotness.get(c)) if card is None else
                     Feature(id_dtype(card), card, max_hotness.get(c)) for c, card in categorical.items()})
    features.update({name: Feature("bool") for name in labels})
    source = {}
    for m in mappings:
        chunks = [Chunk(SPLIT_BINARY, list(numerical), [f"{m}/numerical.bin"])] if numerical else []
        chunks.append(Chunk(SPLIT_BINARY, list(labels), [f"{m}/label.bin"]))
        for c in categorical:
            offsets = [f"{m}/{c}.offsets.bin"] if c in max_hotness else []
            chunks.append(Chunk(SPLIT_BINARY, [c], [f"{m}/{c}.bin"], offsets))
        source[m] = chunks
    channels = {CATEGORICAL: list(categorical), NUMERICAL: list(numerical), LABEL: list(labels)}
    return FeatureSpec(features, channels, source, {}, base_dir)


def in_domain(spec: FeatureSpec, feature: str, values: np.ndarray) -> bool:
    """Whether every value of `feature` is in its domain (as check_values, without locating the
    first bad one): the loader's per-batch test, min/max for ids."""
    if not values.size or spec.features[feature].raw_ids:
        return True
    if feature in spec.channels[CATEGORICAL]:
        return bool(values.min() >= 0 and values.max() < spec.features[feature].cardinality)
    if feature in spec.channels[NUMERICAL]:
        return bool(np.isfinite(values).all())
    return not np.any((values != 0) & (values != 1))


def violations(spec: FeatureSpec, feature: str, values: np.ndarray):
    """(mask of the `values` of `feature` outside its domain, the rule they break; raw ids: any
    int64)."""
    if spec.features[feature].raw_ids:
        return np.zeros(values.shape, bool), "raw ids are int64"
    if feature in spec.channels[CATEGORICAL]:
        return (values < 0) | (values >= spec.features[feature].cardinality), \
            f"ids must be in [0, {spec.features[feature].cardinality})"
    if feature in spec.channels[NUMERICAL]:
        return ~np.isfinite(values), "numerical values must be finite"
    return (values != 0) & (values != 1), "labels must be 0 or 1"


def check_values(spec: FeatureSpec, feature: str, values: np.ndarray, first_row, where: str, unit: str = "row"):
    """Raises DatasetError naming `where`, the feature and the row if `values` of `feature`
    (rows from `first_row`, or one row index per value as an array; `unit` names them) are out
    of their domain."""
    bad, problem = violations(spec, feature, values)
    if np.any(bad):
        k = int(np.argmax(bad))
        row = int(first_row[k]) if isinstance(first_row, np.ndarray) else first_row + k
        raise DatasetError(f"{where}: feature {feature!r}, {unit} {row}: {problem}, got {values[k]}")


# Parsing and validation -------------------------------------------------------------------------

def _fail(where: str, key: str, message: str):
    raise DatasetError(f"{where}: {key}: {message}")


def _names(value, where, key, allow_empty=False) -> List[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        _fail(where, key, f"must be a list of names, got {value!r}")
    if not value and not allow_empty:
        _fail(where, key, "must not be empty")
    return list(value)


def _parse(raw, base_dir, where) -> FeatureSpec:
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: must be a mapping with feature_spec, channel_spec and source_spec")
    for key in ("feature_spec", "channel_spec", "source_spec"):
        if not isinstance(raw.get(key), dict):
            _fail(where, key, "missing, or not a mapping")
    unknown = set(raw) - {"feature_spec", "channel_spec", "source_spec", "metadata"}
    if unknown:
        _fail(where, sorted(unknown)[0], "unknown section (expected feature_spec, channel_spec, source_spec, metadata)")
    features = {}
    for name, entry in raw["feature_spec"].items():
        entry = {} if entry is None else entry
        key = f"feature_spec.{name}"
        if not isinstance(entry, dict):
            _fail(where, key, f"must be a mapping, got {entry!r}")
        extra = set(entry) - {"dtype", "cardinality", "max_hotness", "hotness", "alpha", "raw_ids"}
        if extra:
            _fail(where, f"{key}.{sorted(extra)[0]}", "unknown key (expected dtype, cardinality, max_hotness, "
                                                      "hotness, alpha, raw_ids)")
        features[str(name)] = _parse_feature(entry, where, key)
    channels = raw["channel_spec"]
    if set(channels) != set(CHANNELS):
        _fail(where, "channel_spec", f"must have exactly the channels {', '.join(CHANNELS)}, got {', '.join(map(str, channels))}")
    channels = {c: _names(channels[c] if channels[c] is not None else [], where, f"channel_spec.{c}",
                          allow_empty=c == NUMERICAL) for c in CHANNELS}
    source = {}
    for mapping, chunks in raw["source_spec"].items():
        if not isinstance(chunks, list) or not chunks:
            _fail(where, f"source_spec.{mapping}", "must be a non-empty list of chunks")
        source[str(mapping)] = [_parse_chunk(c, where, f"source_spec.{mapping}[{i}]") for i, c in enumerate(chunks)]
    metadata = raw.get("metadata") or {}
    return FeatureSpec(features, channels, source, metadata, base_dir)


def _parse_feature(entry: dict, where, key) -> Feature:
    """A feature entry; the reference's `hotness` h > 1 becomes max_hotness h (h = 1: one-hot)."""
    f = Feature(entry.get("dtype"), entry.get("cardinality"), entry.get("max_hotness"), entry.get("hotness"),
                entry.get("alpha"), entry.get("raw_ids"))
    if f.raw_ids is not None and not isinstance(f.raw_ids, bool):
        _fail(where, f"{key}.raw_ids", f"must be true or false, got {f.raw_ids!r}")
    if f.hotness is not None:
        if not _positive_int(f.hotness):
            _fail(where, f"{key}.hotness", f"must be a positive integer, got {f.hotness!r}")
        if f.max_hotness is not None and f.max_hotness != f.hotness:
            _fail(where, f"{key}.hotness", f"hotness {f.hotness} and max_hotness {f.max_hotness} differ: give one")
        if f.hotness > 1:
            f.max_hotness = f.hotness
    if f.alpha is not None and (isinstance(f.alpha, bool) or not isinstance(f.alpha, (int, float)) or f.alpha < 0):
        _fail(where, f"{key}.alpha", f"must be a number >= 0, got {f.alpha!r}")
    return f


def _parse_chunk(chunk, where, key) -> Chunk:
    if not isinstance(chunk, dict):
        _fail(where, key, f"must be a mapping with type, features and files, got {chunk!r}")
    extra = set(chunk) - {"type", "features", "files", "offsets"}
    if extra:
        _fail(where, f"{key}.{sorted(extra)[0]}", "unknown key (expected type, features, files, offsets)")
    return Chunk(chunk.get("type"), _names(chunk.get("features"), where, f"{key}.features"),
                 _names(chunk.get("files"), where, f"{key}.files"),
                 _names(chunk.get("offsets", []), where, f"{key}.offsets", allow_empty=True))


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _validate(spec: FeatureSpec, chunk_type: str, where: str):
    seen = set()
    for channel in CHANNELS:
        for name in spec.channels[channel]:
            if name not in spec.features:
                _fail(where, f"channel_spec.{channel}", f"feature {name!r} is not defined in feature_spec")
            if name in seen:
                _fail(where, f"channel_spec.{channel}", f"feature {name!r} appears twice in channel_spec")
            seen.add(name)
    allowed = {CATEGORICAL: ID_DTYPES, NUMERICAL: NUMERICAL_DTYPES, LABEL: LABEL_DTYPES}
    for channel in CHANNELS:
        for name in spec.channels[channel]:
            _validate_feature(spec.features[name], channel, allowed[channel], chunk_type, where, f"feature_spec.{name}")
    for mapping, chunks in spec.source.items() if chunk_type else ():
        _validate_mapping(spec, mapping, chunks, chunk_type, where)


def _validate_feature(f: Feature, channel, dtypes, chunk_type, where, key):
    if f.dtype is None and chunk_type == SPLIT_BINARY:
        _fail(where, f"{key}.dtype", f"missing (one of {', '.join(dtypes)})")
    if f.dtype is not None and f.dtype not in dtypes:
        _fail(where, f"{key}.dtype", f"{f.dtype!r} is not allowed for a {channel} feature (one of {', '.join(dtypes)})")
    if channel != CATEGORICAL:
        for attr in ("cardinality", "max_hotness", "hotness", "alpha", "raw_ids"):
            if getattr(f, attr) is not None:
                _fail(where, f"{key}.{attr}", f"only categorical features have {attr}")
        return
    if f.max_hotness is not None and not _positive_int(f.max_hotness):
        _fail(where, f"{key}.max_hotness", f"must be a positive integer, got {f.max_hotness!r}")
    if f.raw_ids:
        _validate_raw_ids(f, chunk_type, where, key)
        return
    if not (_positive_int(f.cardinality) or (f.cardinality == AUTO and chunk_type == CSV)):
        allowed = "a positive integer" + (" or auto" if chunk_type == CSV else "")
        _fail(where, f"{key}.cardinality", f"must be {allowed}, got {f.cardinality!r}")
    if f.dtype is not None and f.cardinality != AUTO and f.cardinality - 1 > np.iinfo(f.dtype).max:
        _fail(where, f"{key}.dtype", f"{f.dtype} cannot hold ids up to cardinality {f.cardinality} - 1 "
                                     f"(use {id_dtype(f.cardinality)})")


def _validate_raw_ids(f: Feature, chunk_type, where, key):
    """A raw-id feature: int64, no cardinality, no synthetic alpha, not in csv chunks."""
    if f.cardinality is not None:
        _fail(where, f"{key}.cardinality", "a raw-id feature (raw_ids: true) has none: its ids are 64-bit keys, and "
                                           "its dynamic table's capacity is the run's setting")
    if f.dtype is not None and f.dtype != RAW_ID_DTYPE:
        _fail(where, f"{key}.dtype", f"raw ids are {RAW_ID_DTYPE}, got {f.dtype!r}")
    if f.alpha is not None:
        _fail(where, f"{key}.alpha", "a raw-id feature has no synthetic ids to shape")
    if chunk_type == CSV:
        _fail(where, f"{key}.raw_ids", "csv chunks take ids in [0, cardinality); raw ids come from "
                                       "preproc --raw_id_columns")


def _validate_mapping(spec: FeatureSpec, mapping, chunks, chunk_type, where):
    provided = set()
    for i, chunk in enumerate(chunks):
        key = f"source_spec.{mapping}[{i}]"
        if chunk.type != chunk_type:
            _fail(where, f"{key}.type", f"must be {chunk_type}, got {chunk.type!r}")
        for name in chunk.features:
            if name not in spec.features:
                _fail(where, f"{key}.features", f"feature {name!r} is not defined in feature_spec")
            if name in provided:
                _fail(where, f"{key}.features", f"feature {name!r} is already in an earlier chunk of {mapping}")
            provided.add(name)
        multi_hot = [n for n in chunk.features if spec.features[n].multi_hot]
        if chunk.offsets and chunk_type == CSV:
            _fail(where, f"{key}.offsets", "csv chunks have no offsets files (a multi-hot field holds its ids)")
        if multi_hot and chunk_type == SPLIT_BINARY:
            if len(chunk.features) > 1:
                _fail(where, f"{key}.features", f"multi-hot feature {multi_hot[0]!r} must be alone in its chunk")
            if len(chunk.offsets) != len(chunk.files):
                _fail(where, f"{key}.offsets", f"multi-hot feature {multi_hot[0]!r} needs one offsets file per "
                                               f"file ({len(chunk.files)}), got {len(chunk.offsets)}")
        elif chunk.offsets:
            _fail(where, f"{key}.offsets", "only a multi-hot feature (one with max_hotness) has offsets files")
        if chunk_type == SPLIT_BINARY:
            dtypes = {n: str(spec.dtype(n)) for n in chunk.features}
            if len(set(dtypes.values())) > 1:
                _fail(where, f"{key}.features", f"a split_binary chunk holds one dtype, got {dtypes}")
    for channel in CHANNELS:
        missing = [n for n in spec.channels[channel] if n not in provided]
        if missing:
            _fail(where, f"source_spec.{mapping}", f"no chunk provides the {channel} feature {missing[0]!r}")
