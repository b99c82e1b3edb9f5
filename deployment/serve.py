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

The server listens on 127.0.0.1 unless --address says otherwise (--address=0.0.0.0: every
interface). Before exposing it, read docs/deployment.md's "What the server trusts": the native
frontend takes TLS (--tls_cert_file, --tls_key_file; client certificates with --tls_client_ca_file),
a bearer token (--auth_token_file) and bounds on requests (--max_request_mb, --max_header_kb,
--max_connections, --read_timeout_s):

    python deployment/serve.py --model_repository=runs/demo/model_repository --address=0.0.0.0 \
        --tls_cert_file=server.crt --tls_key_file=server.key --auth_token_file=token.txt

Prometheus metrics are served at GET /metrics on --metrics_port: with the native frontend
deployment/serving/metrics.py's (requests by protocol and status, samples, a latency histogram,
the served version's step and the lookup tiers' counts), with --frontend=triton Triton's own.

With --updates=DIR (tables form only), new versions dropped into DIR (deltas, full exports) are
served without a restart, each logged in one line (deployment/serving/live.py's Updater):

    python deployment/serve.py --model_repository=runs/demo/model_repository --updates=runs/demo/updates

With --embedding_cache_mb (or --tiers_config), a tables-form repository's tables are not loaded
whole: lookups go through a per-process cache of hot rows, an optional Redis server shared by
servers (--redis_url), and the table files memory-mapped (deployment/serving/tiers/),
for tables larger than the server's memory:

    python deployment/serve.py --model_repository=runs/demo/model_repository --embedding_cache_mb=512 \
        --redis_url=redis://127.0.0.1:6379/0

The server imports nothing of training: only --checkpoint loads the exporter, to write the
repository it serves.
"""
import dataclasses
import os
import pathlib
import signal
import socket
import sys
import tempfile
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from deployment.repository_format import (CATEGORICAL, LOGITS, NUMERICAL, PREDICTIONS,  # noqa: E402
                                          RepositoryError, categorical_width, read_export_info)
from deployment.repository_format import columns as feature_columns  # noqa: E402
from deployment.serving.backend import MODEL_VERSION, Backend  # noqa: E402
from deployment.serving.errors import BadRequest  # noqa: E402
from deployment.serving.guarded_http import Safeguards  # noqa: E402
from deployment.serving.live import Model, Updater, check_export  # noqa: E402
from deployment.serving.tiers import POLICIES, TierConfig  # noqa: E402
from deployment.serving.monolithic import MonolithicModel  # noqa: E402
from deployment.serving.native import (RaggedInput, RequestError, ServedModel, TensorSpec,  # noqa: E402
                                       serving as native_serving)
from utils.errors import CheckpointError, ConfigError, StoreError  # noqa: E402
from utils.tensorflow_startup import import_tensorflow  # noqa: E402

flags.DEFINE_string("model_repository", None, "a model repository written by deployment/deploy.py")
flags.DEFINE_string("checkpoint", None, "a checkpoint to export (to a temporary repository) and serve, instead")
flags.DEFINE_string("model_name", None, "the name to serve the model under (default: the repository's)")
flags.DEFINE_enum("frontend", "native", ["native", "triton"], "native: this process answers HTTP and gRPC "
                  "itself (deployment/serving/native.py); triton: pytriton's Triton server, its Python backend handing "
                  "each request to this process")
flags.DEFINE_string("address", "127.0.0.1", "address the HTTP, gRPC and metrics endpoints listen on (127.0.0.1: "
                    "this machine only; 0.0.0.0: every interface, see docs/deployment.md's 'What the server trusts')")
flags.DEFINE_string("tls_cert_file", None, "native: a PEM certificate (chain): HTTP, gRPC and metrics over TLS; with "
                    "--tls_key_file")
flags.DEFINE_string("tls_key_file", None, "native: the PEM private key of --tls_cert_file")
flags.DEFINE_string("tls_client_ca_file", None, "native, with --tls_cert_file: PEM CA certificate(s); every client "
                    "(HTTP, gRPC, metrics) must present a certificate one of them signed (mutual TLS)")
flags.DEFINE_string("auth_token_file", None, "native: a file holding a bearer token that every request but health "
                    "(live, ready) must carry: HTTP 'Authorization: Bearer <token>', gRPC 'authorization' metadata; "
                    "/metrics too")
flags.DEFINE_float("max_request_mb", 64, "native: largest request body, MiB, after decompression (HTTP; gRPC: "
                   "message, never more than the model's largest)")
flags.DEFINE_integer("max_header_kb", 64, "native: largest request line and headers, KiB (gRPC: metadata)")
flags.DEFINE_integer("max_connections", 64, "native: most connections at once per HTTP port (over it: 503), gRPC "
                     "calls in flight (over it: RESOURCE_EXHAUSTED)")
flags.DEFINE_float("read_timeout_s", 30.0, "native: a connection whose request is not received whole in this many "
                   "seconds is dropped (gRPC: an idle connection)")
flags.DEFINE_integer("http_port", 8000, "HTTP/REST port")
flags.DEFINE_integer("grpc_port", 8001, "gRPC port")
flags.DEFINE_integer("metrics_port", 8002, "Prometheus metrics port, GET /metrics (native: requests, latency, "
                     "version and lookup tiers, deployment/serving/metrics.py; triton: Triton's own)")
flags.DEFINE_integer("max_batch_size", None, "largest batch a request (or a dynamic batch) may have "
                     "(default: the repository's config.pbtxt)")
flags.DEFINE_string("updates", None, "a directory to poll for new versions to serve (deltas and full exports, "
                    "one per subdirectory); needs a repository with the tables form")
flags.DEFINE_float("poll_seconds", 1.0, "how often --updates is polled, seconds")
flags.DEFINE_bool("updates_allow_full_exports", False, "with --updates: take full exports dropped there too (their "
                  "SavedModel runs in the server: whoever can write the folder can run code as the server); "
                  "without it they are refused and only deltas are taken")
flags.DEFINE_bool("skip_checksums", False, "start without checking every file of the repository against the "
                  "CRC-32 its export.json lists (faster start-up of a large repository)")
flags.DEFINE_integer("max_queue_delay_us", None, "dynamic batching: longest wait for more requests, "
                     "microseconds (default: the repository's config.pbtxt)")
flags.DEFINE_float("embedding_cache_mb", None, "serve the tables form through lookup tiers instead of loading the "
                   "tables whole: the per-process cache of hot rows, MiB over every table")
flags.DEFINE_bool("triton_variable_length", False, "triton: also take a multi-hot feature f (a history) as "
                  "variable-length ids, categorical_<f> [N] with categorical_<f>_lengths [B], as the native frontend "
                  "always does; Triton's batcher cannot put such requests together, so each is served as it comes")
flags.DEFINE_string("embedding_cache_policy", None, f"{' or '.join(POLICIES)} (default lru): which cached rows make "
                    "room for new ones; with --embedding_cache_mb")
flags.DEFINE_string("redis_url", None, "redis://host:port/db: a Redis server shared by servers, between the cache and "
                    "the table files; with --embedding_cache_mb")
flags.DEFINE_string("tiers_config", None, "a JSON file of the lookup tiers' settings (deployment/serving/"
                    "tiers/config.py's TierConfig: cache_bytes, policy, redis_url, ...), instead of the three flags "
                    "above")
FLAGS = flags.FLAGS


def _interrupt(*_):
    raise KeyboardInterrupt


class ServeError(ValueError):
    """A server that cannot start as asked; the message is one line."""


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How `serve` serves a repository: serve.py's flags, checked (settings_from_flags)."""
    model_name: Optional[str] = None           # default: the repository's
    frontend: str = "native"                   # native or triton
    address: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    max_batch_size: Optional[int] = None       # default: the repository's config.pbtxt
    max_queue_delay_us: Optional[int] = None   # triton's dynamic batching; default: the config.pbtxt
    updates: Optional[str] = None              # a directory polled for new versions (tables form)
    poll_seconds: float = 1.0
    tiers: Optional[TierConfig] = None         # the lookup tiers; None: the tables whole in memory
    safeguards: Safeguards = Safeguards()      # the native frontend's TLS, token and bounds
    allow_full_exports: bool = False           # full exports taken from `updates` (their SavedModels run)
    skip_checksums: bool = False               # the repository's files not checked at start-up
    triton_variable_length: bool = False       # triton: the variable-length forms, served unbatched

    @property
    def ports(self) -> Dict[str, int]:
        """Per port flag's name, its port."""
        return {"http_port": self.http_port, "grpc_port": self.grpc_port, "metrics_port": self.metrics_port}


def settings_from_flags() -> ServerSettings:
    """The flags as ServerSettings. Values out of range, flags that have no effect with the chosen
    frontend or without --updates, and lookup-tier flags that do not go together are errors."""
    for name in ("max_batch_size", "max_queue_delay_us"):
        if FLAGS[name].value is not None and FLAGS[name].value < (1 if name == "max_batch_size" else 0):
            raise ServeError(f"--{name} must be {'positive' if name == 'max_batch_size' else '>= 0'}, "
                             f"got {FLAGS[name].value}")
    if FLAGS.poll_seconds <= 0:
        raise ServeError(f"--poll_seconds must be positive, got {FLAGS.poll_seconds:g}")
    if FLAGS.frontend == "native" and FLAGS["max_queue_delay_us"].present:
        raise ServeError("--max_queue_delay_us: no effect with --frontend=native (no dynamic batching); it is "
                         "--frontend=triton's")
    if FLAGS.frontend == "native" and FLAGS.triton_variable_length:
        raise ServeError("--triton_variable_length: no effect with --frontend=native, which always takes "
                         "variable-length ids")
    if FLAGS.triton_variable_length and FLAGS["max_queue_delay_us"].present:
        raise ServeError("--max_queue_delay_us: no effect with --triton_variable_length (each request is served as "
                         "it comes, unbatched)")
    for name in ("poll_seconds", "updates_allow_full_exports"):
        if FLAGS[name].present and not FLAGS.updates:
            raise ServeError(f"--{name}: no effect without --updates")
    return ServerSettings(FLAGS.model_name, FLAGS.frontend, FLAGS.address, FLAGS.http_port, FLAGS.grpc_port,
                          FLAGS.metrics_port, FLAGS.max_batch_size, FLAGS.max_queue_delay_us, FLAGS.updates,
                          FLAGS.poll_seconds, tier_config_from_flags(), safeguards_from_flags(),
                          FLAGS.updates_allow_full_exports, FLAGS.skip_checksums, FLAGS.triton_variable_length)


SAFEGUARD_FLAGS = ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_token_file", "max_request_mb",
                   "max_header_kb", "max_connections", "read_timeout_s")


