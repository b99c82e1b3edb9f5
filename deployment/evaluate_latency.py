"""A bounded load on a Triton server serving an exported model: per batch size, `--concurrency`
clients send `--requests` requests in all (real evaluation samples), one at a time each; prints
throughput and p50/p90/p99 latency as `dlrm.py --mode=inference` prints them in process.

    python deployment/evaluate_latency.py --dataset_type=synthetic ... --batch_sizes=1,64,1024 --concurrency=2
"""
import itertools
import json
import os
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from run import data_flags  # noqa: E402,F401 (the data flags of main.py)
from utils.errors import ConfigError  # noqa: E402
from utils.tensorflow_startup import import_tensorflow  # noqa: E402

flags.DEFINE_enum("protocol", "http", ["http", "grpc"], "how to talk to the server")
flags.DEFINE_string("url", "", "host:port of the server (default localhost:8000 for http, :8001 for grpc)")
flags.DEFINE_string("model_name", "dlrm", "the served model's name")
flags.DEFINE_string("auth_token_file", "", "a file holding the bearer token the server asks for (serve.py's "
                    "--auth_token_file)")
flags.DEFINE_string("tls_ca_file", "", "connect over TLS, trusting the certificates in this PEM file (serve.py's "
                    "--tls_cert_file, or the CA that signed it)")
flags.DEFINE_string("tls_client_cert_file", "", "with --tls_ca_file: present this PEM client certificate (to a "
                    "server with --tls_client_ca_file)")
flags.DEFINE_string("tls_client_key_file", "", "the PEM private key of --tls_client_cert_file")
flags.DEFINE_list("batch_sizes", ["1", "64", "1024"], "samples per request; each size is measured in turn")
flags.DEFINE_integer("concurrency", 1, "clients sending requests at the same time")
flags.DEFINE_integer("requests", 200, "timed requests per batch size (all clients together)")
flags.DEFINE_integer("warmup_requests", 10, "untimed requests per client before timing each batch size")
flags.DEFINE_integer("pool_batches", 8, "distinct request batches cycled through per batch size")
flags.DEFINE_float("wait_s", 60.0, "how long to wait for the server and the model to be ready")
flags.DEFINE_string("output_json", "", "also write the figures to this file (one JSON line per batch size)")
FLAGS = flags.FLAGS


def request_pool(dataset, rows: int, batch_size: int, batches: int) -> list:
    """Up to `batches` distinct requests of `batch_size` evaluation samples."""
    from deployment.client import request_batches
    if rows < batch_size:
        raise ConfigError(f"--batch_sizes entry {batch_size} is larger than the {rows} evaluation samples")
    full = ((numerical, categorical) for numerical, categorical, _ in
            request_batches(dataset, min(rows, batch_size * batches), batch_size) if len(numerical) == batch_size)
    return list(itertools.islice(full, batches))


def load(connect, concurrency: int, pool, requests: int, warmup: int) -> dict:
    """`concurrency` clients (each made by `connect` in its own thread: the HTTP client is bound to
    the thread that made it) send `warmup` untimed requests each, then `requests` timed ones in all."""
    from nn.evaluator import latency_figures
    counter, times, errors = itertools.count(), [[] for _ in range(concurrency)], []
    started = threading.Barrier(concurrency + 1)

    def send(k):
        client = None
        try:
            client = connect()
            for i in range(warmup):
                client.infer(*pool[i % len(pool)])
        except Exception as e:   # reported by the main thread
            errors.append(e)
        started.wait()
        try:
            while not errors and (i := next(counter)) < requests:
                t0 = time.perf_counter()
                client.infer(*pool[i % len(pool)])
                times[k].append(time.perf_counter() - t0)
        except Exception as e:
            errors.append(e)
        finally:
            if client is not None:
                client.close()

    threads = [threading.Thread(target=send, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    started.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dict(latency_figures([t for ts in times for t in ts], len(pool[0][0]), wall), concurrency=concurrency)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    import_tensorflow()   # before the data pipeline loads it, so that its start-up lines honour TF_CPP_MIN_LOG_LEVEL
    from tritonclient.utils import InferenceServerException
    from deployment.client import ServingClient, ServingError, error_line, open_eval_data, read_token
    from run.config import parse_int_list
    try:
        sizes = parse_int_list("batch_sizes", FLAGS.batch_sizes)
        for name, value in [("concurrency", FLAGS.concurrency), ("requests", FLAGS.requests),
                            ("pool_batches", FLAGS.pool_batches)] + [("batch_sizes", s) for s in sizes]:
            if value < 1:
                raise ConfigError(f"--{name} must be positive, got {value}")
        token = read_token(FLAGS.auth_token_file)
        dataset, rows = open_eval_data(FLAGS)
        def connect():
            return ServingClient(FLAGS.protocol, FLAGS.url, FLAGS.model_name, token, FLAGS.tls_ca_file,
                                 FLAGS.tls_client_cert_file, FLAGS.tls_client_key_file)

        probe = connect()
        probe.wait_ready(FLAGS.wait_s)
        probe.check_batch_size(max(sizes), "batch_sizes")
        probe.close()
        print(f"{FLAGS.model_name} over {FLAGS.protocol}, {FLAGS.concurrency} client(s)")
        print("batch_size | samples/s | mean ms | p50 ms | p90 ms | p99 ms")
        results = []
        for size in sizes:
            r = load(connect, FLAGS.concurrency, request_pool(dataset, rows, size, FLAGS.pool_batches), FLAGS.requests,
                     FLAGS.warmup_requests)
            print(f"{size} | {r['samples_per_s']:,.0f} | {r['mean_ms']:.3f} | {r['p50_ms']:.3f} | {r['p90_ms']:.3f} | "
                  f"{r['p99_ms']:.3f}", flush=True)
            results.append(dict(r, protocol=FLAGS.protocol, model=FLAGS.model_name))
    except (ConfigError, ServingError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except InferenceServerException as e:
        print(f"error: the server refused a request: {error_line(e)}", file=sys.stderr)
        sys.exit(1)
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)


if __name__ == "__main__":
    app.run(main)
