"""Serving through the lookup tiers against the same model served all in memory, in process
(deployment/serving/live.py's Model, one client thread): a tables-form repository whose tables are
--ratio times the cache budget, requests with power-law (Zipf) ids. One JSON line: both engines'
figures and their ratios.

    python benchmarks/serving_tiers.py --repository /tmp/dlrm-continuous-bench/repo0 [--ratio 4]
        [--policy lru] [--redis_url redis://127.0.0.1:6379/0 [--redis_peer]] [--alpha 1.05]

The repository: a W1-shaped DLRM (../shared/bench/workloads.yaml: 26 tables, width 16) exported
with deploy.py --forms=tables, e.g. the one benchmarks/continuous_training.py writes. Each
request's feature f takes ids of rank k with P ~ (k + 1)^-alpha, the ranks scattered over the
table by a multiplicative hash (hot rows are not neighbours in the file); numericals N(0, 1).

Per engine, after --warmup batches of 1024 (the cache filled; every batch is a new draw), in
--rounds rounds alternating the engines: throughput at batch 1024 (samples per second over
--batches batches) and latency at batch 64 (p50 and p99 over --requests requests one after
another); medians over the rounds. The tiers' hit rates per tier are those of the timed part.
The first batch is checked: both engines' predictions equal bit for bit.
"""
import argparse
import json
import os
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from dataloading.synthetic import power_law_ids  # noqa: E402
from deployment.serving.live import Model  # noqa: E402
from deployment.serving.tiers import TierConfig  # noqa: E402

HASH = 2654435761   # a prime: rank -> (rank * HASH) % rows is a permutation of each table's rows


class Requests:
    """Draws (numerical [B, n] float32, categorical [B, 26] int64) with Zipf ids."""

    def __init__(self, model: Model, alpha: float, seed: int = 0):
        self.rng, self.alpha = np.random.default_rng(seed), alpha
        self.rows, self.num_numerical = model.layout.cardinalities, model.layout.num_numerical

    def __call__(self, batch: int):
        ranks = [power_law_ids(self.rng.random(batch), rows, self.alpha) for rows in self.rows]
        categorical = np.stack([(r * HASH) % rows for r, rows in zip(ranks, self.rows)], 1)
        return self.rng.standard_normal((batch, self.num_numerical), np.float32), categorical.astype(np.int64)


def throughput(model: Model, batches) -> float:
    start = time.perf_counter()
    for numerical, categorical in batches:
        model.infer(numerical, categorical)
    return sum(len(n) for n, _ in batches) / (time.perf_counter() - start)


def latencies(model: Model, batches) -> np.ndarray:
    out = []
    for numerical, categorical in batches:
        start = time.perf_counter()
        model.infer(numerical, categorical)
        out.append(time.perf_counter() - start)
    return np.array(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", default="/tmp/dlrm-continuous-bench/repo0")
    parser.add_argument("--ratio", type=float, default=4.0, help="the tables' bytes over the cache budget")
    parser.add_argument("--policy", default="lru", choices=("lru", "lfu"))
    parser.add_argument("--redis_url", default=None, help="a Redis server as the middle tier (flushed first)")
    parser.add_argument("--redis_peer", action="store_true",
                        help="with --redis_url: another server of the same tiers first serves --warmup batches of "
                             "other requests (a replica that filled Redis before this one started)")
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--warmup", type=int, default=200, help="batches of 1024 before timing")
    parser.add_argument("--batches", type=int, default=60, help="batches of 1024 per throughput run")
    parser.add_argument("--requests", type=int, default=400, help="batches of 64 per latency run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.redis_url:
        import redis
        redis.Redis.from_url(args.redis_url).flushdb()
    memory = Model(args.repository)
    tables_bytes = sum(r * d * 4 for r, d in zip(memory.layout.cardinalities, memory.layout.embedding_dims))
    config = TierConfig(cache_bytes=int(tables_bytes / args.ratio), policy=args.policy, redis_url=args.redis_url)
    if args.redis_peer:
        peer, other = Model(args.repository, config), Requests(memory, args.alpha, seed=1)
        for _ in range(args.warmup):
            peer.infer(*other(1024))
        peer.close()   # its fills sent
    tiers = Model(args.repository, config)
    draw = Requests(memory, args.alpha)
    first = draw(1024)
    if not np.array_equal(tiers.infer(*first)["logits"], memory.infer(*first)["logits"]):
        raise SystemExit("the tiers' predictions differ from the in-memory engine's")
    start = time.perf_counter()
    for _ in range(args.warmup):
        tiers.infer(*draw(1024))
    warmup_s = time.perf_counter() - start
    before = tiers.stats()
    figures = {"memory": {"throughput": [], "p50": [], "p99": []}, "tiers": {"throughput": [], "p50": [], "p99": []}}
    for _ in range(args.rounds):
        large = [draw(1024) for _ in range(args.batches)]
        small = [draw(64) for _ in range(args.requests)]
        for name, model in (("memory", memory), ("tiers", tiers)):
            figures[name]["throughput"].append(throughput(model, large))
            seconds = latencies(model, small)
            figures[name]["p50"].append(np.percentile(seconds, 50) * 1e3)
            figures[name]["p99"].append(np.percentile(seconds, 99) * 1e3)
    after = tiers.stats()
    result = {name: {"samples_per_s_batch_1024": round(float(np.median(f["throughput"]))),
                     "p50_ms_batch_64": round(float(np.median(f["p50"])), 2),
                     "p99_ms_batch_64": round(float(np.median(f["p99"])), 2)} for name, f in figures.items()}
    cache_lookups = after["cache"]["lookups"] - before["cache"]["lookups"]
    tier_rates = {"cache": (after["cache"]["hits"] - before["cache"]["hits"]) / cache_lookups}
    if "redis" in after:
        asked = after["redis"]["lookups"] - before["redis"]["lookups"]
        tier_rates["redis"] = (after["redis"]["hits"] - before["redis"]["hits"]) / max(asked, 1)
        result["tiers"]["redis_fills_dropped"] = after["redis"]["fills_dropped"]
    tier_rates["store_rows_per_1k_ids"] = 1000 * (after["store"]["rows_read"] - before["store"]["rows_read"]) / \
        cache_lookups
    result["tiers"].update(cache_mb=round(after["cache"]["bytes"] / 2**20),
                           cache_rows_filled=round(after["cache"]["rows"] / max(after["cache"]["capacity"], 1), 3),
                           hit_rates={
        k: round(v, 4) for k, v in tier_rates.items()}, warmup_s=round(warmup_s, 1), redis=args.redis_url)
    print(json.dumps({"tables_mb": round(tables_bytes / 2**20), "budget_mb": round(config.cache_bytes / 2**20),
                      "policy": args.policy, "alpha": args.alpha, **result,
                      "throughput_ratio": round(result["tiers"]["samples_per_s_batch_1024"] /
                                                result["memory"]["samples_per_s_batch_1024"], 3),
                      "p99_ratio": round(result["tiers"]["p99_ms_batch_64"] / result["memory"]["p99_ms_batch_64"], 3)}),
          flush=True)
    tiers.close()


if __name__ == "__main__":
    main()
