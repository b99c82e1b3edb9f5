"""Serves an exported model (or a checkpoint, exported first) over HTTP and gRPC (KServe v2, as
Triton speaks it) until interrupted (Ctrl-C or SIGTERM).

    python deployment/serve.py --model_repository=runs/demo/model_repository
    python deployment/serve.py --checkpoint=runs/demo/checkpoints --http_port=8000 --grpc_port=8001

The repository's table files and dense SavedModel compute each request (deployment/serving/
live.py) when it has the tables form, else its monolithic SavedModel (deployment/serving/
monolithic.py). --frontend=native (the default): this process answers HTTP and gRPC itself
(deployment/serving/native.py); --frontend=triton: the Triton binary of the `nvidia-pytriton`
wheel does, its Python backend handing each (dynamically batched) request to this process (2-3x
slower at batch 1 and 64, docs/benchmarks.md). Requests are those of Triton's TensorFlow backend
serving the same repository (see deployment/repository_format.py): the frontend checks names,
dtypes and shapes, the model checks ids; a bad request gets an error response and the server
keeps serving. An extra output, model_version [B, 1] int64, gives the served version's step to
clients that ask for it.

Prometheus metrics are served at GET /metrics on --metrics_port: with the native frontend
deployment/serving/metrics.py's (requests by protocol and status, samples, a latency histogram,
the served version's step and the lookup tiers' counts), with --frontend=triton Triton's own.

With --updates=DIR (tables form only), new versions dropped into DIR (deltas, full exports) are
served without a restart, each logged in one line (deployment/serving/live.py's Updater):

    python deployment/serve.py --model_repository=runs/demo/model_repository --updates=runs/demo/updates

With --embedding_cache_mb (or --tiers_config), a tables-form repository's tables are not loaded
whole: lookups go through a per-process cache of hot rows, an optional Redis server shared by
servers (--redis_url), and the table files memory-mapped (deployment/serving/lookup_tiers.py),
for tables larger than the server's memory:

    python deployment/serve.py --model_repository=runs/demo/model_repository --embedding_cache_mb=512 \
        --redis_url=redis://127.0.0.1:6379/0

The server imports nothing of training: only --checkpoint loads the exporter, to write the
repository it serves.
"""
import os
import pathlib
import signal
import socket
import sys
import tempfile
from contextlib import contextmanager

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from deployment.repository_format import (CATEGORICAL, LOGITS, NUMERICAL, PREDICTIONS,  # noqa: E402
                                          RepositoryError, categorical_width, export_version, read_export_info)
from deployment.serving.backend import MODEL_VERSION  # noqa: E402
from deployment.serving.errors import BadRequest  # noqa: E402
from deployment.serving.live import Model, Updater  # noqa: E402
from deployment.serving.lookup_tiers import POLICIES, TierConfig  # noqa: E402
from deployment.serving.native import ServedModel, TensorSpec, serving as native_serving  # noqa: E402
from utils.errors import CheckpointError, ConfigError, StoreError  # noqa: E402

flags.DEFINE_string("model_repository", None, "a model repository written by deployment/deploy.py")
flags.DEFINE_string("checkpoint", None, "a checkpoint to export (to a temporary repository) and serve, instead")
flags.DEFINE_string("model_name", None, "the name to serve the model under (default: the repository's)")
flags.DEFINE_enum("frontend", "native", ["native", "triton"], "native: this process answers HTTP and gRPC "
                  "itself (deployment/serving/native.py); triton: pytriton's Triton server, its Python backend handing "
                  "each request to this process")
flags.DEFINE_string("address", "0.0.0.0", "address the HTTP, gRPC and metrics endpoints listen on")
flags.DEFINE_integer("http_port", 8000, "HTTP/REST port")
flags.DEFINE_integer("grpc_port", 8001, "gRPC port")
flags.DEFINE_integer("metrics_port", 8002, "Prometheus metrics port, GET /metrics (native: requests, latency, "
                     "version and lookup tiers, deployment/serving/metrics.py; triton: Triton's own)")
