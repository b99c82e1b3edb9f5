"""Sharded checkpoints, independent of the world size, written atomically.

Every checkpointed tensor has a logical name and full shape (an embedding table and its
optimizer slots are one tensor each, however they are sharded). Each rank writes the pieces it
owns; nothing is gathered onto one rank. Layout of a checkpoint root:

    ROOT/ckpt-<step>/manifest.json     step, write sequence, model signature, world size, tensor -> pieces
    ROOT/ckpt-<step>/<tensor>.r<a>-<b>.c<c>-<d>.npy    rows a:b, columns c:d of the tensor
    ROOT/latest                        name of the newest complete checkpoint
    ROOT/best                          name and evaluation AUC of the best one (--keep_best_checkpoint)

A checkpoint is written under a temporary name and renamed by rank 0 once every rank has
written its pieces; `latest` is replaced atomically afterwards, so a crash (or a dead rank) at
any point leaves the previous checkpoint readable. Nothing is renamed over: a step already in
ROOT (a run restored from an older checkpoint) is written as ckpt-<step>-<sequence>. The `keep`
newest writes (by sequence, not step) are kept, and always those `latest` and `best` name.
Restoring reads, for every variable of this rank, the parts of the saved pieces it overlaps
(memory-mapped), so a checkpoint written at N ranks restores at M. All ranks must see ROOT (a
shared file system).
"""
import dataclasses
import json
import os
import shutil
from typing import Dict, List, Optional, Sequence, Set

import numpy as np

from utils.errors import CheckpointError

MANIFEST = "manifest.json"
LATEST = "latest"
BEST = "best"
KEEP = 2


@dataclasses.dataclass(frozen=True)
class Entry:
    """A variable and where it sits in its logical tensor.

    The variable's first `num_rows` rows (all when None) are rows [row_start, row_start +
    num_rows) and its columns are [col_start, col_start + width) of tensor `name` of shape `shape`.
    `replicated`: every rank holds the whole tensor (rank 0 saves it).
    """
    name: str
    variable: object
    shape: tuple
    row_start: int = 0
    col_start: int = 0
    num_rows: Optional[int] = None
    replicated: bool = False

    @property
    def region(self):
        shape = tuple(self.variable.shape)
        if len(shape) < 2:
            return (0, self.shape[0] if shape else 0), (0, 0)
        num_rows = shape[0] if self.num_rows is None else self.num_rows
        return (self.row_start, self.row_start + num_rows), (self.col_start, self.col_start + shape[1])


def replicated_entries(named: Dict[str, object]) -> List[Entry]:
    """Entries of whole variables every rank holds (rank 0 saves them), by tensor name, sorted."""
    return [Entry(name, v, tuple(v.shape), replicated=True) for name, v in sorted(named.items())]


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path, value):
    _write_text(path, json.dumps(value, indent=1))


def _write_text(path, text):
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _piece_file(entry: Entry) -> str:
    (a, b), (c, d) = entry.region
    return f"{entry.name.replace('/', '.')}.r{a}-{b}.c{c}-{d}.npy"


def save(root: str, entries: Sequence[Entry], step: int, signature: dict, comm, state: dict = None,
         keep: int = KEEP) -> str:
    """Writes a new checkpoint of `step` (every rank its pieces), points ROOT/latest at it and
    keeps the `keep` newest writes (see _prune); returns its path."""
    tmp = os.path.join(root, f".tmp-ckpt-{step}")
    if comm.rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.barrier(f"checkpoint_{step}_start")
    pieces = []
    for e in entries:
        if e.replicated and comm.rank != 0:
            continue
        value = e.variable.numpy()
        if e.num_rows is not None:
            value = value[:e.num_rows]
        (a, b), (c, d) = e.region
        pieces.append({"tensor": e.name, "shape": list(e.shape), "dtype": value.dtype.name,
                       "file": _piece_file(e), "rows": [a, b], "cols": [c, d]})
        with open(os.path.join(tmp, pieces[-1]["file"]), "wb") as f:
            np.save(f, value)
            f.flush()
            os.fsync(f.fileno())
    _write_json(os.path.join(tmp, f"rank-{comm.rank}.json"), pieces)
    comm.barrier(f"checkpoint_{step}_written")
    final = _commit(root, tmp, step, signature, state, comm.size, keep) if comm.rank == 0 else None
    return comm.broadcast_object(final, f"checkpoint_{step}_done")


