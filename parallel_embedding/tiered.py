"""The disk tier: embedding shards larger than memory, in one file per shard with a bounded cache.

A unit is one rank's shards of one feature: rows [row_start, row_start + R) of the table (the
column slices of a table on one rank share their rows, hence one cache). With k optimizer
slots, a shard of width w has
- on disk, `<store>/table_<f>.bin` (a whole table) or `<store>/table_<f>.rows_<a>_<b>.cols_<c>_<d>.bin`
  (a row shard or column slice): [R, 1 + k, w] float32, row i being the table row followed by
  its k slot rows; allocated in full at start-up and filled from the initial values (a
  checkpoint overwrites them), never read across runs;
- in memory, the shard's variable and its slot variables, of C + 1 rows: a cache of C rows,
  and row C, the spare row that a row shard's out-of-range ids read (the in-memory shard's last
  row). `slot_of` [R] maps a row to its cache slot (-1: on disk only).

Staging (`DiskTier.staged`) runs one batch ahead of the train step, in a thread: the
unique ids of batch t+1 that miss are read from disk in bulk into free or evicted slots, dirty
victims written back first; the batch's ids are replaced by cache slots (a row shard's
out-of-range ids by C). The step gathers and updates cache rows exactly as it would the
table's rows (same values, same order of summation), so training is bit-identical to the
in-memory table. Batches t and t+1 stay pinned until the consumer asks for batch t+2: their
slots are never victims. Which rows are cached, and the victims (LRU or LFU), are the unit's
row cache (storage/row_cache.py), so a step costs O(its ids), not O(C).

A dynamic table's hash shard on disk (`DynamicUnit`, parallel_embedding/dynamic_table.py) is a
unit of R = its capacity rows (the id map's rows) whose cache is the DynamicTable's variable and
slots [C, w] (no spare row: an id without a row reads zeros). Its id map stays in memory and
decides in the step, exactly as in memory; the step's host call `DynamicStore.place` turns the
map's rows into cache slots (reading a row the read-ahead missed, giving an admitted row a slot
without reading it: the step re-initialises it). Staging does not change its ids: it only reads
ahead, the map's `find` (which changes nothing) giving the rows of batch t+1's ids that are live
now, read into pinned slots. So the map's state, and what an evaluation or a checkpoint between
steps sees, never depends on staging; a row the read-ahead missed (an id the map takes after the
read-ahead ran) costs a read in the step, not a different result. A lookup's slots stay pinned
until the table's next lookup (its step is over by then). updated_at is per row in host memory,
set by `place` for the rows a training step updates. Its checkpoint streams: a save reads a block of
live rows at a time from the cache or the file (`DynamicStore.read`), a restore empties the cache
and writes a block at a time into the file (`clear`, `write`).
"""
import atexit
import collections
import concurrent.futures
import fcntl
import mmap
import os
import shutil
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

import id_map
from storage.row_cache import POLICIES, CacheFull, RowCache
from utils.errors import ConfigError, DatasetError, StoreError

# Store pages a rank keeps mapped into its process (split over its files by size, at least 16 MiB
# each) before dropping them: a mapped page counts in the process's resident memory, a page mapped
# again costs a fault (~4 us: 1,800 rows read and written took 15 ms, against 0.5 ms mapped).
# Measured on W1 (docs/benchmarks.md): 1 GiB made the staging alone 40% faster but the 26 GB
# model's peak resident memory 8.5 GiB instead of 5.5.
_MAPPED_BYTES = 256 << 20
_MIN_MAPPED_BYTES = 16 << 20