def safeguards_from_flags() -> Safeguards:
    """The native frontend's TLS, token and bounds the flags ask for (guarded_http.Safeguards)."""
    if FLAGS.frontend == "triton":
        given = [f"--{name}" for name in SAFEGUARD_FLAGS if FLAGS[name].present]
        if given:
            raise ServeError(f"{', '.join(given)}: only with --frontend=native (Triton's frontend has no such "
                             "settings here; see docs/deployment.md's 'What the server trusts')")
        return Safeguards()
    for name in ("max_request_mb", "max_header_kb", "max_connections", "read_timeout_s"):
        if not FLAGS[name].value > 0:
            raise ServeError(f"--{name} must be positive, got {FLAGS[name].value:g}")
    if bool(FLAGS.tls_cert_file) != bool(FLAGS.tls_key_file):
        raise ServeError("--tls_cert_file and --tls_key_file go together: give both or neither")
    if FLAGS.tls_client_ca_file and not FLAGS.tls_cert_file:
        raise ServeError("--tls_client_ca_file: only with --tls_cert_file and --tls_key_file (clients are asked for "
                         "a certificate over TLS)")
    token = None
    if FLAGS.auth_token_file:
        try:
            with open(FLAGS.auth_token_file) as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ServeError(f"--auth_token_file={FLAGS.auth_token_file}: cannot read it "
                             f"({getattr(e, 'strerror', None) or e})")
        if not token or not all(33 <= ord(c) < 127 for c in token):
            raise ServeError(f"--auth_token_file={FLAGS.auth_token_file}: the token must be one word of printable "
                             "ASCII characters")
    safeguards = Safeguards(token, FLAGS.tls_cert_file, FLAGS.tls_key_file, int(FLAGS.max_request_mb * (1 << 20)),
                            FLAGS.max_header_kb << 10, FLAGS.max_connections, FLAGS.read_timeout_s,
                            FLAGS.tls_client_ca_file)
    try:
        safeguards.ssl_context()
    except (OSError, ValueError) as e:   # ssl.SSLError is an OSError
        files = [f"--{n}={FLAGS[n].value}" for n in ("tls_cert_file", "tls_key_file", "tls_client_ca_file")
                 if FLAGS[n].value]
        raise ServeError(f"{', '.join(files)}: cannot load them ({getattr(e, 'strerror', None) or e})")
    return safeguards