flags.DEFINE_integer("max_batch_size", None, "largest batch a request (or a dynamic batch) may have "
                     "(default: the repository's config.pbtxt)")
flags.DEFINE_string("updates", None, "a directory to poll for new versions to serve (deltas and full exports, "
                    "one per subdirectory); needs a repository with the tables form")
flags.DEFINE_float("poll_seconds", 1.0, "how often --updates is polled, seconds")
flags.DEFINE_integer("max_queue_delay_us", None, "dynamic batching: longest wait for more requests, "
                     "microseconds (default: the repository's config.pbtxt)")
flags.DEFINE_float("embedding_cache_mb", None, "serve the tables form through lookup tiers instead of loading the "
                   "tables whole: the per-process cache of hot rows, MiB over every table")
flags.DEFINE_string("embedding_cache_policy", None, f"{' or '.join(POLICIES)} (default lru): which cached rows make "
                    "room for new ones; with --embedding_cache_mb")
flags.DEFINE_string("redis_url", None, "redis://host:port/db: a Redis server shared by servers, between the cache and "
                    "the table files; with --embedding_cache_mb")
flags.DEFINE_string("tiers_config", None, "a JSON file of the lookup tiers' settings (deployment/serving/"
                    "lookup_tiers.py's TierConfig: cache_bytes, policy, redis_url, ...), instead of the three flags "
                    "above")
FLAGS = flags.FLAGS


def _interrupt(*_):
    raise KeyboardInterrupt


class ServeError(ValueError):
    """A server that cannot start as asked; the message is one line."""


def check_flags():
    """Flags that have no effect with the chosen frontend, or without --updates, are errors."""
    if FLAGS.frontend == "native" and FLAGS["max_queue_delay_us"].present:
        raise ServeError("--max_queue_delay_us: no effect with --frontend=native (no dynamic batching); it is "
                         "--frontend=triton's")
    if FLAGS["poll_seconds"].present and not FLAGS.updates:
        raise ServeError("--poll_seconds: no effect without --updates")


def check_ports():
    """The port flags name distinct ports free on --address (Triton would wait forever instead)."""
    names = ("http_port", "grpc_port", "metrics_port")
    ports = {name: FLAGS[name].value for name in names}
    if len(set(ports.values())) < len(ports):
        raise ServeError(f"{', '.join(f'--{n}' for n in names)} must differ, got {sorted(ports.values())}")
    for name, port in ports.items():
        with socket.socket() as s:
            try:
                s.bind((FLAGS.address, port))
            except OSError as e:
                raise ServeError(f"--{name}={port}: cannot listen on {FLAGS.address}:{port} ({e.strerror})")


def tier_config():
    """The lookup tiers the flags ask for (lookup_tiers.TierConfig); None: the tables in memory."""
    given = [f"--{name}" for name in ("embedding_cache_mb", "embedding_cache_policy", "redis_url")
             if FLAGS[name].value is not None]
    if FLAGS.tiers_config:
        if given:
            raise ServeError(f"give --tiers_config or {', '.join(given)}, not both")
        return TierConfig.from_file(FLAGS.tiers_config)
    if FLAGS.embedding_cache_mb is None:
        if given:
            raise ServeError(f"{given[0]} needs --embedding_cache_mb (serving through the lookup tiers)")
        return None
    if not FLAGS.embedding_cache_mb >= 0:
        raise ServeError(f"--embedding_cache_mb must be >= 0, got {FLAGS.embedding_cache_mb:g}")
    if FLAGS.embedding_cache_policy not in (None, *POLICIES):
        raise ServeError(f"--embedding_cache_policy must be one of {', '.join(POLICIES)}, "
                         f"got {FLAGS.embedding_cache_policy!r}")
    try:
        return TierConfig(cache_bytes=int(FLAGS.embedding_cache_mb * (1 << 20)),
                          policy=FLAGS.embedding_cache_policy or "lru", redis_url=FLAGS.redis_url)
    except ConfigError as e:
        raise ServeError(f"--{e}")


