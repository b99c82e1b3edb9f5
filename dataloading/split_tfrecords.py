"""Random-access reader of the reference's split-TFRecord datasets (`--dataset_type=split_tfrecords`
of NVIDIA's TF2 DLRM_and_DCNv2, the format its multi-hot data come in).

Layout, relative to the feature spec's directory (the spec gives the features, their order,
cardinalities and hotness; its source_spec is not read), per mapping M (train, test):

    M/length.json              the number of prebatches R (a JSON integer)
    M/numerical/               [P, num_numerical] float16 per prebatch
    M/label/                   [P, 1] int8 (0/1); [P, H] for the H labels of a spec with several
    M/categorical_<i>/         table i of channel_spec.categorical: [P, 1] int32 ids, or for a
                               multi-hot feature a ragged [P, None] int32 (raw ids: int64)

Each directory holds format.json ({"format": "tfrecords", "dtype", "multihot", "feature_name",
"num_features", "batches_per_file"}) and data_<k>.tfrecords files, read in the order of k.
Every record is a tf.train.Example whose bytes feature `feature_name` holds one prebatch of P
rows: tf.io.serialize_tensor of the [P, num_features] tensor, or, multi-hot, serialize_tensor of
the string vector [serialized values [K], serialized row_splits [P + 1]]. Row r of the mapping
is row r % P of record r // P.

Opening indexes every record from the TFRecord framing (uint64 length, its masked CRC-32C,
data, data CRC), checks the length CRCs, format.json, the record counts against length.json and
decodes the first record of each directory. Records are decoded when read (the last few are
kept). `validate` decodes every record, checks the data CRCs and every value. Problems raise
DatasetError naming the file.
"""
import glob
import json
import os
import re
import struct
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError
from tensorflow.core.example import example_pb2
from tensorflow.core.framework import tensor_pb2

from dataloading.feature_spec import Chunk, FeatureSpec, check_values
from dataloading.split_binary import ChunkReader, SplitBinaryDataset
from utils.errors import DatasetError

FORMAT_FILE, LENGTH_FILE, FEATURE_NAME = "format.json", "length.json", "data"
_CACHED_RECORDS = 2


def _crc32c_table() -> List[int]:
    table = []
    for n in range(256):
        for _ in range(8):
            n = (n >> 1) ^ (0x82F63B78 if n & 1 else 0)
        table.append(n)
    return table


_CRC32C = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C (Castagnoli) of `data` (used for the 8-byte length fields)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def index_records(path: str) -> List[tuple]:
    """(data offset, data length) of every record of the TFRecord file `path`."""
    records, pos = [], 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        while pos < size:
            header = f.read(12)
            length, crc = struct.unpack("<QI", header) if len(header) == 12 else (None, None)
            if length is None or crc != masked_crc32c(header[:8]):
                raise DatasetError(f"{path}: record {len(records)} at byte {pos}: not a TFRecord header "
                                   "(truncated or corrupt file)")
            if pos + 16 + length > size:
                raise DatasetError(f"{path}: record {len(records)} at byte {pos}: its {length} bytes run past "
                                   f"the end of the file ({size} bytes): truncated file")
            records.append((pos + 12, length))
            pos += 16 + length
            f.seek(pos)
    return records


def _tensor(serialized: bytes, where: str):
    """A serialized TensorProto as a NumPy array."""
    try:
        return tf.make_ndarray(tensor_pb2.TensorProto.FromString(serialized))
    except (DecodeError, TypeError, ValueError) as e:
        raise DatasetError(f"{where}: not a serialized tensor ({' '.join(str(e).split())})")


class _Records:
    """The decoded records of one feature directory, indexable (records are decoded on demand and
    the last few kept); `component` picks the values (0) or row_splits (1) of multi-hot records."""

    def __init__(self, feature: "FeatureDirectory", component: Optional[int] = None):
        self.feature, self.component = feature, component

    def __getitem__(self, k: int):
        record = self.feature.record(k)
        return record if self.component is None else record[self.component]


