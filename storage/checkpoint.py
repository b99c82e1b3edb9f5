"""Sharded checkpoints, independent of the world size, written atomically.

Every checkpointed tensor has a logical name and full shape (an embedding table and its
optimizer slots are one tensor each, however they are sharded). Each rank writes the pieces it
owns; nothing is gathered onto one rank. Layout of a checkpoint root:

    ROOT/ckpt-<step>/manifest.json     step, write sequence, model signature, world size, tensor -> pieces,
                                       piece file -> CRC-32 (CHECKSUMS)
    ROOT/ckpt-<step>/<tensor>.r<a>-<b>.c<c>-<d>.npy    rows a:b, columns c:d of the tensor (a 2-D one);
                                       a tensor of another rank (a scalar, a bias, a 3-D Keras
                                       kernel) is one whole piece, rows 0:shape[0], columns 0:0
    ROOT/latest                        name of the newest complete checkpoint
    ROOT/best                          name of the best one and the figure it was chosen by,
                                       "auc=<value>" or "logloss=<value>" (--keep_best_checkpoint)

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

Every piece's CRC-32 (zlib's, of its whole file; no faster CRC-32C is at hand: docs/benchmarks.md)
is computed as it is written and recorded in the manifest. Every reader verifies the pieces it
reads (a piece whole, once) before using them, unless told not to (`verify=False`); a mismatch, or
a manifest without the checksums, is a CheckpointError naming the file. Every manifest read is
checked first (`read_manifest`): one that cannot be read, is not JSON, lacks a field or names a
piece outside its checkpoint's folder is a CheckpointError naming it; a save counts and prunes
only the checkpoints of ROOT whose manifests pass (another is left as it is). A save that runs out
of space (ENOSPC, EDQUOT) on any rank removes its partial files and raises, on every rank, a
StoreError naming ROOT, the bytes its pieces take and the bytes free when the save began; the
earlier checkpoints and `latest` stay as they were. So does marking the best checkpoint
(`mark_best`): `best` stays as it was.
"""
import contextlib
import dataclasses
import errno
import io
import json
import os
import shutil
from typing import Dict, Iterator, List, Optional, Protocol, Sequence, Set, Tuple

import numpy as np

from utils.errors import CheckpointError, StoreError
from utils.files import Checksummed, file_crc32

MANIFEST = "manifest.json"
LATEST = "latest"
BEST = "best"
KEEP = 2
BLOCK_BYTES = 64 << 20   # the most a streamed entry's block of rows holds (it holds at least one row)
CHECKSUMS = "crc32"   # the manifest's key of {piece file: zlib.crc32 of the file}
OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


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
    `sized_by_checkpoint`: the variable is the whole tensor, `shape` its shape when saved; a
    restore takes the shape from the checkpoint's manifest and assigns the whole tensor as saved
    (a dynamic table's live rows, whose count only the checkpoint knows).
    """
    name: str
    variable: object
    shape: tuple
    row_start: int = 0
    col_start: int = 0
    num_rows: Optional[int] = None
    replicated: bool = False
    sized_by_checkpoint: bool = False

    def __post_init__(self):
        if self.streamed and (self.num_rows is not None or len(self.variable.shape) != 2):
            raise ValueError(f"{self.name}: a streamed entry is 2-D and has num_rows None")

    @property
    def streamed(self) -> bool:
        return hasattr(self.variable, "read_rows")

    @property
    def region(self):
        shape = tuple(self.shape) if self.sized_by_checkpoint else tuple(self.variable.shape)
        if len(shape) != 2:   # one whole piece
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


@contextlib.contextmanager
def _writing(path):
    """`path` opened for writing bytes, synced when the block ends; an OSError names the path."""
    try:
        with open(path, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        e.filename = e.filename or path
        raise


def _write_json(path, value):
    _write_text(path, json.dumps(value, indent=1))


def _write_text(path, text):
    with _writing(path) as f:
        f.write(text.encode())


def _piece_file(entry: Entry) -> str:
    (a, b), (c, d) = entry.region
    return f"{entry.name.replace('/', '.')}.r{a}-{b}.c{c}-{d}.npy"


def _piece_shape(entry: Entry) -> tuple:
    """The shape of the entry's piece: its region's (a tensor not of 2 dimensions whole)."""
    if len(entry.variable.shape) != 2:
        return tuple(entry.variable.shape)
    (a, b), (c, d) = entry.region
    return b - a, d - c


def _header(shape: tuple, dtype: np.dtype) -> bytes:
    """The .npy header np.save writes for a C-ordered array of `shape` and `dtype`."""
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                             "shape": tuple(shape)})
    return f.getvalue()


def _piece_bytes(entry: Entry) -> int:
    """The size of the entry's .npy file."""
    shape = _piece_shape(entry)
    dtype = np.dtype(getattr(entry.variable.dtype, "as_numpy_dtype", entry.variable.dtype))
    return len(_header(shape, dtype)) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


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
    f.write(_header((rows, cols), dtype))
    for start, stop in _blocks(rows, cols, dtype):
        block = np.ascontiguousarray(source.read_rows(start, stop), dtype)
        if block.shape != (stop - start, cols):
            raise CheckpointError(f"{entry.name}: read_rows({start}, {stop}) gave shape {block.shape}, "
                                  f"not {(stop - start, cols)}")
        f.write(block.data)
    return dtype


def _start(root: str, tmp: str):
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)