def model_function(saved_model_dir: str, step: int):
    """The monolithic SavedModel (of step `step`) as numpy (numerical, categorical) -> {predictions,
    logits, model_version}."""
    import numpy as np
    import tensorflow as tf
    serve = tf.saved_model.load(saved_model_dir).signatures["serving_default"]

    def infer(numerical_features, categorical_features):
        if not np.isfinite(numerical_features).all():
            raise BadRequest("numerical_features holds NaN or infinite values")
        try:
            out = serve(numerical_features=tf.constant(numerical_features),
                        categorical_features=tf.constant(categorical_features))
        except tf.errors.InvalidArgumentError as e:   # the SavedModel's id check
            lines = [line.strip() for line in e.message.splitlines() if line.strip()]
            raise BadRequest(next((line for line in lines if line.startswith("assertion failed:")), lines[-1]))
        return dict({k: v.numpy() for k, v in out.items()},
                    **{MODEL_VERSION: np.full((len(numerical_features), 1), step, np.int64)})
    return infer


def use_stub_environment():
    """Runs Triton's Python-backend stub in the small numpy 1.x environment tools/setup_env.sh makes
    (<venv>/triton-stub, or /opt/triton-stub in the image; DLRM_TRITON_STUB_ENV overrides): the
    stub cannot read numpy 2 arrays and, given this environment, would silently garble every
    tensor. pytriton otherwise runs it in this process's environment."""
    import pytriton.server.triton_server as triton_server
    candidates = [os.environ.get("DLRM_TRITON_STUB_ENV", ""), os.path.join(sys.prefix, "triton-stub"),
                  "/opt/triton-stub"]
    env = next((c for c in candidates if c and os.path.isfile(os.path.join(c, "bin", "python"))), None)
    if env is None:
        raise ServeError("no environment for Triton's Python-backend stub (numpy 1.x, pyzmq): run make setup, "
                         "or set DLRM_TRITON_STUB_ENV")
    triton_server.get_triton_python_backend_python_env = lambda: pathlib.Path(env)


def log(line: str):
    print(line, flush=True)


def serve(repository: str, tiers):
    import numpy as np
    info = read_export_info(repository)
    name, layout, settings, forms = info["name"], info["layout"], info["settings"], ",".join(info["forms"])
    updater = None
    if "tables" in info["forms"]:
        model = Model(repository, tiers, log)
        infer, served = model.infer, f"tables form, {model.version}"
        stats = lambda: dict(model.stats(), model={"version_step": model.version.step})  # noqa: E731
        if tiers:
            served += (f", through a {tiers.cache_bytes / (1 << 20):g} MiB {tiers.policy} cache"
                       f"{f', Redis {tiers.redis_url}' if tiers.redis_url else ''} and the table files")
        if FLAGS.updates:
            updater = Updater(model, FLAGS.updates, FLAGS.poll_seconds, log)
            served += f", updates from {FLAGS.updates} every {FLAGS.poll_seconds:g} s"
    elif FLAGS.updates or tiers:
        raise ServeError(f"--{'updates' if FLAGS.updates else 'embedding_cache_mb'}: {repository} has no table files "
                         f"to {'update' if FLAGS.updates else 'look up'} (exported with --forms={forms}): "
                         "export with --forms including tables")
    elif "monolithic" in info["forms"]:
        version = export_version(repository)
        infer = model_function(os.path.join(repository, name, "1", "model.savedmodel"), version.step)
        served = f"monolithic, {version}"
        stats = lambda: {"model": {"version_step": version.step}}  # noqa: E731
    else:
        raise ServeError(f"{repository}: has no monolithic model or table files to serve "
                         f"(exported with --forms={forms})")

    inputs = [TensorSpec(NUMERICAL, np.float32, (layout["num_numerical"],)),
              TensorSpec(CATEGORICAL, np.int64, (categorical_width(layout["max_hotness"]),))]
    outputs = [TensorSpec(PREDICTIONS, np.float32, (1,)), TensorSpec(LOGITS, np.float32, (1,)),
               TensorSpec(MODEL_VERSION, np.int64, (1,))]
    served_model = ServedModel(FLAGS.model_name or name, inputs, outputs,
                               FLAGS.max_batch_size or settings["max_batch_size"], infer)
    frontend = native_serving(served_model, FLAGS.address, FLAGS.http_port, FLAGS.grpc_port,
                              metrics_port=FLAGS.metrics_port, stats=stats) if FLAGS.frontend == "native" \
        else triton_serving(served_model, settings)
    with frontend as run:
        for stop in (signal.SIGTERM, signal.SIGINT):   # SIGINT too: a background job starts with it ignored
            signal.signal(stop, _interrupt)
        log(f"serving {served_model.name} ({served}) of {info['checkpoint']} on http {FLAGS.address}:"
            f"{FLAGS.http_port}, grpc {FLAGS.address}:{FLAGS.grpc_port}, metrics {FLAGS.address}:"
            f"{FLAGS.metrics_port} ({FLAGS.frontend} frontend)")
        if updater:
            updater.start()
        try:
            run()
        finally:
            if updater:
                updater.stop()