def _commit(root, tmp, step, signature, state, world_size, keep) -> str:
    tensors = {}
    for r in range(world_size):
        rank_file = os.path.join(tmp, f"rank-{r}.json")
        with open(rank_file) as f:
            for p in json.load(f):
                t = tensors.setdefault(p["tensor"], {"shape": p["shape"], "dtype": p["dtype"], "pieces": []})
                t["pieces"].append({k: p[k] for k in ("file", "rows", "cols")})
        os.remove(rank_file)
    sequence = 1 + max((seq for seq, _, _ in _written(root)), default=0)
    name = f"ckpt-{step}"
    if os.path.exists(os.path.join(root, name)):
        name = f"ckpt-{step}-{sequence}"
    manifest = {"step": int(step), "sequence": sequence, "signature": signature, "state": state or {},
                "world_size": world_size, "tensors": dict(sorted(tensors.items()))}
    _write_json(os.path.join(tmp, MANIFEST), manifest)
    os.rename(tmp, os.path.join(root, name))
    _point(root, LATEST, name + "\n")
    _prune(root, keep)
    return os.path.join(root, name)


def _written(root):
    """(sequence, step, name) of every complete checkpoint in ROOT (sequence 0: written before
    sequences were recorded)."""
    found = []
    for d in os.listdir(root):
        if d.startswith("ckpt-") and os.path.isfile(os.path.join(root, d, MANIFEST)):
            with open(os.path.join(root, d, MANIFEST)) as f:
                m = json.load(f)
            found.append((m.get("sequence", 0), m["step"], d))
    return found


def _point(root, pointer, text):
    """Replaces ROOT/<pointer> (its first line names a checkpoint) atomically."""
    _write_text(os.path.join(root, pointer + ".tmp"), text)
    os.replace(os.path.join(root, pointer + ".tmp"), os.path.join(root, pointer))
    _fsync_dir(root)


def _pointed(root, pointer) -> Optional[str]:
    """The checkpoint name ROOT/<pointer> holds, or None without one."""
    try:
        with open(os.path.join(root, pointer)) as f:
            return f.readline().strip()
    except FileNotFoundError:
        return None


def _prune(root, keep):
    """Removes all but the `keep` newest checkpoint writes of ROOT, except those `latest` and
    `best` name, and what interrupted saves and removals left behind. A checkpoint is renamed
    before its files go, so a half-removed one never looks complete."""
    for d in os.listdir(root):
        if d.startswith((".old-ckpt-", ".tmp-ckpt-")):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    named = {_pointed(root, LATEST), _pointed(root, BEST)}
    for _, _, d in sorted(_written(root), reverse=True)[keep:]:
        if d not in named:
            os.rename(os.path.join(root, d), os.path.join(root, f".old-{d}"))
            shutil.rmtree(os.path.join(root, f".old-{d}"))


def mark_best(root: str, path: str, auc: float, keep: int = KEEP):
    """Points ROOT/best at the checkpoint `path`, whose evaluation AUC is `auc`, then prunes."""
    _point(root, BEST, f"{os.path.basename(path)}\nauc={auc!r}\n")
    _prune(root, keep)


def best_auc(root: str) -> float:
    """The AUC ROOT/best records, or -inf without one."""
    file = os.path.join(root, BEST)
    if not os.path.isfile(file):
        return float("-inf")
    with open(file) as f:
        text = f.read()
    try:
        return float(text.split("auc=", 1)[1])
    except (IndexError, ValueError):
        raise CheckpointError(f"{file}: no auc=<value> line; not written by --keep_best_checkpoint")


