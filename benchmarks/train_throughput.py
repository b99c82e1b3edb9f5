"""Training throughput on the shared workloads (../shared/bench/workloads.yaml), one JSON line each.

Runs the train step dlrm.py / dcnv2.py run (the example model examples/dlrm.py or
examples/dcnv2.py at the workload's shapes, handed its tables by run/assembly.py's builtin_model
from the run's flags; its step run.run_model.RunTrainer.train_step; SGD as the workloads
specify) on an in-memory pool of synthetic batches, as the yardstick does:

    python benchmarks/train_throughput.py --workload dlrm-kaggle [--xla 1] [--onednn 0|1] [--threads 2]
    python benchmarks/train_throughput.py --compare      # also runs the yardstick's modes, prints ratios
    python benchmarks/train_throughput.py --scaling      # W1: 2 ranks x 1 thread against 1 rank x 2 threads
    python benchmarks/train_throughput.py --workload dlrm-kaggle --checks 1   # + the cost of the safety checks
    python benchmarks/train_throughput.py --workload dlrm-kaggle --dynamic 3 --timed 5 --rounds 30   # dynamic vs static

Workload, FLOP accounting and batch pool come from the shared yardstick module, so both sides
measure the same thing. With `--ranks N` the step runs hybrid-parallel on N Gloo ranks of this
machine (`horovodrun`, tables placed by the default plan, model-parallel input: each rank
holds only the ids its tables need); samples/s counts the global batch. `--checks 1` also times,
per step, the loader's per-batch value checks (the pool written as split-binary files and read
back by the real loader with and without them) and the train step's non-finite-gradients flag
(the same reduction over gradient-shaped tensors), as fractions of the step. `--dynamic K` builds
the workload's model twice in one process: static tables, and its K largest tables dynamic
(parallel_embedding/dynamic_table.py, capacity = their rows, the pool's ids as raw ids), and times
`--rounds` rounds of `timed` steps of each, alternated (static, dynamic, static, ...), so that
both see the same load.
"""
import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # this checkout's modules, not an installed copy's
from utils.tensorflow_startup import import_tensorflow  # noqa: E402
DEFAULT_BENCH = os.path.join(os.path.dirname(ROOT), "shared", "bench")
WORKLOADS = ("dlrm-kaggle", "dlrm-large", "dcnv2-nvidia")
YARDSTICK_MODES = (("graph", []), ("xla", ["--jit", "1"]), ("onednn", ["--onednn", "1"]),
                   ("xla-onednn", ["--jit", "1", "--onednn", "1"]))


