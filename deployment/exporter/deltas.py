"""Writes deltas (deployment/repository_format.py's layout): the embedding rows a model updated
since an earlier export, and its dense weights, as files any parameter-server-style consumer can
read; and what a delta needs to know of checkpoints (their version, their lineage). No
TensorFlow."""
import os
from typing import Callable, Dict, Iterable, Optional, Tuple

import numpy as np

from deployment.repository_format import (DELTA_FORMAT, DELTA_INFO, DELTA_VERSION, FILES, IDS_DTYPE, ROWS_DTYPE,
                                          Version, export_version, file_entries, read_delta, read_export_info)
from utils.files import Checksummed, write_json


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
    return read_export_info(path)["signature"]


def _save(path: str, value: np.ndarray) -> dict:
    """Writes `value` as the .npy `path`; returns its entry in delta.json (CRC-32 computed as written)."""
    with open(path, "wb") as f:
        checksummed = Checksummed(f)
        np.save(checksummed, value)
        f.flush()
        os.fsync(f.fileno())
    return {"file": os.path.basename(path), "bytes": os.path.getsize(path), "crc32": checksummed.crc}


def write_delta(directory: str, name: str, base: Version, new: Version, signature: dict,
                tables: Iterable[Tuple[int, int, np.ndarray, np.ndarray]],
                write_dense: Callable[[str], None], per_feature: bool = True,
                dynamic: Optional[Dict[int, Tuple[np.ndarray, int]]] = None) -> dict:
    """Writes a delta into the new directory `directory` and returns its delta.json content.
    `tables`: (table index, table rows, updated ids [n] int64 ascending, their rows [n, D] float32);
    `dynamic`: per dynamic table (its updated ids: raw ids new to the base or changed) its live ids
    [L] int64 ascending and the count of the base's ids evicted; `write_dense(path)` writes the
    dense SavedModel at `path`; `per_feature`: table t is feature t's (the built-in models), named
    `feature` too."""
    os.makedirs(directory)
    dense = os.path.join(f"{name}_dense", "1", "model.savedmodel")
    write_dense(os.path.join(directory, dense))
    listed = []
    dynamic = dynamic or {}
    for t, table_rows, ids, rows in tables:
        ids, rows = np.ascontiguousarray(ids, IDS_DTYPE), np.ascontiguousarray(rows, ROWS_DTYPE)
        if not ids.size and t not in dynamic:
            continue
        entry = {"table": t, **({"feature": t} if per_feature else {}), "count": int(ids.size),
                 "dim": int(rows.shape[1]), "table_rows": int(table_rows),
                 "ids": _save(os.path.join(directory, f"table_{t}.ids.npy"), ids),
                 "rows": _save(os.path.join(directory, f"table_{t}.rows.npy"), rows)}
        if t in dynamic:
            live, evicted = dynamic[t]
            live = np.ascontiguousarray(live, IDS_DTYPE)
            entry.update(dynamic=True, live_count=int(live.size), evicted=int(evicted),
                         live=_save(os.path.join(directory, f"table_{t}.live.npy"), live))
        listed.append(entry)
    written = {t[k]["file"]: t[k]["crc32"] for t in listed for k in ("ids", "rows", "live") if k in t}
    info = {"format": DELTA_FORMAT, "version": DELTA_VERSION, "name": name, "base": base.to_json(),
            "new": new.to_json(), "signature": signature, "dense_model": dense, "tables": listed,
            FILES: file_entries(directory, DELTA_INFO, written)}
    write_json(os.path.join(directory, DELTA_INFO), info)
    return info