def _write_pieces(tmp: str, entries: Sequence[Entry], rank: int):
    """Writes the entries' pieces into `tmp` and their list, rank-<rank>.json (tensor, shape,
    dtype, file, rows, cols, CHECKSUMS: the file's CRC-32)."""
    pieces = []
    for e in entries:
        file = _piece_file(e)
        with _writing(os.path.join(tmp, file)) as f:
            checksummed = Checksummed(f)
            dtype = (_save_streamed if e.streamed else _save_variable)(checksummed, e)
        (a, b), (c, d) = e.region
        pieces.append({"tensor": e.name, "shape": list(e.shape), "dtype": dtype.name,
                       "file": file, "rows": [a, b], "cols": [c, d], CHECKSUMS: checksummed.crc})
    _write_json(os.path.join(tmp, f"rank-{rank}.json"), pieces)


def _unless_out_of_space(write, *args):
    """(write(*args), None), or (None, (errno name, path)) if it ran out of space (ENOSPC, EDQUOT);
    other errors propagate."""
    try:
        return write(*args), None
    except OSError as e:
        if e.errno not in OUT_OF_SPACE:
            raise
        return None, (errno.errorcode[e.errno], e.filename)


def _free_bytes(path: str) -> int:
    """The bytes this user may still write on the file system of `path` (or of its nearest
    existing parent)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    s = os.statvfs(path)
    return s.f_bavail * s.f_frsize


def temporary_path(root: str, step: int) -> str:
    """Where `save` writes the checkpoint of `step` before renaming it into place."""
    return os.path.join(root, f".tmp-ckpt-{step}")


def save(root: str, entries: Sequence[Entry], step: int, signature: dict, comm, state: dict = None,
         keep: int = KEEP) -> str:
    """Writes a new checkpoint of `step` (every rank its pieces), points ROOT/latest at it and
    keeps the `keep` newest writes (see _prune); returns its path. When any rank runs out of space,
    the ranks agree, the partial checkpoint is removed and every rank raises the same StoreError."""
    tmp = temporary_path(root, step)
    mine = [e for e in entries if comm.rank == 0 or not e.replicated]
    free, failure = 0, None
    if comm.rank == 0:
        free = _free_bytes(root)
        failure = _unless_out_of_space(_start, root, tmp)[1]
    # (bytes of this rank's pieces, bytes free when the save began (rank 0), failure): also the start barrier
    plans = comm.allgather_object((sum(map(_piece_bytes, mine)), free, failure), f"checkpoint_{step}_start")
    failures = [plan[2] for plan in plans]
    if not any(failures):
        failure = _unless_out_of_space(_write_pieces, tmp, mine, comm.rank)[1]
        failures = comm.allgather_object(failure, f"checkpoint_{step}_written")
    if not any(failures):
        final = None
        if comm.rank == 0:
            final, failure = _unless_out_of_space(_commit, root, tmp, step, signature, state, comm.size, keep)
        final, failure = comm.broadcast_object((final, failure), f"checkpoint_{step}_done")
        if failure is None:
            return final
        failures = [failure]
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(os.path.join(root, LATEST + ".tmp")):
            os.remove(os.path.join(root, LATEST + ".tmp"))
    comm.barrier(f"checkpoint_{step}_removed")   # no rank ends the run before the partial checkpoint is gone
    rank = next(r for r, f in enumerate(failures) if f)
    code, path = failures[rank]
    where = f"{code}{f' on rank {rank}' if comm.size > 1 else ''} writing {os.path.relpath(path, root)}"
    total, free, latest = sum(plan[0] for plan in plans), plans[0][1], _pointed(root, LATEST)
    raise StoreError(f"{root}: out of space ({where}) saving the checkpoint of step {step}: its pieces take "
                     f"{total:,} bytes ({total / 2 ** 20:.1f} MiB), {free:,} ({free / 2 ** 20:.1f} MiB) were free "
                     f"when the save began; its partial files are removed, "
                     f"{f'{LATEST} still names {latest}' if latest else 'no earlier checkpoint'}")


def _commit(root, tmp, step, signature, state, world_size, keep) -> str:
    tensors, checksums = {}, {}
    for r in range(world_size):
        rank_file = os.path.join(tmp, f"rank-{r}.json")
        with open(rank_file) as f:
            for p in json.load(f):
                t = tensors.setdefault(p["tensor"], {"shape": p["shape"], "dtype": p["dtype"], "pieces": []})
                t["pieces"].append({k: p[k] for k in ("file", "rows", "cols")})
                checksums[p["file"]] = p[CHECKSUMS]
        os.remove(rank_file)
    sequence = 1 + max((seq for seq, _, _ in _written(root)), default=0)
    name = f"ckpt-{step}"
    if os.path.exists(os.path.join(root, name)):
        name = f"ckpt-{step}-{sequence}"
    manifest = {"step": int(step), "sequence": sequence, "signature": signature, "state": state or {},
                "world_size": world_size, "tensors": dict(sorted(tensors.items())),
                CHECKSUMS: dict(sorted(checksums.items()))}
    _write_json(os.path.join(tmp, MANIFEST), manifest)
    os.rename(tmp, os.path.join(root, name))
    try:
        _point(root, LATEST, name + "\n")
    except OSError as e:
        if e.errno in OUT_OF_SPACE:   # `latest` still names the previous checkpoint: this one goes
            _remove(root, name)
        raise
    _prune(root, keep)
    return os.path.join(root, name)


def _written(root):
    """(sequence, step, name) of every complete checkpoint in ROOT whose manifest reads (sequence 0:
    written before sequences were recorded)."""
    found = []
    for d in os.listdir(root):
        if d.startswith("ckpt-") and os.path.isfile(os.path.join(root, d, MANIFEST)):
            try:
                m = _load_manifest(os.path.join(root, d))
            except CheckpointError:   # damaged: neither counted nor pruned, for its owner to look at
                continue
            found.append((m.get("sequence", 0), m["step"], d))
    return found


def _point(root, pointer, text):
    """Replaces ROOT/<pointer> (its first line names a checkpoint) atomically."""
    _write_text(os.path.join(root, pointer + ".tmp"), text)
    os.replace(os.path.join(root, pointer + ".tmp"), os.path.join(root, pointer))
    _fsync_dir(root)


def _pointed(root, pointer) -> Optional[str]:
    """The checkpoint name ROOT/<pointer> holds, or None without one; CheckpointError when it
    cannot be read."""
    file = os.path.join(root, pointer)
    try:
        with open(file) as f:
            return f.readline().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read it: {e.strerror}")
    except ValueError as e:   # not text
        raise CheckpointError(f"{file}: not a checkpoint pointer ({e})")


def _prune(root, keep):
    """Removes all but the `keep` newest checkpoint writes of ROOT, except those `latest` and
    `best` name, and what interrupted saves and removals left behind."""
    for d in os.listdir(root):
        if d.startswith((".old-ckpt-", ".tmp-ckpt-")):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    named = {_pointed(root, LATEST), _pointed(root, BEST)}
    for _, _, d in sorted(_written(root), reverse=True)[keep:]:
        if d not in named:
            _remove(root, d)


def _remove(root, name):
    """Removes the checkpoint ROOT/<name>, renamed first so that a half-removed one never looks complete."""
    os.rename(os.path.join(root, name), os.path.join(root, f".old-{name}"))
    shutil.rmtree(os.path.join(root, f".old-{name}"))


def mark_best(root: str, path: str, value: float, comm, keep: int = KEEP, metric: str = "auc"):
    """Points ROOT/best at the checkpoint `path`, whose evaluation `metric` is `value`, then prunes
    (rank 0; every rank returns once it is done). Out of space, ROOT/best is left as it was, its
    partial file removed, and every rank raises the same StoreError naming ROOT and the bytes."""
    name = os.path.basename(path)
    text, failure = f"{name}\n{metric}={value!r}\n", None
    if comm.rank == 0:
        free = _free_bytes(root)
        failure = _unless_out_of_space(_point, root, BEST, text)[1]
        if failure is None:
            _prune(root, keep)
        else:
            if os.path.exists(os.path.join(root, BEST + ".tmp")):
                os.remove(os.path.join(root, BEST + ".tmp"))
            failure = (*failure, free, _pointed(root, BEST))
    failure = comm.broadcast_object(failure, f"best_{name}")
    if failure:
        code, written, free, best = failure
        raise StoreError(f"{root}: out of space ({code} writing {os.path.relpath(written, root)}) marking {name} the "
                         f"best checkpoint ({metric} {value:.5f}): {BEST} takes {len(text)} bytes, {free:,} were "
                         f"free; its partial file is removed, {name} is saved, "
                         f"{f'{BEST} still names {best}' if best else f'no {BEST} was written before'}")


def best_value(root: str, metric: str = "auc") -> Optional[float]:
    """The `metric` value ROOT/best records, or None without one; a CheckpointError naming the
    file where it records another figure or none."""
    file = os.path.join(root, BEST)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        lines = f.read().splitlines()[1:]
    recorded = dict(line.split("=", 1) for line in lines if "=" in line)
    if metric not in recorded and recorded:
        raise CheckpointError(f"{file}: the best checkpoint was chosen by {', '.join(recorded)}, not {metric}; "
                              f"give --keep_best_metric={next(iter(recorded))}, or another --save_checkpoint_path")
    try:
        return float(recorded[metric])
    except (KeyError, ValueError):
        raise CheckpointError(f"{file}: no {metric}=<value> line; not written by --keep_best_checkpoint")


def _present(path: str) -> bool:
    """Whether `path` exists; CheckpointError when that cannot be known (a symbolic link loop, no
    permission)."""
    try:
        os.stat(path)
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it: {e.strerror}")


def resolve(path: str) -> str:
    """A checkpoint directory from itself, a root (the one its `latest` names), or a pointer
    file (ROOT/latest, ROOT/best)."""
    if _present(path) and _present(os.path.join(path, MANIFEST)):
        return path
    pointer_file = os.path.isfile(path) and os.path.basename(path) in (LATEST, BEST)
    root, pointer = os.path.split(path) if pointer_file else (path, LATEST)
    name = _pointed(root, pointer)
    if name is None:
        raise CheckpointError(f"{path}: no checkpoint here (neither {MANIFEST} nor {LATEST})")
    if not _present(os.path.join(root, name, MANIFEST)):
        raise CheckpointError(f"{os.path.join(root, pointer)}: names {name}, which is not a complete checkpoint")
    return os.path.join(root, name)


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint at `path` (see `resolve`), checked (`_load_manifest`), with
    "path": the checkpoint's directory."""
    ckpt = resolve(path)
    manifest = _load_manifest(ckpt)
    manifest["path"] = ckpt
    return manifest