class ShardFile:
    """One shard's rows and optimizer slots on disk, [R, parts, w] float32, memory-mapped and
    locked (flock) against a second run using the same file. Pages it touched are unmapped from
    the process every `mapped_bytes` (the data stays in the page cache and the file), so the
    process's resident memory does not grow with the file."""

    def __init__(self, path: str, rows: int, parts: int, width: int, mapped_bytes: int):
        self.path, self.shape, self.mapped_bytes = path, (rows, parts, width), mapped_bytes
        self.nbytes = rows * parts * width * 4
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"{path}: cannot create the embedding store file: {e.strerror}")
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(self.fd, 0)
            os.posix_fallocate(self.fd, 0, max(self.nbytes, 1))
        except BlockingIOError:
            os.close(self.fd)
            raise ConfigError(f"{path}: another run is using this embedding store file (--embedding_store_path)")
        except OSError as e:
            os.close(self.fd)
            raise ConfigError(f"{path}: cannot allocate {self.nbytes:,} bytes for the embedding store: {e.strerror}")
        self._map = mmap.mmap(self.fd, max(self.nbytes, 1))
        self._map.madvise(mmap.MADV_RANDOM)   # rows are read at random: no readahead (it read 100x the rows)
        self.array = np.ndarray(self.shape, np.float32, buffer=self._map)
        self._touched = 0

    def read(self, rows, part: Optional[int] = None) -> np.ndarray:
        """Rows `rows` (an index array or a slice): [n, parts, w] (`part` j: only part j, [n, w]), copied."""
        values = self.array[rows] if part is None else self.array[rows, part]
        self._touch(rows, values.nbytes)
        return np.array(values) if isinstance(rows, slice) else values

    def write(self, rows, values: np.ndarray, part: Optional[int] = None):
        """Rows `rows` take `values` [n, parts, w] (`part` j: only part j, [n, w])."""
        if part is None:
            self.array[rows] = values
        else:
            self.array[rows, part] = values
        self._touch(rows, values.nbytes)

    def _touch(self, rows, nbytes: int):
        """Counts the bytes of the pages an access mapped: a row read at random maps whole pages."""
        self._touched += nbytes if isinstance(rows, slice) else nbytes + len(rows) * mmap.PAGESIZE
        if self._touched > self.mapped_bytes:
            self._map.madvise(mmap.MADV_DONTNEED)
            self._touched = 0

    def check(self):
        """Raises StoreError if the file was deleted (its mapping would hide that until exit)."""
        if os.fstat(self.fd).st_nlink == 0:
            raise StoreError(f"{self.path}: the embedding store file was deleted during the run")

    def close(self, remove: bool):
        self.array = None
        self._map.close()
        if remove and os.path.exists(self.path):
            os.remove(self.path)
        os.close(self.fd)


class StoreRows:
    """Part `part` of a shard file (0: the table's rows, j: slot j) as a checkpoint row source
    [R, w] (storage.checkpoint's streamed entries). Reading flushes the cache's dirty rows first;
    writing (a restore) empties the unit's cache."""

    def __init__(self, tables: "DiskTier", unit: "Unit", file: ShardFile, part: int):
        self._tables, self._unit, self._file, self._part = tables, unit, file, part
        self.shape = (file.shape[0], file.shape[2])
        self.dtype = np.dtype(np.float32)

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        self._tables.flush()
        return self._file.read(slice(start, stop))[:, self._part]

    def write_rows(self, start: int, values: np.ndarray):
        self._tables.forget(self._unit)
        rows = slice(start, start + len(values))
        block = self._file.read(rows)
        block[:, self._part] = values
        self._file.write(rows, block)


class UpdatedAt:
    """A unit's updated_at as a checkpoint row source [R, 1] int32 (storage.checkpoint's streamed entries):
    the marks of batches staged but not trained yet (their step after `step()`, the steps trained)
    read as the values they replaced, so a checkpoint holds what an in-memory table's would."""

    def __init__(self, unit: "Unit", step: Callable[[], int]):
        self._unit, self._step = unit, step
        self.shape = (unit.rows, 1)
        self.dtype = np.dtype(np.int32)

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        out = self._unit.updated_at[start:stop].copy()
        trained = self._step()
        for rows, before, step in reversed(self._unit.staged_marks):
            if step > trained:
                inside = (rows >= start) & (rows < stop)
                out[rows[inside] - start] = before[inside]
        return out[:, None]

    def write_rows(self, start: int, values: np.ndarray):
        self._unit.staged_marks.clear()
        self._unit.updated_at[start:start + len(values)] = values[:, 0]


