"""Streams the evaluation split through a served model and reports its figures, computed as
`dlrm.py --mode=eval` computes them (every sample, exactly: utils.metrics.output_figures), from
the served logits: AUC and logloss of a logit, RMSE of a value; of a model with heads, each head's
against its label ("<head>_auc", ...), the heads and which are values read from its export.

    python deployment/evaluate_accuracy.py --dataset_type=synthetic ... --protocol=grpc --url=localhost:8001
    python deployment/evaluate_accuracy.py --model_repository=DIR --synthetic_labels=2 ...   # a model with heads

Name the data with the flags of the training run (--dataset_type, --dataset_path, --synthetic_*).
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from run import data_flags  # noqa: E402,F401 (the data flags of main.py)
from utils.errors import ConfigError  # noqa: E402
from utils.tensorflow_startup import import_tensorflow  # noqa: E402

flags.DEFINE_enum("protocol", "http", ["http", "grpc"], "how to talk to the server")
flags.DEFINE_string("url", "", "host:port of the server (default localhost:8000 for http, :8001 for grpc)")
flags.DEFINE_string("model_name", "dlrm", "the served model's name")
flags.DEFINE_string("model_repository", "", "the served model's export (deploy.py's --output, serve.py's "
                    "--model_repository): its export.json names the model's heads and the outputs trained as values "
                    "(scored by RMSE); needed for a model with heads (default: one output, a logit)")
flags.DEFINE_string("auth_token_file", "", "a file holding the bearer token the server asks for (serve.py's "
                    "--auth_token_file)")
flags.DEFINE_string("tls_ca_file", "", "connect over TLS, trusting the certificates in this PEM file (serve.py's "
                    "--tls_cert_file, or the CA that signed it)")
flags.DEFINE_string("tls_client_cert_file", "", "with --tls_ca_file: present this PEM client certificate (to a "
                    "server with --tls_client_ca_file)")
flags.DEFINE_string("tls_client_key_file", "", "the PEM private key of --tls_client_cert_file")
flags.DEFINE_integer("batch_size", 8192, "samples per request (at most the model's max_batch_size)")
flags.DEFINE_integer("max_samples", 0, "evaluate only the first this many samples (0: all)")
flags.DEFINE_float("wait_s", 60.0, "how long to wait for the server and the model to be ready")
flags.DEFINE_string("output_json", "", "also write the metrics (full precision) to this JSON file")
FLAGS = flags.FLAGS


def evaluate(client, dataset, rows: int, batch_size: int, layout=None) -> dict:
    """The figures of the served model over the first `rows` evaluation samples (output_figures' of
    its logits [n, H] and the labels [n, H]), `samples`, `seconds`, `samples_per_s`. `layout`: the
    export's ServingLayout (its `heads`, one per label of the data, named as it, and `values`); None:
    one output, a logit. ServingError, one line, for a model that does not fit the data."""
    import numpy as np
    from deployment.client import ServingError, request_batches
    from deployment.repository_format import LOGITS, categorical_width
    from utils.metrics import output_figures
    served = client.input_shapes()
    expected = {"numerical_features": [dataset.num_numerical],
                "categorical_features": [categorical_width(dataset.max_hotness)]}
    if served != expected:
        raise ServingError(f"model {client.model!r} takes {served}, this dataset gives {expected}")
    _check_heads(client, layout, dataset.label_names)
    heads, values = (layout.heads, layout.values or []) if layout else (None, [])
    client.check_batch_size(batch_size, "batch_size")
    logits, labels = [], []
    t0 = time.perf_counter()
    for numerical, categorical, y in request_batches(dataset, rows, batch_size):
        logits.append(client.infer(numerical, categorical)[LOGITS])
        labels.append(np.reshape(y, [len(y), -1]))
    seconds = time.perf_counter() - t0
    logits, labels = np.concatenate(logits), np.concatenate(labels)
    scores = ["rmse" if h in values else "auc" for h in range(logits.shape[1])]
    return {**output_figures(logits, labels, heads, scores), "samples": int(len(labels)), "seconds": seconds,
            "samples_per_s": len(labels) / seconds}


def _check_heads(client, layout, labels):
    """ServingError, one line, unless the served model gives the outputs of `layout` (None: one)
    and its heads are the data's `labels`, in order (a model of one output: the data have one)."""
    from deployment.client import ServingError
    from deployment.repository_format import LOGITS
    columns, heads = client.output_shapes()[LOGITS][0], layout.heads if layout else None
    if layout is None and columns > 1:
        raise ServingError(f"model {client.model!r} gives {columns} outputs a sample (heads): name its export with "
                           "--model_repository (its export.json names the heads and how each is scored)")
    if layout is not None and columns != layout.outputs:
        raise ServingError(f"model {client.model!r} gives {columns} outputs a sample, its export "
                           f"(--model_repository) {layout.outputs}: name the export the server serves")
    if heads is None and len(labels) > 1:
        raise ServingError(f"model {client.model!r} gives one output; the data have labels {', '.join(labels)}: "
                           "evaluate it on data of one label")
    if heads is not None and heads != labels:
        raise ServingError(f"model {client.model!r}'s heads ({', '.join(heads)}) are not the data's labels "
                           f"({', '.join(labels)}): evaluate it on data with a label per head, named as it")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    import_tensorflow()   # before the data pipeline loads it, so that its start-up lines honour TF_CPP_MIN_LOG_LEVEL
    from tritonclient.utils import InferenceServerException
    from deployment.client import ServingClient, ServingError, error_line, open_eval_data, read_token
    from deployment.repository_format import RepositoryError, ServingLayout, read_export_info
    try:
        token = read_token(FLAGS.auth_token_file)
        layout = ServingLayout(**read_export_info(FLAGS.model_repository)["layout"]) if FLAGS.model_repository \
            else None
        dataset, rows = open_eval_data(FLAGS)
        rows = min(rows, FLAGS.max_samples) if FLAGS.max_samples > 0 else rows
        client = ServingClient(FLAGS.protocol, FLAGS.url, FLAGS.model_name, token, FLAGS.tls_ca_file,
                               FLAGS.tls_client_cert_file, FLAGS.tls_client_key_file)
        client.wait_ready(FLAGS.wait_s)
        metrics = evaluate(client, dataset, rows, FLAGS.batch_size, layout)
    except (ConfigError, ServingError, RepositoryError) as e:   # ConfigError: the data flags, the dataset's files
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except InferenceServerException as e:
        print(f"error: the server refused a request: {error_line(e)}", file=sys.stderr)
        sys.exit(1)
    figures = [k for k, v in metrics.items() if k not in ("samples", "seconds", "samples_per_s") and v is not None
               and not (layout and layout.heads and k in ("auc", "logloss"))]   # of heads: each head's
    print(f"served {FLAGS.model_name} over {FLAGS.protocol}: {' | '.join(f'{k} {metrics[k]:.5f}' for k in figures)} | "
          f"{metrics['samples']:,} samples in {metrics['seconds']:.1f} s ({metrics['samples_per_s']:,.0f} samples/s)")
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    app.run(main)
