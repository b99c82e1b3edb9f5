"""deployment/serving/tiers/: rows through the cache, a real Redis server and the store equal the
tables (NumPy), cold and warm, for caches holding a few percent of the rows; two instances sharing
Redis; updates reaching every tier; Redis killed and restarted during lookups, or down at
start-up; stores missing, half-written, mid-update or of another export refused in one line;
ids outside a table refused."""
import json
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis

from dataloading.synthetic import power_law_ids
from deployment.repository_format import Version
from deployment.serving.tiers import IdError, LookupTiers, TierConfig, cache_capacities, redis_tier, store_version
from deployment.serving.tiers.cache import _Cache
from tests.support.redis_server import RedisServer, free_port
from utils.errors import ConfigError, StoreError

SHAPES = [(20000, 8), (12000, 16), (5, 4)]
V0, V1 = Version("a1b2c3d4e5f6", 100), Version("a1b2c3d4e5f6", 200)
BUDGET = 240_000   # table 2 whole; 713 (3.6%) and 817 (6.8%) cached rows for tables 0 and 1


def make_repository(path, tables, version=V0, name="dlrm"):
    """A tables-form repository as deploy.py writes it (export.json, <name>_tables/ with
    tables.json and one .npy file per table), holding `tables`."""
    directory = os.path.join(path, f"{name}_tables")
    os.makedirs(directory)
    entries = []
    for f, table in enumerate(tables):
        np.save(os.path.join(directory, f"table_{f}.npy"), table)
        entries.append({"feature": f, "file": f"table_{f}.npy", "rows": table.shape[0], "dim": table.shape[1],
                        "dtype": "float32", "max_hotness": None, "combiner": "sum"})
    checkpoint = f"/runs/{version.run}/ckpt-{version.step}"
    with open(os.path.join(directory, "tables.json"), "w") as f:
        json.dump({"format": "dlrm-table-files", "version": 1, "checkpoint": checkpoint, "step": version.step,
                   "tables": entries}, f)
    with open(os.path.join(path, "export.json"), "w") as f:
        json.dump({"name": name, "forms": ["tables"], "checkpoint": checkpoint, "step": version.step,
                   "version": version.to_json(), "table_files": {"directory": f"{name}_tables"}}, f)
    return str(path)


def random_tables(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]


@pytest.fixture
def tables():
    return random_tables()


@pytest.fixture
def repo(tmp_path, tables):
    return make_repository(tmp_path / "repo", tables)


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path).start()
    yield s
    s.stop()


def zipf_batches(n, shape, seed=1):
    """n batches per feature of power-law ids scattered over each table: [(f, ids of `shape`)]."""
    rng = np.random.default_rng(seed)
    scatter = [rng.permutation(rows) for rows, _ in SHAPES]
    return [(f, scatter[f][power_law_ids(rng.random(shape), SHAPES[f][0], 1.05)])
            for _ in range(n) for f in range(len(SHAPES))]


def check_cache(tiers, tables):
    """Every cached row equals its table row, slot_of and id_of agree, at most capacity rows."""
    for group in tiers._groups:
        cache = group.cache
        cached = np.flatnonzero(cache.slot_of >= 0)
        assert len(cached) <= cache.capacity
        assert np.array_equal(cache.id_of[cache.slot_of[cached]], cached)
        for f, ids in group.split(cached):
            assert np.array_equal(cache.values[cache.slot_of[ids + group.offset[f]]], tables[f][ids])


def test_capacities():
    # budget 1000: the 40-byte table whole (share 333), the 400-byte one whole (share 480), then
    # 560 for the last: less than its 4,000 index bytes -> no rows
    assert cache_capacities([(1000, 1), (100, 1), (10, 1)], 1000) == [0, None, None]
    assert cache_capacities([(1000, 1), (100, 1), (5, 1)], 10_000) == [None, None, None]
    # 2 tables of 1000 x 4 (16,000 bytes each) in 20,000: 10,000 each -> (10,000 - 4,000) // 40 = 150 rows
    assert cache_capacities([(1000, 4), (1000, 4)], 20_000) == [150, 150]
    # the small one whole (400 bytes), the rest (9,600) to the big one: (9,600 - 4,000) // 40 = 140
    assert cache_capacities([(1000, 4), (100, 1)], 10_000) == [140, None]
    assert cache_capacities([(1000, 4)], 0) == [0]