def tier_config_from_flags() -> Optional[TierConfig]:
    """The lookup tiers the flags ask for (tiers.TierConfig); None: the tables in memory."""
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


def check_ports(settings: ServerSettings):
    """The ports are distinct and free on the address (Triton would wait forever instead)."""
    ports = settings.ports
    if len(set(ports.values())) < len(ports):
        raise ServeError(f"{', '.join(f'--{n}' for n in ports)} must differ, got {sorted(ports.values())}")
    for name, port in ports.items():
        with socket.socket() as s:
            try:
                s.bind((settings.address, port))
            except OSError as e:
                raise ServeError(f"--{name}={port}: cannot listen on {settings.address}:{port} ({e.strerror})")


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


def open_backend(repository: str, forms: List[str], settings: ServerSettings) -> Tuple[Backend, str, Optional[Updater]]:
    """The backend serving `repository` (exported with `forms`), what it serves in words, and its
    Updater with --updates: live.Model for the tables form, else monolithic.MonolithicModel."""
    tiers, updates = settings.tiers, settings.updates
    if "tables" in forms:
        model = Model(repository, tiers, log)
        served = f"tables form, {model.version}"
        if tiers:
            served += (f", through a {tiers.cache_bytes / (1 << 20):g} MiB {tiers.policy} cache"
                       f"{f', Redis {tiers.redis_url}' if tiers.redis_url else ''} and the table files")
        if not updates:
            return model, served, None
        return (model, f"{served}, updates from {updates} every {settings.poll_seconds:g} s",
                Updater(model, updates, settings.poll_seconds, log, settings.allow_full_exports))
    if updates or tiers:
        raise ServeError(f"--{'updates' if updates else 'embedding_cache_mb'}: {repository} has no table files "
                         f"to {'update' if updates else 'look up'} (exported with --forms={','.join(forms)}): "
                         "export with --forms including tables")
    if "monolithic" in forms:
        model = MonolithicModel(repository)
        return model, f"monolithic, {model.version}", None
    raise ServeError(f"{repository}: has no monolithic model or table files to serve "
                     f"(exported with --forms={','.join(forms)})")


