"""A model repository's and a delta's on-disk format, the one module that the exporter
(deployment/exporter/, which writes them) and the server (deployment/serving/, which reads them)
share. Only utils/, NumPy and JSON below it: no TensorFlow, nothing of training.

Tensors. Requests carry two tensors (Triton's batch dimension first):
    numerical_features    [B, num_numerical] float32
    categorical_features  [B, W] int64: one column per one-hot feature, max_hotness columns per
                          multi-hot feature holding its ids, padded with -1 (PAD) in any slot;
                          a sequence (a history read unpooled) is a multi-hot feature whose ids
                          are in order, oldest first (its padding anywhere); the native frontend
                          also takes a multi-hot feature f as variable-length ids, `categorical_<f>`
                          [N] with `categorical_<f>_lengths` [B], in place of its columns
                          (deployment/serving/native.py, RaggedInput)
and get back `predictions` [B, 1] (click probability) and `logits` [B, 1], both float32; a
model with H heads (main.py --model=FILE on data with H labels) gives them [B, H], one column per
head in the order of the layout's `heads` (a head trained with mean squared error predicts a value:
its column of both is its output; the layout's `values` lists those columns). The ensemble's
sparse model maps categorical_features to `embeddings` [B, sum of the lookups' widths] (lookup
order; the built-in models: one lookup per feature, in feature order), which its dense model
takes with numerical_features. A pooled lookup's width is its table's D; a sequence lookup's
(`sequence` L in its lookups entry) is L D + 1: its kept ids' rows (the most recent L, oldest
first, zeros after them; row j of a sample at columns [j D, (j + 1) D)), then the number of ids
the request gave it (before the most recent L were kept), as a float.

Files. A full export (deployment/exporter/repository.py) is a directory holding export.json
(EXPORT_INFO: its name, forms, version, signature, serving layout, settings, and `files`: every
other file of the export, SavedModels' included, with its size and CRC-32); its tables form
holds `<name>_tables/` with one .npy file per table and tables.json (TABLES_INFO,
deployment/exporter/table_files.py); a dynamic table (raw 64-bit ids: docs/dynamic_tables.md)
also has its ids file `table_<t>.ids.npy` [R, 2] int64, row r's (raw id, LIVE or FREE), aligned
with its rows file [R, D] (tables.json's entry: `dynamic`, `ids_file`). A delta
(deployment/exporter/deltas.py writes it) names the version it applies to (its base) and the one
it makes:

    DIR/delta.json                      written last (its presence means the delta is complete):
                                        format, version, name, base, new, signature, per table its
                                        files, row count, width and CRC-32 of each file, and `files`:
                                        every other file of the delta with its size and CRC-32
    DIR/<name>_dense/1/model.savedmodel the new dense SavedModel (numerical_features, embeddings
                                        -> predictions, logits), as in a full export
    DIR/table_<t>.ids.npy               table t's updated ids [n] int64, ascending, unique
    DIR/table_<t>.rows.npy              their rows [n, D_t] float32 (.npy format 1.0, row-major)

    DIR/table_<t>.live.npy              a dynamic table's: every id live at the new version [L]
                                        int64, ascending (its delta.json entry: `dynamic`, `live`,
                                        `live_count`, `evicted`: the count of base's ids not live)

delta.json names each table by its index, `table` (deltas of built-in models, whose table t is
feature t's, say `feature`; older ones say only that).

Applying a delta to version `base` of a model: for every table listed, row ids[i] becomes
rows[i]; every other row keeps its value; the dense model is replaced whole. Tables without
updated rows are not listed, but dynamic tables always are. A dynamic table's ids are raw ids
(not row numbers): new or changed ones; after the delta its live ids are `live` (each id of
`ids` among them, each id of `live` new to the base among `ids`), every other id (evicted)
reads the default row, zeros.

A manifest's `files` ([{"file": path relative to the directory, '/'-separated, "bytes", "crc32"}],
sorted; file_entries writes it) is what a reader checks the directory against (check_files):
paths inside the directory only, each file of the size and CRC-32 listed; for an update taken
from an updates folder (check_update_files) also no file besides those listed and no symbolic
link anywhere.

A model version is the checkpoint it was exported from, named by the training run that wrote it
and its global step (`Version`); a full export records its version in export.json.
"""
import dataclasses
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from utils.files import file_crc32, read_json

NUMERICAL = "numerical_features"
CATEGORICAL = "categorical_features"
EMBEDDINGS = "embeddings"
PREDICTIONS = "predictions"
LOGITS = "logits"
PAD = -1