@pytest.mark.parametrize("policy, victim", [("lru", 1), ("lfu", 0)])
def test_cache_victims_and_updates(policy, victim):
    cache = _Cache(100, 2, 4, policy)
    rows = np.arange(200, dtype=np.float32).reshape(100, 2)
    cache.fill(np.arange(4), rows[:4], 0)
    for i in [1, 1, 1, 2, 2, 3, 3, 0]:   # row 1 used first (LRU's victim), row 0 least often (LFU's)
        cache.lookup(np.array([i]))
    cache.fill(np.array([9]), rows[9:10], 0)
    assert sorted(np.flatnonzero(cache.slot_of >= 0)) == sorted({0, 1, 2, 3, 9} - {victim})
    _, miss, generation = cache.lookup(np.array([5]))   # read below, then an update of row 5 ...
    assert miss.all()
    cache.replace(np.array([5, 9]), rows[[5, 9]] + 1)
    cache.fill(np.array([5]), rows[5:6], generation)     # ... so the old row is not cached
    assert cache.slot_of[5] == -1
    out, miss, _ = cache.lookup(np.array([9, 2]))
    assert miss is None and np.array_equal(out, [rows[9] + 1, rows[2]])


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("with_redis", [False, True])
def test_rows_exact_cold_and_warm(repo, tables, server, policy, with_redis):
    config = TierConfig(cache_bytes=BUDGET, policy=policy, redis_url=server.url if with_redis else None)
    tiers = LookupTiers(repo, config)
    assert sorted(tiers._whole) == [2] and [g.features for g in tiers._groups] == [[0], [1]]   # widths 8, 16
    capacities = [g.cache.capacity for g in tiers._groups]
    assert 0 < capacities[0] < 0.05 * SHAPES[0][0] and 0 < capacities[1] < 0.1 * SHAPES[1][0]
    for rounds in range(2):   # cold, then warm (the same batches again)
        for f, ids in zipf_batches(15, (256,)) + zipf_batches(15, (64, 3), seed=2):
            out = tiers.rows(f, ids)
            assert out.shape == ids.shape + (SHAPES[f][1],)
            assert np.array_equal(out, tables[f][ids])
        check_cache(tiers, tables)
        if with_redis:
            tiers.redis.drain()   # the fills reach Redis
    stats = tiers.stats()
    assert 0.3 < stats["cache"]["hit_rate"] < 1.0
    assert stats["store"]["rows_read"] > 0
    if with_redis:   # the second round's cache misses were read back from Redis
        assert stats["redis"]["up"] and stats["redis"]["hits"] > 0
        assert stats["store"]["rows_read"] + stats["redis"]["hits"] == stats["redis"]["lookups"]
    else:
        assert "redis" not in stats
    # one-hot lookups of one id each, and an empty one
    assert np.array_equal(tiers.rows(0, np.array(7)), tables[0][7])
    assert tiers.rows(1, np.zeros((0, 3), np.int64)).shape == (0, 3, 16)
    tiers.close()


def test_concurrent_lookups(repo, tables, server):
    tiers = LookupTiers(repo, TierConfig(cache_bytes=BUDGET, policy="lfu", redis_url=server.url))

    def work(seed):
        for f, ids in zipf_batches(20, (200, 2), seed=seed):
            assert np.array_equal(tiers.rows(f, ids), tables[f][ids])
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(8)))
    check_cache(tiers, tables)
    tiers.close()