# The manifest's fields every reader relies on, and their JSON types.
_FIELDS = {"step": int, "world_size": int, "signature": dict, "state": dict, "tensors": dict}


def _load_manifest(ckpt: str) -> dict:
    """The manifest of the checkpoint directory `ckpt`; CheckpointError, one line naming it, unless
    it reads as JSON, has _FIELDS, its tensors' shapes, dtypes and pieces (each a file name in
    `ckpt`, no symbolic link out of it, with rows and columns) and, if any, CHECKSUMS by file."""
    file = os.path.join(ckpt, MANIFEST)
    try:
        with open(file) as f:
            manifest = json.load(f)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read the checkpoint's manifest: {e.strerror}")
    except ValueError as e:   # not JSON (a truncated file), not text
        raise CheckpointError(f"{file}: not a checkpoint manifest ({e})")

    def bad(what):
        raise CheckpointError(f"{file}: not a checkpoint manifest as storage/checkpoint.py writes one: {what}")

    if not isinstance(manifest, dict):
        bad(f"a JSON {type(manifest).__name__}, not an object")
    for key, kind in _FIELDS.items():
        if not _is(manifest.get(key), kind):
            bad(f"no {key!r} ({kind.__name__})")
    checksums = manifest.get(CHECKSUMS, {})
    if not _is(checksums, dict) or not all(_is(v, int) for v in checksums.values()):
        bad(f"{CHECKSUMS!r} is not a map of piece file -> CRC-32")
    real = os.path.realpath(ckpt)
    for name, t in manifest["tensors"].items():
        if not (_is(t, dict) and _is(t.get("shape"), list) and all(_is(n, int) and n >= 0 for n in t["shape"])
                and _is(t.get("dtype"), str) and _is(t.get("pieces"), list) and t["pieces"]):
            bad(f"tensor {name} lacks its shape, dtype or pieces")
        try:
            np.dtype(t["dtype"])
        except TypeError:
            bad(f"tensor {name} has dtype {t['dtype']!r}")
        for p in t["pieces"]:
            if not (_is(p, dict) and _is(p.get("file"), str) and
                    all(_is(p.get(k), list) and len(p[k]) == 2 and all(_is(n, int) for n in p[k])
                        for k in ("rows", "cols"))):
                bad(f"a piece of tensor {name} lacks its file, rows or columns")
            piece = p["file"]
            if os.path.basename(piece) != piece or piece in ("", ".", ".."):
                raise CheckpointError(f"{file}: piece {piece!r} of tensor {name} is not a file name in the "
                                      f"checkpoint's folder {ckpt}; no piece is read from elsewhere")
            if os.path.islink(os.path.join(ckpt, piece)):
                target = os.path.realpath(os.path.join(ckpt, piece))
                if os.path.dirname(target) != real:
                    raise CheckpointError(f"{file}: piece {piece!r} of tensor {name} is a symbolic link to "
                                          f"{target}, outside the checkpoint's folder {ckpt}")
    return manifest


