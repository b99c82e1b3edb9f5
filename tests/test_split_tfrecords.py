"""The reference's split-TFRecord datasets (--dataset_type=split_tfrecords) and tf_raw.

The same rows are written as split-binary files (MappingWriter) and as TFRecords (to_tfrecords'
writer, TensorFlow's serialize_tensor and TFRecordWriter, as the reference writes them); the
TFRecord reader (its own framing and protobuf decoding) must give exactly the batches of the
split-binary reader, at one rank and for every rank's share. The writer's files are checked
against the reference's own parsing (tf.io.parse_single_example, tf.io.parse_tensor).
"""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import tensorflow as tf
import yaml

import run.loop as run_loop
from dataloading.batches import RankInput, eval_batches, train_batches
from dataloading.feature_spec import SPEC_FILE, FeatureSpec, split_binary_spec
from dataloading.split_binary import RaggedIds, SplitBinaryDataset
from dataloading.split_tfrecords import masked_crc32c, open_split_tfrecords
from dataloading.to_tfrecords import main as to_tfrecords_main, write_mapping
from dataloading.writer import MappingWriter
from tests.support.configs import TINY
from tests.support.horovod_run import ROOT
from run.config import build_config
from utils.errors import ConfigError, DatasetError
from tests.support.warm_python import PYTHON

CARDS = {"c0": 1000, "c1": 7, "c2": 40000}
HOT = {"c1": 3}
ROWS = {"train": 1000, "test": 300}
PREBATCH = 100
SPLITS = {"train": "train", "eval": "test"}


def make_rows(rows: int, seed: int) -> dict:
    """Random columns: 3 float16-exact numericals, 0/1 labels, ids, multi-hot c1 (0..3 ids a row)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, rows)
    return {"numerical": rng.normal(size=[rows, 3]).astype(np.float16).astype(np.float32),
            "labels": rng.integers(0, 2, rows).astype(np.float32),
            "c0": rng.integers(0, 1000, rows), "c1": (rng.integers(0, 7, lengths.sum()), lengths),
            "c2": rng.integers(0, 40000, rows)}


def prebatches(columns: dict, size: int):
    """The rows as prebatch dicts (as SplitBinaryDataset.batch gives) of `size` rows."""
    ids, lengths = columns["c1"]
    splits = np.concatenate([[0], np.cumsum(lengths)])
    for start in range(0, len(columns["labels"]) - size + 1, size):
        a, b = splits[start], splits[start + size]
        yield {"numerical": columns["numerical"][start:start + size], "labels": columns["labels"][start:start + size],
               "categorical": [columns["c0"][start:start + size],
                               RaggedIds(ids[a:b], splits[start:start + size + 1] - a),
                               columns["c2"][start:start + size]]}


def write_both(path, columns_of, binary=True):
    """The rows as split-binary files under path/bin (if `binary`) and split-TFRecords under
    path/tfr, 4 prebatches a file (its spec in the reference's style: `hotness` instead of
    max_hotness). Returns the two directories."""
    bin_dir, tfr = os.path.join(path, "bin"), os.path.join(path, "tfr")
    spec = split_binary_spec(["n0", "n1", "n2"], CARDS, max_hotness=HOT, base_dir=bin_dir)
    for mapping, columns in columns_of.items():
        if binary:
            with MappingWriter(spec, mapping) as w:
                w.write({"n0": columns["numerical"][:, 0], "n1": columns["numerical"][:, 1],
                         "n2": columns["numerical"][:, 2], "label": columns["labels"],
                         **{c: columns[c] for c in CARDS}})
        write_mapping(spec, os.path.join(tfr, mapping), prebatches(columns, PREBATCH), batches_per_file=4)
    if binary:
        spec.to_yaml(os.path.join(bin_dir, SPEC_FILE))
    raw = spec.to_dict()
    raw["feature_spec"]["c1"] = {"dtype": "int32", "cardinality": 7, "hotness": 3, "alpha": 1.1}
    with open(os.path.join(tfr, SPEC_FILE), "w") as f:
        yaml.safe_dump(raw, f)
    return bin_dir, tfr


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    return write_both(str(tmp_path_factory.mktemp("both")), {m: make_rows(n, k) for k, (m, n) in enumerate(ROWS.items())})


def assert_same_batch(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if key == "categorical":
            for x, y in zip(a[key], b[key]):
                assert isinstance(x, RaggedIds) == isinstance(y, RaggedIds)
                for u, v in zip(*(((x.values, x.row_splits), (y.values, y.row_splits)) if isinstance(x, RaggedIds)
                                  else ((x,), (y,)))):
                    assert u.dtype == v.dtype
                    np.testing.assert_array_equal(u, v)
        else:
            np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.parametrize("n", [1, 2, 3])
def test_batches_equal_the_split_binary_readers(both, n):
    """Every rank's share of every training batch (batch 100 = the prebatch, and 96: batches across
    records and files) and evaluation batch: exactly the split-binary reader's."""
    binary, tfr = both
    ref = SplitBinaryDataset(FeatureSpec.from_yaml(os.path.join(binary, SPEC_FILE)), SPLITS)
    got = open_split_tfrecords(os.path.join(tfr, SPEC_FILE), SPLITS)
    assert got.rows("train") == 1000 and got.rows("eval") == 300 and got.max_hotness == [None, 3, None]
    assert got.cardinalities == list(CARDS.values()) and got.id_dtype == ref.id_dtype
    for scopes in (("local",) * 3, ("global", "global", "none"), ("none", "local", "global")):
        for r in range(n):
            view = RankInput(r, n, scopes)
            for batch_size in (PREBATCH, 96):
                steps = dict(rows=1000, batch_size=batch_size, seed=3, start_step=0, end_step=25, last_partial=True)
                pairs = zip(train_batches(ref, view, **steps), train_batches(got, view, **steps))
                for a, b in pairs:
                    assert_same_batch(a, b)
            for a, b in zip(eval_batches(ref, view, rows=300, batch_size=128),
                            eval_batches(got, view, rows=300, batch_size=128)):
                assert_same_batch(a, b)