EXPORT_INFO = "export.json"            # a full export's
TABLES_INFO = "tables.json"            # its table files'
TABLES_FORMAT = "dlrm-table-files"
TABLES_VERSION = 1
TABLE_DTYPE = np.dtype(np.float32)     # the table files' rows
DELTA_INFO = "delta.json"              # a delta's
DELTA_FORMAT = "dlrm-delta"
DELTA_VERSION = 2                      # 2: delta.json lists every file (`files`)
ROWS_DTYPE = np.dtype("<f4")           # a delta's rows
IDS_DTYPE = np.dtype("<i8")            # and their ids (a dynamic table's: raw ids); a dynamic table's ids file
LIVE, FREE = 1, 0                      # its second column: the row holds a live id, or none
REPOSITORY = "a model repository written by deployment/deploy.py"
FILES = "files"                        # a manifest's list of the directory's other files


class RepositoryError(ValueError):
    """A model repository or delta that is missing, incomplete, corrupt or cannot be written as
    asked; one line."""


class DeltaError(RepositoryError):
    """A delta that is missing, incomplete, corrupt or does not apply; one line."""


@dataclasses.dataclass(frozen=True)
class ServingLayout:
    """What a client must know to build requests for a model (export.json's "layout"): per
    categorical feature its cardinality and max_hotness (None: one-hot), the number of numerical
    features, and per lookup (a table's rows for one feature's ids, a slice of `embeddings`) its
    embedding width and the feature it reads (`lookup_features`; None: lookup f reads feature f,
    the built-in models' one table per feature), the model's `heads` (the columns of
    predictions and logits [B, H], in order; None: one output, [B, 1]), and `values`: the columns
    trained as values (mean squared error: prediction = output, scored by RMSE), every other one a
    logit of a binary label (prediction = its sigmoid, scored by AUC and logloss); None: none (or an
    export written before the layout said so)."""
    cardinalities: List[int]
    max_hotness: List[Optional[int]]
    embedding_dims: List[int]
    num_numerical: int
    lookup_features: Optional[List[int]] = None
    heads: Optional[List[str]] = None
    values: Optional[List[int]] = None

    @property
    def outputs(self) -> int:
        """The columns of predictions and logits: H heads, or 1."""
        return len(self.heads) if self.heads else 1

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


@dataclasses.dataclass(frozen=True)
class Version:
    """A model version: the checkpoint of training run `run` (hex id) at global step `step`."""
    run: str
    step: int

    def __str__(self) -> str:
        return f"step {self.step} (run {self.run[:8] or 'unknown'})"

    def to_json(self) -> dict:
        return {"run": self.run, "step": self.step}

    @classmethod
    def from_json(cls, value: dict) -> "Version":
        return cls(str(value["run"]), int(value["step"]))


def read_export_info(repository: str) -> dict:
    """export.json's content of the full export `repository`."""
    return read_json(os.path.join(repository, EXPORT_INFO), REPOSITORY, RepositoryError)


def _entries(info: dict) -> List[dict]:
    """A manifest's `files`; KeyError, TypeError or ValueError where garbled."""
    return [{"file": e["file"], "bytes": int(e["bytes"]), "crc32": int(e["crc32"])} for e in info[FILES]]


def export_files(repository: str, info: dict) -> List[dict]:
    """The files (a manifest's `files`) that the full export `repository`'s export.json (content
    `info`) lists; RepositoryError if it lists none (written before deploy.py listed them) or
    garbles them."""
    if FILES not in info:
        raise RepositoryError(f"{os.path.join(repository, EXPORT_INFO)}: lists no files with checksums (written by "
                              "an older deploy.py): export it again")
    try:
        return _entries(info)
    except (KeyError, TypeError, ValueError) as e:
        raise RepositoryError(f"{os.path.join(repository, EXPORT_INFO)}: garbles its files ({e})")


def export_version(repository: str) -> Version:
    """The version a full export (a model repository) holds; run "" if its export.json predates
    versions."""
    info = read_export_info(repository)
    return Version.from_json(info.get("version") or {"run": "", "step": info["step"]})


def file_entries(directory: str, manifest: str, written: Optional[Dict[str, int]] = None) -> List[dict]:
    """Every file under `directory` but its manifest (named `manifest`), as a manifest's `files`
    lists them: [{"file": relative path, '/'-separated, "bytes", "crc32"}], sorted by path.
    `written`: {relative path: CRC-32} of files checksummed as they were written (utils.files.
    Checksummed), not read again; the others are read."""
    out, written = [], written or {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory).replace(os.sep, "/")
            if relative != manifest:
                crc = written[relative] if relative in written else file_crc32(path)
                out.append({"file": relative, "bytes": os.path.getsize(path), "crc32": crc})
    return sorted(out, key=lambda e: e["file"])


