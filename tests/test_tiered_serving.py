"""deployment/serving/live.py through deployment/serving/tiers/ (a cache holding a few rows, a real Redis
server, the table files as the store): predictions equal the in-memory engine's (bit for bit)
and the monolithic model's, cold and warm; deltas reach the store's files, Redis and the cache,
and a restart serves the version the store holds; two engines sharing Redis a delta apart each
serve their own version; a full export replaces the tiers; and
deployment/serve.py with the tiers: two servers sharing Redis, Redis down at start-up and killed
under requests, start-up refusals in one line; the tiers' counts as Prometheus metrics."""
import json
import os
import shutil
import threading

import numpy as np
import pytest
import redis

from deployment.client import ServingClient, free_ports
from deployment.exporter.repository import write_repository
from deployment.repository_format import export_version
from deployment.serving.live import KEPT_DENSE, Model, Updater
from deployment.serving.tiers import TierConfig
from deployment.serving.metrics import Metrics
from tests.support.redis_server import RedisServer, free_port
from tests.support.live_exports import make_delta, read_info, tables_of
from tests.test_live_serving import Load, monolithic, read_delta_of, requests, wait_for
from tests.support.serving import parse_metrics, port_flags, scrape, script, start_server, stop_server
from utils.errors import StoreError

# TINY's tables [20, 50, 7, 30] x 8: in 800 bytes their shares are 2, 0, 3 and 1 rows, one cache of 6 (of 107)
BUDGET = 800
CACHED = 6
KEYS = ("logits", "predictions", "model_version")


@pytest.fixture
def exports(live_exports):
    return live_exports


def copy_repo(repo, path):
    """A copy of a repository (the tiers update its table files in place)."""
    shutil.copytree(repo, path)
    return str(path)


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path).start()
    yield s
    s.stop()


def check_tiers(model, tables, redis_url=None):
    """Every cached row equals `tables`' (per feature [rows, D]), at most the capacity; every row
    in Redis too, at the served version (keys <model>:<run>:<step>:<feature>:<id>); returns the
    rows found in Redis."""
    tiers = model._current.tables
    assert not tiers._whole and len(tiers._groups) == 1   # the 4 tables of width 8 share one cache
    group = tiers._groups[0]
    assert group.cache.capacity == CACHED
    cached = np.flatnonzero(group.cache.slot_of >= 0)
    for f, ids in group.split(cached):
        np.testing.assert_array_equal(group.cache.values[group.cache.slot_of[ids + group.offset[f]]], tables[f][ids])
    if redis_url is None:
        return 0
    tiers.redis.drain()
    client = redis.Redis.from_url(redis_url)
    keys = client.keys("*")
    for key, value in zip(keys, client.mget(keys)):
        f, i = map(int, key.decode().split(":")[-2:])
        assert value[:16] == b"%016x" % model.version.step
        np.testing.assert_array_equal(np.frombuffer(value[24:], np.float32), tables[f][i])
    return len(keys)


@pytest.mark.parametrize("policy, with_redis", [("lru", False), ("lfu", True)])
def test_predictions_through_the_tiers_equal_in_memory_and_monolithic(exports, tmp_path, policy, with_redis):
    server = RedisServer(tmp_path).start() if with_redis else None
    url = server and server.url
    memory = Model(exports[24])
    tiered = Model(copy_repo(exports[24], tmp_path / "repo"), TierConfig(BUDGET, policy, url))
    try:
        batches = [requests(64, seed=20 + k) for k in range(3)]
        for round in range(3):   # the first cold, then warm
            for numerical, categorical in batches:
                out, expected = tiered.infer(numerical, categorical), memory.infer(numerical, categorical)
                for key in KEYS:
                    np.testing.assert_array_equal(out[key], expected[key])
                if round == 0:
                    reference = monolithic(exports[24], numerical, categorical)
                    np.testing.assert_allclose(out["logits"], reference["logits"], rtol=1e-6, atol=1e-6)
            assert (check_tiers(tiered, tables_of(exports[24]), url) > 50) == with_redis
        stats = tiered.stats()
        assert 0 < stats["cache"]["hits"] < stats["cache"]["lookups"] and stats["cache"]["bytes"] <= BUDGET
        if with_redis:   # every row read from the store once, then from Redis
            assert stats["store"]["rows_read"] <= 107 and stats["redis"]["hits"] > 0 and stats["redis"]["up"]
        else:
            assert stats["store"]["rows_read"] > 107
    finally:
        tiered.close()
        if server:
            server.stop()