def test_files_follow_the_references_layout_and_parse_as_it_parses(both):
    """The reference's SingleFeatureTFRecordsFileReader: parse_single_example of feature 'data',
    parse_tensor and reshape to [batch, num_features]; multi-hot: parse_tensor of a string pair,
    then values and row_splits (int32)."""
    _, tfr = both
    assert json.load(open(os.path.join(tfr, "train", "length.json"))) == 10
    meta = json.load(open(os.path.join(tfr, "train", "categorical_1", "format.json")))
    assert meta == dict(format="tfrecords", dtype="int32", multihot=True, feature_name="data", num_features=1,
                        batches_per_file=4)
    assert sorted(os.listdir(os.path.join(tfr, "train", "numerical"))) == [
        "data_0.tfrecords", "data_1.tfrecords", "data_2.tfrecords", "format.json"]
    columns = make_rows(1000, 0)
    description = {"data": tf.io.FixedLenFeature([], tf.string, default_value="")}

    def records(directory):
        files = [os.path.join(tfr, "train", directory, f"data_{k}.tfrecords") for k in range(3)]
        return [tf.io.parse_single_example(r, description)["data"] for r in tf.data.TFRecordDataset(files)]

    numerical = [tf.reshape(tf.io.parse_tensor(r, tf.float16), [PREBATCH, 3]) for r in records("numerical")]
    np.testing.assert_array_equal(np.concatenate(numerical), columns["numerical"])
    labels = [tf.reshape(tf.io.parse_tensor(r, tf.int8), [PREBATCH, 1]) for r in records("label")]
    np.testing.assert_array_equal(np.concatenate(labels)[:, 0], columns["labels"])
    ids = [tf.reshape(tf.io.parse_tensor(r, tf.int32), [PREBATCH, 1]) for r in records("categorical_2")]
    np.testing.assert_array_equal(np.concatenate(ids)[:, 0], columns["c2"])
    values, lengths = [], []
    for r in records("categorical_1"):
        parts = tf.io.parse_tensor(r, tf.string)
        values.append(tf.io.parse_tensor(parts[0], tf.int32))
        lengths.append(np.diff(tf.io.parse_tensor(parts[1], tf.int32)))
    np.testing.assert_array_equal(np.concatenate(values), columns["c1"][0])
    np.testing.assert_array_equal(np.concatenate(lengths), columns["c1"][1])


