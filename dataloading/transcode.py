"""Converts CSV files described by a feature spec into a split-binary dataset and its spec.

    python dataloading/transcode.py --input DIR [--feature_spec_in SPEC] --output DIR [--chunk_size ROWS]

The input spec (default DIR/feature_spec.yaml; its paths are relative to --input) has chunks
of `type: csv`: headerless comma-separated files whose columns are the chunk's features in
order; a chunk's files hold consecutive rows, and all chunks of a mapping the same rows.
Categorical cardinalities may be `auto` (the largest id seen in any mapping, plus one);
numerical and label features may have empty entries. The output is the standard layout of
dataloading.feature_spec.split_binary_spec: ids in the smallest integer dtype that holds the
cardinality, numericals float16 (float32 if the input spec declares any numerical float32),
bool labels. A line with the wrong number of columns, a value that is not a number, an id
outside [0, cardinality), a non-finite numerical or a label other than 0/1 stops the
conversion with one line naming the file, feature and line. Files are written under
temporary names and renamed when complete, the spec last: re-running replaces, never appends.
"""
import argparse
import itertools
import os
import sys
from typing import Dict, Iterator, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from dataloading.feature_spec import (AUTO, CATEGORICAL, CSV, SPEC_FILE, Chunk, DatasetError,  # noqa: E402
                                      FeatureSpec, check_values, split_binary_spec)
from dataloading.writer import MappingWriter  # noqa: E402


def _parse(lines: List[str], path: str, first_line: int, width: int) -> np.ndarray:
    """CSV lines -> [n, width] float64, naming the file and line of the first bad one."""
    rows = [line.rstrip("\r\n").split(",") for line in lines]
    for k, row in enumerate(rows):
        if len(row) != width:
            raise DatasetError(f"{path}: line {first_line + k}: {len(row)} columns, the spec's chunk has {width}")
    try:
        return np.array(rows, dtype=np.float64).reshape(len(rows), width)
    except ValueError:
        for k, row in enumerate(rows):
            for j, value in enumerate(row):
                try:
                    float(value)
                except ValueError:
                    raise DatasetError(f"{path}: line {first_line + k}, column {j + 1}: {value!r} is not a number")
        raise


def read_chunk(spec: FeatureSpec, chunk: Chunk, block: int, check: bool) -> Iterator[np.ndarray]:
    """[block, features] float64 blocks (the last may be shorter) of a chunk's CSV files in
    order; with `check`, every value is checked against `spec` (naming file, feature, line)."""
    pending, have = [], 0
    for path in map(spec.path, chunk.files):
        try:
            f = open(path)
        except OSError as e:
            raise DatasetError(f"cannot read {path}: {e.strerror}")
        with f:
            line = 1
            while True:
                lines = list(itertools.islice(f, block))
                if not lines:
                    break
                values = _parse(lines, path, line, len(chunk.features))
                for j, feature in enumerate(chunk.features):
                    if feature in spec.channels[CATEGORICAL] and np.any(values[:, j] != np.floor(values[:, j])):
                        k = int(np.argmax(values[:, j] != np.floor(values[:, j])))
                        raise DatasetError(f"{path}: feature {feature!r}, line {line + k}: ids must be "
                                           f"integers, got {values[k, j]}")
                    if check:
                        check_values(spec, feature, values[:, j], line, path, unit="line")
                line += len(lines)
                pending.append(values)
                have += len(values)
                while have >= block:
                    stacked = np.concatenate(pending)
                    yield stacked[:block]
                    pending, have = [stacked[block:]], have - block
    if have:
        yield np.concatenate(pending)


def _blocks(spec: FeatureSpec, mapping: str, block: int, check: bool) -> Iterator[Dict[str, np.ndarray]]:
    """The mapping's rows in blocks, by feature name, reading all chunks in step."""
    chunks = spec.mapping(mapping)
    readers = [read_chunk(spec, c, block, check) for c in chunks]
    for parts in itertools.zip_longest(*readers):
        sizes = {len(p) if p is not None else 0 for p in parts}
        if len(sizes) > 1:
            counts = ", ".join(f"{c.files} {'ended' if p is None else len(p)}" for c, p in zip(chunks, parts))
            raise DatasetError(f"source_spec.{mapping}: the chunks' files have unequal row counts ({counts})")
        yield {f: p[:, j] for c, p in zip(chunks, parts) for j, f in enumerate(c.features)}


def infer_cardinalities(spec: FeatureSpec, block: int) -> Dict[str, int]:
    """Cardinality of every categorical feature: the spec's, or for `auto` the largest id + 1."""
    cards = {f: spec.features[f].cardinality for f in spec.categorical}
    auto = [f for f, c in cards.items() if c == AUTO]
    if auto:
        largest = dict.fromkeys(auto, -1)
        for mapping in spec.source:
            for columns in _blocks(spec, mapping, block, check=False):
                for f in auto:
                    if len(columns[f]):
                        largest[f] = max(largest[f], int(columns[f].max()))
        cards.update({f: largest[f] + 1 for f in auto})
        empty = [f for f in auto if cards[f] < 1]
        if empty:
            raise DatasetError(f"feature {empty[0]!r}: cardinality auto, but there are no ids to infer it from")
    return cards


def transcode(input_dir: str, spec_path: str, output_dir: str, block: int = 1 << 16) -> FeatureSpec:
    """Converts every mapping of the CSV spec at `spec_path`; returns the written spec."""
    spec = FeatureSpec.from_yaml(spec_path, chunk_type=CSV)
    spec.base_dir = input_dir
    for f, cardinality in infer_cardinalities(spec, block).items():   # ids are checked against these
        spec.features[f].cardinality = cardinality
    float32 = any(spec.features[n].dtype == "float32" for n in spec.numerical)
    out = split_binary_spec(spec.numerical, dict(zip(spec.categorical, spec.cardinalities)), spec.label,
                            list(spec.source), numerical_dtype="float32" if float32 else "float16",
                            base_dir=output_dir)
    out.metadata = dict(spec.metadata)
    for mapping in spec.source:
        with MappingWriter(out, mapping) as writer:
            for columns in _blocks(spec, mapping, block, check=True):
                writer.write(columns)
    out.to_yaml(os.path.join(output_dir, SPEC_FILE))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="directory of the CSV files (the spec's paths are relative to it)")
    parser.add_argument("--feature_spec_in", default="", help="CSV feature spec (default: INPUT/feature_spec.yaml)")
    parser.add_argument("--output", required=True, help="directory for the split-binary files and feature_spec.yaml")
    parser.add_argument("--chunk_size", type=int, default=1 << 16, help="rows converted at a time (memory vs speed)")
    args = parser.parse_args(argv)
    try:
        os.makedirs(args.output, exist_ok=True)
        spec = transcode(args.input, args.feature_spec_in or os.path.join(args.input, SPEC_FILE), args.output,
                         args.chunk_size)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {os.path.join(args.output, SPEC_FILE)}: cardinalities {spec.cardinalities}")


if __name__ == "__main__":
    main()