def test_two_instances_share_redis(repo, tables, server):
    config = TierConfig(cache_bytes=BUDGET, redis_url=server.url)
    first, second = LookupTiers(repo, config), LookupTiers(repo, config)
    ids = np.unique(zipf_batches(1, (500,))[0][1])
    assert np.array_equal(first.rows(0, ids), tables[0][ids])
    assert first.stats()["store"]["rows_read"] == len(ids)
    first.redis.drain()
    assert np.array_equal(second.rows(0, ids), tables[0][ids])
    s = second.stats()
    assert (s["redis"]["hits"], s["store"]["rows_read"]) == (len(ids), 0)   # all from Redis
    keys = redis.Redis.from_url(server.url).keys("dlrm:a1b2c3d4e5f6:100:0:*")
    assert sorted(int(k.rsplit(b":", 1)[1]) for k in keys) == ids.tolist()
    first.close()
    second.close()


def test_updates_reach_every_tier(tmp_path, repo, tables, server):
    other = shutil.copytree(repo, tmp_path / "copy")   # a second server's repository, still at V0
    config = TierConfig(cache_bytes=BUDGET, redis_url=server.url)
    tiers, peer = LookupTiers(repo, config), LookupTiers(str(other), config)
    ids = np.arange(0, 2000, 7)
    tiers.rows(0, ids)                              # cached (some), in Redis and the store
    tiers.rows(0, np.array([3]))
    tiers.redis.drain()
    new = (tables[0][ids] + 1).astype(np.float32)
    with pytest.raises(StoreError, match="outside advancing"):
        tiers.update(0, ids, new)
    with pytest.raises(StoreError, match="does not apply"):
        with tiers.advancing(V1, Version("a1b2c3d4e5f6", 300)):
            pass
    with tiers.advancing(V0, V1):
        tiers.update(0, ids, new)
        with pytest.raises(IdError):
            tiers.update(0, np.array([SHAPES[0][0]]), new[:1])
    expected = tables[0].copy()
    expected[ids] = new
    check_cache(tiers, [expected] + tables[1:])
    assert tiers.version == V1
    assert np.array_equal(tiers.rows(0, np.arange(SHAPES[0][0])), expected)                 # the cache and the store
    assert np.array_equal(np.load(os.path.join(repo, "dlrm_tables", "table_0.npy")), expected)   # the file
    client = redis.Redis.from_url(server.url)
    assert {client.getrange(f"dlrm:a1b2c3d4e5f6:100:0:{i}", 0, 15) for i in ids} == {b"%016x" % 200}   # Redis
    # the peer, still at V0, takes its own version's rows: not V1's from Redis, and leaves them there
    assert np.array_equal(peer.rows(0, ids), tables[0][ids])
    assert (peer.stats()["redis"]["hits"], peer.stats()["store"]["rows_read"]) == (0, len(ids))
    assert {client.getrange(f"dlrm:a1b2c3d4e5f6:100:0:{i}", 0, 15) for i in ids} == {b"%016x" % 200}
    with peer.advancing(V0, V1):   # the same update reaches the peer's store
        peer.update(0, ids, new)
    peer.close()
    # a server at V1 without a cache takes the updated rows from Redis; a row the update left (3,
    # in Redis at V0) it reads from its store once more and rewrites at V1
    third = LookupTiers(str(other), TierConfig(cache_bytes=0, redis_url=server.url), expect=V1)
    assert np.array_equal(third.rows(0, ids), new)
    assert (third.stats()["redis"]["hits"], third.stats()["store"]["rows_read"]) == (len(ids), 0)
    key = "dlrm:a1b2c3d4e5f6:100:0:3"
    assert client.getrange(key, 0, 15) == b"%016x" % 100
    assert np.array_equal(third.rows(0, np.array([3])), tables[0][[3]])
    third.redis.drain()
    assert client.getrange(key, 0, 15) == b"%016x" % 200
    third.close()
    tiers.close()
    assert store_version(repo) == V1
    with pytest.raises(StoreError, match=r"holds step 200 .*not the served step 100"):
        LookupTiers(repo)
    reopened = LookupTiers(repo, TierConfig(cache_bytes=BUDGET), expect=V1)
    assert np.array_equal(reopened.rows(0, np.arange(SHAPES[0][0])), expected)
    reopened.close()