def test_deltas_through_the_tiers_reach_every_tier_and_a_restart_serves_them(exports, server, tmp_path):
    repo = copy_repo(exports[8], tmp_path / "repo")
    config = TierConfig(BUDGET, "lru", server.url)
    model = Model(repo, config)
    numerical, categorical = requests(200, seed=1)
    model.infer(numerical, categorical)   # the cache and Redis hold rows of step 8
    updates = tmp_path / "updates"
    for base, new in ((8, 16), (16, 24)):
        model.apply_delta(read_delta_of(make_delta(exports[base], exports[new], str(updates / f"d{new}"))))
        assert model.version == export_version(exports[new]) and not model._current.overlay
    expected = tables_of(exports[24])
    for stored, table in zip(tables_of(repo), expected):   # the store's files
        np.testing.assert_array_equal(stored, table)
    assert check_tiers(model, expected, server.url) > 50   # the cache and Redis
    fresh = Model(exports[24]).infer(numerical, categorical)
    for key in KEYS:
        np.testing.assert_array_equal(model.infer(numerical, categorical)[key], fresh[key])
    with open(os.path.join(repo, "dlrm_tables", "store.json")) as f:
        state = json.load(f)
    assert state["holds"] == export_version(exports[24]).to_json() and state[KEPT_DENSE] == "dense-24"
    assert sorted(e for e in os.listdir(os.path.join(repo, "dlrm_tables")) if e.startswith("dense")) == ["dense-24"]
    model.close()
    for restarted in (Model(repo, config), Model(repo)):   # through the tiers, and in memory
        assert restarted.version == export_version(exports[24])
        lines = []
        Updater(restarted, str(updates), log=lines.append).poll()   # the deltas it holds: skipped
        assert lines == [f"skipped update {updates / f'd{step}'}: its step {step} is not above "
                         f"{export_version(exports[24])}, served at start-up" for step in (16, 24)]
        for key in KEYS:
            np.testing.assert_array_equal(restarted.infer(numerical, categorical)[key], fresh[key])
        restarted.close()
    shutil.rmtree(os.path.join(repo, "dlrm_tables", "dense-24"))
    with pytest.raises(StoreError) as e:
        Model(repo, config)
    assert str(e.value) == (f"{repo}/dlrm_tables: holds {export_version(exports[24])} (deltas applied after the "
                            f"export, {export_version(exports[8])}) but not its dense model dense-24: export "
                            f"{export_version(exports[24])} again with deploy.py and serve that")


def test_servers_sharing_redis_at_different_versions_each_serve_their_own(exports, server, tmp_path):
    """Two engines through the tiers share Redis, one a delta ahead of the other: each answers as
    the in-memory engine of its own version, before, while and after the other's rows reach Redis;
    the second one caught up, both answer the new version."""
    config = TierConfig(BUDGET, "lru", server.url)
    ahead, behind = (Model(copy_repo(exports[16], tmp_path / name), config) for name in ("ahead", "behind"))
    reference = {step: Model(exports[step]) for step in (16, 24)}
    batches = [requests(64, seed=40 + k) for k in range(4)]

    def check(model, step):
        model._current.tables.redis.drain()   # the other's fills too, before the next one reads Redis
        for batch in batches:
            for key in KEYS:
                np.testing.assert_array_equal(model.infer(*batch)[key], reference[step].infer(*batch)[key])
    check(ahead, 16)
    check(behind, 16)
    delta = read_delta_of(make_delta(exports[16], exports[24], str(tmp_path / "d24")))
    ahead.apply_delta(delta)   # its rows at step 24 in Redis
    for _ in range(2):
        check(ahead, 24)
        check(behind, 16)
    behind.apply_delta(delta)
    check(behind, 24)
    check(ahead, 24)
    assert behind.stats()["redis"]["hits"] > 0 and ahead.stats()["redis"]["hits"] > 0
    for model in (ahead, behind, *reference.values()):
        model.close()


def test_requests_in_flight_keep_the_old_rows_and_a_full_export_replaces_the_tiers(exports, tmp_path):
    """A request holding the step-8 snapshot: the store's files stay unchanged (the new rows in an
    overlay) until it finishes; then a full export of step 24 serves through new tiers, the old
    ones closed."""
    repo = copy_repo(exports[8], tmp_path / "repo")
    model = Model(repo, TierConfig(BUDGET))
    numerical, categorical = requests(100, seed=2)
    old = model.infer(numerical, categorical)
    new = Model(exports[16]).infer(numerical, categorical)
    delta = read_delta_of(make_delta(exports[8], exports[16], str(tmp_path / "d16")))
    with model.snapshot() as held:
        update = threading.Thread(target=model.apply_delta, args=(delta,))
        update.start()
        wait_for(lambda: model.version.step == 16, "step 16 swapped in")
        assert model._current.overlay and update.is_alive()
        for key in ("logits", "model_version"):
            np.testing.assert_array_equal(model.infer(numerical, categorical)[key], new[key])
            np.testing.assert_array_equal(model.infer_with(held, numerical, categorical)[key], old[key])
        for stored, table in zip(tables_of(repo), tables_of(exports[8])):
            np.testing.assert_array_equal(stored, table)
    update.join(120)
    assert not update.is_alive() and not model._current.overlay
    for stored, table in zip(tables_of(repo), tables_of(exports[16])):
        np.testing.assert_array_equal(stored, table)
    np.testing.assert_array_equal(model.infer(numerical, categorical)["logits"], new["logits"])
    tiers = model._current.tables
    model.replace(copy_repo(exports[24], tmp_path / "full24"))
    assert tiers.store.tables == [] and model._current.tables is not tiers
    fresh = Model(exports[24]).infer(numerical, categorical)
    for key in KEYS:
        np.testing.assert_array_equal(model.infer(numerical, categorical)[key], fresh[key])
    model.close()


