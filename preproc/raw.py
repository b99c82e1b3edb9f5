"""Spec-driven preprocessing of any CSV or Parquet log: a raw spec (YAML) -> split-binary dataset +
feature_spec.yaml, with the Criteo job's machinery (vocabularies and their growth, bad-line
reports, --strict, the same bytes whatever the partitioning).

    python -m preproc.raw --spec raw.yaml --output /data/clicks [--shuffle] [--vocab_from /data/earlier]
    spark-submit --master spark://host:7077 preproc/raw.py --spec /shared/raw.yaml --output /shared/clicks

See docs/preprocessing.md for the spec (a complete example) and the rules.
"""
import argparse
import sys

from preproc import history, raw_spec
from preproc.criteo import add_job_flags, execute, job_options, parse_raw_ids
from preproc.pipeline import Options
from preproc.raw_source import RawSource
from utils.errors import ConfigError


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spec", required=True, help="the raw spec (YAML): inputs, label, numerical, categorical, split")
    p.add_argument("--output", required=True,
                   help="dataset directory (feature_spec.yaml, train/ test/ validation/ vocab/)")
    add_job_flags(p, "NAME")
    return p


def options(args) -> Options:
    spec = raw_spec.load(args.spec)
    names = [c.name for c in spec.categorical]
    raw_ids = parse_raw_ids(args.raw_id_columns, names) if args.raw_id_columns else []
    histories = {k for k, c in enumerate(spec.categorical) if c.history}
    named = sorted(histories & set(raw_ids)) if args.raw_id_columns != "all" else []
    if named:
        c = spec.categorical[named[0]]
        raise ConfigError(f"--raw_id_columns: {c.name} is a history in {args.spec}: " + (
            f"its ids are time gaps, 1 to {history.GAP_IDS - 1}" if c.history.gaps else
            f"it has the ids of {c.history.of} (raw when {c.history.of} is in --raw_id_columns)"))
    raw_ids = [k for k in raw_ids if k not in histories]
    for k in raw_ids:
        c = spec.categorical[k]
        if c.buckets or c.threshold:
            raise ConfigError(f"--raw_id_columns: {c.name} has {'buckets' if c.buckets else 'a threshold'} in "
                              f"{args.spec} (raw ids have no vocabulary and no hashing into buckets)")
    source = RawSource(spec, [names[k] for k in raw_ids])
    job = job_options(args, names, raw_ids, histories)
    sized = sorted(histories & set(job["capacity_rows"]))
    if sized:
        c = spec.categorical[sized[0]]
        raise ConfigError(f"--vocab_capacity: {c.name} is a history in {args.spec}: " + (
            f"its ids are time gaps, 1 to {history.GAP_IDS - 1}" if c.history.gaps else
            f"it has the capacity of {c.history.of}"))
    return Options(spec.paths, args.output, "fraction", spec.test, spec.validation, order=spec.order,
                   thresholds=[c.threshold for c in spec.categorical], source=source,
                   **job)


def main(argv=None):
    args = parser().parse_args(argv)
    return execute(args, lambda: options(args))


if __name__ == "__main__":
    sys.exit(main())