def test_update_while_redis_unreachable_is_not_taken_from_it(tmp_path, repo, tables, server):
    logs = []
    other = shutil.copytree(repo, tmp_path / "copy")   # a second server's repository, still at V0
    config = TierConfig(cache_bytes=BUDGET, redis_url=server.url, redis_timeout_s=0.2, redis_retry_s=0.05)
    tiers = LookupTiers(repo, config, log=logs.append)
    ids = np.arange(100)
    tiers.rows(0, ids)
    tiers.redis.drain()
    client = redis.Redis.from_url(server.url)
    assert client.exists(*[f"dlrm:a1b2c3d4e5f6:100:0:{i}" for i in ids]) == len(ids)
    os.kill(server.process.pid, signal.SIGSTOP)   # unreachable, its data kept
    try:
        with tiers.advancing(V0, V1):
            tiers.update(0, ids[:10], tables[0][ids[:10]] * 2)
        assert not tiers.redis.up
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    time.sleep(0.1)
    others = np.arange(5000, 5050)   # not cached: a lookup in Redis, which reconnects
    assert np.array_equal(tiers.rows(0, others), tables[0][others])
    assert tiers.redis.up and len(logs) == 2 and "reachable again" in logs[1]
    # Redis still holds V0's rows: a server at V1 reads the updated ones from its store, one at V0 from Redis
    tiers.close()
    at_v1 = LookupTiers(repo, TierConfig(cache_bytes=0, redis_url=server.url), expect=V1)
    assert np.array_equal(at_v1.rows(0, ids[:10]), tables[0][ids[:10]] * 2)
    assert at_v1.stats()["store"]["rows_read"] == 10
    at_v0 = LookupTiers(str(other), TierConfig(cache_bytes=0, redis_url=server.url))
    assert np.array_equal(at_v0.rows(0, ids[10:]), tables[0][ids[10:]])
    assert (at_v0.stats()["redis"]["hits"], at_v0.stats()["store"]["rows_read"]) == (90, 0)
    at_v1.close()
    at_v0.close()


def test_fills_wait_in_a_queue_and_overflow_is_dropped(repo, tables, server, monkeypatch):
    tiers = LookupTiers(repo, TierConfig(cache_bytes=0, redis_url=server.url))
    sending, release, sent = threading.Event(), threading.Event(), []
    send = tiers.redis.set
    monkeypatch.setattr(tiers.redis, "set", lambda blocks, version: (sending.set(), release.wait(), sent.append(1),
                                                                      send(blocks, version)))
    for i in range(redis_tier._FILLS_WAITING + 11):   # the first fill is being sent, 64 wait, 10 dropped
        assert np.array_equal(tiers.rows(0, np.array([i])), tables[0][[i]])
        assert sending.wait(5)
    assert tiers.stats()["redis"]["fills_dropped"] == 10
    release.set()
    tiers.redis.drain()
    assert len(sent) == redis_tier._FILLS_WAITING + 1
    client = redis.Redis.from_url(server.url)
    in_redis = [client.exists(f"dlrm:a1b2c3d4e5f6:100:0:{i}") for i in range(redis_tier._FILLS_WAITING + 11)]
    assert in_redis == [1] * (redis_tier._FILLS_WAITING + 1) + [0] * 10
    tiers.close()


def test_redis_killed_and_restarted(repo, tables, server):
    logs = []
    config = TierConfig(cache_bytes=BUDGET, redis_url=server.url, redis_timeout_s=0.2, redis_retry_s=0.05)
    tiers = LookupTiers(repo, config, log=logs.append)
    batches = zipf_batches(40, (128, 2), seed=5)
    for i, (f, ids) in enumerate(batches):
        if i == 30:
            server.kill()
        if i == 80:
            server.start()   # the same port, empty
            time.sleep(0.1)  # past the back-off
        assert np.array_equal(tiers.rows(f, ids), tables[f][ids]), i
    assert len(logs) == 2, logs
    assert "unreachable" in logs[0] and "reachable again" in logs[1] and server.url in logs[0]
    stats = tiers.stats()["redis"]
    assert stats["up"] and stats["outages"] == 1
    tiers.redis.drain()
    assert redis.Redis.from_url(server.url).dbsize() > 0   # filled again after the restart
    tiers.close()


