"""The reference's synthetic-dataset writer, with its flags: split-binary files of synthetic data.

    python -m dataloading.prepare_synthetic_dataset --synthetic_dataset_dir=DIR \\
        [--synthetic_dataset_num_entries=33554432] [--synthetic_dataset_batch_size=32768] \\
        [--synthetic_dataset_table_sizes=100000,...] [--num_numerical_features=13] \\
        [--feature_spec=SPEC] [--seed=12345]

As the reference's: train and test each hold num_entries rounded down to a multiple of
batch_size rows, in the standard layout (DIR/train/numerical.bin, label.bin, cat_<i>.bin, ...,
DIR/feature_spec.yaml); --feature_spec (its shape: cardinalities, numerical count, hotness,
alpha and labels) replaces --synthetic_dataset_table_sizes and --num_numerical_features. The rows are
SyntheticDataset's (dataloading/generate_dataset.py writes them): learnable labels from a
planted model, ids uniform unless the spec gives an alpha.
"""
import os
import sys

from absl import app, flags

from dataloading.feature_spec import FeatureSpec, split_binary_spec
from dataloading.generate_dataset import generate
from utils.errors import DatasetError

flags.DEFINE_integer("synthetic_dataset_num_entries", 32768 * 1024, "samples of train and of test (rounded down "
                     "to a multiple of --synthetic_dataset_batch_size)")
flags.DEFINE_integer("synthetic_dataset_batch_size", 32768, "the multiple the sample count is rounded down to")
flags.DEFINE_integer("num_numerical_features", 13, "numerical features")
flags.DEFINE_list("synthetic_dataset_table_sizes", ["100000"] * 26, "cardinality of each categorical feature")
flags.DEFINE_string("feature_spec", None, "a feature spec giving the shape instead of the two flags above")
flags.DEFINE_string("synthetic_dataset_dir", "/tmp/dlrm_synthetic_data", "output directory")
flags.DEFINE_integer("seed", 12345, "seed of the synthetic data")
FLAGS = flags.FLAGS


def layout(output: str) -> tuple:
    """(the split-binary spec to write under `output`, the ids' power-law alpha)."""
    if FLAGS.feature_spec:
        for name in ("synthetic_dataset_table_sizes", "num_numerical_features"):
            if FLAGS[name].present:
                raise DatasetError(f"--{name}: --feature_spec gives the dataset's shape; remove one")
        shape = FeatureSpec.from_yaml(FLAGS.feature_spec, chunk_type=None)
        numerical, cards = shape.numerical, dict(zip(shape.categorical, shape.cardinalities))
        hot = {n: h for n, h in zip(shape.categorical, shape.max_hotness) if h}
        alphas = sorted({shape.features[n].alpha for n in shape.categorical} - {None})
        if len(alphas) > 1:
            raise DatasetError(f"{FLAGS.feature_spec}: the features have different alphas {alphas}; the synthetic "
                               "ids follow one power law")
        spec = split_binary_spec(numerical, cards, shape.labels, max_hotness=hot, base_dir=output)
        return spec, (alphas or [0.0])[0]
    try:
        cards = [int(c) for c in FLAGS.synthetic_dataset_table_sizes]
    except ValueError:
        raise DatasetError(f"--synthetic_dataset_table_sizes must be integers, got {FLAGS.synthetic_dataset_table_sizes}")
    if FLAGS.num_numerical_features < 1 or not cards or min(cards) < 1:
        raise DatasetError("--synthetic_dataset_table_sizes and --num_numerical_features must be positive")
    numerical = [f"num_{k}" for k in range(FLAGS.num_numerical_features)]
    return split_binary_spec(numerical, {f"cat_{k}": c for k, c in enumerate(cards)}, base_dir=output), 0.0


def main(argv):
    del argv
    try:
        if FLAGS.synthetic_dataset_batch_size < 1:
            raise DatasetError("--synthetic_dataset_batch_size must be positive")
        rows = FLAGS.synthetic_dataset_num_entries // FLAGS.synthetic_dataset_batch_size * \
            FLAGS.synthetic_dataset_batch_size
        if rows < 1:
            raise DatasetError(f"--synthetic_dataset_num_entries ({FLAGS.synthetic_dataset_num_entries}) is less "
                               f"than one --synthetic_dataset_batch_size ({FLAGS.synthetic_dataset_batch_size})")
        spec, alpha = layout(FLAGS.synthetic_dataset_dir)
        os.makedirs(FLAGS.synthetic_dataset_dir, exist_ok=True)
        generate(spec, rows, rows, FLAGS.seed, alpha)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {rows:,} train and {rows:,} test rows to {FLAGS.synthetic_dataset_dir}")


if __name__ == "__main__":
    app.run(main)