def serve(repository: str, settings: ServerSettings):
    """Serves the model repository `repository` as `settings` say, until interrupted."""
    info = read_export_info(repository)
    if not settings.skip_checksums:
        check_export(repository)
    layout, exported = info["layout"], info["settings"]
    model, served, updater = open_backend(repository, info["forms"], settings)
    inputs = [TensorSpec(NUMERICAL, np.float32, (layout["num_numerical"],)),
              TensorSpec(CATEGORICAL, np.int64, (categorical_width(layout["max_hotness"]),))]
    columns = (len(layout.get("heads") or [None]),)   # a column per head (repository_format.ServingLayout)
    outputs = [TensorSpec(PREDICTIONS, np.float32, columns), TensorSpec(LOGITS, np.float32, columns),
               TensorSpec(MODEL_VERSION, np.int64, (1,))]
    ragged = [RaggedInput(f"categorical_{f}", CATEGORICAL, start, end) for f, ((start, end), hotness) in
              enumerate(zip(feature_columns(layout["max_hotness"]), layout["max_hotness"])) if hotness]
    served_model = ServedModel(settings.model_name or info["name"], inputs, outputs,
                               settings.max_batch_size or exported["max_batch_size"], model.infer,
                               ragged if settings.frontend == "native" or settings.triton_variable_length else ())
    if settings.triton_variable_length and not ragged:
        raise ServeError(f"--triton_variable_length: {repository}'s model has no multi-hot feature to take as "
                         "variable-length ids")
    if settings.frontend == "native":
        stats = lambda: dict(model.stats(), model={"version_step": model.version.step})  # noqa: E731
        frontend = native_serving(served_model, settings.address, settings.http_port, settings.grpc_port,
                                  metrics_port=settings.metrics_port, stats=stats, safeguards=settings.safeguards)
    else:
        delay = settings.max_queue_delay_us
        frontend = triton_serving(served_model, settings, exported["max_queue_delay_us"] if delay is None else delay)
    for stop in (signal.SIGTERM, signal.SIGINT):   # before the ports open: a ready server stops cleanly
        signal.signal(stop, _interrupt)            # SIGINT too: a background job starts with it ignored
    with frontend as run:
        guards = settings.safeguards
        log(f"serving {served_model.name} ({served}) of {info['checkpoint']} on http {settings.address}:"
            f"{settings.http_port}, grpc {settings.address}:{settings.grpc_port}, metrics {settings.address}:"
            f"{settings.metrics_port} ({settings.frontend} frontend{', TLS' if guards.tls_cert_file else ''}"
            f"{', bearer token' if guards.token else ''})")
        if updater:
            updater.start()
        try:
            run()
        finally:
            if updater:
                updater.stop()


