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
shared file system). A streamed entry (its variable a `RowSource`: a table in a disk store, larger
than memory) is saved and restored BLOCK_BYTES at a time, never whole in memory; `read_blocks`
reads any 2-D tensor of a checkpoint so (deployment's table files), `gather_rows` some of its rows
(deployment's deltas).
"""
import dataclasses
import json
import os
import shutil
from typing import Dict, Iterator, List, Optional, Protocol, Sequence, Set, Tuple

import numpy as np

from utils.errors import CheckpointError

MANIFEST = "manifest.json"
LATEST = "latest"
BEST = "best"
KEEP = 2
BLOCK_BYTES = 64 << 20   # the most a streamed entry's block of rows holds (it holds at least one row)


class RowSource(Protocol):
    """A 2-D array [rows, cols] kept outside memory (a table in a disk store), read and written
    in blocks of rows; `shape` holds Python ints, `dtype` is a numpy dtype."""
    shape: Tuple[int, int]
    dtype: np.dtype

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop): [stop - start, cols] of `dtype`."""

    def write_rows(self, start: int, values: np.ndarray) -> None:
        """Sets rows [start, start + len(values)) to `values` [n, cols] of `dtype`."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """A variable and where it sits in its logical tensor.

    The variable's first `num_rows` rows (all when None) are rows [row_start, row_start +
    num_rows) and its columns are [col_start, col_start + width) of tensor `name` of shape `shape`.
    `replicated`: every rank holds the whole tensor (rank 0 saves it).
    `streamed`: the variable is a `RowSource` (it has `read_rows`): 2-D, `num_rows` None, saved
    and restored in blocks of at most BLOCK_BYTES; otherwise it is a tf.Variable (or has `numpy`
    and `assign`).
    """
    name: str
    variable: object
    shape: tuple
    row_start: int = 0
    col_start: int = 0
    num_rows: Optional[int] = None
    replicated: bool = False

    def __post_init__(self):
        if self.streamed and (self.num_rows is not None or len(self.variable.shape) != 2):
            raise ValueError(f"{self.name}: a streamed entry is 2-D and has num_rows None")

    @property
    def streamed(self) -> bool:
        return hasattr(self.variable, "read_rows")

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


def _blocks(rows: int, cols: int, *dtypes) -> Iterator[Tuple[int, int]]:
    """[start, stop) cutting `rows` rows of `cols` columns into blocks of at most BLOCK_BYTES in
    each of `dtypes` (at least one row each)."""
    step = max(1, BLOCK_BYTES // max(1, cols * max(np.dtype(t).itemsize for t in dtypes)))
    return ((start, min(rows, start + step)) for start in range(0, rows, step))


def _save_variable(f, entry: Entry) -> np.dtype:
    """Writes the .npy of a (not streamed) entry's rows; returns their dtype."""
    value = entry.variable.numpy()
    if entry.num_rows is not None:
        value = value[:entry.num_rows]
    np.save(f, value)
    return value.dtype


def _save_streamed(f, entry: Entry) -> np.dtype:
    """Writes the .npy of a streamed entry (the bytes np.save writes) a block at a time; returns
    its dtype."""
    source = entry.variable
    rows, cols = source.shape
    dtype = np.dtype(source.dtype)
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtype),
                                             "fortran_order": False, "shape": (rows, cols)})
    for start, stop in _blocks(rows, cols, dtype):
        block = np.ascontiguousarray(source.read_rows(start, stop), dtype)
        if block.shape != (stop - start, cols):
            raise CheckpointError(f"{entry.name}: read_rows({start}, {stop}) gave shape {block.shape}, "
                                  f"not {(stop - start, cols)}")
        f.write(block.data)
    return dtype


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
        file = _piece_file(e)
        with open(os.path.join(tmp, file), "wb") as f:
            dtype = (_save_streamed if e.streamed else _save_variable)(f, e)
            f.flush()
            os.fsync(f.fileno())
        (a, b), (c, d) = e.region
        pieces.append({"tensor": e.name, "shape": list(e.shape), "dtype": dtype.name,
                       "file": file, "rows": [a, b], "cols": [c, d]})
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
    _check_coverage(manifest["path"], entry, t)
    return _read_region(manifest["path"], entry, t)


def read_blocks(path_or_manifest, name: str, dtype=None) -> Iterator[Tuple[int, np.ndarray]]:
    """The 2-D tensor `name` [rows, cols] of a checkpoint (its path, or a manifest from
    read_manifest) a block of rows at a time, never whole in memory: (start, rows [start, start + n)
    as [n, cols] of `dtype`, default the tensor's), each block at most BLOCK_BYTES (at least one row)
    in both dtypes, read from the pieces it overlaps (memory-mapped)."""
    manifest = path_or_manifest if isinstance(path_or_manifest, dict) else read_manifest(path_or_manifest)
    ckpt, tensor = manifest["path"], manifest["tensors"].get(name)
    if tensor is None or len(tensor["shape"]) != 2:
        raise CheckpointError(f"{ckpt}: no 2-D tensor {name}")
    rows, cols = tensor["shape"]
    dtype = np.dtype(dtype or tensor["dtype"])
    entry = Entry(name, np.broadcast_to(np.zeros((), tensor["dtype"]), (rows, cols)), (rows, cols))
    _check_pieces(ckpt, name, tensor)
    _check_coverage(ckpt, entry, tensor)
    for start, stop in _blocks(rows, cols, tensor["dtype"], dtype):
        yield start, _read_region(ckpt, entry, tensor, (start, stop)).astype(dtype, copy=False)


