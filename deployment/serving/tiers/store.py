"""The store tier: every row of every table, the table files of the repository's tables form
(deployment/exporter/table_files.py), memory-mapped and updated in place (RowStore over one
NpyTable per table), and the version they hold.

Versions: the store holds one model version (deployment/repository_format.py's Version). A fresh store holds
its export's (export.json); `advancing(base, new)` moves every tier to a new one (a delta's rows,
`update`) and records it in `store.json` beside the table files: the move before the first row,
the new version after the last, so a store left between is refused at start-up. A store that is
missing, half-written (a file's header or size), mid-update or of another export or version than
expected is refused at start-up with one line (StoreError). A dynamic table's ids file ([R, 2]
int64: per row its raw id, LIVE or FREE) is memory-mapped beside its rows and updated in place
with them (`write_ids`); a delta bringing more new ids than free rows grows both files (`grow`,
inside `advancing`: the new rows free, zeros), and store.json records the table's rows.
"""
import contextlib
import io
import mmap
import os
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from deployment.repository_format import EXPORT_INFO, IDS_DTYPE, TABLES_INFO, Version
from utils.errors import StoreError
from utils.files import read_json, write_json

STORE_STATE = "store.json"
STORE_FORMAT = "dlrm-row-store"


class NpyTable:
    """A [rows, D] float32 .npy file (C order), memory-mapped; its header and size checked. The pages
    read stay mapped: they are the kernel's page cache of the file (counted in the process's RSS as
    file pages, shared, and reclaimed under memory pressure like any file cache), so a table larger
    than memory is served as far as the page cache holds it and read from the disk beyond."""

    def __init__(self, path: str, shape: Optional[Tuple[int, int]], writable: bool):
        self.path = path
        try:
            with open(path, "rb") as f:
                major, _ = np.lib.format.read_magic(f)
                header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                saved, fortran, dtype = header(f)
                offset = f.tell()
        except FileNotFoundError:
            raise StoreError(f"{path}: missing from the store")
        except (OSError, ValueError) as e:
            raise StoreError(f"{path}: not a table file ({e})")
        if dtype != np.dtype("<f4") or fortran or len(saved) != 2 or (shape is not None and saved != tuple(shape)):
            raise StoreError(f"{path}: holds {dtype}{list(saved)}{' (Fortran order)' if fortran else ''}, the store "
                             f"needs float32{list(shape) if shape else ' [rows, D]'}")
        self.shape = saved
        size, need = os.path.getsize(path), offset + saved[0] * saved[1] * 4
        if size != need:
            raise StoreError(f"{path}: {size:,} bytes, a {list(saved)} table takes {need:,}: half-written or damaged")
        with open(path, "r+b" if writable else "rb") as f:
            self._map = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        self._map.madvise(mmap.MADV_RANDOM)   # rows are read at random: no readahead
        self.array = np.ndarray(saved, np.float32, buffer=self._map, offset=offset)
        self.writable = writable

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` [n] (sorted for locality) -> [n, D], copied."""
        return np.take(self.array, ids, axis=0)

    def write(self, ids: np.ndarray, rows: np.ndarray):
        self.array[ids] = rows

    def flush(self):
        self._map.flush()

    def close(self):
        self.array = None
        self._map.close()


def open_npy_table(path: str, writable: bool) -> NpyTable:
    """A table file on its own (benchmarks)."""
    return NpyTable(path, None, writable)


class RowStore:
    """Every row of every table: the table files of a repository's tables form, memory-mapped, and
    the version they hold (`store.json`; absent: the export's). `export`: export.json's content."""

    def __init__(self, repository: str, export: dict):
        if not export.get("table_files"):
            raise StoreError(f"{repository}: has no table files (exported with --forms={','.join(export['forms'])}); "
                             "export with --forms including tables")
        self.directory = os.path.join(repository, export["table_files"]["directory"])
        info = read_json(os.path.join(self.directory, TABLES_INFO),
                         "a complete table store (deploy.py --forms=tables)", StoreError)
        self.export = Version.from_json(export.get("version") or {"run": "", "step": export["step"]})
        if (info.get("checkpoint"), info.get("step")) != (export["checkpoint"], export["step"]):
            raise StoreError(f"{self.directory}: tables of another export ({info.get('checkpoint')} step "
                             f"{info.get('step')}) than {repository}'s ({export['checkpoint']} step {export['step']})")
        state_path = os.path.join(self.directory, STORE_STATE)
        state = read_json(state_path, "a table store", StoreError) if os.path.isfile(state_path) else \
            {"format": STORE_FORMAT, "export": self.export.to_json(), "holds": self.export.to_json(), "updating": None}
        if state.get("format") != STORE_FORMAT or Version.from_json(state["export"]) != self.export:
            raise StoreError(f"{state_path}: the state of another export's store (export {state.get('export')}, "
                             f"this one is {self.export})")
        if state["updating"]:
            raise StoreError(f"{self.directory}: an update from {Version.from_json(state['updating']['from'])} to "
                             f"{Version.from_json(state['updating']['to'])} was interrupted: the store is half-written "
                             "(export the model again)")
        self.version = Version.from_json(state["holds"])
        self._state_path, self._state = state_path, state
        grown = state.get("rows", {})   # dynamic tables grown by deltas: feature -> rows
        self.shapes = [(grown.get(str(f), t["rows"]), t["dim"]) for f, t in enumerate(info["tables"])]
        self._files = [(t["file"], t.get("ids_file")) for t in info["tables"]]
        writable = os.access(self.directory, os.W_OK)
        self.tables: List[NpyTable] = []
        self.ids: Dict[int, np.memmap] = {}   # per dynamic table its ids file
        try:
            for f, (t, (rows, dim)) in enumerate(zip(info["tables"], self.shapes)):
                self.tables.append(NpyTable(os.path.join(self.directory, t["file"]), (rows, dim), writable))
                if t.get("dynamic"):
                    self.ids[f] = _ids_file(os.path.join(self.directory, t["ids_file"]), rows, writable)
        except StoreError:
            self.close()
            raise

    @property
    def state(self) -> dict:
        """store.json's content: the version held (`holds`), and what `advancing` recorded with it."""
        return dict(self._state)

    @contextlib.contextmanager
    def advancing(self, base: Version, new: Version, record: Optional[dict] = None) -> Iterator[None]:
        """Writes inside move the store from version `base` to `new` (recorded before and after,
        with `record`'s keys)."""
        if base != self.version:
            raise StoreError(f"{self.directory}: holds {self.version}, an update from {base} does not apply")
        if not all(t.writable for t in self.tables):
            raise StoreError(f"{self.directory}: not writable: the store cannot be updated")
        self._save(updating={"from": base.to_json(), "to": new.to_json()})
        yield
        for table in self.tables:
            table.flush()
        for ids in self.ids.values():
            ids.flush()
        self.version = new
        self._save(holds=new.to_json(), updating=None, **(record or {}))

    def write_ids(self, feature: int, rows: np.ndarray, row_ids: np.ndarray):
        """A dynamic table's ids file entries `rows` [k] become `row_ids` [k, 2] (inside `advancing`)."""
        self.ids[feature][rows] = row_ids

    def grow(self, feature: int, rows: int):
        """A dynamic table's files take `rows` rows (more than now), the new ones zeros (FREE in the
        ids file); store.json records it. Inside `advancing` (an interruption leaves the store
        refused as mid-update). The old mappings are left to lookups in flight."""
        if not self._state.get("updating"):
            raise StoreError(f"{self.directory}: a table grown outside advancing(base, new)")
        dim = self.shapes[feature][1]
        table_file, ids_file = (os.path.join(self.directory, name) for name in self._files[feature])
        _grow_npy(table_file, rows)
        _grow_npy(ids_file, rows)
        self.tables[feature] = NpyTable(table_file, (rows, dim), True)
        self.ids[feature] = _ids_file(ids_file, rows, True)
        self.shapes[feature] = (rows, dim)
        self._save(rows={**self._state.get("rows", {}), str(feature): rows})

    def _save(self, **changes):
        state = dict(self._state, **changes)
        try:
            write_json(self._state_path, state)
        except OSError as e:
            raise StoreError(f"{self._state_path}: cannot be written: {e.strerror}") from None
        self._state = state

    def close(self):
        for table in self.tables:
            table.close()
        self.tables, self.ids = [], {}


def _grow_npy(path: str, rows: int):
    """Extends the .npy file `path` (format 1.0, C order) to `rows` rows of zeros: the new bytes
    allocated on the device (so that writes through a mapping never find it full), then its header
    rewritten in place (numpy leaves room for the first axis's digits). A full device: StoreError
    naming the file and the bytes, the file as it was."""
    with open(path, "r+b") as f:
        np.lib.format.read_magic(f)
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        offset = f.tell()
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                      "fortran_order": fortran, "shape": (rows, *shape[1:])})
        if len(header.getvalue()) != offset or fortran or rows < shape[0]:
            raise StoreError(f"{path}: cannot grow from {shape[0]} to {rows} rows in place")
        size, grown = os.fstat(f.fileno()).st_size, offset + rows * int(np.prod(shape[1:])) * dtype.itemsize
        try:
            if grown > size:
                os.posix_fallocate(f.fileno(), size, grown - size)
        except OSError as e:
            f.truncate(size)
            raise StoreError(f"{path}: cannot grow from {shape[0]} to {rows} rows: {e.strerror} "
                             f"({grown - size:,} bytes more)") from None
        f.seek(0)
        f.write(header.getvalue())
        f.flush()
        os.fsync(f.fileno())


def _ids_file(path: str, rows: int, writable: bool) -> np.memmap:
    """A dynamic table's ids file, memory-mapped: [rows, 2] int64, checked."""
    try:
        ids = np.load(path, mmap_mode="r+" if writable else "r")
    except FileNotFoundError:
        raise StoreError(f"{path}: missing from the store")
    except (OSError, ValueError) as e:
        raise StoreError(f"{path}: not an ids file ({e})")
    if ids.dtype != IDS_DTYPE or ids.shape != (rows, 2):
        raise StoreError(f"{path}: holds {ids.dtype}{list(ids.shape)}, the store needs int64{[rows, 2]}")
    return ids


def store_state(repository: str) -> dict:
    """The checked state of a tables-form repository's store (RowStore.state; refusals: StoreError)."""
    store = RowStore(repository, read_json(os.path.join(repository, EXPORT_INFO), "a model repository", StoreError))
    store.close()
    return store.state


def store_version(repository: str) -> Version:
    """The version the store of a tables-form repository holds (its export's, or the last update's)."""
    return Version.from_json(store_state(repository)["holds"])