def resolve(path: str) -> str:
    """A checkpoint directory from itself, a root (the one its `latest` names), or a pointer
    file (ROOT/latest, ROOT/best)."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    pointer_file = os.path.isfile(path) and os.path.basename(path) in (LATEST, BEST)
    root, pointer = os.path.split(path) if pointer_file else (path, LATEST)
    name = _pointed(root, pointer)
    if name is None:
        raise CheckpointError(f"{path}: no checkpoint here (neither {MANIFEST} nor {LATEST})")
    if not os.path.isfile(os.path.join(root, name, MANIFEST)):
        raise CheckpointError(f"{os.path.join(root, pointer)}: names {name}, which is not a complete checkpoint")
    return os.path.join(root, name)


def read_manifest(path: str) -> dict:
    ckpt = resolve(path)
    with open(os.path.join(ckpt, MANIFEST)) as f:
        manifest = json.load(f)
    manifest["path"] = ckpt
    return manifest


def read_tensor(path: str, name: str) -> np.ndarray:
    """One whole logical tensor of a checkpoint, assembled from its pieces."""
    manifest = read_manifest(path)
    t = manifest["tensors"][name]
    entry = Entry(name, np.empty(t["shape"], t["dtype"]), tuple(t["shape"]))
    return _read_region(manifest["path"], entry, t)


def _read_region(ckpt: str, entry: Entry, tensor: dict) -> np.ndarray:
    (a, b), (c, d) = entry.region
    shape = tuple(tensor["shape"])
    if len(shape) < 2:
        piece = tensor["pieces"][0]
        return np.load(os.path.join(ckpt, piece["file"]))
    out = np.empty((b - a, d - c), tensor["dtype"])
    covered = 0
    for p in tensor["pieces"]:
        (pa, pb), (pc, pd) = p["rows"], p["cols"]
        ra, rb, ca, cb = max(a, pa), min(b, pb), max(c, pc), min(d, pd)
        if ra >= rb or ca >= cb:
            continue
        values = np.load(os.path.join(ckpt, p["file"]), mmap_mode="r")
        out[ra - a:rb - a, ca - c:cb - c] = values[ra - pa:rb - pa, ca - pc:cb - pc]
        covered += (rb - ra) * (cb - ca)
    if covered != out.size:
        raise CheckpointError(f"{ckpt}: the pieces of {entry.name} do not cover rows {a}:{b}, columns {c}:{d}")
    return out


def _check_pieces(ckpt: str, name: str, tensor: dict):
    for p in tensor["pieces"]:
        file = os.path.join(ckpt, p["file"])
        try:
            values = np.load(file, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{file}: cannot read tensor {name}: {e}")
        expected = (p["rows"][1] - p["rows"][0], p["cols"][1] - p["cols"][0]) if len(tensor["shape"]) >= 2 \
            else tuple(tensor["shape"])
        if tuple(values.shape) != expected:
            raise CheckpointError(f"{file}: tensor {name} has shape {tuple(values.shape)}, "
                                  f"the manifest says {expected}")


def restore(path: str, entries: Sequence[Entry], signature: dict, expected: Set[str], extra_ok: bool = False,
            optional: Set[str] = frozenset()) -> dict:
    """Loads this rank's variables from the checkpoint at `path` and returns its manifest.

    Everything is checked before any variable changes: the signature, the tensor names against
    `expected` (every logical tensor of the model), shapes, and every piece file this rank reads.
    `extra_ok`: tensors beyond `expected` are left unread (a model without its optimizer state).
    `optional`: tensors that either side may lack (a variable the checkpoint lacks keeps its value).
    """
    manifest = read_manifest(path)
    ckpt = manifest["path"]
    for key, value in signature.items():
        if manifest["signature"].get(key) != value:
            raise CheckpointError(f"{ckpt}: written with {key}={manifest['signature'].get(key)}, "
                                  f"this run has {key}={value}")
    tensors: Dict[str, dict] = manifest["tensors"]
    missing, extra = sorted(expected - set(tensors) - optional), sorted(set(tensors) - expected - optional)
    if missing or (extra and not extra_ok):
        raise CheckpointError(f"{ckpt}: tensors differ from this model's "
                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
    entries = [e for e in entries if e.name in tensors]
    for e in entries:
        t = tensors[e.name]
        if tuple(t["shape"]) != tuple(e.shape):
            raise CheckpointError(f"{ckpt}: tensor {e.name} has shape {tuple(t['shape'])}, "
                                  f"the model expects {tuple(e.shape)}")
        _check_pieces(ckpt, e.name, t)
    for e in entries:
        value = _read_region(ckpt, e, tensors[e.name])
        if e.num_rows is not None and e.num_rows < e.variable.shape[0]:
            e.variable[:e.num_rows].assign(value)
        else:
            e.variable.assign(value)
    return manifest