class FeatureDirectory(ChunkReader):
    """One directory (numerical, label or categorical_<i>) of a mapping, read like a split-binary
    chunk of `features`: `read(start, n)` gives [n, features], `read_ragged` multi-hot rows."""

    def __init__(self, directory: str, features: List[str], multi_hot: bool, length: int):
        self.directory, self.features, self.multi_hot = directory, features, multi_hot
        self.chunk = Chunk("split_tfrecords", features, [directory])
        meta = self._format()
        self.dtype, self.key = np.dtype(meta["dtype"]), meta.get("feature_name", FEATURE_NAME)
        self.paths = sorted(glob.glob(os.path.join(directory, "data_*.tfrecords")),
                            key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[0]))
        if not self.paths:
            raise DatasetError(f"{directory}: no data_<k>.tfrecords files")
        self.records = [(path, j, offset, size) for path in self.paths
                        for j, (offset, size) in enumerate(index_records(path))]
        if len(self.records) != length:
            raise DatasetError(f"{directory}: {len(self.records)} records, but {LENGTH_FILE} says {length} "
                               "prebatches")
        self._cache: Dict[int, object] = {}
        self.prebatch = None
        first = self.record(0) if length else None
        self.prebatch = (len(first[1]) - 1 if multi_hot else len(first)) if length else 0
        self.starts = np.arange(length + 1, dtype=np.int64) * self.prebatch
        self.rows = int(self.starts[-1])
        if multi_hot:
            self.values, self.offsets = _Records(self, 0), _Records(self, 1)
        else:
            self.parts = _Records(self)

    def _format(self) -> dict:
        path = os.path.join(self.directory, FORMAT_FILE)
        try:
            with open(path) as f:
                meta = json.load(f)
        except OSError as e:
            raise DatasetError(f"cannot read {path}: {e.strerror}")
        except ValueError as e:
            raise DatasetError(f"{path}: not valid JSON ({e})")
        if not isinstance(meta, dict) or meta.get("format") != "tfrecords":
            raise DatasetError(f"{path}: format must be \"tfrecords\", got {meta.get('format') if isinstance(meta, dict) else meta!r}")
        if bool(meta.get("multihot")) != self.multi_hot:
            raise DatasetError(f"{path}: multihot is {bool(meta.get('multihot'))}, but the feature spec makes "
                               f"{self.features[0]!r} {'multi-hot' if self.multi_hot else 'one-hot'} (hotness)")
        if meta.get("num_features", 1) != (1 if self.multi_hot else len(self.features)):
            raise DatasetError(f"{path}: num_features is {meta.get('num_features')}, the feature spec has "
                               f"{len(self.features)}")
        try:
            np.dtype(meta.get("dtype"))
        except TypeError:
            raise DatasetError(f"{path}: unknown dtype {meta.get('dtype')!r}")
        return meta

    def where(self, k: int) -> str:
        """The file and record index within it of record k."""
        return "{}: record {}".format(*self.records[k][:2])

    def _bytes(self, k: int) -> bytes:
        path, _, offset, size = self.records[k]
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(size)
        try:
            feature = example_pb2.Example.FromString(data).features.feature
        except DecodeError:
            raise DatasetError(f"{self.where(k)}: not a tf.train.Example")
        if self.key not in feature or len(feature[self.key].bytes_list.value) != 1:
            raise DatasetError(f"{self.where(k)}: the Example has no bytes feature {self.key!r}")
        return feature[self.key].bytes_list.value[0]

    def record(self, k: int):
        """Record k decoded: [P, features] of dtype, or (values [K], row_splits [P + 1] int64)."""
        if k in self._cache:
            return self._cache[k]
        where = self.where(k)
        tensor = _tensor(self._bytes(k), where)
        if self.multi_hot:
            if tensor.dtype != object or tensor.shape != (2,):
                raise DatasetError(f"{where}: a multi-hot record holds [values, row_splits], got a {tensor.dtype} "
                                   f"tensor of shape {list(tensor.shape)}")
            values, splits = (_tensor(t, where) for t in tensor)
            rows = len(splits) - 1
            if (splits.ndim != 1 or rows < 0 or splits[0] != 0 or splits[-1] != len(values)
                    or np.any(np.diff(splits) < 0)):
                raise DatasetError(f"{where}: row_splits must rise from 0 to the {len(values)} values")
            decoded = (values, splits.astype(np.int64))
        else:
            width = len(self.features)
            if not (tensor.ndim == 2 and tensor.shape[1] == width or tensor.ndim == 1 and width == 1):
                raise DatasetError(f"{where}: expected a [rows, {width}] tensor, got shape {list(tensor.shape)}")
            decoded = values = tensor.reshape(-1, width)
            rows = len(decoded)
        if values.dtype != self.dtype:
            raise DatasetError(f"{where}: dtype {values.dtype}, but {FORMAT_FILE} says {self.dtype}")
        if self.prebatch is not None and rows != self.prebatch:
            raise DatasetError(f"{where}: {rows} rows, the other records {self.prebatch}")
        if len(self._cache) >= _CACHED_RECORDS:
            self._cache.pop(next(iter(self._cache)))
        self._cache[k] = decoded
        return decoded