@contextmanager
def triton_serving(model: ServedModel, settings: ServerSettings, max_queue_delay_us: int):
    """Serves `model` from pytriton's Triton server (through its Python backend) while the block
    runs; yields the function that serves until interrupted. Dynamically batched, unless the
    model takes variable-length forms of some columns (`model.ragged`, --triton_variable_length:
    a request's ids [N] and lengths [B], whose first dimensions differ, which Triton's batcher
    cannot put together): then each request is served as it comes, checked and padded as the
    native frontend does (ServedModel.run), its `categorical_features` with or without those
    columns."""
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

    def handle_as_sent(requests):
        answers = []
        for request in requests:
            tensors = [(name, TensorSpec(name, a.dtype.type, ()).datatype, list(a.shape), a.tobytes())
                       for name, a in request.items()]
            try:
                answers.append(model.run(tensors, None))
            except RequestError as e:
                raise PyTritonValidationError(str(e))
        return answers

    if model.ragged:
        config = ModelConfig(batching=False)
        inputs = [Tensor(name=t.name, dtype=t.dtype, shape=(-1,) * (1 + len(t.dims))) for t in model.inputs]
        inputs += [Tensor(name=n, dtype=np.int64, shape=(-1,), optional=True) for r in model.ragged
                   for n in (r.name, r.lengths)]
        outputs = [Tensor(name=t.name, dtype=t.dtype, shape=(-1, *t.dims)) for t in model.outputs]
        infer = handle_as_sent
    else:
        config = ModelConfig(max_batch_size=model.max_batch_size,
                             batcher=DynamicBatcher(max_queue_delay_microseconds=max_queue_delay_us))
        inputs, outputs = ([Tensor(name=t.name, dtype=t.dtype, shape=t.dims) for t in specs]
                           for specs in (model.inputs, model.outputs))
        infer = handle
    triton_config = TritonConfig(http_address=settings.address, http_port=settings.http_port,
                                 grpc_address=settings.address, grpc_port=settings.grpc_port,
                                 metrics_address=settings.address, metrics_port=settings.metrics_port,
                                 exit_timeout_secs=5)
    use_stub_environment()
    with Triton(config=triton_config) as triton:
        triton.bind(model_name=model.name, infer_func=infer, inputs=inputs, outputs=outputs, config=config,
                    strict=True)
        yield triton.serve


def serve_until_stopped(repository: str, settings: ServerSettings):
    """`serve`, with a failure of the server itself (a model that does not load, say) in one line."""
    from pytriton.exceptions import PyTritonError
    from tritonclient.utils import InferenceServerException
    try:
        serve(repository, settings)
    except (PyTritonError, InferenceServerException) as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise ServeError(f"the Triton server failed: {lines[0]}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        if bool(FLAGS.model_repository) == bool(FLAGS.checkpoint):
            raise ServeError("give one of --model_repository and --checkpoint")
        settings = settings_from_flags()
        check_ports(settings)
        import_tensorflow()   # before the models load it, so that its start-up lines honour TF_CPP_MIN_LOG_LEVEL
        if FLAGS.model_repository:
            serve_until_stopped(FLAGS.model_repository, settings)
            return
        # The exporter, and with it training's modules (storage.checkpoint, nn), only here: serving a
        # checkpoint writes a repository first. Serving a repository never imports them.
        from deployment.exporter.repository import write_repository
        with tempfile.TemporaryDirectory(prefix="dlrm-serve-") as tmp:
            write_repository(FLAGS.checkpoint, os.path.join(tmp, "repo"),
                             forms=("tables",) if settings.updates or settings.tiers else ("monolithic",))
            serve_until_stopped(os.path.join(tmp, "repo"), settings)
    except (ServeError, RepositoryError, CheckpointError, ConfigError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    app.run(main)
