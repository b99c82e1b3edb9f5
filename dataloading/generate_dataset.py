"""Writes a synthetic split-binary dataset of any size in the layout of a feature spec.

    python dataloading/generate_dataset.py --feature_spec layout.yaml --output DIR \\
        --rows 1000000 --eval_rows 100000 [--seed 12345] [--alpha 1.05]

The samples are SyntheticDataset's (dataloading/synthetic.py) for the spec's cardinalities,
numerical count and labels (H labels: SyntheticDataset's `labels` H, in the spec's order):
mapping "train" holds training samples [0, rows), every other mapping the next `eval_rows`
evaluation samples. With float32 numericals the files hold exactly what
`--dataset_type=synthetic` generates (float16 rounds the numericals), so a file run can be
checked against a synthetic one. Multi-hot features get SyntheticDataset.multi_hot ids.
Written in blocks (streaming; any size fits in memory), under temporary names, then renamed;
the spec goes to DIR/feature_spec.yaml last.
"""
import argparse
import os
import sys
from typing import Dict

from dataloading.feature_spec import SPEC_FILE, FeatureSpec
from dataloading.synthetic import SyntheticDataset
from dataloading.writer import MappingWriter
from utils.errors import DatasetError


def synthetic_sources(spec: FeatureSpec, rows: int, eval_rows: int) -> Dict[str, tuple]:
    """mapping -> (synthetic split, first sample, rows): "train" from the training samples, the
    other mappings from consecutive ranges of evaluation samples."""
    sources, offset = {}, 0
    for mapping in spec.source:
        if mapping == "train":
            sources[mapping] = ("train", 0, rows)
        else:
            sources[mapping] = ("eval", offset, eval_rows)
            offset += eval_rows
    return sources


def synthetic_columns(spec: FeatureSpec, data: SyntheticDataset, split: str, start: int, n: int) -> dict:
    """The spec's features of synthetic samples [start, start + n), by feature name."""
    batch = data.batch(split, start, n)
    columns = {name: batch["numerical"][:, k] for k, name in enumerate(spec.numerical)}
    labels = batch["labels"].reshape(n, len(spec.labels))
    columns.update({name: labels[:, h] for h, name in enumerate(spec.labels)})
    for f, (name, hot) in enumerate(zip(spec.categorical, spec.max_hotness)):
        columns[name] = data.multi_hot(split, start, n, f, hot) if hot else batch["categorical"][f]
    return columns


def generate(spec: FeatureSpec, rows: int, eval_rows: int, seed: int, alpha: float, block: int = 1 << 18):
    """Writes every mapping of `spec` (paths relative to spec.base_dir) and the spec itself."""
    data = SyntheticDataset(spec.cardinalities, len(spec.numerical), alpha, seed, labels=len(spec.labels))
    for mapping, (split, first, n) in synthetic_sources(spec, rows, eval_rows).items():
        with MappingWriter(spec, mapping) as writer:
            for start in range(first, first + n, block):
                writer.write(synthetic_columns(spec, data, split, start, min(block, first + n - start)))
    spec.metadata = dict(spec.metadata, generated_by="dataloading/generate_dataset.py", seed=seed, alpha=alpha)
    spec.to_yaml(os.path.join(spec.base_dir, SPEC_FILE))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--feature_spec", required=True, help="split-binary spec whose layout to write")
    parser.add_argument("--output", required=True, help="dataset directory (the spec's paths are relative to it)")
    parser.add_argument("--rows", type=int, required=True, help="samples of the train mapping")
    parser.add_argument("--eval_rows", type=int, required=True, help="samples of every other mapping")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--alpha", type=float, default=1.05, help="power-law exponent of the ids (0: uniform)")
    args = parser.parse_args(argv)
    try:
        spec = FeatureSpec.from_yaml(args.feature_spec)
        spec.base_dir = args.output
        os.makedirs(args.output, exist_ok=True)
        generate(spec, args.rows, args.eval_rows, args.seed, args.alpha)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