class SplitTFRecordsDataset(SplitBinaryDataset):
    """Random-access dataset over the split-TFRecord directories of `spec`'s directory;
    `mappings` names the directory read for each split ("train", "eval"). Same interface and
    batches as SplitBinaryDataset over the same rows."""

    def _open(self, mapping: str) -> Dict[str, FeatureDirectory]:
        base = self.spec.path(mapping)
        path = os.path.join(base, LENGTH_FILE)
        try:
            with open(path) as f:
                length = json.load(f)
        except OSError as e:
            raise DatasetError(f"cannot read {path}: {e.strerror}")
        except ValueError:
            length = None
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise DatasetError(f"{path}: must hold the number of prebatches, a JSON integer >= 0")
        spec = self.spec
        directories = [FeatureDirectory(os.path.join(base, "numerical"), spec.numerical, False, length),
                       FeatureDirectory(os.path.join(base, "label"), spec.labels, False, length)]
        directories += [FeatureDirectory(os.path.join(base, f"categorical_{i}"), [name], bool(hot), length)
                        for i, (name, hot) in enumerate(zip(spec.categorical, spec.max_hotness))]
        for d in directories:
            if d.rows != directories[1].rows:
                raise DatasetError(f"{d.directory}: prebatches of {d.prebatch} rows, but {directories[1].directory} "
                                   f"has {directories[1].prebatch}")
        return {feature: d for d in directories for feature in d.features}

    def validate(self):
        """Checks every record's data CRC and decodes it; then as SplitBinaryDataset.validate: ids in
        [0, cardinality), finite numericals, 0/1 labels, at most max_hotness ids a row. Raises
        DatasetError naming the file, record, feature and row (within the record)."""
        for split in self.mappings:
            for d in {id(r): r for r in self._readers[split].values()}.values():
                for path in d.paths:
                    try:
                        for _ in tf.data.TFRecordDataset(path):
                            pass
                    except tf.errors.OpError as e:
                        raise DatasetError(f"{path}: {' '.join(e.message.split())}")
                for k in range(len(d.records)):
                    self._validate_record(d, k)

    def _validate_record(self, d: FeatureDirectory, k: int):
        where, record = d.where(k), d.record(k)
        if not d.multi_hot:
            for j, feature in enumerate(d.features):
                check_values(self.spec, feature, record[:, j], 0, where)
            return
        values, splits = record
        lengths, limit = np.diff(splits), self.spec.features[d.features[0]].max_hotness
        if np.any(lengths > limit):
            row = int(np.argmax(lengths > limit))
            raise DatasetError(f"{where}: feature {d.features[0]!r}, row {row}: a row must have 0..{limit} ids "
                               f"(max_hotness), got {lengths[row]}")
        check_values(self.spec, d.features[0], values, np.repeat(np.arange(len(lengths)), lengths), where)


def open_split_tfrecords(path: str, mappings: Dict[str, str]) -> SplitTFRecordsDataset:
    """The dataset of the feature spec at `path` (source_spec not read)."""
    return SplitTFRecordsDataset(FeatureSpec.from_yaml(path, chunk_type=None), mappings)