class Unit(RowCache):
    """One rank's shards of one feature on disk: their files, cache variables and the row cache of
    their R rows in C slots (a slot is the variables' row of that index)."""

    def __init__(self, feature: int, row_start: int, rows: int, capacity: int):
        super().__init__(rows, capacity)
        self.feature, self.row_start = feature, row_start
        self.variables: List[tf.Variable] = []     # per shard: its cache variable [C + 1, w]
        self.parts: List[List[tf.Variable]] = []   # per shard: [variable, slot 1..k] (set by open)
        self.files: List[ShardFile] = []
        self.dirty = np.zeros(capacity, bool)        # per slot: changed since read from disk
        self.updated_at = np.zeros(rows, np.int32)   # per row: the global step that last updated it
        # (rows, their updated_at before, step) of the last training batches staged: one is staged ahead
        self.staged_marks = collections.deque(maxlen=4)

    def reset(self):
        """Empties the cache (nothing may be pinned)."""
        super().reset()
        self.dirty.fill(False)


class DynamicUnit(Unit):
    """A dynamic table's hash shard on disk: `table` (a DynamicTable whose variable and slots are
    the cache of `cache_rows` slots) and `mine`, ids [n] int64 -> [n] bool, the ids of its hash
    shard (None: every id); `step_pins`, the slots its last lookup pinned."""

    def __init__(self, feature: int, table, cache_rows: int, mine: Optional[Callable[[np.ndarray], np.ndarray]]):
        super().__init__(feature, 0, table.capacity, cache_rows)
        self.table, self.mine = table, mine
        self.variables.append(table.variable)
        self.step_pins = np.zeros(0, np.int64)


class DynamicStore:
    """A DynamicUnit's rows as its DynamicTable's RowStore (place, read, clear, write, updated_at:
    dynamic_table.py)."""

    def __init__(self, tables: "DiskTier", unit: DynamicUnit):
        self._tables, self._unit = tables, unit

    def place(self, rows: np.ndarray, step: int, codes: Optional[np.ndarray]) -> np.ndarray:
        """rows [n] int32 (-1: none), the map's codes [n] (None: not training) -> cache slots [n] int32
        (-1: none); run in the lookup's step, after the map."""
        unit, tables = self._unit, self._tables
        with tables._lock:
            unit.unpin(unit.step_pins)   # the table's previous lookup is over
            found = rows >= 0
            fresh = found & np.isin(codes, (id_map.ADMITTED, id_map.EVICTED)) if codes is not None else \
                np.zeros(len(rows), bool)
            unit.tick()
            kept = tables._bring(unit, np.unique(rows[found & ~fresh]), count=False)
            # a slot, unread: the step re-initialises the row
            new = tables._bring(unit, np.unique(rows[fresh]), count=False, read=False)
            unit.step_pins = np.concatenate([kept, new]).astype(np.int64)
            out = np.where(found, unit.slot_of[np.maximum(rows, 0)], -1).astype(np.int32)
            if codes is not None:
                unit.dirty[out[found]] = True
                unit.updated_at[rows[found]] = step + 1
        return out

    def read(self, rows: np.ndarray, part: int) -> np.ndarray:
        """rows [n] -> their part `part` (0: the row, j: slot j) [n, w] float32, from the cache or the file
        (a checkpoint's block)."""
        unit = self._unit
        with self._tables._lock:
            slots = unit.slot_of[rows]
            cached = slots >= 0
            out = np.empty((len(rows), unit.files[0].shape[2]), np.float32)
            out[~cached] = unit.files[0].read(rows[~cached], part)
            if cached.any():
                out[cached] = tf.gather(unit.parts[0][part], slots[cached]).numpy()
            return out

    def clear(self):
        """Empties the cache (a restore begins: the file's rows are overwritten next)."""
        unit = self._unit
        with self._tables._lock:
            unit.unpin(unit.step_pins)
            unit.step_pins = np.zeros(0, np.int64)
            unit.reset()

    def write(self, rows, part: int, values: np.ndarray):
        """rows (a slice, or [n] int64) take `values` [n, w] as their part `part` in the file (a
        restore's block, after `clear`)."""
        with self._tables._lock:
            self._unit.files[0].write(rows, values, part)

    @property
    def updated_at(self) -> np.ndarray:
        """[R] int32 per row, in host memory: the step after the last training lookup of each row."""
        return self._unit.updated_at


