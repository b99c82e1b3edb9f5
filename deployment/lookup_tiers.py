"""Embedding lookups through tiers, for serving tables larger than memory (an inference parameter
server inside the serving process). No TensorFlow.

    cache   per process: the hot rows of each table within a memory budget (LRU or LFU), shared by
            the threads serving requests
    Redis   optional, shared by several servers or instances: a real Redis server
            (redis://host:port/db); key `<model>:<export run>:<export step>:<feature>:<id>`, value
            the row's float32 bytes
    store   every row: the table files of the repository's tables form (deployment/tables.py),
            memory-mapped and updated in place (docs/benchmarks.md: read this way, about 100x
            the rows per second of RocksDB's multi-get, so RocksDB is not used)

A lookup takes what the cache holds, reads the unique rest from Redis, then the rest of that from
the store; rows found below fill the tiers above (Redis only where the key is absent, so that a
fill never overwrites an update). Rows move in bulk: NumPy gathers, pipelined MGET, one script
call per chunk of fills; no Python call per row on the hot path but the Redis client's packing.

Cache budget (`TierConfig.cache_bytes`): tables whose rows fit an equal share of what is left are
held whole (smallest first, no index); the others split the rest equally, each paying 4 bytes per
table row for its slot index and 4 * D + 24 bytes per cached row (row, id, last use, use count).

Versions: the store holds one model version (deployment/delta.py's Version). A fresh store holds
its export's (export.json); `advancing(base, new)` moves every tier to a new one (a delta's rows,
`update`) and records it in `store.json` beside the table files: the move before the first row,
the new version after the last, so a store left between is refused at start-up. A store that is
missing, half-written (a file's header or size), mid-update or of another export or version than
expected is refused at start-up with one line (StoreError).

Redis down, at start-up or later: lookups go on from the cache and the store; one log line says
so, one says when it is back. Reconnection is tried on a lookup at most every `redis_retry_s`
(doubling to 30 s). Keys updated while Redis could not be written are deleted from it before it
is used again. Two servers sharing Redis see each other's updates as soon as they are written.
"""
import contextlib
import dataclasses
import json
import logging
import mmap
import os
import threading
import time
import urllib.parse
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from deployment.delta import EXPORT_INFO, Version
from deployment.tables import TABLES_INFO
from utils.errors import ConfigError, StoreError
from utils.files import read_json, write_json

POLICIES = ("lru", "lfu")
STORE_STATE = "store.json"
STORE_FORMAT = "dlrm-row-store"
_ROW_OVERHEAD = 24       # bytes per cached row besides the row: id_of, last_use, uses (int64)
_INDEX_BYTES = 4         # bytes per table row of a cached table's slot index (int32)
_MAPPED_BYTES = 256 << 20   # store pages kept mapped (split over the files by size) before they are dropped
_MAX_RETRY_S = 30.0
# Sets each key to its value where it is absent: fills never overwrite rows an update wrote.
_SET_ABSENT = "for i, key in ipairs(KEYS) do redis.call('SET', key, ARGV[i], 'NX') end return 0"


class IdError(ValueError):
    """Ids outside a table; one line naming the feature."""


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """The tiers' settings (one JSON file: `from_file`, or flags)."""
    cache_bytes: int = 1 << 30          # the cache's memory budget over every table
    policy: str = "lru"                 # lru or lfu: which cached rows make room for new ones
    redis_url: Optional[str] = None     # redis://host:port/db: the shared tier (none: no Redis)
    redis_chunk: int = 4096             # keys per MGET, MSET or fill script call
    redis_timeout_s: float = 0.5        # connect and reply timeout
    redis_retry_s: float = 1.0          # first wait before reconnecting (doubles up to 30 s)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ConfigError(f"cache policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("cache_bytes", "redis_chunk", "redis_timeout_s", "redis_retry_s"):
            if not getattr(self, name) >= (0 if name == "cache_bytes" else 1e-9):
                raise ConfigError(f"{name} must be {'>= 0' if name == 'cache_bytes' else 'positive'}, "
                                  f"got {getattr(self, name)}")
        if self.redis_url is not None and not _redis_url_ok(self.redis_url):
            raise ConfigError(f"redis_url must be redis://host:port/db (or unix://path), got {self.redis_url!r}")

    @classmethod
    def from_file(cls, path: str) -> "TierConfig":
        """The settings in JSON file `path` (keys: the fields; the others keep their defaults)."""
        try:
            with open(path) as f:
                values = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: unreadable tier settings ({e})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known) if isinstance(values, dict) else ["(not an object)"]
        if unknown:
            raise ConfigError(f"{path}: unknown tier settings {unknown} (known: {sorted(known)})")
        return cls(**values)