def test_masked_crc32c_matches_tensorflows_framing(tmp_path):
    path = str(tmp_path / "x.tfrecords")
    with tf.io.TFRecordWriter(path) as w:
        w.write(b"hello")
    data = open(path, "rb").read()
    assert int.from_bytes(data[8:12], "little") == masked_crc32c(data[:8])
    assert int.from_bytes(data[-4:], "little") == masked_crc32c(b"hello")


def copy_of(tfr, tmp_path):
    out = str(tmp_path / "copy")
    shutil.copytree(tfr, out)
    return out


def _replace_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f)


def _flip_multihot(d):
    path = os.path.join(d, "train", "categorical_1", "format.json")
    _replace_json(path, dict(json.load(open(path)), multihot=False))


def _truncate(d):
    path = os.path.join(d, "test", "label", "data_0.tfrecords")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-10])


def _garbage(d):
    open(os.path.join(d, "train", "numerical", "data_1.tfrecords"), "wb").write(b"numerical,values\n1,2,3\n" * 10)


BAD_FILES = [
    (lambda d: os.remove(os.path.join(d, "train", "length.json")), "cannot read {d}/train/length.json"),
    (lambda d: _replace_json(os.path.join(d, "test", "length.json"), 4),
     "{d}/test/numerical: 3 records, but length.json says 4 prebatches"),
    (_flip_multihot, "{d}/train/categorical_1/format.json: multihot is False, but the feature spec makes 'c1' "
                     "multi-hot (hotness)"),
    (lambda d: os.remove(os.path.join(d, "train", "categorical_2", "format.json")),
     "cannot read {d}/train/categorical_2/format.json"),
    (_truncate, "{d}/test/label/data_0.tfrecords: record 2 at byte"),
    (_garbage, "{d}/train/numerical/data_1.tfrecords: record 0 at byte 0: not a TFRecord header"),
]


@pytest.mark.parametrize("change, message", BAD_FILES)
def test_bad_files_fail_when_opened_naming_the_file(both, tmp_path, change, message):
    d = copy_of(both[1], tmp_path)
    change(d)
    with pytest.raises(DatasetError) as e:
        open_split_tfrecords(os.path.join(d, SPEC_FILE), SPLITS)
    assert str(e.value).startswith(message.format(d=d)) and "\n" not in str(e.value)


def bad_values(tmp_path, edit):
    """A dataset whose train row 257 (record 2, file data_0, row 57) is changed by `edit(columns)`."""
    columns = make_rows(1000, 0)
    edit(columns)
    return write_both(str(tmp_path), {"train": columns, "test": make_rows(300, 1)}, binary=False)[1]


def _long_row(columns):
    ids, lengths = columns["c1"]
    k = lengths[:257].sum()
    columns["c1"] = (np.concatenate([ids[:k], [1] * 4, ids[k + lengths[257]:]]),
                     np.concatenate([lengths[:257], [4], lengths[258:]]))


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["c2"].__setitem__(257, 40000), "train/categorical_2/data_0.tfrecords: record 2: feature 'c2', row 57: "
                                                 "ids must be in [0, 40000), got 40000"),
    (lambda c: c["labels"].__setitem__(257, 2), "train/label/data_0.tfrecords: record 2: feature 'label', row 57: "
                                                "labels must be 0 or 1, got 2"),
    (_long_row, "train/categorical_1/data_0.tfrecords: record 2: feature 'c1', row 57: a row must have 0..3 ids "
                "(max_hotness), got 4"),
])
def test_bad_values_fail_validation_naming_file_record_and_row(tmp_path, edit, message):
    d = bad_values(tmp_path, edit)
    data = open_split_tfrecords(os.path.join(d, SPEC_FILE), SPLITS)
    with pytest.raises(DatasetError, match=f"^{d}/{message}".replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)").replace(".", r"\.")):
        data.validate()


def test_a_corrupt_record_fails_validation_by_its_crc(both, tmp_path):
    d = copy_of(both[1], tmp_path)
    path = os.path.join(d, "train", "numerical", "data_1.tfrecords")
    data = bytearray(open(path, "rb").read())
    data[-100] ^= 0xFF   # inside the last record's float16 values: it still decodes
    open(path, "wb").write(bytes(data))
    dataset = open_split_tfrecords(os.path.join(d, SPEC_FILE), SPLITS)
    with pytest.raises(DatasetError, match=f"^{path}: .*corrupted record"):
        dataset.validate()


