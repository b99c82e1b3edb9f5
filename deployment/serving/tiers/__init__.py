"""Embedding lookups through tiers, for serving tables larger than memory (an inference parameter
server inside the serving process). No TensorFlow.

    cache   per process: the hot rows within a memory budget (LRU or LFU), one cache for the
            tables of each width, shared by the threads serving requests (cache.py)
    Redis   optional, shared by several servers or instances: a real Redis server
            (redis://host:port/db); keys and values, versions, outages: redis_tier.py
    store   every row: the table files of the repository's tables form (deployment/exporter/table_files.py),
            memory-mapped and updated in place (docs/benchmarks.md: read this way, about 100x
            the rows per second of RocksDB's multi-get, so RocksDB is not used) (store.py)

The package owns the tiers' state (the caches, the Redis connection and its fill thread, the
mapped table files and store.json); the server uses only the names below. Shapes: F tables,
table f [rows_f, D_f] float32, ids integers in [0, rows_f) of any shape.
    tiers = LookupTiers(repository, config, expect, log)   a tables-form repository's store, refused
                                             in one line (StoreError) when missing, half-written,
                                             mid-update or holding another version than `expect`
    tiers.lookup({f: ids})                   -> {f: [*ids.shape, D_f]}, ids unchecked (the serving path)
    tiers.rows(f, ids)                       -> [*ids.shape, D_f], ids checked (IdError)
    with tiers.advancing(base, new, record):     moves every tier from Version `base` to `new`
        tiers.update(f, ids, rows)           ids [n] unique, rows [n, D_f]
        tiers.update_ids(f, rows, row_ids)   a dynamic table's ids file: rows [k], row_ids [k, 2] int64
        tiers.grow(f, rows)                  a dynamic table's files grow to `rows` rows (the new ones free)
    tiers.row_ids(f) -> [R, 2] int64         a dynamic table's ids file (per row: raw id, LIVE or FREE)
    tiers.version; tiers.stats() (per tier its counts); tiers.close()
Settings and the store on its own:
    TierConfig(cache_bytes, policy, redis_url, ...)   or TierConfig.from_file(path); policy one of POLICIES
    cache_capacities([(rows_f, D_f)] F, budget)   -> F x (None: held whole, else the cached rows)
    store_state(repository) -> store.json's content; store_version(repository) -> the Version held
    open_npy_table(path, writable).read(ids [n]) -> [n, D]   one table file (benchmarks)

Modules: config.py (TierConfig, the cache budget's shares), store.py (RowStore over NpyTable, the
version held), cache.py (tables held whole, a cache per width over storage/row_cache.py),
redis_tier.py (RedisTier), lookup.py (LookupTiers: the tiers put together).
"""
from deployment.serving.tiers.config import POLICIES, TierConfig, cache_capacities
from deployment.serving.tiers.lookup import IdError, LookupTiers
from deployment.serving.tiers.store import open_npy_table, store_state, store_version

__all__ = ["POLICIES", "IdError", "LookupTiers", "TierConfig", "cache_capacities", "open_npy_table",
           "store_state", "store_version"]
