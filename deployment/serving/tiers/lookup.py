"""The tiers put together: LookupTiers, a repository's tables served through the cache
(cache.py), Redis (redis_tier.py) and the store (store.py).

A request's lookup (`lookup`, every feature at once) takes what the caches hold, reads the unique
rest from Redis, then the rest of that from the store; rows found below fill the tiers above (the
cache at once; Redis from a thread of its own, which the request does not wait for: at most
_FILLS_WAITING requests' fills wait, others are dropped and counted). Rows move in bulk: one cache
lookup per width, one pipelined MGET round trip per request, NumPy gathers from the store, one
round trip of fills (a script per chunk); no Python call per row on the hot path but the Redis
client's packing.

Updates (`advancing`, `update`) reach every tier; rows read from the store while an update runs
are not written to Redis (they may be of either version).
"""
import contextlib
import logging
import os
import threading
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from deployment.repository_format import EXPORT_INFO, Version
from deployment.serving.tiers.cache import _Group, _Whole
from deployment.serving.tiers.config import TierConfig, cache_capacities
from deployment.serving.tiers.redis_tier import RedisTier
from deployment.serving.tiers.store import RowStore
from utils.errors import StoreError
from utils.files import read_json


class IdError(ValueError):
    """Ids outside a table; one line naming the feature."""


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

    def row_ids(self, feature: int) -> np.ndarray:
        """A dynamic table's ids file [R, 2] int64 (per row: raw id, LIVE or FREE), a copy."""
        return np.array(self.store.ids[feature])

    def update_ids(self, feature: int, rows: np.ndarray, row_ids: np.ndarray):
        """A dynamic table's ids file entries `rows` [k] become `row_ids` [k, 2]. Inside `advancing`."""
        if not self._advancing:
            raise StoreError(f"{self.store.directory}: an update outside advancing(base, new)")
        self.store.write_ids(feature, rows, row_ids)

    def grow(self, feature: int, rows: int):
        """A dynamic table takes `rows` rows (more than now; the new ones free): the store's files
        grow (RowStore.grow), a table held whole is copied larger, and a cached table's group
        starts an empty cache (its tables' rows are the cache's keys). Inside `advancing`."""
        if not self._advancing:
            raise StoreError(f"{self.store.directory}: a table grown outside advancing(base, new)")
        self.store.grow(feature, rows)
        self.shapes = self.store.shapes
        if feature in self._whole:
            grown = _Whole(np.array(self.store.tables[feature].array))
            grown.lookups = self._whole[feature].lookups
            self._whole = {**self._whole, feature: grown}
            return
        old = self._group_of[feature]
        group = _Group(old.features, [self.shapes[f][0] for f in old.features], old.dim, old.cache.capacity,
                       self.config.policy)
        self._groups = [group if g is old else g for g in self._groups]
        self._group_of = {f: group for g in self._groups for f in g.features}

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
