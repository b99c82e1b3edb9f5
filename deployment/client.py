"""Requests to a Triton server serving an exported model (tritonclient, HTTP or gRPC), and the
evaluation data turned into requests (the --dataset_type, --dataset_path, ... flags of main.py).
"""
import socket
import time
import types
from typing import Iterator, Tuple

import numpy as np

from deployment.repository_format import CATEGORICAL, LOGITS, NUMERICAL, categorical_matrix
from utils.errors import ConfigError

DEFAULT_PORTS = {"http": 8000, "grpc": 8001}


class ServingError(RuntimeError):
    """The server is unreachable, not ready, or serves another model; the message is one line."""


def error_line(error: Exception) -> str:
    """The one line that says why the server refused a request (a refusal by the model comes back
    as the Python backend's traceback, whose last line names the error)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    refused = [line for line in lines if line.startswith("pytriton.exceptions.PyTritonValidationError: ")]
    return refused[-1].split(": ", 1)[1] if refused else (lines[0] if lines else type(error).__name__)


class ServingClient:
    """One connection to `model` on the server at `url` (default localhost and the protocol's port);
    over TLS when `ca_file` (a PEM file of the certificates to trust) is given, presenting the
    client certificate `cert_file` (PEM, its key `key_file`) when given, each call carrying the
    bearer `token` when one is given (serve.py's --tls_cert_file, --tls_client_ca_file,
    --auth_token_file)."""

    def __init__(self, protocol: str = "http", url: str = "", model: str = "dlrm", token: str = "",
                 ca_file: str = "", cert_file: str = "", key_file: str = ""):
        if (cert_file or key_file) and not (cert_file and key_file and ca_file):
            raise ConfigError("a client certificate (--tls_client_cert_file) goes with its key "
                              "(--tls_client_key_file) and TLS (--tls_ca_file)")
        if protocol == "http":
            import tritonclient.http as api
            mine = {"certfile": cert_file, "keyfile": key_file} if cert_file else {}
            tls = dict(ssl=True, ssl_options={"ca_certs": ca_file, **mine}) if ca_file else {}
        else:
            import tritonclient.grpc as api
            mine = {"private_key": key_file, "certificate_chain": cert_file} if cert_file else {}
            tls = dict(ssl=True, root_certificates=ca_file, **mine) if ca_file else {}
        self.api, self.protocol, self.model = api, protocol, model
        self.url = url or f"localhost:{DEFAULT_PORTS[protocol]}"
        self.client = api.InferenceServerClient(self.url, **tls)
        self.headers = {"authorization": f"Bearer {token}"} if token else None

    def wait_ready(self, timeout_s: float = 60.0):
        """Returns once the model is ready; raises ServingError after `timeout_s`."""
        from tritonclient.utils import InferenceServerException
        deadline, why = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            try:
                if self.client.is_model_ready(self.model, headers=self.headers):
                    return
                why = f"model {self.model!r} is not ready"
            except (InferenceServerException, ConnectionError, OSError) as e:
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
            time.sleep(0.2)
        raise ServingError(f"{self.protocol}://{self.url}: {why} after {timeout_s:.0f} s")

    def input_shapes(self) -> dict:
        """The inputs a request to the served model must carry: name -> dims (without the batch
        dimension); not the optional ones its config names (the native frontend's variable-length forms)."""
        config = self.client.get_model_config(self.model, headers=self.headers)
        optional = {t["name"] for t in config.get("input", []) if t.get("optional")} if isinstance(config, dict) \
            else {t.name for t in config.config.input if t.optional}
        return {k: v for k, v in self._shapes("inputs").items() if k not in optional}

    def output_shapes(self) -> dict:
        """The served model's outputs: name -> dims (without the batch dimension)."""
        return self._shapes("outputs")

    def _shapes(self, which: str) -> dict:
        metadata = self.client.get_model_metadata(self.model, headers=self.headers)
        tensors = metadata[which] if isinstance(metadata, dict) else [
            {"name": t.name, "shape": list(t.shape)} for t in getattr(metadata, which)]
        return {t["name"]: [int(d) for d in t["shape"]][1:] for t in tensors}

    def max_batch_size(self) -> int:
        config = self.client.get_model_config(self.model, headers=self.headers)
        return int(config["max_batch_size"] if isinstance(config, dict) else config.config.max_batch_size)

    def check_batch_size(self, size: int, flag: str):
        """Raises ServingError if requests of `size` samples (set by --`flag`) exceed the model's max."""
        limit = self.max_batch_size()
        if size > limit:
            raise ServingError(f"--{flag} {size} exceeds model {self.model!r}'s max_batch_size {limit}")

    def infer(self, numerical: np.ndarray, categorical: np.ndarray, outputs=(LOGITS,)) -> dict:
        """One request: numerical [b, n] float32, categorical [b, W] int64 -> {output: [b, 1]} ([b, H]
        of a model with H heads, the export layout's `heads`)."""
        tensors = []
        for name, value, dtype in ((NUMERICAL, numerical, "FP32"), (CATEGORICAL, categorical, "INT64")):
            tensor = self.api.InferInput(name, list(value.shape), dtype)
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        result = self.client.infer(self.model, tensors, outputs=[self.api.InferRequestedOutput(o) for o in outputs],
                                   headers=self.headers)
        return {o: result.as_numpy(o) for o in outputs}

    def close(self):
        self.client.close()


def read_token(path: str) -> str:
    """The bearer token in the file `path` ('' for no path); ConfigError naming the file if unreadable."""
    if not path:
        return ""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        raise ConfigError(f"--auth_token_file={path}: cannot read it ({e.strerror})")


def free_ports(n: int) -> list:
    """`n` ports free on 127.0.0.1 right now (for the servers that tests and benchmarks start)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def open_eval_data(flags) -> Tuple[object, int]:
    """(dataset, evaluation rows) named by main.py's data flags (run/data_flags.py)."""
    from dataloading.open import open_dataset
    from dataloading.synthetic import with_history
    from run.config import feature_spec_path, parse_int_list
    if flags.dataset_type == "synthetic":
        cards = parse_int_list("synthetic_cardinalities", flags.synthetic_cardinalities)
        labels = flags.synthetic_labels
        if labels < 1:
            raise ConfigError(f"--synthetic_labels must be positive, got {labels}")
        num_numerical, history = flags.synthetic_num_numerical, flags.synthetic_history_length
        if history < 0:
            raise ConfigError(f"--synthetic_history_length must be >= 0, got {history}")
        cards, hotness = with_history(cards, None, history)
    else:
        if not flags.dataset_path and not flags.feature_spec:
            raise ConfigError(f"--dataset_type={flags.dataset_type} needs --dataset_path (a directory with "
                              "feature_spec.yaml) or --feature_spec")
        cards, num_numerical, labels, hotness, history = None, None, 1, None, 0
    cfg = types.SimpleNamespace(   # what open_dataset reads for evaluation
        mode="eval", dataset_type=flags.dataset_type, cardinalities=cards, num_numerical=num_numerical,
        max_hotness=hotness, synthetic_alpha=flags.synthetic_alpha, synthetic_labels=labels, seed=flags.seed,
        synthetic_history_length=history,
        synthetic_rows=0, synthetic_eval_rows=flags.synthetic_eval_rows, eval_mapping=flags.eval_mapping,
        feature_spec_path=feature_spec_path(flags.dataset_path, flags.feature_spec))
    dataset, rows = open_dataset(cfg)
    return dataset, rows["eval"]


def request_batches(dataset, rows: int, batch_size: int) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The first `rows` evaluation samples in order as (numerical, categorical_features, labels [n],
    or [n, H] of a dataset of H labels) batches of at most `batch_size`."""
    from dataloading.batches import RankInput, eval_batches
    view = RankInput.single_process(len(dataset.cardinalities))
    for batch in eval_batches(dataset, view, rows=rows, batch_size=batch_size):
        n = batch["valid"]
        yield (batch["numerical"][:n], categorical_matrix(batch["categorical"], dataset.max_hotness)[:n],
               batch["labels"][:n])
