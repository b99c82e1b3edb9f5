"""The flags naming a run's data (and --seed, which also seeds the synthetic data), shared by
main.py and the deployment clients (deployment/evaluate_accuracy.py, evaluate_latency.py)."""
from absl import flags

from run.config import DATASET_TYPES

flags.DEFINE_integer("seed", 12345, "seed for initialisation and data order")
flags.DEFINE_enum("dataset_type", "split_binary", list(DATASET_TYPES), "split_binary: files described by a feature "
                  "spec (see docs/datasets.md); tf_raw: the reference's name for the same files; split_tfrecords: the "
                  "reference's TFRecord directories (its multi-hot format); synthetic: generated on the fly from the "
                  "--synthetic_* flags")
flags.DEFINE_string("dataset_path", "", "dataset directory (holding feature_spec.yaml)")
flags.DEFINE_string("feature_spec", "", "feature spec file (default: <dataset_path>/feature_spec.yaml)")
flags.DEFINE_string("eval_mapping", "test", "the feature spec's source_spec mapping to evaluate on")
flags.DEFINE_list("synthetic_cardinalities",
                  ["100000", "50000", "20000", "10000", "5000", "3000", "2000", "1000", "500", "300",
                   "200", "100", "100000", "50000", "20000", "10000", "1000", "500", "100", "50",
                   "20", "10", "8", "4", "3", "2"],
                  "synthetic table sizes, one per categorical feature")
flags.DEFINE_integer("synthetic_num_numerical", 13, "synthetic numerical features")
flags.DEFINE_integer("synthetic_eval_rows", 2 ** 18, "synthetic evaluation samples")
flags.DEFINE_float("synthetic_alpha", 1.05, "power-law exponent of synthetic ids (0: uniform)")
flags.DEFINE_integer("synthetic_history_length", 0, "synthetic data: L > 0 appends feature 'history', each sample's "
                     "0..L earlier items of cat_0's vocabulary (most recent last), on which the label also depends "
                     "(the candidate cat_0's affinity to it: a sequence model's data)")
flags.DEFINE_integer("synthetic_labels", 1, "synthetic labels per sample (label, label_1, ...), each from its own "
                     "planted logit over the same features; several need a model file with a head per label (--model)")
