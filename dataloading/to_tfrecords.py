"""Writes a split-binary dataset in the reference's split-TFRecord layout (what NVIDIA's TF2
DLRM_and_DCNv2 reads with `--dataset_type=split_tfrecords`; layout in dataloading/split_tfrecords.py).

    python dataloading/to_tfrecords.py --dataset_path SRC --output DST --prebatch_size 65536 \\
        [--feature_spec SPEC] [--mappings train,test] [--batches_per_file N]

As the reference's transcribe.py: DST/feature_spec.yaml is the source spec (with the reference's
`hotness` for multi-hot features), each mapping M gets M/length.json and the directories
numerical (float16), label (int8) and categorical_<i> (int32, multi-hot ones ragged; int64 for a
raw-id feature, `raw_ids: true`, which the reference cannot read), each with
format.json and data_<k>.tfrecords of `batches_per_file` prebatches of `prebatch_size` rows.
Rows past the last whole prebatch are left out (the reference reads whole prebatches only).
Files are written under temporary names and renamed when complete; the spec last.
"""
import argparse
import json
import os
import sys
from typing import Iterable

import numpy as np

from utils.tensorflow_startup import import_tensorflow

import_tensorflow()   # a script too: TensorFlow's start-up lines then honour TF_CPP_MIN_LOG_LEVEL
import tensorflow as tf  # noqa: E402

from dataloading.feature_spec import SPEC_FILE, FeatureSpec  # noqa: E402
from dataloading.split_binary import RaggedIds, SplitBinaryDataset  # noqa: E402
from utils.errors import DatasetError  # noqa: E402


class _DirectoryWriter:
    """One feature directory: format.json and data_<k>.tfrecords, `batches_per_file` records each
    (0: one file)."""

    def __init__(self, directory: str, dtype: tf.DType, num_features: int, multihot: bool, batches_per_file: int):
        os.makedirs(directory, exist_ok=True)
        self.directory, self.dtype, self.multihot, self.per_file = directory, dtype, multihot, batches_per_file
        self.meta = dict(format="tfrecords", dtype=dtype.name, multihot=multihot, feature_name="data",
                         num_features=num_features)
        self.written, self.files, self.writer = 0, [], None

    def save(self, prebatch):
        """prebatch: [P, num_features] (or [P]) array, or RaggedIds when multi-hot."""
        if self.writer is None or self.per_file and self.written % self.per_file == 0:
            self._close_file()
            self.files.append(os.path.join(self.directory, f"data_{len(self.files)}.tfrecords"))
            self.writer = tf.io.TFRecordWriter(self.files[-1] + ".tmp")
        if self.multihot:   # the reference's serialize_composite of a ragged int32 tensor
            parts = [tf.io.serialize_tensor(tf.constant(prebatch.values, self.dtype)),
                     tf.io.serialize_tensor(tf.constant(prebatch.row_splits, tf.int32))]
            serialized = tf.io.serialize_tensor(tf.stack(parts)).numpy()
        else:
            serialized = tf.io.serialize_tensor(tf.cast(prebatch, self.dtype)).numpy()
        feature = {"data": tf.train.Feature(bytes_list=tf.train.BytesList(value=[serialized]))}
        self.writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
        self.written += 1

    def _close_file(self):
        if self.writer:
            self.writer.close()
            self.writer = None

    def close(self):
        self._close_file()
        for path in self.files:
            os.replace(path + ".tmp", path)
        with open(os.path.join(self.directory, "format.json"), "w") as f:
            json.dump(dict(self.meta, batches_per_file=self.per_file or self.written), f)


def write_mapping(spec: FeatureSpec, directory: str, prebatches: Iterable[dict], batches_per_file: int) -> int:
    """Writes mapping `directory` from prebatches (dicts as SplitBinaryDataset.batch gives: numerical
    [P, n], labels [P] (H labels: [P, H]), categorical: per table [P] ids or RaggedIds),
    `batches_per_file` a file (0: one file); returns their count."""
    writers = [_DirectoryWriter(os.path.join(directory, "numerical"), tf.float16, len(spec.numerical), False,
                                batches_per_file),
               _DirectoryWriter(os.path.join(directory, "label"), tf.int8, len(spec.labels), False, batches_per_file)]
    writers += [_DirectoryWriter(os.path.join(directory, f"categorical_{i}"),
                                 tf.int64 if spec.features[name].raw_ids else tf.int32, 1, bool(hot), batches_per_file)
                for i, (name, hot) in enumerate(zip(spec.categorical, spec.max_hotness))]
    count = 0
    for batch in prebatches:
        writers[0].save(batch["numerical"])
        writers[1].save(batch["labels"])
        for writer, ids in zip(writers[2:], batch["categorical"]):
            writer.save(ids if isinstance(ids, RaggedIds) else np.reshape(ids, [-1, 1]))
        count += 1
    for writer in writers:
        writer.close()
    with open(os.path.join(directory, "length.json"), "w") as f:
        json.dump(count, f)
    return count


def convert(spec: FeatureSpec, output: str, mappings, prebatch_size: int, batches_per_file: int) -> dict:
    """Writes `mappings` of the split-binary dataset `spec` under `output`; returns mapping -> rows
    written (whole prebatches)."""
    data = SplitBinaryDataset(spec, {m: m for m in mappings})
    written = {}
    for m in mappings:
        count = data.rows(m) // prebatch_size
        batches = (data.batch(m, k * prebatch_size, prebatch_size) for k in range(count))
        written[m] = write_mapping(spec, os.path.join(output, m), batches, batches_per_file) * prebatch_size
    raw = spec.to_dict()
    for name, hot in zip(spec.categorical, spec.max_hotness):
        if hot:
            raw["feature_spec"][name]["hotness"] = hot
    out = FeatureSpec.from_dict(raw, output, chunk_type=None)
    out.to_yaml(os.path.join(output, SPEC_FILE))
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset_path", required=True, help="split-binary dataset directory")
    parser.add_argument("--feature_spec", default="", help="its spec (default: DATASET_PATH/feature_spec.yaml)")
    parser.add_argument("--output", required=True, help="split-TFRecord dataset directory")
    parser.add_argument("--prebatch_size", type=int, default=65536, help="rows per record (the reference's "
                        "--batch_size must equal it)")
    parser.add_argument("--batches_per_file", type=int, default=0, help="records per data_<k>.tfrecords file "
                        "(default: all in one file, as the reference)")
    parser.add_argument("--mappings", default="train,test", help="mappings to write (the reference reads train, test)")
    args = parser.parse_args(argv)
    try:
        if args.prebatch_size < 1 or args.batches_per_file < 0:
            raise DatasetError("--prebatch_size must be positive and --batches_per_file >= 0")
        spec = FeatureSpec.from_yaml(args.feature_spec or os.path.join(args.dataset_path, SPEC_FILE))
        mappings = args.mappings.split(",")
        for m in mappings:
            spec.mapping(m)
        written = convert(spec, args.output, mappings, args.prebatch_size, args.batches_per_file)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(", ".join(f"{m}: {rows:,} rows" for m, rows in written.items()) + f" written to {args.output}")


if __name__ == "__main__":
    main()
