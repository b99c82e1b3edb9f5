"""Random-access reader of split-binary datasets (see dataloading/feature_spec.py for the layout).

Every file is memory-mapped; a read of rows [start, start + n) slices the maps and decodes
whole columns at once (float16 -> float32, bool -> float32, ids -> one int dtype), so a batch
costs a few vectorised copies and no per-sample Python. Opening a dataset makes the cheap
checks (files exist, sizes are whole records, all chunks of a mapping have the same rows,
offsets files start at 0 and end at their ids' count); `validate` scans every value. Every
batch read is checked (ids in [0, cardinality) before the cast to the model's id dtype, finite
numericals, 0/1 labels), naming the file, feature and row of a bad value as `validate` does.
The ids come as int32, or int64 for all features when a cardinality needs it or a feature holds
raw 64-bit ids (`raw_ids: true`, int64 on disk, every value in its domain).
"""
import os
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from dataloading.feature_spec import OFFSETS_DTYPE, Chunk, FeatureSpec, check_values, in_domain, violations
from utils.errors import DatasetError


class RaggedIds(NamedTuple):
    """Multi-hot ids of n rows: row i is values[row_splits[i]:row_splits[i + 1]]."""
    values: np.ndarray       # [K]
    row_splits: np.ndarray   # [n + 1] int64, starting at 0