def _is(value, kind) -> bool:
    """Whether a JSON value is of `kind` (a bool is no int)."""
    return isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)


def _checksums(manifest: dict) -> Dict[str, int]:
    """The manifest's CHECKSUMS; CheckpointError, naming the manifest and the flag that skips
    verification, where it records none."""
    if CHECKSUMS not in manifest:
        raise CheckpointError(f"{os.path.join(manifest['path'], MANIFEST)}: records no checksums of the "
                              f"checkpoint's pieces ({CHECKSUMS!r}), so they cannot be verified; "
                              f"--skip_checkpoint_checksums (verify=False) reads them unverified")
    return manifest[CHECKSUMS]


def _verify(manifest: dict, pieces: Sequence[Tuple[str, dict]]):
    """Raises unless the manifest records checksums and every one of `pieces` ((tensor, piece)
    pairs) has the CRC-32 recorded for its file."""
    checksums = _checksums(manifest)
    for name, p in pieces:
        file = os.path.join(manifest["path"], p["file"])
        recorded = checksums.get(p["file"])
        if recorded is None:
            raise CheckpointError(f"{file}: the manifest records no checksum for this piece of tensor {name}")
        try:
            crc = file_crc32(file)
        except (OSError, ValueError) as e:   # ValueError: an empty file
            raise CheckpointError(f"{file}: cannot read tensor {name}: {e}")
        if crc != recorded:
            raise CheckpointError(f"{file}: tensor {name} changed on disk since it was written (CRC-32 {crc:08x}, "
                                  f"the manifest records {recorded:08x})")


