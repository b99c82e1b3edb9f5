"""Embedding lookups through tiers, for serving tables larger than memory (an inference parameter
server inside the serving process). No TensorFlow.

    cache   per process: the hot rows within a memory budget (LRU or LFU), one cache for the
            tables of each width, shared by the threads serving requests
    Redis   optional, shared by several servers or instances: a real Redis server
            (redis://host:port/db); key `<model>:<export run>:<export step>:<feature>:<id>`, value
            the version it was written at (_TAG_BYTES: the step in 16 hex digits, 8 bytes of a
            hash of the run) and the row's float32 bytes
    store   every row: the table files of the repository's tables form (deployment/exporter/table_files.py),
            memory-mapped and updated in place (docs/benchmarks.md: read this way, about 100x
            the rows per second of RocksDB's multi-get, so RocksDB is not used)

A request's lookup (`lookup`, every feature at once) takes what the caches hold, reads the unique
rest from Redis, then the rest of that from the store; rows found below fill the tiers above (the
cache at once; Redis from a thread of its own, which the request does not wait for: at most
_FILLS_WAITING requests' fills wait, others are dropped and counted). Rows move in bulk: one cache
lookup per width, one pipelined MGET round trip per request, NumPy gathers from the store, one
round trip of fills (a script per chunk); no Python call per row on the hot path but the Redis
client's packing.

Cache budget (`TierConfig.cache_bytes`): tables whose rows fit an equal share of what is left are
held whole (smallest first, no index); the others split the rest equally, each paying 4 bytes per
table row for its slot index and 4 * D + 24 bytes per cached row (row, id, last use, use count);
the shares of the tables of one width form their cache, so hot rows of any of them compete.

Versions: the store holds one model version (deployment/repository_format.py's Version). A fresh store holds
its export's (export.json); `advancing(base, new)` moves every tier to a new one (a delta's rows,
`update`) and records it in `store.json` beside the table files: the move before the first row,
the new version after the last, so a store left between is refused at start-up. A store that is
missing, half-written (a file's header or size), mid-update or of another export or version than
expected is refused at start-up with one line (StoreError). In Redis a lookup takes only values
written at the version its store holds (other servers sharing it may serve older or newer ones);
values are written where a key is absent or holds an older version's (a smaller step), so a fill
never overwrites an update. After an update Redis holds the rows it changed at the new version;
the others are read from the store once more and rewritten at it as requests ask for them. Rows
read from the store while an update runs are not written to Redis (they may be of either version).

Redis down, at start-up or later: lookups go on from the cache and the store; one log line says
so, one says when it is back. Reconnection is tried on a lookup at most every `redis_retry_s`
(doubling to 30 s). Rows an update could not write to Redis stay there at their older version,
which servers at the new one do not take.
"""
import contextlib
import dataclasses
import hashlib
import json
import logging
import mmap
import os
import queue
import threading
import time
import urllib.parse
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from deployment.repository_format import EXPORT_INFO, TABLES_INFO, Version
from utils.errors import ConfigError, StoreError
from utils.files import read_json, write_json

POLICIES = ("lru", "lfu")
STORE_STATE = "store.json"
STORE_FORMAT = "dlrm-row-store"
_ROW_OVERHEAD = 24       # bytes per cached row besides the row: id_of, last_use, uses (int64)
_INDEX_BYTES = 4         # bytes per table row of a cached table's slot index (int32)
_MAX_RETRY_S = 30.0
_FILLS_WAITING = 64      # requests' fills queued for Redis at most; more are dropped (counted)
_TAG_BYTES = 24          # a Redis value's version: its step as 16 hex digits, 8 bytes of its run's hash
# Sets each key to its value where it is absent or holds an older version's (a smaller step): a
# fill never overwrites an update, a late update never overwrites a newer one.
_SET_NEWER = """for i, key in ipairs(KEYS) do
  local held = tonumber(redis.call('GETRANGE', key, 0, 15), 16) or -1
  if held < tonumber(string.sub(ARGV[i], 1, 16), 16) then redis.call('SET', key, ARGV[i]) end
end
return 0"""


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
        self.shapes = [(t["rows"], t["dim"]) for t in info["tables"]]
        writable = os.access(self.directory, os.W_OK)
        self.tables: List[NpyTable] = []
        try:
            for t, (rows, dim) in zip(info["tables"], self.shapes):
                self.tables.append(NpyTable(os.path.join(self.directory, t["file"]), (rows, dim), writable))
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
    """A table held whole in memory: `values` [rows, D]."""

    def __init__(self, values: np.ndarray):
        self.values = values
        self.lookups = 0

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """ids (any shape) -> [*ids.shape, D]."""
        self.lookups += ids.size
        return self.values[ids]

    hits = property(lambda self: self.lookups)   # every id is found

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


