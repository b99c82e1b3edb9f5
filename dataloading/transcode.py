"""Converts CSV files described by a feature spec into a split-binary dataset and its spec.

    python dataloading/transcode.py --input DIR [--feature_spec_in SPEC] --output DIR [--chunk_size ROWS]
        [--header] [--multi_hot_delimiter '|']

The input spec (default DIR/feature_spec.yaml; its paths are relative to --input) has chunks
of `type: csv`: comma-separated files whose columns are the chunk's features in order (with
--header, each file's first line names them and is skipped); a chunk's files hold consecutive
rows, and all chunks of a mapping the same rows. A multi-hot feature (one with max_hotness)
is a field of ids joined by the delimiter (`3|17|42`; empty: no ids), in any chunk.
Categorical cardinalities may be `auto` (the largest id seen in any mapping, plus one); an
empty numerical field reads as 0 (labels and one-hot ids must be there). The output is the
standard layout of dataloading.feature_spec.split_binary_spec: ids in the smallest integer
dtype that holds the cardinality, multi-hot ids with their offsets, numericals float16
(float32 if the input spec declares any numerical float32), bool labels. A line with the
wrong number of columns, a value that is not a number, an id outside [0, cardinality), a
multi-hot field of more than max_hotness ids, a non-finite numerical or a label other than
0/1 stops the conversion with one line naming the file, feature and line. Files are written
under temporary names and renamed when complete, the spec last: re-running replaces, never
appends.
"""
import argparse
import itertools
import os
import sys
from typing import Dict, Iterator, List

import numpy as np

from dataloading.feature_spec import (AUTO, CATEGORICAL, CSV, NUMERICAL, SPEC_FILE, Chunk,
                                      FeatureSpec, check_values, split_binary_spec)
from dataloading.writer import MappingWriter
from utils.errors import DatasetError

DELIMITER = "|"   # joins the ids of a multi-hot field


def _numbers(table: list, lines, columns: List[int], path: str) -> np.ndarray:
    """Rows of number strings -> [rows, len(columns)] float64, naming the file, line (lines[k]:
    row k's) and column (columns[j]: field j's, from 0) of the first that is not a number."""
    try:
        return np.array(table, np.float64).reshape(len(table), len(columns))
    except ValueError:
        for k, row in enumerate(table):
            for j, value in enumerate(row):
                try:
                    float(value)
                except ValueError:
                    raise DatasetError(f"{path}: line {lines[k]}, column {columns[j] + 1}: {value!r} is not a number")
        raise


def _parse(lines: List[str], path: str, first_line: int, spec: FeatureSpec, chunk: Chunk, delimiter: str,
           check: bool) -> Dict[str, np.ndarray]:
    """CSV lines -> by feature: [n] float64 (an empty numerical field reads as 0), or for a
    multi-hot feature an [n] object array of float64 id arrays (an empty field: no ids). Ids must
    be integers and multi-hot rows have at most max_hotness ids; with `check`, every value is
    checked against `spec`. Errors name the file, line (and feature or column)."""
    rows = [line.rstrip("\r\n").split(",") for line in lines]
    width = len(chunk.features)
    for k, row in enumerate(rows):
        if len(row) != width:
            raise DatasetError(f"{path}: line {first_line + k}: {len(row)} columns, the spec's chunk has {width}")
    line_of_row = first_line + np.arange(len(rows))
    hot = [spec.features[f].max_hotness for f in chunk.features]
    scalar = [j for j in range(width) if not hot[j]]
    table = rows if len(scalar) == width else [[row[j] for j in scalar] for row in rows]
    try:
        numbers = np.array(table, np.float64).reshape(len(rows), len(scalar))
    except ValueError:   # empty numerical fields (they read as 0), or a value to name
        zero = [chunk.features[j] in spec.channels[NUMERICAL] for j in scalar]
        table = [[v or ("0" if z else v) for v, z in zip(row, zero)] for row in table]
        numbers = _numbers(table, line_of_row, scalar, path)
    columns = {}
    for j, feature in enumerate(chunk.features):
        if hot[j]:
            field = [row[j] for row in rows]
            lengths = np.array([ids.count(delimiter) + 1 if ids else 0 for ids in field], np.int64)
            joined = delimiter.join(ids for ids in field if ids)
            lines_of = np.repeat(line_of_row, lengths)
            values = _numbers([[v] for v in joined.split(delimiter)] if joined else [], lines_of, [j], path)[:, 0]
            if np.any(lengths > hot[j]):
                k = int(np.argmax(lengths > hot[j]))
                raise DatasetError(f"{path}: feature {feature!r}, line {line_of_row[k]}: {lengths[k]} ids, more "
                                   f"than its max_hotness {hot[j]}")
        else:
            values, lines_of = numbers[:, scalar.index(j)], line_of_row
        if feature in spec.channels[CATEGORICAL] and np.any(values != np.floor(values)):
            k = int(np.argmax(values != np.floor(values)))
            raise DatasetError(f"{path}: feature {feature!r}, line {lines_of[k]}: ids must be integers, got {values[k]}")
        if check:
            check_values(spec, feature, values, lines_of, path, unit="line")
        columns[feature] = _object_rows(values, lengths) if hot[j] else values
    return columns


