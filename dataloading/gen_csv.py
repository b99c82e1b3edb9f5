"""Writes synthetic CSV files in the layout of a CSV feature spec (the input of transcode.py).

    python dataloading/gen_csv.py --feature_spec_in SPEC --output DIR --rows 100000 --eval_rows 10000

The samples are SyntheticDataset's (see generate_dataset.py: mapping "train" from the training
samples, the others from the evaluation ones), so the labels follow a planted logistic model
that a trained model can learn (and whose AUC is known), not constants. Categorical
cardinalities must be numbers here; multi-hot fields are ids joined by `|`. A chunk's rows are
split evenly over its files; the spec is copied to DIR/feature_spec.yaml, ready for
`transcode.py --input DIR`.
"""
import argparse
import os
import sys

import numpy as np

from dataloading.feature_spec import AUTO, CSV, SPEC_FILE, FeatureSpec
from dataloading.generate_dataset import synthetic_columns, synthetic_sources
from dataloading.synthetic import SyntheticDataset
from dataloading.transcode import DELIMITER
from utils.errors import DatasetError


def gen_csv(spec: FeatureSpec, rows: int, eval_rows: int, seed: int, alpha: float):
    """Writes every chunk of every mapping of `spec` (paths relative to spec.base_dir) and the spec."""
    auto = [f for f in spec.categorical if spec.features[f].cardinality == AUTO]
    if auto:
        raise DatasetError(f"feature_spec.{auto[0]}.cardinality: gen_csv needs a number, not auto")
    data = SyntheticDataset(spec.cardinalities, len(spec.numerical), alpha, seed)
    for mapping, (split, first, n) in synthetic_sources(spec, rows, eval_rows).items():
        columns = synthetic_columns(spec, data, split, first, n)
        for chunk in spec.mapping(mapping):
            lines = [",".join(fields) + "\n" for fields in zip(*(_fields(spec, f, columns[f]) for f in chunk.features))]
            for path, part in zip(chunk.files, np.array_split(np.arange(n), len(chunk.files))):
                os.makedirs(os.path.dirname(spec.path(path)) or ".", exist_ok=True)
                with open(spec.path(path), "w") as f:
                    f.writelines(lines[k] for k in part)
    spec.to_yaml(os.path.join(spec.base_dir, SPEC_FILE))


def _fields(spec: FeatureSpec, feature: str, column) -> list:
    """A column's CSV fields: ids and labels as integers, numericals to 7 digits, multi-hot
    (ids, row lengths) as ids joined by transcode's delimiter."""
    if spec.features[feature].multi_hot:
        ids, lengths = column
        return [DELIMITER.join(map(str, row)) for row in np.split(ids, np.cumsum(lengths)[:-1])]
    fmt = "%d" if feature in spec.categorical or feature in spec.labels else "%.7g"
    return [fmt % v for v in column]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--feature_spec_in", required=True, help="CSV feature spec (chunks of type csv)")
    parser.add_argument("--output", required=True, help="directory for the CSV files (the spec's paths are relative to it)")
    parser.add_argument("--rows", type=int, default=100000, help="rows of the train mapping")
    parser.add_argument("--eval_rows", type=int, default=10000, help="rows of every other mapping")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--alpha", type=float, default=1.05, help="power-law exponent of the ids (0: uniform)")
    args = parser.parse_args(argv)
    try:
        spec = FeatureSpec.from_yaml(args.feature_spec_in, chunk_type=CSV)
        spec.base_dir = args.output
        gen_csv(spec, args.rows, args.eval_rows, args.seed, args.alpha)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