def _tag(version: Version) -> bytes:
    """The first _TAG_BYTES bytes of a Redis value written at `version`."""
    return b"%016x" % version.step + hashlib.blake2b(version.run.encode(), digest_size=8).digest()


class RedisTier:
    """Rows in a Redis server shared by servers (see the module's docstring). Every method answers
    None / does nothing while the server is down; `log` gets one line when it goes down and one
    when it is back."""

    def __init__(self, url: str, prefix: str, config: TierConfig, log: Callable[[str], None]):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        self._errors = (redis.RedisError, OSError)
        self.url, self._prefix, self._chunk, self._log = url, prefix, config.redis_chunk, log
        self._client = redis.Redis.from_url(url, socket_timeout=config.redis_timeout_s,
                                            socket_connect_timeout=config.redis_timeout_s,
                                            retry=Retry(NoBackoff(), 1))   # a pooled connection a restart broke
        self._set_newer = self._client.register_script(_SET_NEWER)
        self._first_wait = self._wait = config.redis_retry_s
        self._lock, self._count_lock = threading.Lock(), threading.Lock()
        self.up, self._next_try = False, 0.0
        self.downs = self.fills_dropped = self.nonfinite = 0
        if not self._reconnect():
            self.downs = 1
            self._log(f"{url}: Redis unreachable at start-up; answering from the cache and the store, "
                      f"reconnecting every {self._wait:g} s or more")
        self._fills: queue.Queue = queue.Queue(_FILLS_WAITING)
        self._filler = threading.Thread(target=self._send_fills, name="redis-fills", daemon=True)
        self._filler.start()

    def keys(self, feature: int, ids: np.ndarray) -> list:
        """The keys of a feature's rows `ids` [n]: [n] bytes."""
        return np.strings.add(np.bytes_(f"{self._prefix}:{feature}:".encode()), ids.astype("S20")).tolist()

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

    def get(self, requests: Sequence[Tuple[list, int]], version: Version) -> Optional[List[Tuple[np.ndarray, np.ndarray]]]:
        """Per request (keys [n], D): (found [n] bool, the rows found [found, D] float32), found =
        held at `version` and finite (values of other versions or widths are not; values not finite
        are not, and counted in `nonfinite`). One round trip for all; None if Redis is down."""
        keys = [k for request_keys, _ in requests for k in request_keys]
        replies = self._run(lambda pipe: [pipe.mget(keys[s:s + self._chunk]) for s in self._chunks(len(keys))])
        if replies is None:
            return None
        values = [v for reply in replies for v in reply]
        tag = np.frombuffer(_tag(version), np.uint8)
        out, start = [], 0
        for request_keys, dim in requests:
            part, width = values[start:start + len(request_keys)], _TAG_BYTES + 4 * dim
            start += len(request_keys)
            found = np.fromiter((v is not None and len(v) == width for v in part), bool, len(part))
            block = np.frombuffer(b"".join(v for v, ok in zip(part, found) if ok), np.uint8).reshape(-1, width)
            rows = block[:, _TAG_BYTES:].copy().view(np.float32)
            current = (block[:, :_TAG_BYTES] == tag).all(1)
            finite = np.isfinite(rows).all(1)
            if not finite[current].all():   # a miss: read from the store instead, counted
                with self._count_lock:
                    self.nonfinite += int((current & ~finite).sum())
            found[found] = current & finite
            out.append((found, rows[current & finite]))
        return out

    def set(self, blocks: Sequence[Tuple[int, np.ndarray, np.ndarray]], version: Version):
        """Per block (feature, ids [n], rows [n, D]): the rows at `version`, written where a key is
        absent or holds an older version's. One round trip for all; nothing if Redis is down."""
        tag = np.frombuffer(_tag(version), np.uint8)
        keys, values = [], []
        for feature, ids, rows in blocks:
            data = np.empty((len(rows), _TAG_BYTES + 4 * rows.shape[1]), np.uint8)
            data[:, :_TAG_BYTES] = tag
            data[:, _TAG_BYTES:] = np.ascontiguousarray(rows, np.float32).view(np.uint8)
            keys += self.keys(feature, ids)
            values += data.view(f"V{data.shape[1]}").reshape(-1).tolist()
        self._run(lambda pipe: [self._set_newer(keys=keys[s:s + self._chunk], args=values[s:s + self._chunk],
                                                client=pipe) for s in self._chunks(len(keys))])

    def fill(self, blocks: Sequence[Tuple[int, np.ndarray, np.ndarray]], version: Version):
        """`set`, sent by a thread of its own (a request does not wait for it); dropped while
        _FILLS_WAITING others wait."""
        try:
            self._fills.put_nowait((blocks, version))
        except queue.Full:
            with self._lock:
                self.fills_dropped += 1

    def _send_fills(self):
        while True:
            fill = self._fills.get()
            try:
                if fill is None:
                    return
                self.set(*fill)
            finally:
                self._fills.task_done()

    def drain(self):
        """Returns once the fills queued so far are sent."""
        self._fills.join()

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
        """Pings; sets `up`."""
        try:
            self._client.ping()
        except self._errors:
            self._next_try = time.monotonic() + self._wait
            return False
        self.up, self._wait = True, self._first_wait
        return True

    def close(self):
        self._fills.put(None)
        self._filler.join()
        self._client.close()