def inside(directory: str, relative, manifest: str, error: type) -> str:
    """The path of `relative` (a manifest's entry) in `directory`; raises `error` for anything but
    a relative path below it (absolute, `..`, empty parts)."""
    parts = relative.split("/") if isinstance(relative, str) and "\\" not in relative else [""]
    if any(p in ("", ".", "..") for p in parts):   # "/x" (absolute) has an empty part
        raise error(f"{os.path.join(directory, manifest)}: names {relative!r}, not a relative path inside "
                    f"{directory}")
    return os.path.join(directory, *parts)


def check_files(directory: str, manifest: str, entries: List[dict], error: type, skip: Sequence[str] = ()):
    """Every file `entries` (a manifest's `files`) lists but those in `skip`: a regular file inside
    `directory` (no symbolic link on the way) of the size and CRC-32 listed; else `error`, one line
    naming the file."""
    real = os.path.realpath(directory)
    for entry in entries:
        path = inside(directory, entry["file"], manifest, error)
        if entry["file"] in skip:
            continue
        if os.path.realpath(path) != os.path.join(real, *entry["file"].split("/")):
            raise error(f"{path}: a symbolic link, or below one ({manifest} lists regular files only)")
        actual = os.path.getsize(path) if os.path.isfile(path) else None
        if actual != entry["bytes"]:
            raise error(f"{path}: {'missing' if actual is None else f'{actual} bytes'}, {manifest} says "
                        f"{entry['bytes']} bytes")
        if file_crc32(path) != entry["crc32"]:
            raise error(f"{path}: CRC-32 differs from {manifest}'s (a corrupt or partial file)")


def check_update_files(directory: str, manifest: str, entries: List[dict], error: type):
    """check_files for an update from an updates folder, and more: no symbolic link anywhere in
    `directory`, and no file there that `entries` does not list."""
    listed = {entry["file"] for entry in entries}
    for root, dirs, names in os.walk(directory):
        for name in dirs + names:
            if os.path.islink(os.path.join(root, name)):
                raise error(f"{os.path.join(root, name)}: a symbolic link (an update holds regular files only)")
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/")
            if relative != manifest and relative not in listed:
                raise error(f"{os.path.join(root, name)}: not listed in {manifest}")
    check_files(directory, manifest, entries, error)


@dataclasses.dataclass
class Delta:
    """A delta read from `directory` (read_delta): what it applies to and makes, and its rows."""
    directory: str
    info: dict

    @property
    def name(self) -> str:
        return self.info["name"]

    @property
    def base(self) -> Version:
        return Version.from_json(self.info["base"])

    @property
    def new(self) -> Version:
        return Version.from_json(self.info["new"])

    @property
    def signature(self) -> dict:
        return self.info["signature"]

    @property
    def dense_model(self) -> str:
        """The new dense SavedModel's directory."""
        return os.path.join(self.directory, self.info["dense_model"])

    @property
    def features(self) -> List[int]:
        """The indices of the tables it updates."""
        return [_table_index(t) for t in self.info["tables"]]

    def table(self, index: int) -> dict:
        return next(t for t in self.info["tables"] if _table_index(t) == index)

    def rows(self, index: int) -> Tuple[np.ndarray, np.ndarray]:
        """Table `index`'s updated (ids [n] int64, rows [n, D] float32), checked: CRC-32 of both
        files, shapes and dtypes, rows finite, ids ascending, unique and inside the table."""
        t = self.table(index)
        arrays = []
        for key, dtype, shape in (("ids", IDS_DTYPE, (t["count"],)), ("rows", ROWS_DTYPE, (t["count"], t["dim"]))):
            path = os.path.join(self.directory, t[key]["file"])
            if file_crc32(path) != t[key]["crc32"]:
                raise DeltaError(f"{path}: CRC-32 differs from {DELTA_INFO}'s (a corrupt or partial file)")
            value = np.load(path)
            if value.dtype != dtype or value.shape != shape:
                raise DeltaError(f"{path}: {value.dtype}{list(value.shape)}, {DELTA_INFO} says {dtype}{list(shape)}")
            arrays.append(value)
        finite = np.isfinite(arrays[1]).all(1) if arrays[1].size else np.ones(len(arrays[1]), bool)
        if not finite.all():
            raise DeltaError(f"{os.path.join(self.directory, t['rows']['file'])}: {int((~finite).sum())} of "
                             f"{len(finite)} rows hold NaN or infinite values")
        ids = arrays[0]
        if t.get("dynamic"):
            _check_ascending(ids, os.path.join(self.directory, t["ids"]["file"]))
        elif ids.size and (ids[0] < 0 or ids[-1] >= t["table_rows"] or np.any(ids[1:] <= ids[:-1])):
            raise DeltaError(f"{os.path.join(self.directory, t['ids']['file'])}: ids must be ascending, unique and "
                             f"in [0, {t['table_rows']})")
        return ids, arrays[1]

    def dynamic(self, index: int) -> bool:
        """Whether table `index` is a dynamic one (raw ids)."""
        return bool(self.table(index).get("dynamic"))

    def live(self, index: int) -> np.ndarray:
        """Dynamic table `index`'s live ids at the new version [L] int64, checked: CRC-32, shape,
        ascending and unique."""
        t = self.table(index)
        path = os.path.join(self.directory, t["live"]["file"])
        if file_crc32(path) != t["live"]["crc32"]:
            raise DeltaError(f"{path}: CRC-32 differs from {DELTA_INFO}'s (a corrupt or partial file)")
        live = np.load(path)
        if live.dtype != IDS_DTYPE or live.shape != (t["live_count"],):
            raise DeltaError(f"{path}: {live.dtype}{list(live.shape)}, {DELTA_INFO} says {IDS_DTYPE}"
                             f"{[t['live_count']]}")
        _check_ascending(live, path)
        return live