def test_metrics_render_the_tiers_counts(exports, tmp_path):
    """deployment/serving/metrics.py given a model served through the tiers (without Redis): its version's
    step and the tiers' counts as Model.stats() has them, no Redis metrics."""
    model = Model(copy_repo(exports[24], tmp_path / "repo"), TierConfig(BUDGET))
    metrics = Metrics("dlrm", lambda: dict(model.stats(), model={"version_step": model.version.step}))
    for k in range(3):
        model.infer(*requests(64, seed=40 + k))
    samples, types = parse_metrics(metrics.render())
    stats = model.stats()
    model.close()
    assert {k: v for k, v in samples.items() if not k.startswith("dlrm_inference_")} == {
        'dlrm_model_version_step{model="dlrm"}': 24,
        'dlrm_cache_lookups_total{model="dlrm"}': stats["cache"]["lookups"],
        'dlrm_cache_hits_total{model="dlrm"}': stats["cache"]["hits"],
        'dlrm_cache_bytes{model="dlrm"}': stats["cache"]["bytes"],
        'dlrm_cache_rows{model="dlrm"}': stats["cache"]["rows"],
        'dlrm_store_rows_read_total{model="dlrm"}': stats["store"]["rows_read"]}
    assert 0 < stats["cache"]["hits"] <= stats["cache"]["lookups"] and 0 < stats["cache"]["rows"] <= CACHED
    assert types["dlrm_cache_rows"] == "gauge" and types["dlrm_store_rows_read_total"] == "counter"


def serve_flags(ports, *args):
    """Flags of serve.py (native frontend) on ports (http, grpc, metrics), then `args`."""
    return [*port_flags(ports), "--address=127.0.0.1", *args]


@pytest.mark.slow
def test_serve_refuses_bad_tier_flags_and_stores_in_one_line(exports, tmp_path):
    repo = exports[8]
    mono = tmp_path / "mono"
    write_repository(read_info(repo)["checkpoint"], str(mono), forms=["monolithic"])
    missing, short, other = (copy_repo(repo, tmp_path / name) for name in ("missing", "short", "other"))
    os.remove(os.path.join(missing, "dlrm_tables", "table_1.npy"))
    with open(os.path.join(short, "dlrm_tables", "table_3.npy"), "r+b") as f:
        f.truncate(500)
    shutil.rmtree(os.path.join(other, "dlrm_tables"))
    shutil.copytree(os.path.join(exports[16], "dlrm_tables"), os.path.join(other, "dlrm_tables"))
    settings = tmp_path / "tiers.json"
    settings.write_text(json.dumps({"cache_bytes": 800, "colour": "red"}))
    checkpoint = read_info(repo)["checkpoint"]
    cache = "--embedding_cache_mb=1"
    for args, message in (
            ([repo, cache, "--embedding_cache_policy=mru"],
             "--embedding_cache_policy must be one of lru, lfu, got 'mru'"),
            ([repo, cache, "--redis_url=redis://localhost:port/0"],
             "--redis_url must be redis://host:port/db (or unix://path), got 'redis://localhost:port/0'"),
            ([repo, "--redis_url=redis://localhost:6379/0"],
             "--redis_url needs --embedding_cache_mb (serving through the lookup tiers)"),
            ([repo, "--embedding_cache_mb=-1"], "--embedding_cache_mb must be >= 0, got -1"),
            ([repo, cache, f"--tiers_config={settings}"], "give --tiers_config or --embedding_cache_mb, not both"),
            ([repo, f"--tiers_config={settings}"],
             f"{settings}: unknown tier settings ['colour'] (known: ['cache_bytes', 'policy', 'redis_chunk', "
             "'redis_retry_s', 'redis_timeout_s', 'redis_url'])"),
            ([str(mono), cache], f"--embedding_cache_mb: {mono} has no table files to look up (exported with "
                                 "--forms=monolithic): export with --forms including tables"),
            ([missing, cache], f"{missing}/dlrm_tables/table_1.npy: missing from the store"),
            ([short, cache], f"{short}/dlrm_tables/table_3.npy: 500 bytes, a [30, 8] table takes 1,088: "
                             "half-written or damaged"),
            ([other, cache], f"{other}/dlrm_tables: tables of another export ({checkpoint[:-1]}16 step 16) than "
                             f"{other}'s ({checkpoint} step 8)")):
        result = script("serve.py", f"--model_repository={args[0]}", *serve_flags(free_ports(3), *args[1:]))
        assert result.returncode == 2 and result.stderr.strip().splitlines()[-1:] == [f"error: {message}"], \
            (args, result.stderr[-2000:])


