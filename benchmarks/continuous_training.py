"""Continuous training at W1 scale (../shared/bench/workloads.yaml): two generated "days", the
delta against the full export, and a running server that applies it under a fixed request rate.
Prints one JSON line.

    python benchmarks/continuous_training.py [--steps 200] [--rate 100] [--batch 64]

Day 0: W1 (batch 4096, width 16, SGD) trained --steps steps from scratch on power-law ids, exported
in full (--forms=tables). Day 1: --steps more on other ids (another seed), continued from day 0
(--restore_mode=continue), exported in full and as a delta against day 0: rows updated, sizes
and times. Then deployment/serve.py serves day 0 with --updates; a client sends requests of
--batch samples at --rate per second (gRPC) for --seconds, the delta is moved into the updates
directory half-way, and the line reports: seconds from the delta written to the first response
of the new version, failed requests, and p50/p99 latency in steady state (before) against the
window from the delta written to 2 s after it became visible.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np

from benchmarks.tiered_store import BATCH, ROOT, W1_CARDINALITIES, dataset, run
from deployment.client import ServingClient, free_ports


def command(*args) -> float:
    """Runs a project script; returns its seconds."""
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return time.perf_counter() - t0


def size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def requests(batch: int, n: int, seed: int):
    """`n` requests of `batch` W1 samples, power-law ids (categorical_features [batch, 26])."""
    rng = np.random.default_rng(seed)
    cards = np.array(W1_CARDINALITIES)
    out = []
    for _ in range(n):
        ids = np.minimum(rng.zipf(1.2, size=(batch, 26)) - 1, cards - 1)
        out.append((rng.normal(size=(batch, 13)).astype(np.float32), ids))
    return out


class Client(threading.Thread):
    """Requests at a fixed rate; per response (time sent, seconds, model_version), and errors."""

    def __init__(self, port: int, rate: float, batch: int):
        super().__init__(daemon=True)
        self.client = ServingClient("grpc", f"localhost:{port}", "dlrm")
        self.interval, self.batches = 1.0 / rate, requests(batch, 16, 1)
        self.responses, self.errors, self.stop = [], [], threading.Event()

    def run(self):
        k, next_at = 0, time.monotonic()
        while not self.stop.is_set():
            next_at += self.interval
            numerical, categorical = self.batches[k % len(self.batches)]
            start = time.monotonic()
            try:
                out = self.client.infer(numerical, categorical, ("model_version",))
                self.responses.append((start, time.monotonic() - start, int(out["model_version"][0, 0])))
            except Exception as e:   # counted: the target is none
                self.errors.append((start, str(e).splitlines()[0] if str(e) else type(e).__name__))
            k += 1
            time.sleep(max(0.0, next_at - time.monotonic()))


def percentiles(latencies) -> dict:
    ms = 1000 * np.asarray(latencies)
    return {"requests": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2)} if len(ms) else {"requests": 0}


def serve_and_update(repo: str, delta: str, work: str, args) -> dict:
    updates, staging = os.path.join(work, "updates"), os.path.join(work, "staging")
    shutil.rmtree(updates, ignore_errors=True)
    os.makedirs(updates)
    http, grpc, metrics = free_ports(3)
    log = open(os.path.join(work, "serve.log"), "w")
    server = subprocess.Popen([sys.executable, "deployment/serve.py", f"--model_repository={repo}",
                               f"--updates={updates}", f"--http_port={http}", f"--grpc_port={grpc}",
                               f"--metrics_port={metrics}", "--address=127.0.0.1"],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        ServingClient("grpc", f"localhost:{grpc}", "dlrm").wait_ready(600)
        client = Client(grpc, args.rate, args.batch)
        client.start()
        time.sleep(args.seconds / 2)
        old_version = client.responses[-1][2]
        shutil.copytree(delta, staging)
        written = time.monotonic()
        os.rename(staging, os.path.join(updates, "day_1"))   # appears complete, at once
        deadline = written + 120
        while time.monotonic() < deadline and not any(r[2] != old_version and r[0] >= written
                                                      for r in client.responses[-50:]):
            time.sleep(0.05)
        visible = next((r[0] + r[1] for r in client.responses if r[2] != old_version), None)
        time.sleep(args.seconds / 2)
        client.stop.set()
        client.join()
    finally:
        server.terminate()
        server.wait(30)
        log.close()
    steady = [r[1] for r in client.responses if r[0] < written]
    swap_end = (visible or written) + 2.0
    swap = [r[1] for r in client.responses if written <= r[0] + r[1] and r[0] <= swap_end]
    return {"rate_per_s": args.rate, "batch": args.batch,
            "delta_written_to_visible_s": round(visible - written, 2) if visible else None,
            "failed_requests": len(client.errors), "first_errors": sorted({e for _, e in client.errors})[:3],
            "steady": percentiles(steady), "during_swap": percentiles(swap),
            "swap_p99_ratio": round(percentiles(swap)["p99_ms"] / percentiles(steady)["p99_ms"], 2)
            if swap and steady else None,
            "server_log": [line.strip() for line in open(os.path.join(work, "serve.log"))
                           if "applied" in line or "refused" in line or "serving" in line][-4:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="training steps per day (batch 4096)")
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second during the update")
    ap.add_argument("--batch", type=int, default=64, help="samples per request")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the request loop")
    ap.add_argument("--work_dir", default="/tmp/dlrm-continuous-bench")
    args = ap.parse_args()
    work = args.work_dir
    os.makedirs(work, exist_ok=True)
    rows = args.steps * BATCH
    days = [dataset(work, rows, seed=12345), dataset(work, rows, seed=1)]
    ckpt = os.path.join(work, "checkpoints")
    shutil.rmtree(ckpt, ignore_errors=True)
    out = {"machine": os.uname().nodename, "date": time.strftime("%Y-%m-%d"), "steps_per_day": args.steps,
           "samples_per_day": rows}
    run(days[0], args.steps, 16, os.path.join(work, "day0.json"), [f"--save_checkpoint_path={ckpt}"])
    day0 = os.path.join(ckpt, f"ckpt-{args.steps}")
    run(days[1], args.steps, 16, os.path.join(work, "day1.json"),
        [f"--save_checkpoint_path={ckpt}", f"--restore_checkpoint_path={day0}", "--restore_mode=continue"])
    day1 = os.path.join(ckpt, f"ckpt-{2 * args.steps}")
    repos = [os.path.join(work, f"repo{k}") for k in range(2)]
    seconds = [command("deployment/deploy.py", f"--checkpoint={c}", f"--output={r}", "--forms=tables", "--overwrite")
               for c, r in zip((day0, day1), repos)]
    delta = os.path.join(work, "delta1")
    delta_seconds = command("deployment/deploy.py", f"--checkpoint={day1}", f"--delta_from={repos[0]}",
                            f"--output={delta}", "--overwrite")
    with open(os.path.join(delta, "delta.json")) as f:
        info = json.load(f)
    updated = sum(t["count"] for t in info["tables"])
    out.update(table_rows=sum(W1_CARDINALITIES), rows_updated_day1=updated,
               rows_updated_fraction=round(updated / sum(W1_CARDINALITIES), 4),
               full_export_mb=round(size(repos[1]) / 2 ** 20, 1), full_export_s=round(seconds[1], 1),
               delta_mb=round(size(delta) / 2 ** 20, 1), delta_s=round(delta_seconds, 1))
    out["serving"] = serve_and_update(repos[0], delta, work, args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