def test_spec_hotness_and_max_hotness(both, tmp_path):
    raw = yaml.safe_load(open(os.path.join(both[1], SPEC_FILE)))
    spec = FeatureSpec.from_dict(raw, chunk_type=None)
    assert spec.max_hotness == [None, 3, None] and spec.features["c1"].alpha == 1.1
    raw["feature_spec"]["c0"]["hotness"] = 1   # the reference's one-hot
    assert FeatureSpec.from_dict(raw, chunk_type=None).max_hotness == [None, 3, None]
    raw["feature_spec"]["c1"]["max_hotness"] = 4
    with pytest.raises(DatasetError, match="feature_spec.c1.hotness: hotness 3 and max_hotness 4 differ: give one"):
        FeatureSpec.from_dict(raw, chunk_type=None)


def tfr_config(path, **overrides):
    values = dict(TINY, dataset_path=path, warmup_steps=3, decay_start_step=6, decay_steps=6, batch_size=100,
                  valid_batch_size=128)
    values.update(overrides)
    return build_config(values, present={"dataset_type", "dataset_path", *overrides})


def test_training_on_tfrecords_equals_training_on_split_binary_and_tf_raw(both):
    binary, tfr = both
    runs = {t: run_loop.run(tfr_config(p, dataset_type=t))
            for t, p in (("split_binary", binary), ("tf_raw", binary), ("split_tfrecords", tfr))}
    assert tfr_config(binary, dataset_type="tf_raw").data.dataset_type == "split_binary"
    assert runs["split_tfrecords"]["steps"] == 10 and runs["split_tfrecords"]["samples"] == 300
    for t in ("tf_raw", "split_tfrecords"):
        assert runs[t]["auc"] == runs["split_binary"]["auc"] and runs[t]["logloss"] == runs["split_binary"]["logloss"]
    with pytest.raises(ConfigError, match=f"--eval_mapping=validation: no directory {tfr}/validation"):
        tfr_config(tfr, dataset_type="split_tfrecords", eval_mapping="validation")


def dlrm(*args):
    return subprocess.run([*PYTHON, "dlrm.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


MODEL = ["--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--optimizer=adam",
         "--learning_rate=0.01", "--warmup_steps=2", "--decay_start_step=8", "--decay_steps=2", "--batch_size=100",
         "--valid_batch_size=128", "--print_freq=5"]


@pytest.mark.slow
def test_dlrm_trains_on_tfrecords_and_reports_a_bad_file_in_one_line(both, tmp_path):
    ok = dlrm("--dataset_type=split_tfrecords", f"--dataset_path={both[1]}", "--validate_dataset", *MODEL)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "validated every value" in ok.stdout and "eval at step 10: auc" in ok.stdout
    d = copy_of(both[1], tmp_path)
    _truncate(d)
    bad = dlrm("--dataset_type=split_tfrecords", f"--dataset_path={d}", *MODEL)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith(f"error: {d}/test/label/data_0.tfrecords: record 2"), \
        bad.stderr[-3000:]


def test_to_tfrecords_tool_converts_a_split_binary_dataset(both, tmp_path, capsys):
    binary, tfr = both
    out = str(tmp_path / "out")
    to_tfrecords_main(["--dataset_path", binary, "--output", out, "--prebatch_size", "100"])
    assert "train: 1,000 rows, test: 300 rows written" in capsys.readouterr().out
    assert yaml.safe_load(open(os.path.join(out, SPEC_FILE)))["feature_spec"]["c1"]["hotness"] == 3
    converted, written = (open_split_tfrecords(os.path.join(d, SPEC_FILE), SPLITS) for d in (out, tfr))
    view = RankInput.single_process(3)
    for a, b in zip(eval_batches(converted, view, rows=300, batch_size=300),
                    eval_batches(written, view, rows=300, batch_size=300)):
        assert_same_batch(a, b)
    to_tfrecords_main(["--dataset_path", binary, "--output", str(tmp_path / "big"), "--prebatch_size", "128"])
    assert open_split_tfrecords(str(tmp_path / "big" / SPEC_FILE), SPLITS).rows("train") == 896   # 7 prebatches
    with pytest.raises(SystemExit) as e:
        to_tfrecords_main(["--dataset_path", str(tmp_path / "none"), "--output", out])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: cannot read the feature spec")
