"""Spec-driven preprocessing of any CSV or Parquet log: a raw spec (YAML) -> split-binary dataset +
feature_spec.yaml, with the Criteo job's machinery (vocabularies and their growth, bad-line
reports, --strict, the same bytes whatever the partitioning).

    python -m preproc.raw --spec raw.yaml --output /data/clicks [--shuffle] [--vocab_from /data/earlier]
    spark-submit --master spark://host:7077 preproc/raw.py --spec /shared/raw.yaml --output /shared/clicks

See docs/preprocessing.md for the spec (a complete example) and the rules.
"""
import argparse
import sys

from preproc import raw_spec
from preproc.criteo import add_job_flags, execute, job_options
from preproc.pipeline import Options
from preproc.raw_source import RawSource


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spec", required=True, help="the raw spec (YAML): inputs, label, numerical, categorical, split")
    p.add_argument("--output", required=True,
                   help="dataset directory (feature_spec.yaml, train/ test/ validation/ vocab/)")
    add_job_flags(p, "NAME")
    return p


def options(args) -> Options:
    spec = raw_spec.load(args.spec)
    source = RawSource(spec)
    return Options(spec.paths, args.output, "fraction", spec.test, spec.validation, order=spec.order,
                   thresholds=[c.threshold for c in spec.categorical], source=source,
                   **job_options(args, source.schema.categorical))


def main(argv=None):
    args = parser().parse_args(argv)
    return execute(args, lambda: options(args))


if __name__ == "__main__":
    sys.exit(main())