def gather_rows(manifest: dict, name: str, ids: np.ndarray, dtype=None) -> np.ndarray:
    """Rows `ids` ([n] ascending) of the 2-D tensor `name` of a checkpoint (its manifest, from
    read_manifest) as [n, cols] of `dtype` (default the tensor's), read from the pieces that hold
    them (memory-mapped): only those rows are read."""
    ckpt, tensor = manifest["path"], manifest["tensors"].get(name)
    if tensor is None or len(tensor["shape"]) != 2:
        raise CheckpointError(f"{ckpt}: no 2-D tensor {name}")
    rows, cols = tensor["shape"]
    _check_pieces(ckpt, name, tensor)
    _check_coverage(ckpt, Entry(name, np.broadcast_to(np.zeros((), tensor["dtype"]), (rows, cols)), (rows, cols)),
                    tensor)
    out = np.empty((len(ids), cols), dtype or tensor["dtype"])
    for p in tensor["pieces"]:
        (pa, pb), (pc, pd) = p["rows"], p["cols"]
        lo, hi = np.searchsorted(ids, [pa, pb])
        if lo < hi:
            values = np.load(os.path.join(ckpt, p["file"]), mmap_mode="r")
            out[lo:hi, pc:pd] = values[ids[lo:hi] - pa]
    return out


def _overlaps(tensor: dict, rows: Tuple[int, int], cols: Tuple[int, int]):
    """(piece, rows, cols) of every piece of a 2-D `tensor` that overlaps rows x cols (tensor
    [start, stop) pairs), with the overlap's rows and columns; from the manifest alone."""
    (a, b), (c, d) = rows, cols
    for p in tensor["pieces"]:
        (pa, pb), (pc, pd) = p["rows"], p["cols"]
        ra, rb, ca, cb = max(a, pa), min(b, pb), max(c, pc), min(d, pd)
        if ra < rb and ca < cb:
            yield p, (ra, rb), (ca, cb)


def _check_coverage(ckpt: str, entry: Entry, tensor: dict):
    """Raises unless the pieces of `tensor` (which do not overlap) cover the entry's region."""
    if len(tensor["shape"]) < 2:
        return
    (a, b), (c, d) = entry.region
    covered = sum((rb - ra) * (cb - ca) for _, (ra, rb), (ca, cb) in _overlaps(tensor, (a, b), (c, d)))
    if covered != (b - a) * (d - c):
        raise CheckpointError(f"{ckpt}: the pieces of {entry.name} do not cover rows {a}:{b}, columns {c}:{d}")


def _read_region(ckpt: str, entry: Entry, tensor: dict, rows: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """The entry's region [rows, cols] (only tensor rows [start, stop) of it with `rows`) from
    the pieces it overlaps, which _check_coverage has found to cover it."""
    if len(tensor["shape"]) < 2:
        return np.load(os.path.join(ckpt, tensor["pieces"][0]["file"]))
    (a, b), (c, d) = entry.region
    a, b = rows or (a, b)
    out = np.empty((b - a, d - c), tensor["dtype"])
    for p, (ra, rb), (ca, cb) in _overlaps(tensor, (a, b), (c, d)):
        (pa, _), (pc, _) = p["rows"], p["cols"]
        values = np.load(os.path.join(ckpt, p["file"]), mmap_mode="r")
        out[ra - a:rb - a, ca - c:cb - c] = values[ra - pa:rb - pa, ca - pc:cb - pc]
    return out


def _restore_streamed(ckpt: str, entry: Entry, tensor: dict):
    """Writes a streamed entry's region, read a block of rows at a time, into its source."""
    source = entry.variable
    (a, b), (c, d) = entry.region
    for start, stop in _blocks(b - a, d - c, tensor["dtype"], source.dtype):
        block = _read_region(ckpt, entry, tensor, (a + start, a + stop))
        source.write_rows(start, block.astype(source.dtype, copy=False))


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
    `expected` (every logical tensor of the model), shapes, every piece file this rank reads, and
    that the pieces cover each entry's region. Streamed entries are written a block at a time.
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
        _check_coverage(ckpt, e, t)
    for e in entries:
        if e.streamed:
            _restore_streamed(ckpt, e, tensors[e.name])
            continue
        value = _read_region(ckpt, e, tensors[e.name])
        if e.num_rows is not None and e.num_rows < e.variable.shape[0]:
            e.variable[:e.num_rows].assign(value)
        else:
            e.variable.assign(value)
    return manifest