@pytest.mark.slow
def test_two_servers_share_redis_which_goes_down_and_comes_back(exports, tmp_path):
    """Two serve.py processes through the tiers (flags; a settings file) with Redis down at
    start-up: each says so once and answers; Redis started, they reconnect and share it (the
    answers of both equal the in-memory engine's); Redis killed under continuous requests and
    restarted: every response right, no error, one line each way."""
    redis_server = RedisServer(tmp_path, free_port())
    settings = tmp_path / "tiers.json"
    settings.write_text(json.dumps({"cache_bytes": BUDGET, "policy": "lfu", "redis_url": redis_server.url,
                                    "redis_retry_s": 0.2}))
    repo = exports[24]
    ports = [free_ports(3), free_ports(3)]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    servers = [start_server(logs[0], ports[0], f"--model_repository={repo}",
                            f"--embedding_cache_mb={BUDGET / 2**20}", f"--redis_url={redis_server.url}"),
               start_server(logs[1], ports[1], f"--model_repository={repo}", f"--tiers_config={settings}")]
    clients = [ServingClient("grpc", f"localhost:{p[1]}", "dlrm") for p in ports]
    memory = Model(repo)
    expected = [memory.infer(*batch)["logits"] for batch in Load.BATCHES]
    load = Load(ports[0][1])
    down, back = "Redis unreachable", "Redis reachable again"
    try:
        for client in clients:
            client.wait_ready(120)
        numerical, categorical = requests(64, seed=30)
        reference = memory.infer(numerical, categorical)
        ask = lambda client: client.infer(numerical, categorical, ("logits", "model_version"))  # noqa: E731
        for client, log in zip(clients, logs):
            np.testing.assert_array_equal(ask(client)["logits"], reference["logits"])
            assert log.read_text().count(down) == 1 and f"{redis_server.url}: {down} at start-up" in log.read_text()
        redis_server.start()
        for client, log in zip(clients, logs):
            wait_for(lambda: ask(client) and back in log.read_text(), "reconnected to Redis", 60)
        for client in clients + clients[::-1]:
            np.testing.assert_array_equal(ask(client)["logits"], reference["logits"])
        assert redis.Redis.from_url(redis_server.url).dbsize() > 50
        load.start()
        wait_for(lambda: len(load.responses) >= 50, "requests with Redis up")
        redis_server.kill()
        count = len(load.responses)
        wait_for(lambda: len(load.responses) >= count + 50 and logs[0].read_text().count(down) == 2,
                 "requests with Redis down")
        redis_server.start()
        wait_for(lambda: logs[0].read_text().count(back) == 2, "reconnected after the restart", 90)
        count = len(load.responses)
        wait_for(lambda: len(load.responses) >= count + 50, "requests after the restart")
        answered = len(load.responses)
        samples, _ = scrape(ports[0][2])
    finally:
        load.finish()
        for server, p, log in zip(servers, ports, logs):
            stop_server(server, p, log)
        redis_server.stop()
    assert load.errors == []
    for _, _, k, versions, logits in load.responses:
        assert versions == {24}
        np.testing.assert_array_equal(logits, expected[k])
    lines = logs[0].read_text().splitlines()
    assert sum(down in line for line in lines) == 2 and sum(back in line for line in lines) == 2
    metric = lambda name: samples[f'dlrm_{name}{{model="dlrm"}}']  # noqa: E731
    assert metric("redis_outages_total") == 2 and metric("redis_up") == 1 and metric("model_version_step") == 24
    assert 0 < metric("redis_hits_total") <= metric("redis_lookups_total") <= metric("cache_lookups_total")
    assert samples['dlrm_inference_requests_total{model="dlrm",protocol="grpc",status="success"}'] >= answered
    assert any(line.startswith(f"serving dlrm (tables form, step 24 (run {exports.run}), through a "
                               f"{BUDGET / 2**20:g} MiB lru cache, Redis {redis_server.url} and the table files) of ")
               for line in lines), lines[:5]
