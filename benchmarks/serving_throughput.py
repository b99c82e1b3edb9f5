"""Serving throughput and latency of a W1-shaped DLRM (../shared/bench/workloads.yaml, "dlrm-kaggle"):
deployment/serve.py with each frontend (native: this process answers HTTP and gRPC; triton: a real
Triton server and its Python backend) over HTTP and gRPC against the same model in process
(dlrm.py --mode=inference), one JSON line per (mode, frontend, protocol, concurrency, batch size),
then a table.

    python benchmarks/serving_throughput.py [--batch_sizes 1,64,1024] [--protocols http,grpc]
        [--frontends native,triton] [--concurrency 1,2] [--requests 300] [--inference_steps 200]
        [--onednn 0|1] [--work_dir DIR] [--keep]

Steps: train 2 SGD steps of W1 on synthetic data into a checkpoint, time it in process, export it
(deployment/deploy.py: monolithic, CPU instances), then per frontend: serve it on free ports of
127.0.0.1, load it with deployment/evaluate_latency.py, stop the server with SIGTERM. Both sides predict the same
synthetic evaluation samples (same cardinalities, seed). Checkpoint and repository take ~2.2 GB
each; found in --work_dir, they are reused. About 4-5 minutes on 2 cores.

Every process inherits this environment, so TF_ENABLE_ONEDNN_OPTS (set by --onednn, else as
exported, else TensorFlow's default) is the same on both sides. In process, the model has every
core to itself; served, the server (with Triton and its Python backend, or not) and the client
process share the cores (two on the reference machine), so the served figures include the
client's encoding and decoding as well as the transport.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BENCH = os.path.join(os.path.dirname(ROOT), "shared", "bench")
FIGURES = ("samples_per_s", "mean_ms", "p50_ms", "p90_ms", "p99_ms")
T0 = time.monotonic()


def progress(message: str):
    print(f"[{time.monotonic() - T0:6.1f} s] {message}", file=sys.stderr, flush=True)


def workload_flags(bench_dir: str):
    """(data flags, model flags) of W1 for dlrm.py; the data flags also suit evaluate_latency.py."""
    with open(os.path.join(bench_dir, "workloads.yaml")) as f:
        doc = yaml.safe_load(f)
    w = dict(doc["defaults"], **doc["workloads"]["dlrm-kaggle"])
    join = lambda values: ",".join(map(str, values))  # noqa: E731
    data = ["--dataset_type=synthetic", f"--synthetic_cardinalities={join(w['cardinalities'])}",
            f"--synthetic_num_numerical={w['num_dense']}", f"--seed={w['seed']}"]
    model = [f"--embedding_dim={w['embedding_dim']}", f"--bottom_mlp_dims={join(w['bottom_mlp'])}",
             f"--top_mlp_dims={join(w['top_mlp'])}", f"--optimizer={w['optimizer']['name']}"]
    return data, model


def fail(why: str, log: str):
    """Exits with `why` and the end of `log` (a temporary work dir is removed on the way out)."""
    with open(log) as f:
        sys.exit(f"{why}; the end of {log}:\n{f.read()[-3000:]}")


def script(log: str, *args: str):
    """Runs a repository script with this interpreter, its output into `log`."""
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if code:
        fail(f"{args[0]} exited with {code}", log)


def read_json_lines(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f]


def record(mode: str, frontend, protocol, concurrency: int, r: dict) -> dict:
    return dict(mode=mode, frontend=frontend, protocol=protocol, concurrency=concurrency, batch_size=r["batch_size"],
                **{k: round(r[k], 3) for k in FIGURES}, onednn=os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default"))


def in_process(args, data, model, ckpt) -> list:
    log = os.path.join(args.work_dir, "inference.json")
    if os.path.exists(log):   # the run log is appended to: keep only this run's records
        os.remove(log)
    script(os.path.join(args.work_dir, "inference.log"), "dlrm.py", "--mode=inference", *data, *model,
           f"--restore_checkpoint_path={ckpt}", f"--inference_batch_sizes={args.batch_sizes}",
           f"--inference_steps={args.inference_steps}", f"--log_path={log}")
    return [record("in-process", None, None, 1, r) for r in read_json_lines(log) if r["kind"] == "inference"]


def wait_ready(server, url: str, timeout_s: float, log: str):
    """Returns once the served model is ready; exits if the server does or `timeout_s` passes."""
    from deployment.client import ServingClient, ServingError
    client, deadline = ServingClient("http", url, "dlrm"), time.monotonic() + timeout_s
    try:   # closed after, or the server waits for this connection when it stops
        while True:
            try:
                return client.wait_ready(5)
            except ServingError:
                if server.poll() is not None or time.monotonic() > deadline:
                    fail(f"the server did not get ready (exit code {server.poll()})", log)
    finally:
        client.close()


def served(args, data, repo, frontend: str) -> list:
    """Serves `repo` with `frontend` and loads it over every protocol at every concurrency."""
    from deployment.client import free_ports
    http, grpc, metrics = free_ports(3)
    urls = {"http": f"127.0.0.1:{http}", "grpc": f"127.0.0.1:{grpc}"}
    log = open(os.path.join(args.work_dir, f"server-{frontend}.log"), "w")
    server = subprocess.Popen([sys.executable, "deployment/serve.py", f"--model_repository={repo}",
                               f"--frontend={frontend}", "--address=127.0.0.1", f"--http_port={http}",
                               f"--grpc_port={grpc}", f"--metrics_port={metrics}"],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    results = []
    try:
        wait_ready(server, urls["http"], args.ready_timeout, log.name)
        progress(f"{frontend} server ready")
        for protocol in args.protocols.split(","):
            for concurrency in map(int, args.concurrency.split(",")):
                out = os.path.join(args.work_dir, f"latency-{frontend}-{protocol}-{concurrency}.json")
                script(out.replace(".json", ".log"), "deployment/evaluate_latency.py", *data,
                       f"--protocol={protocol}", f"--url={urls[protocol]}", f"--batch_sizes={args.batch_sizes}",
                       f"--concurrency={concurrency}", f"--requests={args.requests}", f"--output_json={out}")
                results += [record("served", frontend, protocol, concurrency, r) for r in read_json_lines(out)]
                progress(f"measured {frontend} {protocol} at concurrency {concurrency}")
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)
        log.close()
        progress(f"{frontend} server stopped (exit code {code})")
    return results


def table(records: list) -> str:
    """Per batch size: in process, then every served setting with its throughput relative to in process."""
    lines = ["batch | mode                | samples/s |  p50 ms |  p99 ms | served/in-process"]
    for size in sorted({r["batch_size"] for r in records}):
        rows = [r for r in records if r["batch_size"] == size]
        base = next(r["samples_per_s"] for r in rows if r["mode"] == "in-process")
        for r in rows:
            mode = "in-process" if r["protocol"] is None else f"{r['frontend']} {r['protocol']} c={r['concurrency']}"
            ratio = "" if r["protocol"] is None else f"{r['samples_per_s'] / base:.3f}"
            lines.append(f"{size:5d} | {mode:19s} | {r['samples_per_s']:9,.0f} | {r['p50_ms']:7.3f} | "
                         f"{r['p99_ms']:7.3f} | {ratio}")
    return "\n".join(lines)


def benchmark(args):
    data, model = workload_flags(args.bench_dir)
    ckpt, repo = os.path.join(args.work_dir, "ckpt"), os.path.join(args.work_dir, "repo")
    if not os.path.isdir(ckpt):
        progress(f"training the W1 checkpoint into {ckpt}")
        script(os.path.join(args.work_dir, "train.log"), "dlrm.py", "--mode=train", *data, *model,
               "--learning_rate=0.1", "--warmup_steps=0", "--decay_steps=0", "--max_steps=2", "--batch_size=4096",
               "--synthetic_rows=8192", "--synthetic_eval_rows=65536", "--evals_per_epoch=0",
               f"--save_checkpoint_path={ckpt}")
    progress("timing in process")
    records = in_process(args, data, model, ckpt)
    if not os.path.isdir(repo):
        progress(f"exporting to {repo}")
        script(os.path.join(args.work_dir, "deploy.log"), "deployment/deploy.py", f"--checkpoint={ckpt}",
               f"--output={repo}", "--forms=monolithic", "--instance_kind=cpu")
    for frontend in args.frontends.split(","):
        progress(f"starting the {frontend} server")
        records += served(args, data, repo, frontend)
    for r in records:
        print(json.dumps(r), flush=True)
    print(table(records), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch_sizes", default="1,64,1024", help="samples per prediction / request")
    ap.add_argument("--protocols", default="http,grpc")
    ap.add_argument("--frontends", default="native,triton", help="serve.py --frontend values, each served in turn")
    ap.add_argument("--concurrency", default="1,2", help="served: clients sending requests at once, each in turn")
    ap.add_argument("--requests", type=int, default=300, help="served: timed requests per batch size")
    ap.add_argument("--inference_steps", type=int, default=200, help="in process: timed predictions per batch size")
    ap.add_argument("--onednn", type=int, choices=[0, 1], default=None, help="TF_ENABLE_ONEDNN_OPTS for every "
                    "process (default: as exported, else TensorFlow's choice)")
    ap.add_argument("--ready_timeout", type=float, default=600, help="seconds to wait for the served model")
    ap.add_argument("--bench_dir", default=DEFAULT_BENCH, help="folder holding workloads.yaml")
    ap.add_argument("--work_dir", help="checkpoint, model repository and logs (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary work dir")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.onednn is not None:
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = str(args.onednn)
    temporary = args.work_dir is None
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="serving-bench-")
    os.makedirs(args.work_dir, exist_ok=True)
    try:
        benchmark(args)
    finally:
        if temporary and not args.keep:
            shutil.rmtree(args.work_dir, ignore_errors=True)
        else:
            progress(f"kept {args.work_dir}")


if __name__ == "__main__":
    main()
