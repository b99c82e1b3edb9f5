"""The disk tier of embedding tables on W1 (../shared/bench/workloads.yaml), one JSON line per run.

    python benchmarks/tiered_store.py train [--steps 2500] [--rounds 2]   # W1 in memory vs 3 tables on disk
    python benchmarks/tiered_store.py pipeline [--steps 2500]             # the input pipeline, with/without staging
    python benchmarks/tiered_store.py large [--dim 192] [--steps 300]     # tables larger than this machine's memory

`train`: W1 (batch 4096, width 16, SGD) through dlrm.py on split-binary files of synthetic
samples with power-law ids (alpha 1.05; written once under --work_dir), alternately all in
memory and with a per-rank budget (--embedding_memory_budget_gb) that leaves the three
largest tables (10.1M, 8.4M, 7.0M rows) on disk with caches of at most `--cache_fraction` of
their rows. Reports samples/s over the last 30% of the steps (by then the caches are full and
evict: about 2500 steps at the default fraction), the tiered run's hit rate, MB read/written
per step and staging time and wait (from its progress records), and each process's peak RSS.
`pipeline`: the same batches through the real input pipeline (split-binary reader, tf.data
prefetch) and the embedding's staging, no train step: samples/s of one rank over the last 30%.
`large`: W1's cardinalities at width --dim (192: 26 GB of tables with SGD) on disk under a
--budget_gb budget: trains --steps steps; samples/s, hit rate, peak RSS.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from utils.tensorflow_startup import import_tensorflow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W1_CARDINALITIES = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
BATCH = 4096
INDEX_BYTES, SLOT_BYTES = 4, 32   # parallel_embedding.planner's per-row index and per-slot bookkeeping


def dataset(work_dir: str, rows: int, seed: int = 12345) -> str:
    """W1-shaped split-binary files of `rows` training samples (power-law ids, drawn with `seed`),
    written once."""
    path = os.path.join(work_dir, f"w1_{rows}" + (f"_seed{seed}" if seed != 12345 else ""))
    if not os.path.isfile(os.path.join(path, "feature_spec.yaml")):
        from dataloading.feature_spec import split_binary_spec
        from dataloading.generate_dataset import generate
        spec = split_binary_spec([f"num_{k}" for k in range(13)],
                                 {f"cat_{k}": c for k, c in enumerate(W1_CARDINALITIES)}, base_dir=path)
        os.makedirs(path, exist_ok=True)
        t0 = time.perf_counter()
        generate(spec, rows, BATCH, seed=seed, alpha=1.05)
        print(f"wrote {rows:,} W1 samples to {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return path


def budget_gb(dim: int, on_disk: int, cache_fraction: float) -> float:
    """A budget that keeps every table but the `on_disk` largest in memory (SGD: no slots) and
    gives those caches of `cache_fraction` of their rows. (The planner moves tables to disk,
    largest first, until the rest fits: for it to move the third, the caches must take less
    than that table in memory; on W1 a fraction up to about 0.13.)"""
    big = sorted(W1_CARDINALITIES, reverse=True)[:on_disk]
    rest = sum(W1_CARDINALITIES) - sum(big)
    row = 4 * dim
    return (rest * row + sum(int(cache_fraction * r) * (row + SLOT_BYTES) + r * INDEX_BYTES for r in big)) / 2 ** 30


def run(data: str, steps: int, dim: int, log: str, extra=()) -> dict:
    """dlrm.py on W1 for `steps` steps; returns its final record, step records and peak RSS."""
    cmd = [sys.executable, os.path.join(ROOT, "dlrm.py"), f"--dataset_path={data}", f"--batch_size={BATCH}",
           f"--valid_batch_size={BATCH}", f"--embedding_dim={dim}", "--bottom_mlp_dims=512,256,64,16" if dim == 16
           else f"--bottom_mlp_dims=512,256,{dim}", "--top_mlp_dims=512,256,1", "--optimizer=sgd",
           "--learning_rate=0.1", "--warmup_steps=0", "--decay_steps=0", f"--max_steps={steps}",
           f"--print_freq={max(steps // 10, 1)}", "--evals_per_epoch=0", f"--log_path={log}", *extra]
    if os.path.exists(log):
        os.remove(log)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"dlrm.py failed ({' '.join(cmd)}):\n{out[-3000:]}")
    records = [json.loads(line) for line in open(log)]
    final = next(r for r in records if r["kind"] == "final")
    return {"final": final, "steps": [r for r in records if r["kind"] == "step"], "out": out,
            "peak_rss_gb": usage.ru_maxrss / 2 ** 20}


def store_figures(steps: list, last: int = 3) -> dict:
    """Means over the `last` progress lines (the cache is full by then in `train`'s runs): step
    time and samples/s, and the store's figures."""
    lines = steps[-last:]
    keys = ("step_ms", "cache_hit_rate", "store_mb_read_per_step", "store_mb_written_per_step",
            "store_wait_ms_per_step", "staging_ms_per_step")
    out = {k: sum(r[k] for r in lines) / len(lines) for k in keys if k in lines[0]}
    out["last_samples_per_s"] = BATCH / out["step_ms"] * 1000
    return out


def train(args):
    data = dataset(args.work_dir, (args.steps + 1) * BATCH)
    store = os.path.join(args.work_dir, "store")
    os.makedirs(store, exist_ok=True)
    budget = budget_gb(16, 3, args.cache_fraction)
    tiered = [f"--embedding_memory_budget_gb={budget:.6f}", f"--embedding_store_path={store}",
              f"--embedding_cache_policy={args.policy}"]
    results = {"memory": [], "tiered": []}
    for r in range(args.rounds):
        for name, extra in (("memory", []), ("tiered", tiered)):
            res = run(data, args.steps, 16, os.path.join(args.work_dir, f"{name}.json"), extra)
            record = {"run": name, "round": r, "mean_step_ms": res["final"]["mean_step_time_ms"],
                      "samples_per_s": res["final"]["throughput"], "peak_rss_gb": round(res["peak_rss_gb"], 2),
                      **store_figures(res["steps"])}
            if name == "tiered" and r == 0:
                record["plan"] = [line for line in res["out"].splitlines() if "disk" in line or "total" in line]
            print(json.dumps(record), flush=True)
            results[name].append(record)
    ratios = [t["last_samples_per_s"] / m["last_samples_per_s"] for m, t in zip(results["memory"], results["tiered"])]
    print(json.dumps({"summary": "W1, 3 largest tables on disk", "budget_gb": round(budget, 4),
                      "cache_fraction": args.cache_fraction, "policy": args.policy,
                      "ratio_per_round": [round(r, 3) for r in ratios], "median_ratio": statistics.median(ratios)}))


def pipeline(args):
    """Samples/s of one rank's input pipeline (split-binary reader, tf.data prefetch, and with tables
    on disk the staging), no train step, over the last 30% of --steps batches (caches full)."""
    import_tensorflow()   # its start-up lines once, held to TF_CPP_MIN_LOG_LEVEL
    import tensorflow as tf
    from dataloading.batches import RankInput, prefetched, train_batches
    from dataloading.feature_spec import FeatureSpec
    from dataloading.split_binary import SplitBinaryDataset
    from nn.model import model_tables
    from nn.model_config import ModelConfig, table_configs
    from parallel_embedding.planner import assign_tiers, plan_tables
    data_dir = dataset(args.work_dir, (args.steps + 1) * BATCH)
    d = SplitBinaryDataset(FeatureSpec.from_yaml(os.path.join(data_dir, "feature_spec.yaml")), {"train": "train"})
    config = ModelConfig(tables=table_configs(cardinalities=W1_CARDINALITIES, dims=[16] * 26, max_hotness=[None] * 26,
                                              multi_hot_combiner="sum"),
                         num_numerical=13, bottom_mlp_dims=(512, 256, 64, 16), top_mlp_dims=(512, 256, 1),
                         interaction="dot", num_cross_layers=0, cross_layer_projection_dim=0)
    store = os.path.join(args.work_dir, "store")
    os.makedirs(store, exist_ok=True)
    timed_from = int(0.7 * args.steps)
    for name, budget in (("no store", None), ("staging", budget_gb(16, 3, args.cache_fraction))):
        plan = assign_tiers(plan_tables(W1_CARDINALITIES, [16] * 26, 1), 0,
                            None if budget is None else int(budget * 2 ** 30), [4 * BATCH] * 26)
        emb = model_tables(config, plan, store_path=store, zeros_initializer=True)
        emb.set_optimizer("sgd", tf.Variable(0, dtype=tf.int64))
        batches = train_batches(d, RankInput.single_process(26), rows=d.rows("train"), batch_size=BATCH, seed=1,
                                start_step=0, end_step=args.steps)
        for n, element in enumerate(emb.staged(prefetched(batches, d), training=True)):
            tf.nest.map_structure(lambda x: x, element)
            if n == timed_from:
                emb.store_stats()
                t0 = time.perf_counter()
        seconds = time.perf_counter() - t0
        figures = {k: round(v, 3) for k, v in emb.store_stats().items() if not k.endswith("per_step")}
        timed = args.steps - 1 - timed_from
        print(json.dumps({"pipeline": name, "batches": timed, "samples_per_s": round(timed * BATCH / seconds),
                          "ms_per_batch": round(1000 * seconds / timed, 2), **figures}), flush=True)
        emb.close()


def large(args):
    data = dataset(args.work_dir, (args.steps + 1) * BATCH)
    store = os.path.join(args.work_dir, "store")
    os.makedirs(store, exist_ok=True)
    t0 = time.perf_counter()
    res = run(data, args.steps, args.dim, os.path.join(args.work_dir, "large.json"),
              [f"--embedding_memory_budget_gb={args.budget_gb}", f"--embedding_store_path={store}"])
    tables_gb = sum(W1_CARDINALITIES) * args.dim * 4 / 1e9
    print(json.dumps({"run": "large", "dim": args.dim, "tables_gb": round(tables_gb, 1), "budget_gb": args.budget_gb,
                      "steps": args.steps, "samples_per_s": res["final"]["throughput"],
                      "wall_s": round(time.perf_counter() - t0, 1), "peak_rss_gb": round(res["peak_rss_gb"], 2),
                      **store_figures(res["steps"]),
                      "plan": [line for line in res["out"].splitlines() if "disk" in line or "total" in line]}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("train", "pipeline", "large"))
    ap.add_argument("--steps", type=int, default=None, help="default: 2500 (train, pipeline), 300 (large)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache_fraction", type=float, default=0.125)
    ap.add_argument("--policy", choices=("lru", "lfu"), default="lru")
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--budget_gb", type=float, default=3.0)
    ap.add_argument("--work_dir", default="/tmp/tiered_store_bench")
    args = ap.parse_args()
    args.steps = args.steps or (300 if args.part == "large" else 2500)
    os.makedirs(args.work_dir, exist_ok=True)
    {"train": train, "pipeline": pipeline, "large": large}[args.part](args)


if __name__ == "__main__":
    main()
