"""Deltas: the embedding rows a model updated since an earlier export, and its dense weights,
as files any parameter-server-style consumer can read (no TensorFlow here).

A model version is the checkpoint it was exported from, named by the training run that wrote it
and its global step (`Version`). A full export (deployment/repository.py) records its version in
export.json; a delta names the version it applies to (its base) and the one it makes:

    DIR/delta.json                      written last (its presence means the delta is complete):
                                        format, version, name, base, new, signature, per table its
                                        files, row count, width and CRC-32 of each file
    DIR/<name>_dense/1/model.savedmodel the new dense SavedModel (numerical_features, embeddings
                                        -> predictions, logits), as in a full export
    DIR/table_<f>.ids.npy               feature f's updated ids [n] int64, ascending, unique
    DIR/table_<f>.rows.npy              their rows [n, D_f] float32 (.npy format 1.0, row-major)

Applying a delta to version `base` of a model: for every table listed, row ids[i] becomes
rows[i]; every other row keeps its value; the dense model is replaced whole. Tables without
updated rows are not listed.
"""
import dataclasses
import os
import zlib
from typing import Callable, Iterable, List, Tuple

import numpy as np

from utils.files import read_json, write_json

FORMAT = "dlrm-delta"
FORMAT_VERSION = 1
DELTA_INFO = "delta.json"
EXPORT_INFO = "export.json"   # a full export's (deployment/repository.py)
ROWS_DTYPE = np.dtype("<f4")
IDS_DTYPE = np.dtype("<i8")
_CRC_BLOCK = 16 << 20
REPOSITORY = "a model repository written by deployment/deploy.py"


class DeltaError(ValueError):
    """A delta (or export) that is missing, incomplete, corrupt or does not apply; one line."""


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


def checkpoint_version(manifest: dict) -> Version:
    """The version of the checkpoint whose manifest (storage.checkpoint.read_manifest) is given; run ""
    for a checkpoint written before runs were recorded."""
    lineage = manifest["state"].get("lineage") or [{"run": ""}]
    return Version(lineage[-1]["run"], int(manifest["step"]))


def descends_from(manifest: dict, base: Version) -> bool:
    """Whether the checkpoint (manifest) was trained from version `base`: its lineage (the runs
    that trained it, each from the step it restored) passes through base's run at base's step."""
    lineage = manifest["state"].get("lineage") or []
    ends = [segment["from_step"] for segment in lineage[1:]] + [int(manifest["step"])]
    return any(segment["run"] == base.run and base.run and segment["from_step"] <= base.step <= end
               for segment, end in zip(lineage, ends))


def export_version(repository: str) -> Version:
    """The version a full export (a model repository) holds; run "" if its export.json predates
    versions."""
    info = read_json(os.path.join(repository, EXPORT_INFO), REPOSITORY, DeltaError)
    return Version.from_json(info.get("version") or {"run": "", "step": info["step"]})


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


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
        return [t["feature"] for t in self.info["tables"]]

    def table(self, feature: int) -> dict:
        return next(t for t in self.info["tables"] if t["feature"] == feature)

    def rows(self, feature: int) -> Tuple[np.ndarray, np.ndarray]:
        """Feature's updated (ids [n] int64, rows [n, D] float32), checked: CRC-32 of both files,
        shapes and dtypes, ids ascending, unique and inside the table."""
        t = self.table(feature)
        arrays = []
        for key, dtype, shape in (("ids", IDS_DTYPE, (t["count"],)), ("rows", ROWS_DTYPE, (t["count"], t["dim"]))):
            path = os.path.join(self.directory, t[key]["file"])
            if _crc32(path) != t[key]["crc32"]:
                raise DeltaError(f"{path}: CRC-32 differs from {DELTA_INFO}'s (a corrupt or partial file)")
            value = np.load(path)
            if value.dtype != dtype or value.shape != shape:
                raise DeltaError(f"{path}: {value.dtype}{list(value.shape)}, {DELTA_INFO} says {dtype}{list(shape)}")
            arrays.append(value)
        ids = arrays[0]
        if ids.size and (ids[0] < 0 or ids[-1] >= t["table_rows"] or np.any(ids[1:] <= ids[:-1])):
            raise DeltaError(f"{os.path.join(self.directory, t['ids']['file'])}: ids must be ascending, unique and "
                             f"in [0, {t['table_rows']})")
        return ids, arrays[1]


