"""Criteo preprocessing: raw TSV logs (plain or .gz) -> split-binary dataset + feature_spec.yaml.

    python -m preproc.criteo --input train.txt --output /data/criteo [--frequency_threshold=3]
    spark-submit --master spark://host:7077 preproc/criteo.py --input /shared/raw --output /shared/criteo

See docs/preprocessing.md for the rules, the layout and running on a cluster.
"""
import argparse
import os
import sys
import time
from fractions import Fraction

from preproc.layout import MAPPINGS
from preproc.parsing import CATEGORICAL_NAMES
from preproc.pipeline import Options, run
from preproc.session import spark_session
from preproc.sources import CATEGORICAL, CriteoSource
from utils import preemption
from utils.errors import ConfigError


def feature_index(name: str, names) -> int:
    """The index of categorical feature `name` in `names`; with the Criteo columns' names (C1..C26)
    also the name training gives it (cat_0..cat_25); -1 for none."""
    if name in names:
        return names.index(name)
    if names is CATEGORICAL_NAMES and name in CATEGORICAL:
        return CATEGORICAL.index(name)
    return -1


def known_features(names) -> str:
    return "C1..C26 or cat_0..cat_25" if names is CATEGORICAL_NAMES else ", ".join(names)


def _per_feature(flag: str, text: str, default, parse_default, parse_named, names=CATEGORICAL_NAMES):
    """'X' (every feature), 'C3:N,C20:N' (those), 'X,C3:N' (both) -> (X or `default`, {feature index: N});
    `names`: the categorical features' names in the flag (feature_index)."""
    named = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition(":")
        try:
            if not sep:
                default = parse_default(item)
            else:
                index = feature_index(name, names)
                if index < 0:
                    raise ConfigError(f"{flag}: {name!r} is not a categorical feature ({known_features(names)})")
                named[index] = parse_named(value)
        except (ValueError, ZeroDivisionError):
            raise ConfigError(f"{flag}: {item!r} is not X or Ck:N")
    return default, named


def parse_thresholds(text: str, raw_ids=()):
    """'3' (every feature), 'C3:5,C20:2' (those), '2,C3:5' (both): one threshold per C1..C26 (0
    for the features of `raw_ids`, indices, which have no vocabulary; naming one is an error)."""
    default, named = _per_feature("--frequency_threshold", text, 0, int, int)
    thresholds = [0 if k in raw_ids else named.get(k, default) for k in range(len(CATEGORICAL_NAMES))]
    if min(thresholds) < 0:
        raise ConfigError("--frequency_threshold: thresholds must be >= 0")
    _not_raw("--frequency_threshold", named, raw_ids, CATEGORICAL_NAMES)
    if raw_ids and len(raw_ids) == len(CATEGORICAL_NAMES):
        raise ConfigError("--frequency_threshold has no effect: every column has raw ids (--raw_id_columns)")
    return thresholds


def parse_raw_ids(text: str, names) -> list:
    """--raw_id_columns: 'all', or names of categorical features (`names`) -> their indices."""
    if text == "all":
        return list(range(len(names)))
    chosen = []
    for name in filter(None, text.split(",")):
        index = feature_index(name, names)
        if index < 0:
            raise ConfigError(f"--raw_id_columns: {name!r} is not a categorical feature ({known_features(names)}, "
                              "or all)")
        chosen.append(index)
    if not chosen:
        raise ConfigError("--raw_id_columns: name the columns (or all)")
    return sorted(set(chosen))


def _not_raw(flag: str, named, raw_ids, names):
    """Stops with one line if `flag` names (`named`: indices) a feature with raw ids."""
    clash = sorted(set(named) & set(raw_ids))
    if clash:
        raise ConfigError(f"{flag}: {names[clash[0]]} has raw ids (--raw_id_columns): no vocabulary to set")


def parse_capacity(text: str, names=CATEGORICAL_NAMES):
    """'1.5' (headroom factor of every feature), 'C3:1000000' (that feature's rows), or both ->
    (headroom, {feature index: rows})."""
    headroom, rows = _per_feature("--vocab_capacity", text, Fraction(1), Fraction, int, names)
    if headroom < 1 or min(rows.values(), default=1) < 1:
        raise ConfigError("--vocab_capacity: the headroom factor must be >= 1 and the rows positive")
    return headroom, rows


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="files or directories (day_0 ... day_23 or one file)")
    p.add_argument("--output", required=True, help="dataset directory (feature_spec.yaml, train/ test/ validation/ vocab/)")
    p.add_argument("--split", choices=["auto", "day", "fraction"], default="auto",
                   help="day: days 0..N-1 train, day N halves test/validation; fraction: in file order "
                        "(auto: day for several day_N files)")
    p.add_argument("--test_fraction", type=float, help="fraction split: test share (default 0.05)")
    p.add_argument("--validation_fraction", type=float, help="fraction split: validation share (default 0.05)")
    p.add_argument("--split_order", help="fraction split: the mappings in input order (default train,test,validation)")
    p.add_argument("--frequency_threshold",
                   help="values seen fewer times in training map to id 0: N, or Ck:N,..., or both (default 0; "
                        "with --vocab_from: the earlier vocabulary's)")
    add_job_flags(p, "Ck")
    return p