def yardstick_module(bench_dir):
    spec = importlib.util.spec_from_file_location("yardstick", os.path.join(bench_dir, "yardstick", "yardstick.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(args):
    """Times our train step on one workload; returns the JSON record."""
    for k in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        os.environ[k] = str(args.threads)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.onednn is not None:
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = str(args.onednn)
    import_tensorflow()   # its start-up lines once, held to TF_CPP_MIN_LOG_LEVEL
    import tensorflow as tf
    from parallel_embedding.collectives import make_collectives

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    ys = yardstick_module(args.bench_dir)
    w = ys.load_workload(args.workload, args.threads)
    warmup = args.warmup if args.warmup is not None else w["warmup_steps"]
    timed = args.timed if args.timed is not None else w["timed_steps"]
    cards = w["cardinalities"]
    comm = make_collectives()
    plan, trainer = run_trainer(args, w, comm)
    model = trainer.model
    batch = int(w["batch_size"])
    pool = batch_pool(w, comm, [model.embeddings.input_rows(f) for f in range(len(cards))])
    if args.dynamic:
        return against_dynamic(args, w, comm, trainer.train_step, pool, warmup, timed)
    times = timed_steps(trainer.train_step, pool, warmup, timed)
    sps = batch * len(times) / sum(times)
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default")
    dense_elements = sum(int(v.shape.num_elements()) for v in model.dense_variables)
    return {"impl": "ours" + ("-xla" if args.xla else "") + ("-amp" if args.amp else ""), "workload": args.workload, "onednn": onednn,
            "ranks": comm.size, "threads": args.threads, "dot_op": args.dot_op, "batch": batch, "timed_steps": len(times),
            "samples_per_s": round(sps, 1),
            "alltoall_bytes_per_step": alltoall_bytes(plan, batch),
            "allreduce_bytes_per_step": 4 * dense_elements * 2 * (comm.size - 1) // comm.size,
            "step_ms_median": round(1000 * statistics.median(times), 2),
            "achieved_gflops": round(ys.train_flops_per_sample(w) * sps / 1e9, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "tensorflow": tf.__version__,
            **(check_costs(w, [(n.numpy(), [i.numpy() for i in ids], y.numpy()) for n, ids, y in pool], times)
               if args.checks else {})}


def batch_pool(w, comm, scopes) -> list:
    """The workload's `pool_batches` batches (numerical [b, n], F ids [b] int32, labels [b]) as this
    rank's tensors: every rank draws the same global batches and keeps its part, a feature's ids
    by its scope ("global": the global batch's, "local": this rank's b, else none)."""
    import numpy as np
    import_tensorflow()   # its start-up lines once, held to TF_CPP_MIN_LOG_LEVEL
    import tensorflow as tf
    rng = np.random.default_rng(w["seed"])
    batch = int(w["batch_size"])
    b = batch // comm.size
    mine = slice(comm.rank * b, (comm.rank + 1) * b)
    card = np.asarray(w["cardinalities"], dtype=np.int64)
    pool = []
    for _ in range(int(w["pool_batches"])):
        ids = np.minimum((rng.random((batch, len(card))) * card).astype(np.int64), card - 1).astype(np.int32)
        numerical = rng.standard_normal((batch, w["num_dense"]), dtype=np.float32)
        labels = rng.integers(0, 2, size=batch).astype(np.float32)
        pool.append((tf.constant(numerical[mine]),
                     [tf.constant(ids[:, f] if s == "global" else ids[mine, f] if s == "local" else ids[:0, f])
                      for f, s in enumerate(scopes)],
                     tf.constant(labels[mine])))
    return pool


def timed_steps(step, pool, warmup: int, timed: int, start: int = 0) -> list:
    """Seconds of each of `timed` steps on the pool's batches (from batch `start`, cycling) after
    `warmup` untimed ones; a step ends when its loss reaches the host."""
    times = []
    for i in range(warmup + timed):
        t0 = time.perf_counter()
        float(step(*pool[(start + i) % len(pool)]))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def run_trainer(args, w, comm, dynamic=()):
    """(plan, trainer) of the workload as dlrm.py / dcnv2.py run it: the run's configuration from
    their flags at the workload's shapes (synthetic data, its optimizer at a constant learning
    rate, --xla and --amp as asked; --interaction=dot_custom, or dot_tensorflow with --dot_op 0;
    `dynamic`: the features whose tables --dynamic_tables makes dynamic, capacity = their rows),
    the run's plan (run.runtime.embedding_plan), run.assembly.builtin_model and its RunTrainer."""
    import tensorflow as tf
    from parallel_embedding.optimizers import slot_names
    from run import flags as run_flags
    from run.assembly import builtin_model
    from run.runtime import embedding_plan
    from run.run_model import RunTrainer
    cards, dcn = w["cardinalities"], w["model"] == "dcnv2"
    argv = ["dlrm.py", f"--interaction={'cross' if dcn else 'dot_custom' if args.dot_op else 'dot_tensorflow'}",
            f"--embedding_dim={w['embedding_dim']}", f"--bottom_mlp_dims={','.join(map(str, w['bottom_mlp']))}",
            f"--top_mlp_dims={','.join(map(str, w['top_mlp']))}",
            *([f"--num_cross_layers={w['cross_layers']}",
               f"--cross_layer_projection_dim={w['cross_projection_dim']}"] if dcn else []),
            "--dataset_type=synthetic", f"--synthetic_cardinalities={','.join(map(str, cards))}",
            f"--synthetic_num_numerical={w['num_dense']}", f"--batch_size={w['batch_size']}",
            f"--optimizer={w['optimizer']['name']}", f"--learning_rate={w['optimizer']['lr']}",
            "--warmup_steps=0", "--decay_steps=0", f"--seed={w['seed']}", f"--xla={bool(args.xla)}",
            f"--amp={bool(args.amp)}", f"--dynamic_tables={','.join(f'{f}:{cards[f]}' for f in dynamic)}"]
    run_flags.FLAGS.unparse_flags()
    run_flags.FLAGS(argv)
    cfg = run_flags.config_from_flags(comm.size)
    plan = embedding_plan(cfg, comm.size, len(slot_names(cfg.training.optimizer)),
                          bool(tf.config.list_physical_devices("GPU")))
    return plan, RunTrainer(builtin_model(cfg, comm, plan))


def against_dynamic(args, w, comm, static_step, pool, warmup: int, timed: int) -> dict:
    """The workload with static tables against the same workload with its `args.dynamic` largest
    tables dynamic (`alternated`, dynamic / static speed): each a DynamicTable of capacity = its
    rows (--dynamic_tables=<f>:<rows>: LRU, K = 1, one hash shard; parallel_embedding/dynamic_table.py), fed the same global
    batches, their ids taken as raw ids. The pool's ids fit: once the first pass over the pool
    has admitted them, every lookup is a hit. With `args.fresh_ids` the dynamic side's step k
    takes the dynamic tables' ids of batch k + cardinality x k instead (int64): ids never seen
    before, every distinct one admitted (a new row initialised) at its step, the worst case for
    admission (no eviction while the steps' ids fit in the capacity). The dynamic tables' counts
    at the end are in `dynamic_counts`."""
    cards = w["cardinalities"]
    if args.dynamic > len(cards):
        raise SystemExit(f"--dynamic {args.dynamic}: {args.workload} has {len(cards)} tables")
    largest = sorted(sorted(range(len(cards)), key=lambda f: -cards[f])[:args.dynamic])
    _, dynamic = run_trainer(args, w, comm, largest)
    fresh = pool
    if args.fresh_ids:
        import tensorflow as tf
        fresh = [(n, [tf.cast(i, tf.int64) + cards[f] * k if f in largest else i for f, i in enumerate(ids)], y)
                 for k, (n, ids, y) in ((k, pool[k % len(pool)]) for k in range(warmup + args.rounds * timed))]
    record = alternated(args, int(w["batch_size"]), {"static": (static_step, pool),
                                                     "dynamic": (dynamic.train_step, fresh)}, warmup, timed)
    return {"impl": "dynamic-vs-static", "workload": args.workload, "threads": args.threads,
            "dynamic_tables": {f: cards[f] for f in largest}, "fresh_ids": args.fresh_ids, **record,
            "dynamic_counts": dynamic.model.embeddings.layers[0].embedding.dynamic_stats()}


def alternated(args, batch: int, sides: dict, warmup: int, timed: int) -> dict:
    """`args.rounds` rounds of `timed` steps of each of the two `sides` (name -> (step, pool)), the
    first then the second (each after its `warmup` steps, once), so that both see the same load
    (steps `warmup` + r `timed` ... of the pools, cycling, in round r).
    Ratios are second / first speed: of the median steps, and per round (its median, quartiles
    and range: the noise; short rounds see the same load on both sides), and of the median CPU
    seconds per step (this process' threads, which other processes inflate less than wall time)."""
    for step, batches in sides.values():
        timed_steps(step, batches, warmup, 0)
    times, cpu = {side: [] for side in sides}, {side: [] for side in sides}
    for r in range(args.rounds):
        for side, (step, batches) in sides.items():
            c0 = time.process_time()
            times[side].append(timed_steps(step, batches, 0, timed, start=warmup + r * timed))
            cpu[side].append((time.process_time() - c0) / timed)
    first, second = sides
    steps = {side: sum(rounds, []) for side, rounds in times.items()}
    ratios = sorted(sum(times[first][r]) / sum(times[second][r]) for r in range(args.rounds))
    quartiles = statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else ratios * 2
    return {"batch": batch, "rounds": args.rounds, "timed_steps_per_round": timed,
            **{f"{side}_samples_per_s": round(batch * len(t) / sum(t), 1) for side, t in steps.items()},
            **{f"{side}_step_ms_median": round(1000 * statistics.median(t), 2) for side, t in steps.items()},
            **{f"{side}_cpu_ms_per_step_median": round(1000 * statistics.median(c), 2) for side, c in cpu.items()},
            "ratio_of_medians": round(statistics.median(steps[first]) / statistics.median(steps[second]), 3),
            "cpu_ratio_of_medians": round(statistics.median(cpu[first]) / statistics.median(cpu[second]), 3),
            "round_ratio_median": round(statistics.median(ratios), 3),
            "round_ratio_quartiles": [round(q, 3) for q in quartiles],
            "round_ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
            "load_average_1min": round(os.getloadavg()[0], 2)}


def check_costs(w, pool, times, rounds: int = 7) -> dict:
    """Per step (medians of `rounds`, measured right after the steps `times`, so under the same
    load): the loader's value checks (the pool's batches read from split-binary files with
    SplitBinaryDataset's checks on, minus off; wall and CPU time, the latter unaffected by
    other processes) and the train step's non-finite-gradients flag over W's gradient shapes;
    both also as % of the median step."""
    import tempfile
    import numpy as np
    import_tensorflow()   # its start-up lines once, held to TF_CPP_MIN_LOG_LEVEL
    import tensorflow as tf
    from dataloading.batches import RankInput, rank_batch
    from dataloading.feature_spec import split_binary_spec
    from dataloading.split_binary import SplitBinaryDataset
    from dataloading.writer import MappingWriter
    from ranking.precision import gradient_sum
    cards, batch = w["cardinalities"], int(w["batch_size"])
    spec = split_binary_spec([f"n{k}" for k in range(w["num_dense"])], {f"c{k}": c for k, c in enumerate(cards)},
                             mappings=["train"], base_dir=tempfile.mkdtemp(prefix="check_cost_"))
    with MappingWriter(spec, "train") as writer:
        for numerical, ids, labels in pool:
            writer.write({**{f"n{k}": numerical[:, k] for k in range(w["num_dense"])},
                          **{f"c{k}": v for k, v in enumerate(ids)}, "label": labels})
    view = RankInput.single_process(len(cards))
    seconds = {True: [], False: []}   # (wall, CPU) seconds per batch
    for _ in range(rounds):   # alternating, so that both see the same load
        for check in seconds:
            data = SplitBinaryDataset(spec, {"train": "train"}, check=check)
            seconds[check].append(np.array(_timed(lambda: [rank_batch(data, "train", k * batch, batch, view)
                                                           for k in range(len(pool))])) / len(pool))
    seconds = {check: np.median(s, axis=0) for check, s in seconds.items()}
    shutil.rmtree(spec.base_dir)
    grads = [tf.IndexedSlices(tf.random.normal([batch, w["embedding_dim"]]), tf.zeros([batch], tf.int64))
             for _ in cards]
    widths = [w["num_dense"]] + list(w["bottom_mlp"])
    top_in = w["bottom_mlp"][-1] + (len(cards) + 1) * len(cards) // 2
    shapes = [(a, b) for a, b in zip(widths, widths[1:])]
    shapes += [(a, b) for a, b in zip([top_in] + list(w["top_mlp"]), w["top_mlp"])]
    grads += [tf.random.normal(s) for s in shapes] + [tf.random.normal(s[1:]) for s in shapes]
    flag = tf.function(lambda: tf.math.is_finite(gradient_sum(grads)))
    flag()
    grad_s = statistics.median(_timed(lambda: [bool(flag()) for _ in range(20)])[0] for _ in range(rounds)) / 20
    step_ms = 1000 * statistics.median(times)
    loader_ms, loader_cpu_ms = (float(x) for x in 1000 * (seconds[True] - seconds[False]))
    return {"loader_batch_ms": round(1000 * float(seconds[False][0]), 3), "loader_check_ms": round(loader_ms, 3),
            "loader_check_cpu_ms": round(loader_cpu_ms, 3), "loader_check_pct_of_step": round(100 * loader_ms / step_ms, 3),
            "grad_check_ms": round(1000 * grad_s, 3), "grad_check_pct_of_step": round(100000 * grad_s / step_ms, 3)}


def _timed(fn):
    """(wall, this thread's CPU) seconds of fn()."""
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - t0, time.thread_time() - c0


def alltoall_bytes(plan, global_batch: int) -> int:
    """Bytes one step's embedding all-to-alls move between ranks (forward rows and backward
    gradients, float32; what a rank keeps for itself not counted): every rank sends each other
    rank b = B / N rows of its shards' summed width."""
    n = plan.world_size
    width = sum(s.width for r in range(n) for s in plan.shards_on(r))
    return 2 * 4 * (n - 1) * (global_batch // n) * width


def run_json(cmd):
    """The last JSON line a command prints (under horovodrun: rank 0's)."""
    lines = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()
    rank0 = [line.split("<stdout>:", 1)[1] for line in lines if line.startswith("[0]<stdout>:")]
    return json.loads((rank0 or lines)[-1])


def ranks_command(args, ranks: int, threads: int, workload: str):
    """The command that measures `workload` on `ranks` ranks of `threads` threads each."""
    cmd = [sys.executable, __file__, "--bench_dir", args.bench_dir, "--workload", workload, "--threads", str(threads)]
    cmd += ["--warmup", str(args.warmup)] if args.warmup is not None else []
    cmd += ["--timed", str(args.timed)] if args.timed is not None else []
    cmd += ["--xla", str(args.xla), "--amp", str(args.amp)] + (["--onednn", str(args.onednn)] if args.onednn is not None else [])
    if ranks == 1:
        return cmd
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return [horovodrun, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo"] + cmd


def scaling(args):
    """`args.rounds` alternating runs of 1 rank x 2 threads and 2 ranks x 1 thread; the ratio of
    the medians."""
    workload = args.workload or "dlrm-kaggle"
    runs = {1: [], 2: []}
    for _ in range(args.rounds):
        for ranks in (1, 2):
            r = run_json(ranks_command(args, ranks, 2 // ranks, workload))
            runs[ranks].append(r)
            print(json.dumps(r), flush=True)
    median = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in runs.items()}
    print(json.dumps({"workload": workload, "one_rank_2_threads": median[1], "two_ranks_1_thread": median[2],
                      "ratio": round(median[2] / median[1], 3),
                      "alltoall_bytes_per_step": runs[2][0]["alltoall_bytes_per_step"],
                      "allreduce_bytes_per_step": runs[2][0]["allreduce_bytes_per_step"]}), flush=True)


def compare(args):
    """Ours vs every yardstick mode, each in a fresh process, side by side per workload."""
    for workload in args.workloads:
        steps = ["--warmup", str(args.warmup)] if args.warmup is not None else []
        steps += ["--timed", str(args.timed)] if args.timed is not None else []
        common = ["--workload", workload, "--threads", str(args.threads)] + steps
        ours = run_json([sys.executable, __file__, "--bench_dir", args.bench_dir] + common)
        yard = [run_json([sys.executable, os.path.join(args.bench_dir, "yardstick", "yardstick.py")] + common + extra)
                for _, extra in YARDSTICK_MODES]
        best = max(yard, key=lambda r: r["samples_per_s"])
        print(json.dumps(ours))
        for r in yard:
            print(json.dumps(r))
        print(json.dumps({"workload": workload, "ours_samples_per_s": ours["samples_per_s"],
                          "yardstick_best": best["impl"], "yardstick_best_samples_per_s": best["samples_per_s"],
                          "ratio": round(ours["samples_per_s"] / best["samples_per_s"], 3)}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=WORKLOADS)
    ap.add_argument("--compare", action="store_true", help="run every workload (or --workload) against the yardstick")
    ap.add_argument("--scaling", action="store_true", help="2 ranks x 1 thread against 1 rank x 2 threads (W1 "
                    "unless --workload)")
    ap.add_argument("--ranks", type=int, default=1, help="run --workload on this many Gloo ranks (horovodrun)")
    ap.add_argument("--rounds", type=int, default=3, help="--scaling, --dynamic: alternating rounds")
    ap.add_argument("--dynamic", type=int, default=0, metavar="K", help="also build the workload with its K largest "
                    "tables dynamic (capacity = their rows, --dynamic_tables) and time both, alternated")
    ap.add_argument("--fresh_ids", type=int, choices=[0, 1], default=0, help="--dynamic: the dynamic tables' ids "
                    "new at every step (every one admitted: the worst case), not the pool's ids cycling (all hits)")
    ap.add_argument("--xla", type=int, choices=[0, 1], default=0)
    ap.add_argument("--amp", type=int, choices=[0, 1], default=0, help="mixed precision (bfloat16 on CPU)")
    ap.add_argument("--onednn", type=int, choices=[0, 1], default=None, help="TF_ENABLE_ONEDNN_OPTS (default: TF's choice)")
    ap.add_argument("--dot_op", type=int, choices=[0, 1], default=1, help="DLRM: the dot-interaction op (1) or "
                    "TensorFlow's implementation (0)")
    ap.add_argument("--checks", type=int, choices=[0, 1], default=0, help="also time the loader's value checks and "
                    "the non-finite-gradients flag (dlrm-kaggle: the pool written to split-binary files, ~6 MB)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--timed", type=int)
    ap.add_argument("--bench_dir", default=DEFAULT_BENCH, help="folder holding workloads.yaml and yardstick/")
    args = ap.parse_args()
    if args.dynamic and (args.xla or args.amp or args.ranks > 1 or args.compare or args.scaling or not args.workload):
        ap.error("--dynamic times one --workload on one rank, without --xla, --amp, --compare, --scaling")
    if args.fresh_ids and not args.dynamic:
        ap.error("--fresh_ids 1 needs --dynamic K")
    if args.dynamic < 0:
        ap.error(f"--dynamic {args.dynamic}: the number of tables made dynamic, >= 0")
    if args.compare:
        args.workloads = [args.workload] if args.workload else list(WORKLOADS)
        compare(args)
    elif args.scaling:
        scaling(args)
    elif args.ranks > 1:
        print(json.dumps(run_json(ranks_command(args, args.ranks, args.threads, args.workload or "dlrm-kaggle"))))
    elif args.workload:
        print(json.dumps(measure(args)))
    else:
        for workload in WORKLOADS:
            args.workload = workload
            print(subprocess.run([sys.executable, __file__] + sys.argv[1:] + ["--workload", workload],
                                 capture_output=True, text=True, check=True).stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