def read_tensor(path: str, name: str, verify: bool = True) -> np.ndarray:
    """One whole logical tensor of a checkpoint, assembled from its pieces (their checksums
    verified unless `verify` is False)."""
    manifest = read_manifest(path)
    t = manifest["tensors"][name]
    entry = Entry(name, np.empty(t["shape"], t["dtype"]), tuple(t["shape"]))
    _check_coverage(manifest["path"], entry, t)
    if verify:
        _verify(manifest, [(name, p) for p in t["pieces"]])
    return _read_region(manifest["path"], entry, t)


def read_blocks(path_or_manifest, name: str, dtype=None, verify: bool = True) -> Iterator[Tuple[int, np.ndarray]]:
    """The 2-D tensor `name` [rows, cols] of a checkpoint (its path, or a manifest from
    read_manifest) a block of rows at a time, never whole in memory: (start, rows [start, start + n)
    as [n, cols] of `dtype`, default the tensor's), each block at most BLOCK_BYTES (at least one row)
    in both dtypes, read from the pieces it overlaps (memory-mapped). Every piece's checksum is
    verified before the first block, unless `verify` is False."""
    manifest = path_or_manifest if isinstance(path_or_manifest, dict) else read_manifest(path_or_manifest)
    ckpt, tensor = manifest["path"], manifest["tensors"].get(name)
    if tensor is None or len(tensor["shape"]) != 2:
        raise CheckpointError(f"{ckpt}: no 2-D tensor {name}")
    rows, cols = tensor["shape"]
    dtype = np.dtype(dtype or tensor["dtype"])
    entry = Entry(name, np.broadcast_to(np.zeros((), tensor["dtype"]), (rows, cols)), (rows, cols))
    _check_pieces(ckpt, name, tensor)
    _check_coverage(ckpt, entry, tensor)
    if verify:
        _verify(manifest, [(name, p) for p in tensor["pieces"]])
    for start, stop in _blocks(rows, cols, tensor["dtype"], dtype):
        yield start, _read_region(ckpt, entry, tensor, (start, stop)).astype(dtype, copy=False)


