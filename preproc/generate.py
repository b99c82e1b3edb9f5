"""Criteo-format TSV generator for tests and benchmarks (the real logs cannot be downloaded here).

    python -m preproc.generate --output /tmp/criteo.tsv --rows 2000000 [--gz] [--bad_fraction 0.001]
                               [--value_effects C3:1,C4:1]

Lines `label, I1..I13, C1..C26`: categoricals are 8-digit hex hashes drawn with Zipf-like
frequencies from per-feature vocabularies of Criteo-like sizes (scaled by --vocab_scale);
integers are heavy-tailed counts, I2 also -1..-3; every feature is missing (empty) at its own
rate; labels (about 25% positive) depend on I1 and C1, so a model can learn something, and with
--value_effects also on the values of the columns it names: each value adds its own fixed effect
(unit variance, from its hash; missing: none) times the column's weight to the label's logit,
which only a model that learns that value's embedding can use (the same value, the same effect,
in every file and seed).
"""
import argparse
import gzip
import sys
from typing import Dict, Optional

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from preproc.parsing import CATEGORICAL_NAMES, INTEGER_NAMES

# Per-feature vocabulary sizes shaped like Criteo Kaggle's (scaled down by vocab_scale).
VOCAB = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
         5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def generate(rows: int, seed: int = 0, vocab_scale: float = 0.01, bad_fraction: float = 0.0,
             value_effects: Optional[Dict[str, float]] = None) -> pa.Table:
    """`rows` lines as a table of strings (None: missing); bad lines come as label 'x'.
    `value_effects`: column (C1..C26) -> weight of its values' effects on the label (none: the
    lines of a call without it, bit for bit)."""
    rng = np.random.default_rng(seed)
    columns = {}
    effects = np.zeros(rows)
    ints = np.floor(rng.lognormal(1.0, 1.6, size=(rows, 13))).astype(np.int64)
    ints[:, 1] -= rng.choice([0, 1, 2, 3], size=rows, p=[0.85, 0.1, 0.04, 0.01])   # I2: -1..-3 occur
    int_missing = rng.random((rows, 13)) < np.linspace(0.02, 0.45, 13)
    for k, name in enumerate(INTEGER_NAMES):
        columns[name] = pa.array(ints[:, k].astype(str), pa.string(), mask=int_missing[:, k])
    c1 = None
    for k, name in enumerate(CATEGORICAL_NAMES):
        size = max(2, int(VOCAB[k] * vocab_scale))
        ranks = np.minimum(rng.zipf(1.3, size=rows), size) - 1
        hashes = (_hash(np.arange(size, dtype=np.uint64) + np.uint64(k << 32)) >> np.uint64(32)).astype(np.uint32)
        values = np.char.mod("%08x", hashes)[ranks]
        missing = rng.random(rows) < (0.3 if k % 5 == 4 else 0.03)
        columns[name] = pa.array(values, pa.string(), mask=missing)
        c1 = ranks if k == 0 else c1
        if name in (value_effects or {}):   # uniform, unit variance, by the value's hash
            unit = (_hash(hashes.astype(np.uint64)) >> np.uint64(40)).astype(np.float64) / (1 << 24)
            effects += value_effects[name] * np.sqrt(12.0) * (unit[ranks] - 0.5) * ~missing
    logit = -1.6 + 0.25 * np.log1p(np.maximum(ints[:, 0], 0)) - 0.4 * (c1 % 3 == 0) + effects
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int8).astype(str)
    labels[rng.random(rows) < bad_fraction] = "x"
    return pa.table({"label": pa.array(labels), **columns})


def _hash(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(33))) * np.uint64(0xFF51AFD7ED558CCD)
    return x ^ (x >> np.uint64(29))


def write(table: pa.Table, path: str):
    """Tab-separated, no header, no quotes; empty fields for missing values; .gz by the name."""
    opts = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    if path.endswith(".gz"):
        with gzip.open(path, "wb", compresslevel=1) as f:
            pacsv.write_csv(table, f, opts)
    else:
        pacsv.write_csv(table, path, opts)


def parse_value_effects(text: str) -> Dict[str, float]:
    """--value_effects' "Ck:W,..." -> {Ck: W}; a bad entry: SystemExit, one line naming it."""
    effects = {}
    for entry in filter(None, text.split(",")):
        column, _, weight = entry.partition(":")
        try:
            if column not in CATEGORICAL_NAMES:
                raise ValueError
            effects[column] = float(weight)
        except ValueError:
            raise SystemExit(f"--value_effects entry {entry!r}: expected Ck:W with Ck one of C1..C26 and W a number")
    return effects


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="file to write (.gz: compressed)")
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab_scale", type=float, default=0.01, help="vocabulary sizes relative to Criteo Kaggle's")
    p.add_argument("--bad_fraction", type=float, default=0.0, help="share of lines with a bad label")
    p.add_argument("--value_effects", default="", help="Ck:W,...: the label also depends on these columns' values, "
                   "each value a fixed effect of weight W (for benchmarks of what embeddings learn)")
    args = p.parse_args(argv)
    effects = parse_value_effects(args.value_effects)
    chunk = 1 << 20
    tables = [generate(min(chunk, args.rows - s), args.seed + s, args.vocab_scale, args.bad_fraction, effects)
              for s in range(0, args.rows, chunk)]
    write(pa.concat_tables(tables), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