def add_job_flags(p, feature: str):
    """The flags of every preprocessing job (`feature`: how --vocab_capacity names a feature)."""
    p.add_argument("--vocab_capacity", default="1",
                   help="embedding rows per feature, fixed by the first dataset for later growth: a headroom "
                        f"factor F (ceil(F x ids)), or {feature}:ROWS,..., or both (default 1: no room to grow)")
    p.add_argument("--raw_id_columns", default="",
                   help=f"these categorical features ({feature},... or all) get raw ids: each value's 64-bit key as "
                        "an int64 id, no vocabulary (for dynamic tables)")
    p.add_argument("--shuffle", action="store_true", help="shuffle the training rows globally")
    p.add_argument("--seed", type=int, help="shuffle seed (default 12345)")
    p.add_argument("--vocab_from", default="",
                   help="encode with the vocabularies of this earlier output, grown by the new frequent values")
    p.add_argument("--freeze_vocab", action="store_true",
                   help="with --vocab_from: keep its vocabularies as they are (new values -> id 0)")
    p.add_argument("--strict", action="store_true", help="stop at bad lines instead of skipping them")
    p.add_argument("--master", help="Spark master (default: spark-submit's, else local[*])")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="Spark configuration")
    p.add_argument("--split_mb", type=int, default=128, help="task size for plain files (a .gz file is one task)")
    p.add_argument("--part_rows", type=int, default=1 << 24, help="rows per output part file")


def options(args) -> Options:
    if args.freeze_vocab and args.frequency_threshold is not None:
        raise ConfigError("--frequency_threshold has no effect with --freeze_vocab (the vocabularies are given)")
    fractions = {"test_fraction": args.test_fraction, "validation_fraction": args.validation_fraction}
    given = {k: v for k, v in fractions.items() if v is not None}
    if args.split == "day" and given:
        raise ConfigError(f"--{next(iter(given))} has no effect with --split=day")
    fractions = {k: 0.05 if v is None else v for k, v in fractions.items()}
    if min(fractions.values()) < 0 or sum(fractions.values()) >= 1:
        raise ConfigError("--test_fraction and --validation_fraction must be >= 0 and sum to less than 1")
    if args.split == "day" and args.split_order is not None:
        raise ConfigError("--split_order has no effect with --split=day")
    order = None if args.split_order is None else tuple(args.split_order.split(","))
    if order is not None and sorted(order) != sorted(MAPPINGS):
        raise ConfigError(f"--split_order: {args.split_order!r} is not train, test and validation in some order")
    raw_ids = parse_raw_ids(args.raw_id_columns, CATEGORICAL_NAMES) if args.raw_id_columns else []
    thresholds = None if args.frequency_threshold is None else parse_thresholds(args.frequency_threshold, raw_ids)
    return Options(args.input, args.output, args.split, thresholds=thresholds, fractions_given=bool(given),
                   order=order, source=CriteoSource([CATEGORICAL[k] for k in raw_ids]),
                   **job_options(args, CATEGORICAL_NAMES, raw_ids), **fractions)


def job_options(args, names, raw_ids, histories=()) -> dict:
    """The Options of the job flags (add_job_flags) but --raw_id_columns (parse_raw_ids: `raw_ids`,
    indices); `names`: the categorical features' names, `histories` (indices) those that are
    histories (preproc.raw), which have no vocabulary but continue from --vocab_from."""
    if args.freeze_vocab and not args.vocab_from:
        raise ConfigError("--freeze_vocab needs --vocab_from")
    if args.vocab_from and args.vocab_capacity != "1":
        raise ConfigError("--vocab_capacity has no effect with --vocab_from (the first dataset fixed the capacities)")
    if args.seed is not None and not args.shuffle:
        raise ConfigError("--seed has no effect without --shuffle")
    for flag in ("split_mb", "part_rows"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag} must be positive")
    if args.vocab_from and not os.path.isdir(os.path.join(args.vocab_from, "vocab")):
        raise ConfigError(f"--vocab_from {args.vocab_from}: no vocab/ directory there")
    headroom, capacity_rows = parse_capacity(args.vocab_capacity, names)
    _not_raw("--vocab_capacity", capacity_rows, raw_ids, names)
    if len(raw_ids) + len(histories) == len(names):
        given = [f for f in ("freeze_vocab",) + ("vocab_from",) * (not histories) if getattr(args, f)] + \
            ["vocab_capacity"] * (args.vocab_capacity != "1")
        if given:
            raise ConfigError(f"--{given[0]} has no effect: every column has raw ids (--raw_id_columns)")
    return dict(headroom=headroom, capacity_rows=capacity_rows, shuffle=args.shuffle,
                seed=12345 if args.seed is None else args.seed, vocab_from=args.vocab_from,
                freeze_vocab=args.freeze_vocab, strict=args.strict, split_bytes=args.split_mb << 20,
                part_rows=args.part_rows)


def main(argv=None):
    args = parser().parse_args(argv)
    return execute(args, lambda: options(args))


def execute(args, make_options) -> int:
    """Runs the job of `make_options()` (Options) on the Spark of the job flags; prints its summary.
    SIGTERM/SIGINT: one line and exit code 143/130, the job's temporary folder removed."""
    return preemption.exit_on_signal(lambda: _execute(args, make_options),
                                     f"preprocessing into {args.output} unfinished (its temporary files removed)")


def _execute(args, make_options) -> int:
    try:
        opts = make_options()
        if any("=" not in item for item in args.conf):
            raise ConfigError("--conf takes KEY=VALUE")
        conf = dict(item.split("=", 1) for item in args.conf)
        start = time.time()
        spark = spark_session(args.master, conf)
        summary = run(spark, opts)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = ", ".join(f"{m} {n}" for m, n in summary["rows"].items())
    print(f"wrote {args.output}: {rows} rows, {summary['bad_lines']} bad lines skipped, "
          f"{time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