def gather_rows(manifest: dict, name: str, ids: np.ndarray, dtype=None, verify: bool = True) -> np.ndarray:
    """Rows `ids` ([n] ascending) of the 2-D tensor `name` of a checkpoint (its manifest, from
    read_manifest) as [n, cols] of `dtype` (default the tensor's), read from the pieces that hold
    them (memory-mapped). Each such piece's checksum is verified first (the piece read whole)
    unless `verify` is False; then only those rows are read."""
    ckpt, tensor = manifest["path"], manifest["tensors"].get(name)
    if tensor is None or len(tensor["shape"]) != 2:
        raise CheckpointError(f"{ckpt}: no 2-D tensor {name}")
    rows, cols = tensor["shape"]
    _check_pieces(ckpt, name, tensor)
    _check_coverage(ckpt, Entry(name, np.broadcast_to(np.zeros((), tensor["dtype"]), (rows, cols)), (rows, cols)),
                    tensor)
    held = [(p, *np.searchsorted(ids, p["rows"])) for p in tensor["pieces"]]   # (piece, ids[lo:hi] in it)
    held = [(p, lo, hi) for p, lo, hi in held if lo < hi]
    if verify:
        _verify(manifest, [(name, p) for p, _, _ in held])
    out = np.empty((len(ids), cols), dtype or tensor["dtype"])
    for p, lo, hi in held:
        values = np.load(os.path.join(ckpt, p["file"]), mmap_mode="r")
        out[lo:hi, slice(*p["cols"])] = values[ids[lo:hi] - p["rows"][0]]
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
    if len(tensor["shape"]) != 2:
        return
    (a, b), (c, d) = entry.region
    covered = sum((rb - ra) * (cb - ca) for _, (ra, rb), (ca, cb) in _overlaps(tensor, (a, b), (c, d)))
    if covered != (b - a) * (d - c):
        raise CheckpointError(f"{ckpt}: the pieces of {entry.name} do not cover rows {a}:{b}, columns {c}:{d}")