class _Group:
    """The cached tables of one width D sharing one cache: row i of `features[k]` is the cache's
    row starts[k] + i."""

    def __init__(self, features: List[int], rows: List[int], dim: int, capacity: int, policy: str):
        self.features, self.dim = features, dim
        self.starts = np.cumsum([0] + rows)
        self.offset = dict(zip(features, self.starts[:-1].tolist()))
        self.cache = _Cache(int(self.starts[-1]), dim, capacity, policy)

    def split(self, ids: np.ndarray) -> Iterator[Tuple[int, np.ndarray]]:
        """Sorted cache rows [n] -> per feature among them, in order: (feature, its table's ids)."""
        bounds = np.searchsorted(ids, self.starts)
        for k, f in enumerate(self.features):
            if bounds[k + 1] > bounds[k]:
                yield f, ids[bounds[k]:bounds[k + 1]] - self.starts[k]


class LookupTiers:
    """The embedding tables of a tables-form repository served through the tiers.

    lookup({feature: ids}) -> {feature: rows} (the serving path: ids checked by the caller);
    rows(feature, ids) (checked); advancing(base, new) and update(feature, ids, rows) for updates;
    stats(); close(). `expect`: the version to serve (default the export's); a store holding
    another is refused. Thread-safe: lookups run concurrently with each other and with an update
    (a lookup concurrent with the update of its rows may read them old or new)."""

    def __init__(self, repository: str, config: TierConfig = TierConfig(), expect: Optional[Version] = None,
                 log: Callable[[str], None] = logging.getLogger(__name__).warning):
        export = read_json(os.path.join(repository, EXPORT_INFO), "a model repository written by deploy.py", StoreError)
        self.store = RowStore(repository, export)
        expect = expect or self.store.export
        if self.store.version != expect:
            self.store.close()
            raise StoreError(f"{self.store.directory}: holds {self.store.version}, not the served {expect}")
        self.config, self.shapes = config, self.store.shapes
        capacities = cache_capacities(self.shapes, config.cache_bytes)
        self._whole = {f: _Whole(np.array(table.array))
                       for f, (capacity, table) in enumerate(zip(capacities, self.store.tables)) if capacity is None}
        widths: Dict[int, List[int]] = {}
        for f in range(len(self.shapes)):
            if f not in self._whole:
                widths.setdefault(self.shapes[f][1], []).append(f)
        self._groups = [_Group(fs, [self.shapes[f][0] for f in fs], dim, sum(capacities[f] for f in fs), config.policy)
                        for dim, fs in sorted(widths.items())]
        self._group_of = {f: group for group in self._groups for f in group.features}
        self.redis = None
        if config.redis_url:
            origin = self.store.export
            self.redis = RedisTier(config.redis_url, f"{export['name']}:{origin.run or 'norun'}:{origin.step}",
                                   config, log)
        self._count_lock, self._update_lock = threading.Lock(), threading.Lock()
        self._counts = dict.fromkeys(("redis_asked", "redis_found", "store_rows_read"), 0)
        # An update in progress (to `_target`); `_epoch` advances as one starts and ends: rows read
        # from the store across either are not written to Redis (they may be of either version)
        self._advancing, self._target, self._epoch = False, None, 0

    @property
    def version(self) -> Version:
        return self.store.version

    def rows(self, feature: int, ids: np.ndarray) -> np.ndarray:
        """Feature's rows of `ids` (any shape, integers in [0, rows)) -> [*ids.shape, D] float32;
        other ids refused (IdError)."""
        ids = np.asarray(ids)
        return self.lookup({feature: self._checked(feature, ids.reshape(-1)).reshape(ids.shape)})[feature]

    def lookup(self, ids: Dict[int, np.ndarray]) -> Dict[int, np.ndarray]:
        """Per feature its ids (any shape, integers in [0, rows): unchecked) -> its rows
        [*ids.shape, D] float32. One cache lookup per width of cached tables; what they miss, one
        Redis round trip and one store read per table (Redis filled later, by its thread)."""
        out = {f: self._whole[f].lookup(x) for f, x in ids.items() if f in self._whole}
        missed = []
        for group in self._groups:
            features = [f for f in group.features if f in ids]
            if not features:
                continue
            flat = np.concatenate([ids[f].reshape(-1).astype(np.int64) + group.offset[f] for f in features])
            rows, miss, generation = group.cache.lookup(flat)
            if miss is not None:
                wanted, inverse = np.unique(flat[miss], return_inverse=True)
                missed.append((group, wanted, inverse, rows, miss, generation))
            start = 0
            for f in features:
                out[f] = rows[start:start + ids[f].size].reshape(*ids[f].shape, group.dim)   # views: filled below
                start += ids[f].size
        if missed:
            below = self._below([(group, wanted) for group, wanted, *_ in missed])
            for (group, wanted, inverse, rows, miss, generation), found in zip(missed, below):
                group.cache.fill(wanted, found, generation)
                rows[miss] = found[inverse]
        return out

    def _checked(self, feature: int, ids: np.ndarray) -> np.ndarray:
        if not 0 <= feature < len(self.shapes):
            raise IdError(f"feature {feature}: the model has {len(self.shapes)} tables")
        rows = self.shapes[feature][0]
        if ids.dtype.kind not in "iu" or (ids.size and (ids.min() < 0 or ids.max() >= rows)):
            raise IdError(f"feature {feature}: ids out of range [0, {rows})" + (
                f" (min {ids.min()}, max {ids.max()})" if ids.size and ids.dtype.kind in "iuf" else
                f" (dtype {ids.dtype})"))
        return ids.astype(np.int64, copy=False)

    def _keys(self, group: _Group, ids: np.ndarray) -> list:
        return [k for f, table_ids in group.split(ids) for k in self.redis.keys(f, table_ids)]

    def _read(self, group: _Group, ids: np.ndarray, fills: list) -> np.ndarray:
        """Cache rows `ids` [n] (sorted) of `group` from the store -> [n, D]; with Redis, appends
        per table (feature, its ids, their rows) to `fills`."""
        parts = [(f, table_ids, self.store.tables[f].read(table_ids)) for f, table_ids in group.split(ids)]
        if self.redis:
            fills += parts
        return np.concatenate([rows for _, _, rows in parts])

    def _below(self, wanted: List[Tuple[_Group, np.ndarray]]) -> List[np.ndarray]:
        """Per group its cache rows [n] (sorted, unique) -> their values [n, D]: from Redis where it
        holds them at the store's version, the rest from the store (then written to Redis)."""
        epoch, advancing, version = self._epoch, self._advancing, self.store.version
        found = self.redis.get([(self._keys(g, ids), g.dim) for g, ids in wanted], version) if self.redis else None
        outs, fills, read = [], [], 0
        for k, (group, ids) in enumerate(wanted):
            out = np.empty((len(ids), group.dim), np.float32)
            rest = slice(None)
            if found is not None:
                mask, rows = found[k]
                out[mask] = rows
                rest = ~mask
            rest_ids = ids[rest]
            if len(rest_ids):
                out[rest] = self._read(group, rest_ids, fills)
                read += len(rest_ids)
            outs.append(out)
        if fills and not advancing and epoch == self._epoch:   # no update started or ended since the reads began
            self.redis.fill(fills, version)
        with self._count_lock:
            if found is not None:
                self._counts["redis_asked"] += sum(len(ids) for _, ids in wanted)
                self._counts["redis_found"] += sum(int(mask.sum()) for mask, _ in found)
            self._counts["store_rows_read"] += read
        return outs

    @contextlib.contextmanager
    def advancing(self, base: Version, new: Version, record: Optional[dict] = None) -> Iterator[None]:
        """`update`s inside move every tier from version `base` (the one held) to `new`; `record`'s
        keys are kept in store.json with the new version."""
        with self._update_lock:
            self._epoch += 1
            self._advancing, self._target = True, new
            try:
                with self.store.advancing(base, new, record):
                    yield
            finally:
                self._advancing = False
                self._epoch += 1

    def update(self, feature: int, ids: np.ndarray, rows: np.ndarray):
        """Rows `ids` [n] (unique) of a feature become `rows` [n, D] in every tier: the store, Redis
        (at the new version), the cache. Inside `advancing`."""
        if not self._advancing:
            raise StoreError(f"{self.store.directory}: an update outside advancing(base, new)")
        ids = self._checked(feature, np.asarray(ids).reshape(-1))
        rows = np.asarray(rows, np.float32)
        if rows.shape != (len(ids), self.shapes[feature][1]):
            raise StoreError(f"feature {feature}: rows {list(rows.shape)} for {len(ids)} ids of width "
                             f"{self.shapes[feature][1]}")
        self.store.tables[feature].write(ids, rows)
        if self.redis:
            self.redis.set([(feature, ids, rows)], self._target)
        if feature in self._whole:
            self._whole[feature].replace(ids, rows)
        else:
            group = self._group_of[feature]
            group.cache.replace(ids + group.offset[feature], rows)

    def stats(self) -> dict:
        """Counts since start-up: per tier its lookups and hits (cache: ids as requested; Redis:
        the unique ids the cache missed), the rows read from the store, the cache's bytes, rows
        and capacity (of the tables not held whole), and whether Redis is up."""
        caches = [g.cache for g in self._groups]
        parts = list(self._whole.values()) + caches
        lookups, hits = sum(p.lookups for p in parts), sum(p.hits for p in parts)
        with self._count_lock:
            c = dict(self._counts)
        out = {"cache": {"lookups": lookups, "hits": hits, "hit_rate": hits / lookups if lookups else 1.0,
                         "bytes": sum(p.nbytes for p in parts), "whole_tables": sorted(self._whole),
                         "rows": sum(t.filled for t in caches), "capacity": sum(t.capacity for t in caches)},
               "store": {"rows_read": c["store_rows_read"]}}
        if self.redis:
            out["redis"] = {"lookups": c["redis_asked"], "hits": c["redis_found"],
                            "hit_rate": c["redis_found"] / c["redis_asked"] if c["redis_asked"] else 1.0,
                            "up": self.redis.up, "outages": self.redis.downs,
                            "fills_dropped": self.redis.fills_dropped, "nonfinite": self.redis.nonfinite}
        return out

    def close(self):
        if self.redis:
            self.redis.close()
        self.store.close()