def _check_ascending(ids: np.ndarray, path: str):
    if ids.size and np.any(ids[1:] <= ids[:-1]):
        raise DeltaError(f"{path}: ids must be ascending and unique")


def _table_index(entry: dict) -> int:
    """A delta.json table's index (`table`; older deltas: `feature`, the built-in models' table)."""
    return entry["table"] if "table" in entry else entry["feature"]


def table_lookups(tables_info: dict) -> List[dict]:
    """tables.json's lookups: per lookup its feature, table (index), max_hotness, combiner,
    categorical_columns and embedding_columns (a sequence lookup: `sequence`, its L); without
    `lookups` (the built-in models' export), table t is the one lookup of feature t and its entry
    says so."""
    if "lookups" in tables_info:
        return tables_info["lookups"]
    return [dict(t, table=i) for i, t in enumerate(tables_info["tables"])]


def read_delta(directory: str) -> Delta:
    """The delta in `directory`, its delta.json checked (format, version; check_update_files: its
    files, and nothing else, there as listed; the tables' files and the dense model among them);
    the rows are checked as they are read (Delta.rows)."""
    info = read_json(os.path.join(directory, DELTA_INFO), "a delta written by deployment/deploy.py", DeltaError)
    if info.get("format") != DELTA_FORMAT or info.get("version") != DELTA_VERSION:
        raise DeltaError(f"{directory}: {DELTA_INFO} is format {info.get('format')!r} version "
                         f"{info.get('version')!r}, not {DELTA_FORMAT!r} version {DELTA_VERSION}")
    try:
        entries = _entries(info)
        named = [t[key]["file"] for t in info["tables"] for key in ("ids", "rows", "live") if key in t] + \
            [info["dense_model"]]
        Version.from_json(info["base"]), Version.from_json(info["new"])
    except (KeyError, TypeError, ValueError) as e:
        raise DeltaError(f"{directory}: {DELTA_INFO} lacks or garbles {e}")
    check_update_files(directory, DELTA_INFO, entries, DeltaError)
    listed = {e["file"] for e in entries}
    for name in named:
        inside(directory, name, DELTA_INFO, DeltaError)
        if name not in listed and not any(f.startswith(f"{name}/") for f in listed):
            raise DeltaError(f"{os.path.join(directory, DELTA_INFO)}: names {name!r}, not a file of the delta")
    return Delta(directory, info)


def live_ids(path: str, index: int) -> np.ndarray:
    """Dynamic table `index`'s live ids [L] int64, ascending, in the version held at `path`: a full
    export's (its ids file, as exported) or a delta's (`live`); RepositoryError if it has no such
    table."""
    if os.path.isfile(os.path.join(path, DELTA_INFO)):
        delta = read_delta(path)
        if index not in delta.features or not delta.dynamic(index):
            raise RepositoryError(f"{path}: its delta has no dynamic table {index}")
        return delta.live(index)
    info = read_export_info(path)
    if not info.get("table_files"):
        raise RepositoryError(f"{path}: has no table files, so no ids of dynamic table {index}")
    directory = os.path.join(path, info["table_files"]["directory"])
    tables = read_json(os.path.join(directory, TABLES_INFO), REPOSITORY, RepositoryError)["tables"]
    if not 0 <= index < len(tables) or not tables[index].get("dynamic"):
        raise RepositoryError(f"{path}: table {index} is not a dynamic table there")
    ids = np.load(os.path.join(directory, tables[index]["ids_file"]))
    return np.sort(ids[ids[:, 1] == LIVE, 0])