def _read_region(ckpt: str, entry: Entry, tensor: dict, rows: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """The entry's region [rows, cols] (only tensor rows [start, stop) of it with `rows`) from
    the pieces it overlaps, which _check_coverage has found to cover it."""
    if len(tensor["shape"]) != 2:
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


def _pieces_read(entry: Entry, tensor: dict) -> List[dict]:
    """The pieces of `tensor` that reading the entry's region reads."""
    if len(tensor["shape"]) != 2:
        return tensor["pieces"][:1]
    return [p for p, _, _ in _overlaps(tensor, *entry.region)]


def _check_pieces(ckpt: str, name: str, tensor: dict):
    for p in tensor["pieces"]:
        file = os.path.join(ckpt, p["file"])
        try:
            values = np.load(file, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{file}: cannot read tensor {name}: {e}")
        expected = (p["rows"][1] - p["rows"][0], p["cols"][1] - p["cols"][0]) if len(tensor["shape"]) == 2 \
            else tuple(tensor["shape"])
        if tuple(values.shape) != expected:
            raise CheckpointError(f"{file}: tensor {name} has shape {tuple(values.shape)}, "
                                  f"the manifest says {expected}")


def restore(path: str, entries: Sequence[Entry], signature: dict, expected: Set[str], extra_ok: bool = False,
            optional: Set[str] = frozenset(), verify: bool = True, hints: Dict[str, str] = None) -> dict:
    """Loads this rank's variables from the checkpoint at `path` and returns its manifest.

    Everything is checked before any variable changes: the signature, the tensor names against
    `expected` (every logical tensor of the model), shapes, every piece file this rank reads (and
    its checksum, unless `verify` is False), and that the pieces cover each entry's region.
    Then the entries are restored in their order (a dynamic table lists its ids before its
    streamed rows, which need them): streamed entries are written a block at a time; entries
    sized by the checkpoint take its shapes (streamed too: their rows [0, L) as saved, L from the
    manifest).
    `extra_ok`: tensors beyond `expected` are left unread (a model without its optimizer state).
    `optional`: tensors that either side may lack (a variable the checkpoint lacks keeps its value).
    `hints`: signature key -> why it may differ, appended to that key's mismatch line.
    """
    manifest = read_manifest(path)
    ckpt = manifest["path"]
    for key, value in signature.items():
        if manifest["signature"].get(key) != value:
            hint = (hints or {}).get(key)
            raise CheckpointError(f"{ckpt}: written with {key}={manifest['signature'].get(key)}, "
                                  f"this run has {key}={value}{f'; {hint}' if hint else ''}")
    tensors: Dict[str, dict] = manifest["tensors"]
    missing, extra = sorted(expected - set(tensors) - optional), sorted(set(tensors) - expected - optional)
    if missing or (extra and not extra_ok):
        raise CheckpointError(f"{ckpt}: tensors differ from this model's "
                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
    entries = [dataclasses.replace(e, shape=tuple(tensors[e.name]["shape"])) if e.sized_by_checkpoint else e
               for e in entries if e.name in tensors]
    read = {}   # file -> (tensor, piece) of every piece this rank reads
    for e in entries:
        t = tensors[e.name]
        if tuple(t["shape"]) != tuple(e.shape):
            raise CheckpointError(f"{ckpt}: tensor {e.name} has shape {tuple(t['shape'])}, "
                                  f"the model expects {tuple(e.shape)}")
        _check_pieces(ckpt, e.name, t)
        _check_coverage(ckpt, e, t)
        read.update({p["file"]: (e.name, p) for p in _pieces_read(e, t)})
    if verify:
        _verify(manifest, list(read.values()))
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
