"""Streaming writer of split-binary files: what transcode.py, generate_dataset.py and the Criteo
preprocessor use to emit a dataset described by a FeatureSpec.

    spec = split_binary_spec(["num_0", "num_1"], {"cat_0": 1000}, base_dir=out)
    with MappingWriter(spec, "train") as w:
        w.write({"num_0": x0, "num_1": x1, "cat_0": ids, "label": y})   # any number of times
    spec.to_yaml(os.path.join(out, SPEC_FILE))

A multi-hot feature's column is a pair (ids, row lengths). Every column is checked (ids in
[0, cardinality), finite numericals, labels 0/1) before it is written; the files are written
under temporary names and renamed by `close`, so an interrupted run leaves no partial file
behind under a final name and a re-run never appends to old data.
"""
import os
from typing import Dict

import numpy as np

from dataloading.feature_spec import OFFSETS_DTYPE, FeatureSpec, check_values
from utils.errors import DatasetError


class MappingWriter:
    """Appends rows of one mapping to its files; each chunk of the mapping must have one file."""

    def __init__(self, spec: FeatureSpec, mapping: str):
        self.spec, self.mapping, self.rows = spec, mapping, 0
        self.chunks = spec.mapping(mapping)
        self._files, self._ends = {}, {}
        for chunk in self.chunks:
            if len(chunk.files) != 1:
                raise DatasetError(f"source_spec.{mapping}: MappingWriter writes one file per chunk, "
                                   f"got {chunk.files}")
            for path in chunk.files + chunk.offsets:
                os.makedirs(os.path.dirname(spec.path(path)) or ".", exist_ok=True)
                self._files[spec.path(path)] = open(spec.path(path) + ".tmp", "wb")
            if chunk.offsets:
                self._ends[chunk.features[0]] = 0
                np.zeros(1, OFFSETS_DTYPE).tofile(self._file(chunk.offsets[0]))

    def _file(self, path):
        return self._files[self.spec.path(path)]

    def write(self, columns: Dict[str, np.ndarray]):
        """Appends n rows: columns[feature] is [n] (multi-hot: (ids [K], row lengths [n]))."""
        n = None
        for chunk in self.chunks:
            for feature in chunk.features:
                column = columns[feature]
                rows = len(column[1]) if chunk.offsets else len(column)
                if n is not None and rows != n:
                    raise DatasetError(f"{self.mapping}: feature {feature!r} has {rows} rows in this write, "
                                       f"others {n}")
                n = rows
        for chunk in self.chunks:
            where = self.spec.path(chunk.files[0])
            dtype = self.spec.dtype(chunk.features[0])
            if chunk.offsets:
                ids, lengths = (np.asarray(a) for a in columns[chunk.features[0]])
                rows_of_ids = self.rows + np.repeat(np.arange(len(lengths)), lengths)
                check_values(self.spec, chunk.features[0], ids, rows_of_ids, where)
                ids.astype(dtype).tofile(self._file(chunk.files[0]))
                ends = self._ends[chunk.features[0]] + np.cumsum(lengths, dtype=OFFSETS_DTYPE)
                ends.tofile(self._file(chunk.offsets[0]))
                self._ends[chunk.features[0]] = int(ends[-1]) if len(ends) else self._ends[chunk.features[0]]
                continue
            block = np.empty([n, len(chunk.features)], dtype)
            for k, feature in enumerate(chunk.features):
                values = np.asarray(columns[feature])
                check_values(self.spec, feature, values, self.rows, where)
                block[:, k] = values
            block.tofile(self._file(chunk.files[0]))
        self.rows += n

    def close(self) -> int:
        """Renames the finished files to their final names; returns the rows written."""
        for path, f in self._files.items():
            f.close()
            os.replace(path + ".tmp", path)
        self._files = {}
        return self.rows

    def abort(self):
        for path, f in self._files.items():
            f.close()
            os.remove(path + ".tmp")
        self._files = {}

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if kind is None:
            self.close()
        else:
            self.abort()