class DiskTier:
    """The disk-tier units of one rank, their store files and the staging of batches.

    `units`: feature -> Unit (a DynamicUnit: its table's store is set here). `open` creates and
    fills the files once the optimizer's slots exist; `staged` wraps a batch stream; `flush` writes
    dirty cache rows back; `stats` counts since its last call.
    """

    def __init__(self, units: Dict[int, Unit], cardinalities: Sequence[int], store_path: str, policy: str,
                 rank: int):
        if policy not in POLICIES:
            raise ConfigError(f"--embedding_cache_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.units, self.cardinalities, self.policy, self.rank = units, list(cardinalities), policy, rank
        self.store_path = store_path
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embedding-staging")
        self._counts = dict.fromkeys(("ids", "hits", "misses", "rows_read", "rows_written", "bytes_read",
                                      "bytes_written"), 0)
        self._seconds = {"staging": 0.0, "waited": 0.0, "steps": 0}
        self._next_step = 1   # the global step the next staged training batch updates
        for unit in units.values():
            if isinstance(unit, DynamicUnit):
                unit.table.store = DynamicStore(self, unit)

    # Start-up ------------------------------------------------------------------------------------

    def open(self, parts: Dict[int, List[List[tf.Variable]]], initial_rows):
        """Creates the store files and fills them: part j of rows [start, stop) of a unit's i-th
        shard from `initial_rows(unit, i, j, start, stop) -> [stop - start, w]`.
        `parts`: feature -> per shard [variable, slot variables...]."""
        if not self.store_path:
            raise ConfigError("the embedding plan puts tables on disk: --embedding_store_path is needed")
        if not os.path.isdir(self.store_path):
            raise ConfigError(f"--embedding_store_path={self.store_path}: no such directory")
        if not os.access(self.store_path, os.W_OK):
            raise ConfigError(f"--embedding_store_path={self.store_path}: not writable")
        shapes = []   # (file name, rows, parts, width) of every shard, in unit order
        for f, unit in self.units.items():
            unit.parts = parts[f]
            for shard_parts in parts[f]:
                name, width = shard_parts[0].name.split(":")[0], int(shard_parts[0].shape[1])
                shapes.append((self._file_name(name), unit.rows, len(shard_parts), width))
        need = sum(r * p * w * 4 for _, r, p, w in shapes)
        existing = sum(os.path.getsize(os.path.join(self.store_path, n)) for n, *_ in shapes
                       if os.path.isfile(os.path.join(self.store_path, n)))
        free = shutil.disk_usage(self.store_path).free + existing
        if need > free:
            raise ConfigError(f"--embedding_store_path={self.store_path}: rank {self.rank}'s tables on disk need "
                              f"{need:,} bytes, {free:,} are free")
        atexit.register(self.close)   # whatever ends the run, the files go
        files = iter(ShardFile(os.path.join(self.store_path, n), r, p, w,
                               max(_MIN_MAPPED_BYTES, _MAPPED_BYTES * r * p * w * 4 // max(need, 1)))
                     for n, r, p, w in shapes)
        block = 1 << 16
        for f, unit in self.units.items():
            for i, shard_parts in enumerate(unit.parts):
                file = next(files)
                unit.files.append(file)
                for start in range(0, unit.rows, block):
                    stop = min(start + block, unit.rows)
                    file.write(slice(start, stop), np.stack([initial_rows(unit, i, j, start, stop)
                                                            for j in range(len(shard_parts))], axis=1))

    @staticmethod
    def _file_name(variable_name: str) -> str:
        """embedding/table_3/rows_0_10/cols_0_16 -> table_3.rows_0_10.cols_0_16.bin"""
        return ".".join(variable_name.split("/")[1:]) + ".bin"

    def close(self):
        """Stops the staging thread and removes the store files (a checkpoint is the durable state);
        called again (at exit), does nothing."""
        self._pool.shutdown(wait=True)
        for unit in self.units.values():
            for file in unit.files:
                file.close(remove=True)
            unit.files = []

    # Staging -------------------------------------------------------------------------------------

    def staged(self, elements: Iterator[tuple], training: bool, first_step: Optional[int] = None
               ) -> Iterator[tuple]:
        """Elements (numerical, ids, ...) with ids (F tensors, see DistributedEmbedding) of the
        units' features replaced by cache slots; element t+1 is staged in a thread while the
        consumer works on element t. The consumer asking for element t+1 releases element t
        (its step is done: on a GPU, later ops on the cache queue behind it). Training: element t's
        rows get updated_at `first_step` + t (default: continuing from the last training batch)."""
        if training and first_step is not None:
            self._next_step = first_step
        source = iter(elements)

        def stage_next():
            element = next(source, None)
            if element is None:
                return None
            ids, pins = self.stage(element[1], training)
            return (element[0], ids) + tuple(element[2:]), pins

        pending, current = self._pool.submit(stage_next), None
        try:
            while True:
                t0 = time.perf_counter()
                result = pending.result()
                self._seconds["waited"] += time.perf_counter() - t0
                if current is not None:
                    self.release(current)
                    current = None
                if result is None:
                    return
                element, current = result
                self._seconds["steps"] += training
                pending = self._pool.submit(stage_next)
                yield element
        finally:
            if current is not None:
                self.release(current)
            try:
                result = pending.result()
            except Exception:   # the consumer has stopped; its own error is the one to report
                result = None
            if result is not None:
                self.release(result[1])

    def stage(self, ids: Sequence, training: bool) -> Tuple[tuple, Dict[int, np.ndarray]]:
        """Brings the rows of one batch's ids into the caches and pins them (`training`: and marks
        them dirty: the step will update them); returns the ids with the units' features as cache
        slots, and the pinned slots per feature (for `release`)."""
        t0 = time.perf_counter()
        ids, pins = list(ids), {}
        with self._lock:
            for f, unit in self.units.items():
                x = ids[f]
                ragged = isinstance(x, tf.RaggedTensor)
                values = np.asarray(x.values if ragged else x)
                if isinstance(unit, DynamicUnit):   # raw ids stay (the map decides in the step): read ahead
                    pins[f] = self._read_ahead(unit, values)
                    continue
                slots, pins[f] = self._stage_unit(unit, values)
                unit.dirty[pins[f]] |= training
                if training:
                    rows = unit.id_of[pins[f]]
                    unit.staged_marks.append((rows, unit.updated_at[rows], self._next_step))
                    unit.updated_at[rows] = self._next_step
                slots = tf.constant(slots.astype(values.dtype))
                ids[f] = x.with_values(slots) if ragged else slots
            self._next_step += training
        self._seconds["staging"] += time.perf_counter() - t0
        return tuple(ids), pins

    def _stage_unit(self, unit: Unit, values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """values [K]: table ids -> ([K] cache slots, the unique slots now pinned)."""
        for file in unit.files:
            file.check()
        if values.size and (values.min() < 0 or values.max() >= self.cardinalities[unit.feature]):
            raise DatasetError(f"feature {unit.feature}: ids out of range [0, {self.cardinalities[unit.feature]}) "
                               f"(min {values.min()}, max {values.max()})")
        local = values.astype(np.int64) - unit.row_start
        inside = (local >= 0) & (local < unit.rows)
        local_in = local[inside]
        unit.tick()
        slots = self._bring(unit, np.unique(local_in))
        out = np.full(len(values), unit.capacity, np.int64)
        out[inside] = unit.slot_of[local_in]
        return out, slots

    def _read_ahead(self, unit: DynamicUnit, values: np.ndarray) -> np.ndarray:
        """values [K] raw ids of a dynamic unit's feature -> the slots now pinned of the rows its map
        holds for them (`find`: the map unchanged)."""
        for file in unit.files:
            file.check()
        values = values.astype(np.int64)
        if unit.mine is not None:
            values = values[unit.mine(values)]
        rows = unit.table.map.find(tf.constant(values, tf.int64)).numpy()
        unit.tick()
        return self._bring(unit, np.unique(rows[rows >= 0]))

    def _bring(self, unit: Unit, rows: np.ndarray, count: bool = True, read: bool = True) -> np.ndarray:
        """rows [m] (unique, sorted) -> their slots [m], cached and pinned at the unit's clock (the
        caller ticks it once per use), missing ones read from disk (`read` false: only given slots,
        as `_load`'s); `count`: in the hit rate."""
        slots = unit.slot_of[rows]
        hit = slots >= 0
        unit.use(slots[hit])
        unit.pin(slots[hit])
        miss = rows[~hit]
        if count:
            self._counts["ids"] += len(rows)
            self._counts["misses"] += len(miss)
            self._counts["hits"] += len(rows) - len(miss)
        if len(miss):
            unit.pin(self._load(unit, miss, read))
        return unit.slot_of[rows]

    def _load(self, unit: Unit, miss: np.ndarray, read: bool = True) -> np.ndarray:
        """Reads rows `miss` (sorted) from disk into free or evicted cache slots, dirty evicted rows
        written back first; returns the slots. `read` false: the slots are only assigned (a dynamic
        table's admitted rows, which the step initialises)."""
        try:
            victims, old = unit.admit(miss, self.policy)
        except CacheFull as e:
            raise StoreError(f"feature {unit.feature}: the cache of {unit.capacity} rows on rank {self.rank} "
                             f"cannot hold the rows of the batches in flight ({e.need} more needed)") from None
        write = (old >= 0) & unit.dirty[victims]
        if write.any():
            order = np.argsort(old[write])
            write, rows = victims[write][order], old[write][order]
            for file, parts in zip(unit.files, unit.parts):
                values = np.stack([tf.gather(v, write).numpy() for v in parts], axis=1)
                file.write(rows, values)
                self._counts["bytes_written"] += values.nbytes
            self._counts["rows_written"] += len(write)
        for file, parts in zip(unit.files, unit.parts if read else ()):
            values = file.read(miss)
            self._counts["bytes_read"] += values.nbytes
            for j, v in enumerate(parts):
                v.scatter_update(tf.IndexedSlices(values[:, j], victims))
        self._counts["rows_read"] += len(miss) if read else 0
        unit.dirty[victims] = False
        return victims

    def release(self, pins: Dict[int, np.ndarray]):
        """Unpins a batch's slots once its step is done."""
        with self._lock:
            for f, slots in pins.items():
                self.units[f].unpin(slots)

    # Checkpoints and statistics ------------------------------------------------------------------

    def flush(self):
        """Writes every dirty cached row (and its slots) back to disk, between steps. Rows of a
        staged batch stay dirty: its step has yet to update them."""
        with self._lock:
            for unit in self.units.values():
                slots = np.flatnonzero(unit.dirty)
                if not len(slots):
                    continue
                rows = unit.id_of[slots]
                for file, parts in zip(unit.files, unit.parts):
                    file.write(rows, np.stack([tf.gather(v, slots).numpy() for v in parts], axis=1))
                unit.dirty[slots] = unit.pinned[slots] > 0

    def forget(self, unit: Unit):
        """Empties `unit`'s cache before its file is overwritten (a restore)."""
        with self._lock:
            unit.reset()

    def sources(self, unit: Unit) -> List[List[StoreRows]]:
        """Per shard of `unit`, its parts as checkpoint row sources."""
        return [[StoreRows(self, unit, file, j) for j in range(file.shape[1])] for file in unit.files]

    def updated_at(self, unit: Unit, step: Callable[[], int]) -> "UpdatedAt":
        """`unit`'s rows' updated_at as a checkpoint row source [R, 1] int32; `step()`: the steps
        trained so far."""
        return UpdatedAt(unit, step)

    def stats(self) -> dict:
        """Counts since the last call: hit rate of the unique ids, rows and MB read/written, and
        the seconds staging took and the consumer waited for it (per training step)."""
        with self._lock:
            c, s = self._counts, self._seconds
            steps = max(s["steps"], 1)
            out = {"cache_hit_rate": c["hits"] / c["ids"] if c["ids"] else 1.0,
                   "store_rows_read": c["rows_read"], "store_rows_written": c["rows_written"],
                   "store_mb_read_per_step": c["bytes_read"] / 2 ** 20 / steps,
                   "store_mb_written_per_step": c["bytes_written"] / 2 ** 20 / steps,
                   "staging_ms_per_step": 1000 * s["staging"] / steps,
                   "store_wait_ms_per_step": 1000 * s["waited"] / steps}
            self._counts = dict.fromkeys(c, 0)
            self._seconds = {"staging": 0.0, "waited": 0.0, "steps": 0}
        return out
