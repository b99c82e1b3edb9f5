"""Streams the evaluation split through a Triton server and reports AUC and logloss, computed
as `dlrm.py --mode=eval` computes them (every sample, exactly), from the served logits.

    python deployment/evaluate_accuracy.py --dataset_type=synthetic ... --protocol=grpc --url=localhost:8001

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


def evaluate(client, dataset, rows: int, batch_size: int) -> dict:
    """AUC and logloss of the served model over the first `rows` evaluation samples."""
    import numpy as np
    from deployment.client import ServingError, request_batches
    from deployment.repository_format import categorical_width
    from utils.metrics import log_loss, roc_auc
    served = client.input_shapes()
    expected = {"numerical_features": [dataset.num_numerical],
                "categorical_features": [categorical_width(dataset.max_hotness)]}
    if served != expected:
        raise ServingError(f"model {client.model!r} takes {served}, this dataset gives {expected}")
    client.check_batch_size(batch_size, "batch_size")
    logits, labels = [], []
    t0 = time.perf_counter()
    for numerical, categorical, y in request_batches(dataset, rows, batch_size):
        logits.append(client.infer(numerical, categorical)["logits"][:, 0])
        labels.append(y)
    seconds = time.perf_counter() - t0
    logits, labels = np.concatenate(logits), np.concatenate(labels)
    return {"auc": roc_auc(labels, logits), "logloss": log_loss(labels, logits), "samples": int(labels.size),
            "seconds": seconds, "samples_per_s": labels.size / seconds}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    import_tensorflow()   # before the data pipeline loads it, so that its start-up lines honour TF_CPP_MIN_LOG_LEVEL
    from tritonclient.utils import InferenceServerException
    from deployment.client import ServingClient, ServingError, error_line, open_eval_data, read_token
    try:
        token = read_token(FLAGS.auth_token_file)
        dataset, rows = open_eval_data(FLAGS)
        rows = min(rows, FLAGS.max_samples) if FLAGS.max_samples > 0 else rows
        client = ServingClient(FLAGS.protocol, FLAGS.url, FLAGS.model_name, token, FLAGS.tls_ca_file,
                               FLAGS.tls_client_cert_file, FLAGS.tls_client_key_file)
        client.wait_ready(FLAGS.wait_s)
        metrics = evaluate(client, dataset, rows, FLAGS.batch_size)
    except (ConfigError, ServingError) as e:   # ConfigError: the data flags, the dataset's files
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except InferenceServerException as e:
        print(f"error: the server refused a request: {error_line(e)}", file=sys.stderr)
        sys.exit(1)
    print(f"served {FLAGS.model_name} over {FLAGS.protocol}: auc {metrics['auc']:.5f} | logloss "
          f"{metrics['logloss']:.5f} | {metrics['samples']:,} samples in {metrics['seconds']:.1f} s "
          f"({metrics['samples_per_s']:,.0f} samples/s)")
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    app.run(main)