def test_redis_down_at_start_up(repo, tables):
    logs = []
    url = f"redis://127.0.0.1:{free_port()}/0"
    tiers = LookupTiers(repo, TierConfig(cache_bytes=BUDGET, redis_url=url, redis_retry_s=0.05), log=logs.append)
    for f, ids in zipf_batches(5, (100,)):
        assert np.array_equal(tiers.rows(f, ids), tables[f][ids])
    assert len(logs) == 1 and "at start-up" in logs[0] and "\n" not in logs[0]
    assert not tiers.stats()["redis"]["up"]
    tiers.close()


def refused(repo, match, **kwargs):
    with pytest.raises(StoreError, match=match) as e:
        LookupTiers(repo, TierConfig(cache_bytes=BUDGET), **kwargs)
    assert "\n" not in str(e.value)


def test_store_refused(tmp_path, repo):
    table0 = os.path.join(repo, "dlrm_tables", "table_0.npy")
    shutil.copy(table0, tmp_path / "saved")
    os.remove(table0)
    refused(repo, "table_0.npy: missing from the store")
    with open(tmp_path / "saved", "rb") as src, open(table0, "wb") as dst:
        dst.write(src.read()[:-100])   # half-written
    refused(repo, r"table_0.npy: 640,028 bytes, a \[20000, 8\] table takes 640,128: half-written")
    np.save(table0, np.zeros((20000, 4), np.float32))   # another table's file
    refused(repo, r"table_0.npy: holds float32\[20000, 4\], the store needs float32\[20000, 8\]")
    shutil.copy(tmp_path / "saved", table0)
    LookupTiers(repo).close()

    info_path = os.path.join(repo, "dlrm_tables", "tables.json")
    info = json.load(open(info_path))
    json.dump(dict(info, step=99), open(info_path, "w"))   # the tables of another export
    refused(repo, "tables of another export")
    os.remove(info_path)
    refused(repo, r"not a complete table store \(deploy.py --forms=tables\) \(no tables.json\)")
    json.dump(info, open(info_path, "w"))
    refused(repo, r"holds step 100 .*not the served step 200", expect=V1)

    tiers = LookupTiers(repo)
    with pytest.raises(RuntimeError, match="crash"):
        with tiers.advancing(V0, V1):
            tiers.update(0, np.array([1]), np.ones((1, 8), np.float32))
            raise RuntimeError("crash")
    tiers.close()
    refused(repo, r"an update from step 100 \(run a1b2c3d4\) to step 200 \(run a1b2c3d4\) was interrupted")

    export = json.load(open(os.path.join(repo, "export.json")))
    json.dump(dict(export, forms=["monolithic"], table_files=None), open(os.path.join(repo, "export.json"), "w"))
    refused(repo, "has no table files")
    refused(str(tmp_path / "nowhere"), r"not a model repository written by deploy.py \(no export.json\)")


def test_ids_refused(repo):
    tiers = LookupTiers(repo, TierConfig(cache_bytes=BUDGET))
    for f, ids, match in ((0, [5, -1], r"feature 0: ids out of range \[0, 20000\) \(min -1, max 5\)"),
                          (1, [[12000]], r"feature 1: ids out of range \[0, 12000\)"),
                          (2, [0.5], r"feature 2: ids out of range \[0, 5\)"),
                          (3, [0], "the model has 3 tables")):
        with pytest.raises(IdError, match=match):
            tiers.rows(f, np.array(ids))
    tiers.close()


def test_config_file(tmp_path):
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps({"cache_bytes": 1 << 20, "policy": "lfu", "redis_url": "redis://h:1/0"}))
    assert TierConfig.from_file(str(path)) == TierConfig(cache_bytes=1 << 20, policy="lfu", redis_url="redis://h:1/0")
    path.write_text(json.dumps({"cache_size": 1}))
    with pytest.raises(ConfigError, match=r"unknown tier settings \['cache_size'\]"):
        TierConfig.from_file(str(path))
    with pytest.raises(ConfigError, match="policy must be one of lru, lfu"):
        TierConfig(policy="fifo")