@contextmanager
def triton_serving(model: ServedModel, settings: dict):
    """Serves `model` from pytriton's Triton server (dynamically batched, through its Python backend)
    while the block runs; yields the function that serves until interrupted."""
    from pytriton.decorators import batch
    from pytriton.exceptions import PyTritonValidationError
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    @batch
    def handle(**inputs):
        try:
            return model.infer(*(inputs[t.name] for t in model.inputs))
        except BadRequest as e:
            raise PyTritonValidationError(str(e))

    config = ModelConfig(max_batch_size=model.max_batch_size,
                         batcher=DynamicBatcher(max_queue_delay_microseconds=FLAGS.max_queue_delay_us
                                                if FLAGS.max_queue_delay_us is not None
                                                else settings["max_queue_delay_us"]))
    triton_config = TritonConfig(http_address=FLAGS.address, http_port=FLAGS.http_port,
                                 grpc_address=FLAGS.address, grpc_port=FLAGS.grpc_port,
                                 metrics_port=FLAGS.metrics_port, exit_timeout_secs=5)
    use_stub_environment()
    tensors = lambda specs: [Tensor(name=t.name, dtype=t.dtype, shape=t.dims) for t in specs]  # noqa: E731
    with Triton(config=triton_config) as triton:
        triton.bind(model_name=model.name, infer_func=handle, inputs=tensors(model.inputs),
                    outputs=tensors(model.outputs), config=config, strict=True)
        yield triton.serve


def serve_until_stopped(repository: str, tiers):
    """`serve`, with a failure of the server itself (a model that does not load, say) in one line."""
    from pytriton.exceptions import PyTritonError
    from tritonclient.utils import InferenceServerException
    try:
        serve(repository, tiers)
    except (PyTritonError, InferenceServerException) as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise ServeError(f"the Triton server failed: {lines[0]}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        if bool(FLAGS.model_repository) == bool(FLAGS.checkpoint):
            raise ServeError("give one of --model_repository and --checkpoint")
        for name in ("max_batch_size", "max_queue_delay_us"):
            if FLAGS[name].value is not None and FLAGS[name].value < (1 if name == "max_batch_size" else 0):
                raise ServeError(f"--{name} must be {'positive' if name == 'max_batch_size' else '>= 0'}, "
                                  f"got {FLAGS[name].value}")
        if FLAGS.poll_seconds <= 0:
            raise ServeError(f"--poll_seconds must be positive, got {FLAGS.poll_seconds:g}")
        check_flags()
        tiers = tier_config()
        check_ports()
        if FLAGS.model_repository:
            serve_until_stopped(FLAGS.model_repository, tiers)
            return
        from deployment.exporter.repository import write_repository   # the exporter: only to serve a checkpoint
        with tempfile.TemporaryDirectory(prefix="dlrm-serve-") as tmp:
            write_repository(FLAGS.checkpoint, os.path.join(tmp, "repo"),
                             forms=("tables",) if FLAGS.updates or tiers else ("monolithic",))
            serve_until_stopped(os.path.join(tmp, "repo"), tiers)
    except (ServeError, RepositoryError, CheckpointError, ConfigError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    app.run(main)