def _map(path: str, dtype: np.dtype, width: int = 1) -> np.ndarray:
    """The file as a read-only [records, width] (width 1: [records]) array, after checking its size."""
    if not os.path.isfile(path):
        raise DatasetError(f"missing file {path}")
    size, record = os.path.getsize(path), dtype.itemsize * width
    if size % record:
        raise DatasetError(f"{path}: size {size} bytes is not a multiple of the record size {record} "
                           f"({width} x {dtype.name})")
    shape = (size // record, width) if width > 1 else (size // record,)
    # A plain ndarray view of the map: NumPy's memmap subclass makes every slice and reduction of
    # a batch (the per-batch checks) several times slower.
    return np.asarray(np.memmap(path, dtype, "r", shape=shape)) if size else np.zeros(shape, dtype)


class ChunkReader:
    """The rows of one chunk, over all of its files (parts)."""

    def __init__(self, spec: FeatureSpec, chunk: Chunk):
        self.chunk, self.features, self.multi_hot = chunk, chunk.features, bool(chunk.offsets)
        dtype = spec.dtype(chunk.features[0])
        self.dtype = np.dtype(np.uint8) if dtype == np.bool_ else dtype   # labels: 0/1 bytes, checked
        self.paths = [spec.path(f) for f in chunk.files]
        if chunk.offsets:
            self.values = [_map(p, self.dtype) for p in self.paths]
            self.offsets = [_map(spec.path(p), OFFSETS_DTYPE) for p in chunk.offsets]
            for path, values, offsets in zip(chunk.offsets, self.values, self.offsets):
                if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(values):
                    raise DatasetError(f"{spec.path(path)}: feature {chunk.features[0]!r}: offsets must run from 0 "
                                       f"to the {len(values)} ids of its values file, got "
                                       f"{offsets[0] if len(offsets) else 'no offsets'}..{offsets[-1] if len(offsets) else ''}")
            counts = [len(o) - 1 for o in self.offsets]
        else:
            self.parts = [_map(p, self.dtype, len(chunk.features)) for p in self.paths]
            counts = [len(p) for p in self.parts]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.rows = int(self.starts[-1])

    def locate(self, row: int):
        """(path of the file holding row `row` of the chunk, its row within that file)."""
        k = int(np.searchsorted(self.starts, row, side="right")) - 1
        return self.paths[k], row - int(self.starts[k])

    def _pieces(self, start: int, n: int):
        """(part, first row in part, rows) covering rows [start, start + n)."""
        end, k = start + n, int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < end:
            take = min(end, int(self.starts[k + 1])) - start
            yield k, start - int(self.starts[k]), take
            start += take
            k += 1

    def read(self, start: int, n: int) -> np.ndarray:
        """Rows [start, start + n) as [n, features] (a view when they lie in one file)."""
        pieces = [self.parts[k][s:s + m] for k, s, m in self._pieces(start, n)]
        if len(pieces) == 1:
            return pieces[0].reshape(n, -1)
        return np.concatenate([p.reshape(len(p), -1) for p in pieces] or [np.zeros([0, len(self.features)], self.dtype)])

    def read_ragged(self, start: int, n: int) -> RaggedIds:
        values, splits, total = [], [np.zeros(1, np.int64)], 0
        for k, s, m in self._pieces(start, n):
            o = np.asarray(self.offsets[k][s:s + m + 1])
            values.append(self.values[k][o[0]:o[-1]])
            splits.append(o[1:] - o[0] + total)
            total += int(o[-1] - o[0])
        return RaggedIds(np.concatenate(values) if values else np.zeros(0, self.dtype), np.concatenate(splits))


class SplitBinaryDataset:
    """Random-access dataset over the split-binary files of `spec`; `mappings` names the spec's
    mapping read for each split ("train", "eval"). Same interface as SyntheticDataset (without
    an oracle): `batch`, `categorical`, `rows`, `label_names` (the spec's labels). `check`: test
    every value read (see `_check`)."""
    has_oracle = False

    def __init__(self, spec: FeatureSpec, mappings: Dict[str, str], check: bool = True):
        self.spec, self.mappings, self.check = spec, dict(mappings), check
        self.cardinalities = spec.cardinalities
        self.max_hotness = spec.max_hotness
        self.num_numerical = len(spec.numerical)
        self.label_names = spec.labels
        # int32 unless a cardinality needs int64, or a feature holds raw 64-bit ids (then int64 for all)
        wide = spec.raw_id_features or max(self.cardinalities) - 1 > np.iinfo(np.int32).max
        self.id_dtype = np.int64 if wide else np.int32
        self._readers = {split: self._open(mapping) for split, mapping in self.mappings.items()}

    def _open(self, mapping: str) -> Dict[str, ChunkReader]:
        readers = {}
        for chunk in self.spec.mapping(mapping):
            reader = ChunkReader(self.spec, chunk)
            readers.update(dict.fromkeys(chunk.features, reader))
        first = next(iter(readers.values()))
        for reader in readers.values():
            if reader.rows != first.rows:
                raise DatasetError(f"source_spec.{mapping}: {first.paths} hold {first.rows} rows "
                                   f"(feature {first.features[0]!r}) but {reader.paths} hold {reader.rows} "
                                   f"(feature {reader.features[0]!r})")
        return readers

    def rows(self, split: str) -> int:
        return next(iter(self._readers[split].values())).rows

    def _check(self, split: str, feature: str, values: np.ndarray, start: int, row_splits=None):
        """Raises DatasetError naming the file, feature and row (as `validate`) of the first value
        of `feature` out of its domain; `values` [n] are rows [start, start + n) of `split` or,
        multi-hot, split into rows by `row_splits`."""
        if not self.check or in_domain(self.spec, feature, values):
            return
        k = int(np.argmax(violations(self.spec, feature, values)[0]))
        row = k if row_splits is None else int(np.searchsorted(row_splits, k, side="right")) - 1
        path, row = self._readers[split][feature].locate(start + row)
        check_values(self.spec, feature, values[k:k + 1], row, path)

    def _column(self, split: str, feature: str, start: int, n: int) -> np.ndarray:
        reader = self._readers[split][feature]
        column = reader.read(start, n)[:, reader.features.index(feature)]
        self._check(split, feature, column, start)
        return column

    def _numerical(self, split: str, start: int, n: int) -> np.ndarray:
        out = np.empty([n, self.num_numerical], np.float32)
        names = self.spec.numerical
        done = set()
        for k, name in enumerate(names):
            reader = self._readers[split][name]
            if id(reader) in done:
                continue
            done.add(id(reader))
            block = reader.read(start, n)
            for j, feature in enumerate(reader.features):
                if feature in names:
                    out[:, names.index(feature)] = block[:, j]
        if self.check and not np.isfinite(out).all():
            i, j = np.argwhere(~np.isfinite(out))[0]
            self._check(split, names[j], out[i:i + 1, j], start + int(i))
        return out

    def _labels(self, split: str, start: int, size: int) -> np.ndarray:
        """Labels [n] float32 (0/1) of samples [start, start + n); with H labels [n, H], in spec order."""
        columns = [self._column(split, name, start, size).astype(np.float32) for name in self.label_names]
        return columns[0] if len(columns) == 1 else np.stack(columns, axis=1)

    def categorical(self, split: str, start: int, size: int, features: Sequence[int]) -> List:
        """Ids of samples [start, start + size) for each of `features` (indices): [size] arrays of
        `id_dtype`, or RaggedIds for multi-hot features."""
        out = []
        for f in features:
            name = self.spec.categorical[f]
            reader = self._readers[split][name]
            if reader.multi_hot:
                ragged = reader.read_ragged(start, size)
                self._check(split, name, ragged.values, start, ragged.row_splits)
                out.append(RaggedIds(ragged.values.astype(self.id_dtype), ragged.row_splits))
            else:
                out.append(self._column(split, name, start, size).astype(self.id_dtype))
        if self.check:
            self._check_aligned(split, start, dict(zip(features, out)))
        return out

    def _check_aligned(self, split: str, start: int, read: dict):
        """Raises DatasetError naming the file, row and both features where a side feature read
        (the spec's metadata `aligned_with`: {side feature: its history}, as preproc.raw writes it)
        holds another count of ids than its history read beside it."""
        names = self.spec.categorical
        for side, history in (self.spec.metadata.get("aligned_with") or {}).items():
            if side not in names or history not in names:
                continue
            a, b = read.get(names.index(side)), read.get(names.index(history))
            if not isinstance(a, RaggedIds) or not isinstance(b, RaggedIds):
                continue
            counts = np.diff(a.row_splits), np.diff(b.row_splits)
            if np.array_equal(*counts):
                continue
            k = int(np.argmax(counts[0] != counts[1]))
            reader = self._readers[split][side]
            path, row = reader.locate(start + k)
            path = self.spec.path(reader.chunk.offsets[reader.paths.index(path)])   # the counts' file
            raise DatasetError(f"{path}: row {row}: feature {side!r} holds {counts[0][k]} ids, the history "
                               f"{history!r} it is aligned with (the spec's metadata aligned_with) {counts[1][k]}: a "
                               f"side feature holds one id per event of its history")

    def batch(self, split: str, start: int, size: int, features: Optional[Sequence[int]] = None) -> dict:
        """Samples [start, start + size): numerical [n, num_numerical] float32, labels [n] float32
        ([n, H] for the H `label_names` of a spec with several),
        oracle_logits (zeros as the labels: files carry no oracle) and categorical: F entries, those of
        `features` (default all) read, the others None."""
        features = range(len(self.cardinalities)) if features is None else features
        categorical = [None] * len(self.cardinalities)
        for f, ids in zip(features, self.categorical(split, start, size, features)):
            categorical[f] = ids
        labels = self._labels(split, start, size)
        return {"numerical": self._numerical(split, start, size), "categorical": categorical, "labels": labels,
                "oracle_logits": np.zeros(labels.shape, np.float32)}

    def validate(self, block_rows: int = 1 << 20):
        """Scans every value of every split: ids in [0, cardinality), finite numericals, 0/1 labels,
        offsets that never decrease and rows of at most max_hotness ids. Raises DatasetError
        naming the file, feature and row (within the file) of the first bad value."""
        for split in self.mappings:
            for reader in {id(r): r for r in self._readers[split].values()}.values():
                for k, path in enumerate(reader.paths):
                    first, last = int(reader.starts[k]), int(reader.starts[k + 1])
                    for start in range(first, last, block_rows):
                        n = min(block_rows, last - start)
                        if reader.chunk.offsets:
                            self._validate_ragged(reader, k, path, start - first, n)
                        else:
                            block = reader.read(start, n)
                            for j, feature in enumerate(reader.features):
                                check_values(self.spec, feature, block[:, j], start - first, path)

    def _validate_ragged(self, reader: ChunkReader, part: int, path: str, row: int, n: int):
        feature = reader.features[0]
        offsets = np.asarray(reader.offsets[part][row:row + n + 1])
        lengths = np.diff(offsets)
        limit = self.spec.features[feature].max_hotness
        bad = (lengths < 0) | (lengths > limit)
        if np.any(bad):
            k = int(np.argmax(bad))
            raise DatasetError(f"{self.spec.path(reader.chunk.offsets[part])}: feature {feature!r}, row {row + k}: "
                               f"a row must have 0..{limit} ids (max_hotness), offsets give {lengths[k]}")
        ids = reader.values[part][offsets[0]:offsets[-1]]
        rows_of_ids = row + np.repeat(np.arange(n), lengths)
        check_values(self.spec, feature, ids, rows_of_ids, path)