def _object_rows(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[n] object array of the rows' values (row i: the next lengths[i] of `values`)."""
    rows = np.empty(len(lengths), object)
    for i, row in enumerate(np.split(values, np.cumsum(lengths)[:-1]) if len(lengths) else []):
        rows[i] = row
    return rows


def _as_written(column: np.ndarray):
    """A column as MappingWriter takes it: multi-hot object rows become (ids, row lengths)."""
    if column.dtype != object:
        return column
    return np.concatenate([np.zeros(0), *column]), np.array([len(row) for row in column], np.int64)


def read_chunk(spec: FeatureSpec, chunk: Chunk, block: int, check: bool, header: bool = False,
               delimiter: str = DELIMITER) -> Iterator[Dict[str, np.ndarray]]:
    """Blocks of `block` rows (the last may be shorter) of a chunk's CSV files in order, by
    feature (see _parse); `header`: each file's first line names the columns and is skipped."""
    pending, have = [], 0
    for path in map(spec.path, chunk.files):
        try:
            f = open(path)
        except OSError as e:
            raise DatasetError(f"cannot read {path}: {e.strerror}")
        with f:
            line = 1 + int(header and bool(f.readline()))
            while True:
                lines = list(itertools.islice(f, block))
                if not lines:
                    break
                pending.append(_parse(lines, path, line, spec, chunk, delimiter, check))
                line += len(lines)
                have += len(lines)
                while have >= block:
                    stacked = {name: np.concatenate([p[name] for p in pending]) for name in chunk.features}
                    yield {name: c[:block] for name, c in stacked.items()}
                    pending, have = [{name: c[block:] for name, c in stacked.items()}], have - block
    if have:
        yield {name: np.concatenate([p[name] for p in pending]) for name in chunk.features}


def _blocks(spec: FeatureSpec, mapping: str, block: int, check: bool, header: bool = False,
            delimiter: str = DELIMITER) -> Iterator[Dict[str, np.ndarray]]:
    """The mapping's rows in blocks, by feature name (multi-hot: (ids, row lengths)), reading all
    chunks in step."""
    chunks = spec.mapping(mapping)
    readers = [read_chunk(spec, c, block, check, header, delimiter) for c in chunks]
    for parts in itertools.zip_longest(*readers):
        rows = [len(next(iter(p.values()))) if p is not None else 0 for p in parts]
        if len(set(rows)) > 1:
            counts = ", ".join(f"{c.files} {'ended' if p is None else n}" for c, p, n in zip(chunks, parts, rows))
            raise DatasetError(f"source_spec.{mapping}: the chunks' files have unequal row counts ({counts})")
        yield {f: _as_written(column) for p in parts for f, column in p.items()}


def infer_cardinalities(spec: FeatureSpec, block: int, header: bool = False, delimiter: str = DELIMITER) -> Dict[str, int]:
    """Cardinality of every categorical feature: the spec's, or for `auto` the largest id + 1."""
    cards = {f: spec.features[f].cardinality for f in spec.categorical}
    auto = [f for f, c in cards.items() if c == AUTO]
    if auto:
        largest = dict.fromkeys(auto, -1)
        for mapping in spec.source:
            for columns in _blocks(spec, mapping, block, False, header, delimiter):
                for f in auto:
                    ids = columns[f][0] if isinstance(columns[f], tuple) else columns[f]
                    if len(ids):
                        largest[f] = max(largest[f], int(ids.max()))
        cards.update({f: largest[f] + 1 for f in auto})
        empty = [f for f in auto if cards[f] < 1]
        if empty:
            raise DatasetError(f"feature {empty[0]!r}: cardinality auto, but there are no ids to infer it from")
    return cards


def transcode(input_dir: str, spec_path: str, output_dir: str, block: int = 1 << 16, header: bool = False,
              delimiter: str = DELIMITER) -> FeatureSpec:
    """Converts every mapping of the CSV spec at `spec_path`; returns the written spec. `header`:
    every CSV file starts with a header line (skipped); `delimiter` joins a multi-hot field's ids."""
    if delimiter in ("", ",") or "\n" in delimiter:
        raise DatasetError(f"the multi-hot delimiter must be a non-empty string other than a comma, got {delimiter!r}")
    spec = FeatureSpec.from_yaml(spec_path, chunk_type=CSV)
    spec.base_dir = input_dir
    for f, cardinality in infer_cardinalities(spec, block, header, delimiter).items():   # ids are checked against these
        spec.features[f].cardinality = cardinality
    float32 = any(spec.features[n].dtype == "float32" for n in spec.numerical)
    out = split_binary_spec(spec.numerical, dict(zip(spec.categorical, spec.cardinalities)), spec.labels,
                            list(spec.source), max_hotness={f: h for f, h in zip(spec.categorical, spec.max_hotness) if h},
                            numerical_dtype="float32" if float32 else "float16", base_dir=output_dir)
    out.metadata = dict(spec.metadata)
    for mapping in spec.source:
        with MappingWriter(out, mapping) as writer:
            for columns in _blocks(spec, mapping, block, True, header, delimiter):
                writer.write(columns)
    out.to_yaml(os.path.join(output_dir, SPEC_FILE))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="directory of the CSV files (the spec's paths are relative to it)")
    parser.add_argument("--feature_spec_in", default="", help="CSV feature spec (default: INPUT/feature_spec.yaml)")
    parser.add_argument("--output", required=True, help="directory for the split-binary files and feature_spec.yaml")
    parser.add_argument("--chunk_size", type=int, default=1 << 16, help="rows converted at a time (memory vs speed)")
    parser.add_argument("--header", action="store_true", help="every CSV file starts with a header line (skipped)")
    parser.add_argument("--multi_hot_delimiter", default=DELIMITER, help="joins the ids inside a multi-hot field")
    args = parser.parse_args(argv)
    try:
        os.makedirs(args.output, exist_ok=True)
        spec = transcode(args.input, args.feature_spec_in or os.path.join(args.input, SPEC_FILE), args.output,
                         args.chunk_size, args.header, args.multi_hot_delimiter)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {os.path.join(args.output, SPEC_FILE)}: cardinalities {spec.cardinalities}")


if __name__ == "__main__":
    main()