def read_delta(directory: str) -> Delta:
    """The delta in `directory`, its delta.json checked (format, version, every file present with
    the size it records); the rows are checked as they are read (Delta.rows)."""
    info = read_json(os.path.join(directory, DELTA_INFO), "a delta written by deployment/deploy.py", DeltaError)
    if info.get("format") != FORMAT or info.get("version") != FORMAT_VERSION:
        raise DeltaError(f"{directory}: {DELTA_INFO} is format {info.get('format')!r} version "
                         f"{info.get('version')!r}, not {FORMAT!r} version {FORMAT_VERSION}")
    try:
        files = [t[key] for t in info["tables"] for key in ("ids", "rows")]
        Version.from_json(info["base"]), Version.from_json(info["new"])
        checks = [(os.path.join(directory, f["file"]), f["bytes"]) for f in files]
    except (KeyError, TypeError, ValueError) as e:
        raise DeltaError(f"{directory}: {DELTA_INFO} lacks or garbles {e}")
    if not os.path.isdir(os.path.join(directory, info.get("dense_model", ""))):
        raise DeltaError(f"{directory}: no dense model {info.get('dense_model')!r}")
    for path, size in checks:
        actual = os.path.getsize(path) if os.path.isfile(path) else None
        if actual != size:
            raise DeltaError(f"{path}: {'missing' if actual is None else f'{actual} bytes'}, "
                             f"{DELTA_INFO} says {size} bytes")
    return Delta(directory, info)


def base_version(path: str) -> Version:
    """The version that a delta made against `path` applies to: the version `path` holds (a full
    export, or a delta's new version)."""
    if os.path.isfile(os.path.join(path, DELTA_INFO)):
        return read_delta(path).new
    return export_version(path)


def base_signature(path: str) -> dict:
    """The model signature of a full export or a delta at `path`."""
    if os.path.isfile(os.path.join(path, DELTA_INFO)):
        return read_delta(path).signature
    return read_json(os.path.join(path, EXPORT_INFO), REPOSITORY, DeltaError)["signature"]


def _save(path: str, value: np.ndarray) -> dict:
    with open(path, "wb") as f:
        np.save(f, value)
        f.flush()
        os.fsync(f.fileno())
    return {"file": os.path.basename(path), "bytes": os.path.getsize(path), "crc32": _crc32(path)}


def write_delta(directory: str, name: str, base: Version, new: Version, signature: dict,
                tables: Iterable[Tuple[int, int, np.ndarray, np.ndarray]],
                write_dense: Callable[[str], None]) -> dict:
    """Writes a delta into the new directory `directory` and returns its delta.json content.
    `tables`: (feature, table rows, updated ids [n] int64 ascending, their rows [n, D] float32);
    `write_dense(path)` writes the dense SavedModel at `path`."""
    os.makedirs(directory)
    dense = os.path.join(f"{name}_dense", "1", "model.savedmodel")
    write_dense(os.path.join(directory, dense))
    listed = []
    for feature, table_rows, ids, rows in tables:
        ids, rows = np.ascontiguousarray(ids, IDS_DTYPE), np.ascontiguousarray(rows, ROWS_DTYPE)
        if not ids.size:
            continue
        listed.append({"feature": feature, "count": int(ids.size), "dim": int(rows.shape[1]),
                       "table_rows": int(table_rows),
                       "ids": _save(os.path.join(directory, f"table_{feature}.ids.npy"), ids),
                       "rows": _save(os.path.join(directory, f"table_{feature}.rows.npy"), rows)})
    info = {"format": FORMAT, "version": FORMAT_VERSION, "name": name, "base": base.to_json(), "new": new.to_json(),
            "signature": signature, "dense_model": dense, "tables": listed}
    write_json(os.path.join(directory, DELTA_INFO), info)
    return info