def _redis_url_ok(url: str) -> bool:
    """Whether `url` is redis://host[:port][/db] or unix://path."""
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port
    except ValueError:
        return False
    if parts.scheme == "unix":
        return bool(parts.path)
    return parts.scheme == "redis" and bool(parts.hostname) and (parts.path in ("", "/") or
                                                                 parts.path[1:].isdigit())


def cache_capacities(shapes: Sequence[Tuple[int, int]], budget: int) -> List[Optional[int]]:
    """Per table (rows, D): None where the table is held whole, else its cache's rows (see the
    module's docstring)."""
    order = sorted(range(len(shapes)), key=lambda f: shapes[f][0] * shapes[f][1])
    out: List[Optional[int]] = [None] * len(shapes)
    left = budget
    for k, f in enumerate(order):
        rows, dim = shapes[f]
        share = left // (len(order) - k)
        if rows * dim * 4 <= share:
            left -= rows * dim * 4
            continue
        out[f] = int(min(rows, max(0, share - _INDEX_BYTES * rows) // (4 * dim + _ROW_OVERHEAD)))
        left -= share
    return out


class NpyTable:
    """A [rows, D] float32 .npy file (C order), memory-mapped; its header and size checked. Pages
    the reads and writes touched are dropped from the process every `mapped_bytes` (the data stays
    in the page cache and the file), so its resident memory does not grow with the table."""

    def __init__(self, path: str, shape: Optional[Tuple[int, int]], writable: bool,
                 mapped_bytes: int = _MAPPED_BYTES):
        self.path, self.mapped_bytes, self._touched = path, mapped_bytes, 0
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
        out = np.take(self.array, ids, axis=0)
        self._touch(len(ids))
        return out

    def write(self, ids: np.ndarray, rows: np.ndarray):
        self.array[ids] = rows
        self._touch(len(ids))

    def _touch(self, rows: int):
        self._touched += rows * (self.shape[1] * 4 + mmap.PAGESIZE)
        if self._touched > self.mapped_bytes:
            self._map.madvise(mmap.MADV_DONTNEED)
            self._touched = 0

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
        self.shapes = [(t["rows"], t["dim"]) for t in info["tables"]]
        total = max(1, sum(r * d * 4 for r, d in self.shapes))
        writable = os.access(self.directory, os.W_OK)
        self.tables: List[NpyTable] = []
        try:
            for t, (rows, dim) in zip(info["tables"], self.shapes):
                self.tables.append(NpyTable(os.path.join(self.directory, t["file"]), (rows, dim), writable,
                                            max(16 << 20, _MAPPED_BYTES * rows * dim * 4 // total)))
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
        self.version = new
        self._save(holds=new.to_json(), updating=None, **(record or {}))

    def _save(self, **changes):
        self._state = dict(self._state, **changes)
        write_json(self._state_path, self._state)

    def close(self):
        for table in self.tables:
            table.close()
        self.tables = []


def store_state(repository: str) -> dict:
    """The checked state of a tables-form repository's store (RowStore.state; refusals: StoreError)."""
    store = RowStore(repository, read_json(os.path.join(repository, EXPORT_INFO), "a model repository", StoreError))
    store.close()
    return store.state


def store_version(repository: str) -> Version:
    """The version the store of a tables-form repository holds (its export's, or the last update's)."""
    return Version.from_json(store_state(repository)["holds"])


class _Whole:
    """A table held whole in memory."""

    def __init__(self, values: np.ndarray):
        self.values = values
        self.lookups = self.hits = 0

    def lookup(self, ids: np.ndarray) -> Tuple[np.ndarray, Optional[np.ndarray], int]:
        self.lookups += len(ids)
        self.hits += len(ids)
        return self.values[ids], None, 0

    def fill(self, ids: np.ndarray, rows: np.ndarray, generation: int):
        pass

    def replace(self, ids: np.ndarray, rows: np.ndarray):
        self.values[ids] = rows

    nbytes = property(lambda self: self.values.nbytes)


class _Cache:
    """A table's hot rows: `capacity` slots `values` [C, D]; `slot_of` [rows] int32 (-1: not
    cached), `id_of` [C]. Victims: LRU, or LFU (fewest uses since cached, ties by age), chosen
    from a reserve of the lowest-ranked slots that one pass over the cache refreshes when it runs
    out (a slot used since is skipped), so a fill costs O(its rows), not O(C). `generation` counts
    updates: rows read below before an update are not filled after it."""

    def __init__(self, rows: int, dim: int, capacity: int, policy: str):
        self.capacity, self.policy = capacity, policy
        self.lock = threading.Lock()
        self.values = np.empty((capacity, dim), np.float32)
        self.slot_of = np.full(rows, -1, np.int32)
        self.id_of = np.full(capacity, -1, np.int64)
        self.last_use = np.zeros(capacity, np.int64)
        self.uses = np.zeros(capacity, np.int64)
        self.clock = self.filled = self.generation = self.reserve_pos = self.reserved_at = 0
        self.reserve = np.zeros(0, np.int64)
        self.lookups = self.hits = 0

    nbytes = property(lambda self: self.values.nbytes + self.slot_of.nbytes + self.capacity * _ROW_OVERHEAD)

    def lookup(self, ids: np.ndarray) -> Tuple[np.ndarray, Optional[np.ndarray], int]:
        """ids [n] -> (rows [n, D], the cached ones filled; miss mask [n], None if none missed;
        the generation to fill the missed rows with)."""
        with self.lock:
            self.clock += 1
            slots = self.slot_of[ids]
            hit = slots >= 0
            used = slots[hit]
            self.last_use[used] = self.clock
            self.uses[used] += 1
            n_hit = len(used)
            self.lookups += len(ids)
            self.hits += n_hit
            if n_hit == len(ids):
                return self.values[slots], None, self.generation
            out = np.empty((len(ids), self.values.shape[1]), np.float32)
            out[hit] = self.values[used]
            return out, ~hit, self.generation

    def fill(self, ids: np.ndarray, rows: np.ndarray, generation: int):
        """Caches rows `ids` [n] (unique) read below, unless an update came since `generation`."""
        if not self.capacity:
            return
        with self.lock:
            if generation != self.generation:
                return
            new = self.slot_of[ids] < 0   # another request may have cached some meanwhile
            ids, rows = ids[new][:self.capacity], rows[new][:self.capacity]
            if not len(ids):
                return
            self.clock += 1
            victims = self._victims(len(ids))
            old = self.id_of[victims]
            self.slot_of[old[old >= 0]] = -1
            self.slot_of[ids] = victims
            self.id_of[victims] = ids
            self.values[victims] = rows
            self.uses[victims] = 1

    def _victims(self, m: int) -> np.ndarray:
        """m distinct slots (m <= C): never-used ones first, then the policy's choice; marked used now."""
        take = min(m, self.capacity - self.filled)
        chosen = [np.arange(self.filled, self.filled + take)]
        self.last_use[chosen[0]] = self.clock
        self.filled += take
        need = m - take
        while need:
            if self.reserve_pos >= len(self.reserve):
                self._refill(need)
            candidates = self.reserve[self.reserve_pos:self.reserve_pos + need]
            self.reserve_pos += len(candidates)
            valid = candidates[self.last_use[candidates] <= self.reserved_at]
            self.last_use[valid] = self.clock
            chosen.append(valid)
            need -= len(valid)
        return np.concatenate(chosen)

    def _refill(self, need: int):
        """The lowest-ranked quarter of the slots not used by this operation (at least `need`)."""
        self.reserved_at = self.clock - 1
        free = np.flatnonzero(self.last_use <= self.reserved_at)
        key = self.last_use[free] if self.policy == "lru" else (self.uses[free] << 32) + self.last_use[free]
        n = min(len(free), max(need, self.capacity // 4))
        if n < len(free):
            part = np.argpartition(key, n - 1)[:n]
            free, key = free[part], key[part]
        self.reserve, self.reserve_pos = free[np.argsort(key, kind="stable")], 0

    def replace(self, ids: np.ndarray, rows: np.ndarray):
        """Rows `ids` become `rows` where cached; fills of rows read before this are dropped."""
        with self.lock:
            slots = self.slot_of[ids]
            cached = slots >= 0
            self.values[slots[cached]] = rows[cached]
            self.generation += 1


class RedisTier:
    """Rows in a Redis server shared by servers (see the module's docstring). Every method answers
    None / does nothing while the server is down; `log` gets one line when it goes down and one
    when it is back."""

    def __init__(self, url: str, prefix: str, dims: Sequence[int], config: TierConfig, log: Callable[[str], None]):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        self._errors = (redis.RedisError, OSError)
        self.url, self._dims, self._chunk, self._log = url, list(dims), config.redis_chunk, log
        self._prefixes = [np.bytes_(f"{prefix}:{f}:".encode()) for f in range(len(dims))]
        self._client = redis.Redis.from_url(url, socket_timeout=config.redis_timeout_s,
                                            socket_connect_timeout=config.redis_timeout_s,
                                            retry=Retry(NoBackoff(), 1))   # a pooled connection a restart broke
        self._set_absent = self._client.register_script(_SET_ABSENT)
        self._first_wait = self._wait = config.redis_retry_s
        self._lock = threading.Lock()
        self._stale: List[Tuple[int, np.ndarray]] = []   # keys updated while down: deleted before reuse
        self.up, self._next_try = False, 0.0
        self.downs = 0
        if not self._reconnect():
            self.downs = 1
            self._log(f"{url}: Redis unreachable at start-up; answering from the cache and the store, "
                      f"reconnecting every {self._wait:g} s or more")

    def _keys(self, feature: int, ids: np.ndarray) -> list:
        return np.strings.add(self._prefixes[feature], ids.astype("S20")).tolist()

    def _chunks(self, n: int) -> range:
        return range(0, n, self._chunk)

    def _run(self, commands: Callable) -> Optional[list]:
        """`commands(pipeline)` queued and sent at once; their replies, or None if Redis is down."""
        if not self.up and not self._try_reconnect():
            return None
        try:
            pipe = self._client.pipeline(transaction=False)
            commands(pipe)
            return pipe.execute()
        except self._errors as e:
            self._down(e)
            return None

    def get(self, feature: int, ids: np.ndarray, out: np.ndarray) -> Optional[np.ndarray]:
        """Rows `ids` [n] found into `out` [n, D]; the found mask [n], or None if down."""
        keys = self._keys(feature, ids)
        replies = self._run(lambda pipe: [pipe.mget(keys[s:s + self._chunk]) for s in self._chunks(len(keys))])
        if replies is None:
            return None
        values = [v for reply in replies for v in reply]
        found = np.fromiter((v is not None for v in values), bool, len(values))
        data = b"".join(v for v in values if v is not None)
        if len(data) != int(found.sum()) * out.shape[1] * 4:
            self._down(f"values of another width than feature {feature}'s rows under its keys")
            return None
        out[found] = np.frombuffer(data, np.float32).reshape(-1, out.shape[1])
        return found

    def fill(self, feature: int, ids: np.ndarray, rows: np.ndarray):
        """Rows `ids` read from the store, written where their keys are absent."""
        keys, values = self._keys(feature, ids), self._values(rows)
        self._run(lambda pipe: [self._set_absent(keys=keys[s:s + self._chunk], args=values[s:s + self._chunk],
                                                 client=pipe) for s in self._chunks(len(keys))])

    def put(self, feature: int, ids: np.ndarray, rows: np.ndarray):
        """Rows `ids` updated; if Redis cannot take them, their keys are deleted before it is used again."""
        keys, values = self._keys(feature, ids), self._values(rows)

        def commands(pipe):
            for s in self._chunks(len(keys)):
                pipe.mset(dict(zip(keys[s:s + self._chunk], values[s:s + self._chunk])))
        if self._run(commands) is None:
            with self._lock:
                self._stale.append((feature, ids.copy()))

    @staticmethod
    def _values(rows: np.ndarray) -> list:
        rows = np.ascontiguousarray(rows, np.float32)
        return rows.view(f"V{rows.shape[1] * 4}").reshape(-1).tolist()

    def _down(self, error):
        with self._lock:
            if self.up:
                self.up, self.downs = False, self.downs + 1
                self._next_try, self._wait = time.monotonic() + self._first_wait, self._first_wait
                self._log(f"{self.url}: Redis unreachable ({error}); answering from the cache and the store, "
                          f"reconnecting every {self._first_wait:g} s or more")

    def _try_reconnect(self) -> bool:
        """Whether Redis is up again: one thread tries, once the back-off has passed."""
        if time.monotonic() < self._next_try or not self._lock.acquire(blocking=False):
            return False
        try:
            if self.up or time.monotonic() < self._next_try:
                return self.up
            if self._reconnect():
                self._log(f"{self.url}: Redis reachable again")
                return True
            self._next_try = time.monotonic() + self._wait
            self._wait = min(2 * self._wait, _MAX_RETRY_S)
            return False
        finally:
            self._lock.release()

    def _reconnect(self) -> bool:
        """Pings, deletes the keys updated while down; sets `up`."""
        try:
            self._client.ping()
            for feature, ids in self._stale:
                keys = self._keys(feature, ids)
                pipe = self._client.pipeline(transaction=False)
                for s in self._chunks(len(keys)):
                    pipe.delete(*keys[s:s + self._chunk])
                pipe.execute()
        except self._errors:
            self._next_try = time.monotonic() + self._wait
            return False
        self._stale, self.up, self._wait = [], True, self._first_wait
        return True

    def close(self):
        self._client.close()


class TieredTables:
    """The embedding tables of a tables-form repository served through the tiers.

    rows(feature, ids) -> [*ids.shape, D_f]; advancing(base, new) and update(feature, ids, rows)
    for updates; stats(); close(). `expect`: the version to serve (default the export's); a store
    holding another is refused. Thread-safe: lookups run concurrently with each other and with an
    update (a lookup concurrent with the update of its rows may read them old or new)."""

    def __init__(self, repository: str, config: TierConfig = TierConfig(), expect: Optional[Version] = None,
                 log: Callable[[str], None] = logging.getLogger(__name__).warning):
        export = read_json(os.path.join(repository, EXPORT_INFO), "a model repository written by deploy.py", StoreError)
        self.store = RowStore(repository, export)
        expect = expect or self.store.export
        if self.store.version != expect:
            self.store.close()
            raise StoreError(f"{self.store.directory}: holds {self.store.version}, not the served {expect}")
        self.config, self.shapes = config, self.store.shapes
        self._tables: list = []
        for (rows, dim), capacity, table in zip(self.shapes, cache_capacities(self.shapes, config.cache_bytes),
                                                self.store.tables):
            self._tables.append(_Whole(np.array(table.array)) if capacity is None else
                                _Cache(rows, dim, capacity, config.policy))
        self.redis = None
        if config.redis_url:
            origin = self.store.export
            self.redis = RedisTier(config.redis_url, f"{export['name']}:{origin.run or 'norun'}:{origin.step}",
                                   [d for _, d in self.shapes], config, log)
        self._count_lock, self._update_lock = threading.Lock(), threading.Lock()
        self._counts = dict.fromkeys(("redis_asked", "redis_found", "store_rows_read"), 0)
        self._advancing = False

    @property
    def version(self) -> Version:
        return self.store.version

    def rows(self, feature: int, ids: np.ndarray) -> np.ndarray:
        """Feature's rows of `ids` (any shape, integers in [0, rows)) -> [*ids.shape, D] float32."""
        ids = np.asarray(ids)
        flat = self._checked(feature, ids.reshape(-1))
        table = self._tables[feature]
        out, miss, generation = table.lookup(flat)
        if miss is not None:
            wanted, inverse = np.unique(flat[miss], return_inverse=True)
            below = self._below(feature, wanted)
            table.fill(wanted, below, generation)
            out[miss] = below[inverse]
        return out.reshape(*ids.shape, self.shapes[feature][1])

    def _checked(self, feature: int, ids: np.ndarray) -> np.ndarray:
        if not 0 <= feature < len(self.shapes):
            raise IdError(f"feature {feature}: the model has {len(self.shapes)} tables")
        rows = self.shapes[feature][0]
        if ids.dtype.kind not in "iu" or (ids.size and (ids.min() < 0 or ids.max() >= rows)):
            raise IdError(f"feature {feature}: ids out of range [0, {rows})" + (
                f" (min {ids.min()}, max {ids.max()})" if ids.size and ids.dtype.kind in "iuf" else
                f" (dtype {ids.dtype})"))
        return ids.astype(np.int64, copy=False)

    def _below(self, feature: int, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` [n] (sorted, unique) from Redis, the rest from the store (filling Redis)."""
        out = np.empty((len(ids), self.shapes[feature][1]), np.float32)
        found = self.redis.get(feature, ids, out) if self.redis else None
        rest = ids if found is None else ids[~found]
        if len(rest):
            rows = self.store.tables[feature].read(rest)
            out[slice(None) if found is None else ~found] = rows
            if self.redis:
                self.redis.fill(feature, rest, rows)
        with self._count_lock:
            self._counts["redis_asked"] += len(ids) if found is not None else 0
            self._counts["redis_found"] += int(found.sum()) if found is not None else 0
            self._counts["store_rows_read"] += len(rest)
        return out

    @contextlib.contextmanager
    def advancing(self, base: Version, new: Version, record: Optional[dict] = None) -> Iterator[None]:
        """`update`s inside move every tier from version `base` (the one held) to `new`; `record`'s
        keys are kept in store.json with the new version."""
        with self._update_lock, self.store.advancing(base, new, record):
            self._advancing = True
            try:
                yield
            finally:
                self._advancing = False

    def update(self, feature: int, ids: np.ndarray, rows: np.ndarray):
        """Rows `ids` [n] (unique) of a feature become `rows` [n, D] in every tier: the store, Redis,
        the cache. Inside `advancing`."""
        if not self._advancing:
            raise StoreError(f"{self.store.directory}: an update outside advancing(base, new)")
        ids = self._checked(feature, np.asarray(ids).reshape(-1))
        rows = np.asarray(rows, np.float32)
        if rows.shape != (len(ids), self.shapes[feature][1]):
            raise StoreError(f"feature {feature}: rows {list(rows.shape)} for {len(ids)} ids of width "
                             f"{self.shapes[feature][1]}")
        self.store.tables[feature].write(ids, rows)
        if self.redis:
            self.redis.put(feature, ids, rows)
        self._tables[feature].replace(ids, rows)

    def stats(self) -> dict:
        """Counts since start-up: per tier its lookups and hits (cache: ids as requested; Redis:
        the unique ids the cache missed), the rows read from the store, the cache's bytes, rows
        and capacity (of the tables not held whole), and whether Redis is up."""
        caches = [t for t in self._tables if isinstance(t, _Cache)]
        lookups = sum(t.lookups for t in self._tables)
        hits = sum(t.hits for t in self._tables)
        with self._count_lock:
            c = dict(self._counts)
        out = {"cache": {"lookups": lookups, "hits": hits, "hit_rate": hits / lookups if lookups else 1.0,
                         "bytes": sum(t.nbytes for t in self._tables),
                         "whole_tables": [f for f, t in enumerate(self._tables) if isinstance(t, _Whole)],
                         "rows": sum(t.filled for t in caches), "capacity": sum(t.capacity for t in caches)},
               "store": {"rows_read": c["store_rows_read"]}}
        if self.redis:
            out["redis"] = {"lookups": c["redis_asked"], "hits": c["redis_found"],
                            "hit_rate": c["redis_found"] / c["redis_asked"] if c["redis_asked"] else 1.0,
                            "up": self.redis.up, "outages": self.redis.downs}
        return out

    def close(self):
        if self.redis:
            self.redis.close()
        self.store.close()
