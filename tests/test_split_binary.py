"""Feature spec, split-binary reader, CSV transcoding and per-rank batch streams over files.

References are independent of the reader: the CSV text parsed by the csv module, the
SyntheticDataset the files were generated from, and row numbers stored in a numerical column.
"""
import copy
import csv
import os
import shutil

import numpy as np
import pytest
import yaml

from dataloading.batches import RankInput, eval_batches, rank_batch, steps_per_epoch, train_batches
from dataloading.feature_spec import SPEC_FILE, FeatureSpec, id_dtype, split_binary_spec
from dataloading.gen_csv import gen_csv
from dataloading.generate_dataset import generate
from dataloading.split_binary import SplitBinaryDataset
from dataloading.synthetic import SyntheticDataset
from dataloading.transcode import main as transcode_main, transcode
from dataloading.writer import MappingWriter
from utils.errors import DatasetError

CARDS = {"c0": 20, "c1": 300, "c2": 40000}
HOT = {"c1": 3}
SPLITS = {"train": "train", "eval": "test"}


def make_dataset(path, rows=1000, eval_rows=300, hot=HOT, numerical_dtype="float32"):
    spec = split_binary_spec(["n0", "n1", "n2"], CARDS, max_hotness=hot, numerical_dtype=numerical_dtype,
                             base_dir=str(path))
    generate(spec, rows, eval_rows, seed=5, alpha=1.05, block=128)
    return FeatureSpec.from_yaml(os.path.join(path, SPEC_FILE))


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("data")
    make_dataset(path)
    return str(path)


def spec_dict(dataset_dir):
    with open(os.path.join(dataset_dir, SPEC_FILE)) as f:
        return yaml.safe_load(f)


def test_id_dtype_is_the_smallest_that_holds_the_ids():
    assert [id_dtype(c) for c in (1, 128, 129, 32768, 32769, 2 ** 31, 2 ** 31 + 1)] == \
        ["int8", "int8", "int16", "int16", "int32", "int32", "int64"]


def test_files_hold_the_synthetic_samples(dataset_dir):
    data = SplitBinaryDataset(FeatureSpec.from_yaml(os.path.join(dataset_dir, SPEC_FILE)), SPLITS)
    synthetic = SyntheticDataset(list(CARDS.values()), 3, 1.05, 5)
    assert data.rows("train") == 1000 and data.rows("eval") == 300
    assert data.spec.dtype("c0") == np.int8 and data.spec.dtype("c2") == np.int32
    for split, start, n in (("train", 100, 250), ("eval", 0, 300)):
        got, want = data.batch(split, start, n), synthetic.batch(split, start, n)
        for key in ("numerical", "labels"):
            np.testing.assert_array_equal(got[key], want[key])
        for f in (0, 2):
            np.testing.assert_array_equal(got["categorical"][f], want["categorical"][f])
        ids, lengths = synthetic.multi_hot(split, start, n, 1, 3)
        np.testing.assert_array_equal(got["categorical"][1].values, ids)
        np.testing.assert_array_equal(np.diff(got["categorical"][1].row_splits), lengths)
        assert 0 in lengths and 3 in lengths   # empty and full rows


def test_several_files_per_chunk_read_as_one(tmp_path, dataset_dir):
    """Every chunk cut into three files (rows 0..399, 400..401, 402..): the same rows."""
    raw, whole = spec_dict(dataset_dir), SplitBinaryDataset(FeatureSpec.from_yaml(os.path.join(dataset_dir, SPEC_FILE)),
                                                            SPLITS)
    cuts = [0, 400, 402, 1000]
    for k, chunk in enumerate(raw["source_spec"]["train"]):
        spec = whole.spec
        dtype = spec.dtype(chunk["features"][0])
        width = len(chunk["features"])
        if "offsets" in chunk:
            values = np.fromfile(os.path.join(dataset_dir, chunk["files"][0]), dtype)
            offsets = np.fromfile(os.path.join(dataset_dir, chunk["offsets"][0]), np.int64)
            parts = [(values[offsets[a]:offsets[b]], offsets[a:b + 1] - offsets[a]) for a, b in zip(cuts, cuts[1:])]
        else:
            rows = np.fromfile(os.path.join(dataset_dir, chunk["files"][0]), dtype).reshape(-1, width)
            parts = [(rows[a:b], None) for a, b in zip(cuts, cuts[1:])]
        chunk["files"], offsets_files = [f"part{k}_{i}.bin" for i in range(3)], [f"part{k}_{i}.off" for i in range(3)]
        for i, (values, offsets) in enumerate(parts):
            values.tofile(tmp_path / chunk["files"][i])
            if offsets is not None:
                offsets.tofile(tmp_path / offsets_files[i])
        if "offsets" in chunk:
            chunk["offsets"] = offsets_files
    raw["source_spec"]["test"] = raw["source_spec"]["train"]
    split = SplitBinaryDataset(FeatureSpec.from_dict(raw, str(tmp_path)), SPLITS)
    split.validate(block_rows=150)
    for start, n in ((0, 1000), (390, 20), (401, 1), (402, 598)):
        got, want = split.batch("train", start, n), whole.batch("train", start, n)
        np.testing.assert_array_equal(got["numerical"], want["numerical"])
        np.testing.assert_array_equal(got["labels"], want["labels"])
        np.testing.assert_array_equal(got["categorical"][0], want["categorical"][0])
        for a, b in zip(got["categorical"][1], want["categorical"][1]):
            np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------------------------
# Per-rank streams.

@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """A dataset whose numerical n0 is the row number (train 1000 rows, eval 300)."""
    path = tmp_path_factory.mktemp("numbered")
    spec = split_binary_spec(["n0"], {"c0": 1000, "c1": 7}, max_hotness={"c1": 2}, numerical_dtype="float32",
                             base_dir=str(path))
    for mapping, rows in (("train", 1000), ("test", 300)):
        with MappingWriter(spec, mapping) as w:
            r = np.arange(rows)
            w.write({"n0": r, "c0": r % 1000, "c1": (r[r % 3 > 0] % 7, (r % 3 > 0).astype(int)), "label": r % 2})
    return SplitBinaryDataset(spec, SPLITS)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("last_partial", [False, True])
def test_every_row_once_per_epoch_at_any_rank_count(numbered, n, last_partial):
    batch_size = 96
    steps = steps_per_epoch(1000, batch_size, n, last_partial)
    assert steps == 10 + int(last_partial)
    for scopes in (("local", "local"), ("global", "none"), ("none", "global")):
        seen = []
        for epoch in range(2):
            streams = [list(train_batches(numbered, RankInput(r, n, scopes), rows=1000, batch_size=batch_size, seed=7,
                                          start_step=epoch * steps, end_step=(epoch + 1) * steps,
                                          last_partial=last_partial)) for r in range(n)]
            rows = np.concatenate([b["numerical"][:, 0] for parts in zip(*streams) for b in parts]).astype(int)
            for parts in zip(*streams):   # global ids: the whole global batch on the ranks that ask
                batch_rows = np.concatenate([b["numerical"][:, 0] for b in parts]).astype(int)
                for r, b in enumerate(parts):
                    for f, kind in enumerate(scopes):
                        ids = b["categorical"][f]
                        flat = ids.values if f == 1 else ids
                        if kind == "global":
                            expected = batch_rows % 1000 if f == 0 else batch_rows[batch_rows % 3 > 0] % 7
                            np.testing.assert_array_equal(flat, expected)
                        elif kind == "none":
                            assert len(flat) == 0
            full = 960 + (1000 - 960) // n * n * int(last_partial)
            assert len(rows) == full and len(set(rows)) == full
            seen.append(rows)
        assert not np.array_equal(seen[0], seen[1])   # reshuffled


def test_batch_order_is_a_reproducible_permutation_or_file_order(numbered):
    def first_rows(seed, shuffle=True):
        return [int(b["numerical"][0, 0]) for b in train_batches(numbered, RankInput.single_process(2), rows=1000,
                                                                 batch_size=100, seed=seed, start_step=0,
                                                                 end_step=10, shuffle=shuffle)]
    order = first_rows(3)
    assert sorted(order) == list(range(0, 1000, 100)) and order != sorted(order)
    assert first_rows(3) == order and first_rows(4) != order
    assert first_rows(3, shuffle=False) == list(range(0, 1000, 100))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_evaluation_reads_every_row_in_order_with_the_last_partial_batch(numbered, n):
    views = [RankInput(r, n, ("local", "global")) for r in range(n)]
    streams = [list(eval_batches(numbered, v, rows=300, batch_size=128)) for v in views]
    rows = [b["numerical"][:b["valid"], 0] for parts in zip(*streams) for b in parts]
    np.testing.assert_array_equal(np.concatenate(rows), np.arange(300))
    last = streams[-1][-1]   # padding rows: zeros and empty multi-hot rows
    assert len(last["labels"]) == -(-44 // n) and np.all(last["numerical"][last["valid"]:] == 0)
    assert len(last["categorical"][1].row_splits) == -(-44 // n) * n + 1


def test_reading_past_the_end_pads(numbered):
    batch = rank_batch(numbered, "eval", 290, 16, RankInput.single_process(2), end=300)
    np.testing.assert_array_equal(batch["numerical"][:, 0], np.r_[np.arange(290, 300), np.zeros(6)])
    assert list(np.diff(batch["categorical"][1].row_splits)[10:]) == [0] * 6


# ------------------------------------------------------------------------------------------------
# Spec errors: one line naming the key.

SPEC_ERRORS = [
    (lambda s: s.pop("channel_spec"), "channel_spec: missing"),
    (lambda s: s["channel_spec"].update(label=["label", "n0"]), "channel_spec.label"),
    (lambda s: s["channel_spec"]["numerical"].append("nope"), "feature 'nope' is not defined"),
    (lambda s: s["feature_spec"]["c0"].update(cardinality=0), "feature_spec.c0.cardinality"),
    (lambda s: s["feature_spec"]["c0"].update(cardinality="auto"), "feature_spec.c0.cardinality"),
    (lambda s: s["feature_spec"]["c2"].update(dtype="int16"), "feature_spec.c2.dtype: int16 cannot hold"),
    (lambda s: s["feature_spec"]["n0"].update(dtype="float64"), "feature_spec.n0.dtype"),
    (lambda s: s["feature_spec"]["label"].update(dtype="int8"), "feature_spec.label.dtype"),
    (lambda s: s["feature_spec"]["n0"].update(cardinalty=3), "feature_spec.n0.cardinalty: unknown key"),
    (lambda s: s["feature_spec"]["c1"].pop("max_hotness"), "source_spec.train[3].offsets: only a multi-hot"),
    (lambda s: s["source_spec"]["train"][3].pop("offsets"), "source_spec.train[3].offsets"),
    (lambda s: s["source_spec"]["train"].pop(2), "source_spec.train: no chunk provides the categorical feature 'c0'"),
    (lambda s: s["source_spec"]["test"][0].update(type="csv"), "source_spec.test[0].type"),
    (lambda s: s["source_spec"]["test"][2]["features"].append("c2"), "source_spec.test[2].features"),
    (lambda s: s["source_spec"]["test"][1]["features"].append("n0"), "already in an earlier chunk"),
]


@pytest.mark.parametrize("mutate,fragment", SPEC_ERRORS, ids=[e[1][:40] for e in SPEC_ERRORS])
def test_spec_errors_name_the_key(dataset_dir, mutate, fragment):
    raw = copy.deepcopy(spec_dict(dataset_dir))
    mutate(raw)
    with pytest.raises(DatasetError) as info:
        FeatureSpec.from_dict(raw, dataset_dir, where="spec.yaml")
    message = str(info.value)
    assert fragment in message and message.startswith("spec.yaml: ") and "\n" not in message, message


def test_spec_round_trips_through_yaml(dataset_dir, tmp_path):
    spec = FeatureSpec.from_yaml(os.path.join(dataset_dir, SPEC_FILE))
    spec.to_yaml(str(tmp_path / "copy.yaml"))
    assert FeatureSpec.from_yaml(str(tmp_path / "copy.yaml")).to_dict() == spec.to_dict()


def test_unknown_mapping_is_named(dataset_dir):
    with pytest.raises(DatasetError, match="no mapping 'validation'"):
        SplitBinaryDataset(FeatureSpec.from_yaml(os.path.join(dataset_dir, SPEC_FILE)), {"eval": "validation"})


# ------------------------------------------------------------------------------------------------
# Bad files: cheap checks when opening, the rest by validate().

def corrupt(tmp_path, dataset_dir, file, change):
    """A copy of the dataset with `change(array)` applied to `file` (as its dtype) -> the dataset."""
    copy_dir = tmp_path / "copy"
    spec = FeatureSpec.from_yaml(os.path.join(dataset_dir, SPEC_FILE))
    spec.base_dir = str(copy_dir)
    for chunk in spec.source["train"] + spec.source["test"]:
        for f in chunk.files + chunk.offsets:
            os.makedirs(copy_dir / os.path.dirname(f), exist_ok=True)
            data = open(os.path.join(dataset_dir, f), "rb").read()
            open(copy_dir / f, "wb").write(data)
    path = copy_dir / file
    dtype = {"train/c0.bin": np.int8, "train/c2.bin": np.int32, "train/numerical.bin": np.float32,
             "train/label.bin": np.uint8, "train/c1.bin": np.int16, "train/c1.offsets.bin": np.int64}[file]
    result = change(np.fromfile(path, dtype))
    if result is None:
        os.remove(path)
    else:
        result.tofile(path)
    return lambda: SplitBinaryDataset(spec, SPLITS)


def setitem(i, value):
    def change(a):
        a[i] = value
        return a
    return change


OPEN_ERRORS = [
    ("train/c2.bin", lambda a: a.view(np.uint8)[:-1], "size 3999 bytes is not a multiple of the record size 4"),
    ("train/c0.bin", lambda a: a[:-1], "hold 1000 rows (feature 'n0') but ['"),
    ("train/label.bin", lambda a: None, "missing file"),
    ("train/c1.offsets.bin", setitem(-1, 5), "offsets must run from 0"),
]
SCAN_ERRORS = [
    ("train/c0.bin", setitem(17, 20), "train/c0.bin: feature 'c0', row 17: ids must be in [0, 20), got 20"),
    ("train/c2.bin", setitem(999, -3), "train/c2.bin: feature 'c2', row 999: ids must be in [0, 40000), got -3"),
    ("train/numerical.bin", setitem(3 * 41 + 2, np.nan), "feature 'n2', row 41: numerical values must be finite"),
    ("train/numerical.bin", setitem(0, np.inf), "feature 'n0', row 0: numerical values must be finite"),
    ("train/label.bin", setitem(5, 2), "feature 'label', row 5: labels must be 0 or 1"),
    ("train/c1.bin", setitem(4, 300), "train/c1.bin: feature 'c1', row "),
]


@pytest.mark.parametrize("file,change,fragment", OPEN_ERRORS, ids=[e[2][:30] for e in OPEN_ERRORS])
def test_bad_files_fail_when_opened(tmp_path, dataset_dir, file, change, fragment):
    with pytest.raises(DatasetError) as info:
        corrupt(tmp_path, dataset_dir, file, change)()
    assert fragment in str(info.value) and file.split("/")[1] in str(info.value), str(info.value)


@pytest.mark.parametrize("file,change,fragment", SCAN_ERRORS, ids=[e[2][:40] for e in SCAN_ERRORS])
def test_bad_values_fail_validation(tmp_path, dataset_dir, file, change, fragment):
    dataset = corrupt(tmp_path, dataset_dir, file, change)()   # sizes are fine: opens
    with pytest.raises(DatasetError) as info:
        dataset.validate(block_rows=256)
    assert fragment in str(info.value), str(info.value)


def every_batch(dataset, batch_size=100):
    """Reads every training and evaluation sample through the loader, as training does."""
    rows = {split: dataset.rows(split) for split in SPLITS}
    steps = steps_per_epoch(rows["train"], batch_size, 1, True)
    view = RankInput.single_process(len(CARDS))
    list(train_batches(dataset, view, rows=rows["train"], batch_size=batch_size, seed=5, start_step=0, end_step=steps,
                       last_partial=True))
    list(eval_batches(dataset, view, rows=rows["eval"], batch_size=batch_size))


@pytest.mark.parametrize("file,change,fragment", SCAN_ERRORS, ids=[e[2][:40] for e in SCAN_ERRORS])
def test_the_loader_stops_at_a_bad_value_as_validation_names_it(tmp_path, dataset_dir, file, change, fragment):
    """Without the scan, reading the batch that holds a bad value raises validate's exact line."""
    with pytest.raises(DatasetError) as scanned:
        corrupt(tmp_path, dataset_dir, file, change)().validate()
    with pytest.raises(DatasetError) as loaded:
        every_batch(corrupt(tmp_path, dataset_dir, file, change)())
    assert str(loaded.value) == str(scanned.value) and fragment in str(loaded.value), str(loaded.value)


def test_wide_ids_are_checked_before_they_are_cast(tmp_path, dataset_dir):
    """An int64 file (the spec may name a wider dtype) holding 2^32 + 3 for a table of 20 rows:
    the model's int32 ids would wrap it to 3, a valid id; loader and scan both refuse it."""
    def widen(ids):
        ids = ids.astype(np.int64)
        ids[123] = 2 ** 32 + 3
        return ids
    corrupt(tmp_path, dataset_dir, "train/c0.bin", widen)
    raw = spec_dict(dataset_dir)
    raw["feature_spec"]["c0"]["dtype"] = "int64"
    test_ids = np.fromfile(os.path.join(dataset_dir, "test", "c0.bin"), np.int8).astype(np.int64)
    test_ids.tofile(tmp_path / "copy" / "test" / "c0.bin")
    spec = FeatureSpec.from_dict(raw, str(tmp_path / "copy"))
    dataset = SplitBinaryDataset(spec, SPLITS)
    assert dataset.id_dtype == np.int32 and np.int64(2 ** 32 + 3).astype(np.int32) == 3
    want = f"{tmp_path}/copy/train/c0.bin: feature 'c0', row 123: ids must be in [0, 20), got {2 ** 32 + 3}"
    with pytest.raises(DatasetError) as loaded:
        every_batch(dataset)
    with pytest.raises(DatasetError) as scanned:
        dataset.validate()
    assert str(loaded.value) == str(scanned.value) == want


def test_multi_hot_row_longer_than_max_hotness_fails_validation(tmp_path, dataset_dir):
    def lengthen(offsets):   # row 10 takes one id of row 11 (which has at least one)
        rows = np.flatnonzero((np.diff(offsets) == 3)[:-1] & (np.diff(offsets)[1:] > 0))
        offsets[rows[0] + 1] += 1
        lengthen.row = int(rows[0])
        return offsets
    dataset = corrupt(tmp_path, dataset_dir, "train/c1.offsets.bin", lengthen)()
    with pytest.raises(DatasetError, match=rf"c1.offsets.bin: feature 'c1', row {lengthen.row}: a row must have 0..3"):
        dataset.validate()


# ------------------------------------------------------------------------------------------------
# CSV -> split-binary.

CSV_SPEC = {
    "channel_spec": {"categorical": ["cat_0", "cat_1", "cat_2"], "numerical": ["num_0", "num_1"], "label": ["label"]},
    "feature_spec": {"cat_0": {"cardinality": 10}, "cat_1": {"cardinality": 40}, "cat_2": {"cardinality": 500},
                     "label": None, "num_0": {}, "num_1": {}},
    "source_spec": {
        "train": [{"type": "csv", "features": ["num_0", "num_1"], "files": ["train/num_a.csv", "train/num_b.csv"]},
                  {"type": "csv", "features": ["label", "cat_1"], "files": ["train/label_cat1.csv"]},
                  {"type": "csv", "features": ["cat_2", "cat_0"], "files": ["train/cats.csv"]}],
        "validation": [{"type": "csv", "features": ["label", "num_0", "num_1", "cat_0", "cat_1", "cat_2"],
                        "files": ["valid/all.csv"]}]},
}


@pytest.fixture(scope="module")
def csv_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("csv")
    gen_csv(FeatureSpec.from_dict(copy.deepcopy(CSV_SPEC), str(path), chunk_type="csv"), 700, 200, seed=3, alpha=1.05)
    return path


def read_csv_columns(csv_dir, chunks):
    """feature -> values, straight from the CSV text."""
    columns = {}
    for chunk in chunks:
        rows = [r for f in chunk["files"] for r in csv.reader(open(csv_dir / f))]
        for j, feature in enumerate(chunk["features"]):
            columns[feature] = np.array([float(r[j]) for r in rows])
    return columns


def test_csv_round_trip(csv_dir, tmp_path):
    auto = copy.deepcopy(CSV_SPEC)
    auto["feature_spec"]["cat_1"]["cardinality"] = "auto"
    with open(tmp_path / "csv_spec.yaml", "w") as f:
        yaml.safe_dump(auto, f)
    out = transcode(str(csv_dir), str(tmp_path / "csv_spec.yaml"), str(tmp_path / "bin"), block=64)
    spec = FeatureSpec.from_yaml(str(tmp_path / "bin" / SPEC_FILE))
    assert spec.to_dict() == out.to_dict() and list(spec.source) == ["train", "validation"]
    for mapping, split in (("train", "train"), ("validation", "eval")):
        want = read_csv_columns(csv_dir, CSV_SPEC["source_spec"][mapping])
        data = SplitBinaryDataset(spec, {split: mapping})
        rows = data.rows(split)
        assert rows == (700 if split == "train" else 200)
        got = data.batch(split, 0, rows)
        np.testing.assert_array_equal(got["labels"], want["label"])
        for k, name in enumerate(spec.numerical):
            np.testing.assert_array_equal(got["numerical"][:, k], want[name].astype(np.float16))
        for f, name in enumerate(spec.categorical):
            np.testing.assert_array_equal(got["categorical"][f], want[name])
    largest = max(read_csv_columns(csv_dir, CSV_SPEC["source_spec"][m])["cat_1"].max() for m in ("train", "validation"))
    assert spec.cardinalities == [10, int(largest) + 1, 500] and spec.dtype("cat_2") == np.int16
    before = {f: os.path.getsize(tmp_path / "bin" / "train" / f) for f in os.listdir(tmp_path / "bin" / "train")}
    transcode_main(["--input", str(csv_dir), "--feature_spec_in", str(tmp_path / "csv_spec.yaml"),
                    "--output", str(tmp_path / "bin")])   # again: replaced, not appended
    assert {f: os.path.getsize(tmp_path / "bin" / "train" / f) for f in os.listdir(tmp_path / "bin" / "train")} == before


CSV_ERRORS = [
    ("train/cats.csv", 4, "3,1,7", "train/cats.csv: line 5: 3 columns, the spec's chunk has 2"),
    ("train/num_b.csv", 0, "0.5,abc", "train/num_b.csv: line 1, column 2: 'abc' is not a number"),
    ("train/cats.csv", 9, "500,1", "train/cats.csv: feature 'cat_2', line 10: ids must be in [0, 500), got 500.0"),
    ("train/cats.csv", 2, "-1,1", "train/cats.csv: feature 'cat_2', line 3: ids must be in [0, 500), got -1.0"),
    ("train/cats.csv", 2, "1.5,1", "feature 'cat_2', line 3: ids must be integers"),
    ("train/num_a.csv", 6, "nan,1", "train/num_a.csv: feature 'num_0', line 7: numerical values must be finite"),
    ("train/label_cat1.csv", 3, "2,1", "train/label_cat1.csv: feature 'label', line 4: labels must be 0 or 1"),
    ("train/cats.csv", None, None, "source_spec.train: the chunks' files have unequal row counts"),
]


@pytest.mark.parametrize("file,line,text,fragment", CSV_ERRORS, ids=[e[3][-40:] for e in CSV_ERRORS])
def test_bad_csv_fails_naming_file_feature_and_line(csv_dir, tmp_path, capsys, file, line, text, fragment):
    bad = tmp_path / "in"
    for chunk in CSV_SPEC["source_spec"]["train"] + CSV_SPEC["source_spec"]["validation"]:
        for f in chunk["files"]:
            os.makedirs(bad / os.path.dirname(f), exist_ok=True)
            lines = open(csv_dir / f).read().splitlines()
            if f == file:
                lines = lines[:-1] if line is None else lines[:line] + [text] + lines[line + 1:]
            open(bad / f, "w").write("\n".join(lines) + "\n")
    with open(bad / SPEC_FILE, "w") as f:
        yaml.safe_dump(CSV_SPEC, f)
    with pytest.raises(SystemExit) as info:
        transcode_main(["--input", str(bad), "--output", str(tmp_path / "out"), "--chunk_size", "4"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and fragment in err and "\n" not in err, err
    assert not os.path.exists(tmp_path / "out" / SPEC_FILE) and not os.path.exists(tmp_path / "out" / "train" / "cat_2.bin")


# Multi-hot CSV fields, a header line, empty numerical fields.

LIST_SPEC = {
    "channel_spec": {"categorical": ["cat", "tags"], "numerical": ["num_0", "num_1"], "label": ["label"]},
    "feature_spec": {"cat": {"cardinality": 5}, "tags": {"cardinality": "auto", "max_hotness": 3},
                     "label": None, "num_0": {}, "num_1": {}},
    "source_spec": {m: [{"type": "csv", "features": ["label", "num_0", "tags", "cat", "num_1"], "files": [f"{m}.csv"]}]
                    for m in ("train", "test")},
}
LIST_CSV = {"train": ["label,num_0,tags,cat,num_1", "1,0.5,3|1|4,2,7", "0,,,0,-1.5", "1,2,9,4,", "0,1e3,1|1,1,0.25"],
            "test": ["label,num_0,tags,cat,num_1", "0,1,,3,2", "1,0,2|7|5,0,1"]}


def write_list_csv(path, replace=None):
    """LIST_SPEC's CSV files under `path`; `replace`: (line number in train.csv, new text)."""
    os.makedirs(path, exist_ok=True)
    for mapping, lines in LIST_CSV.items():
        lines = list(lines)
        if replace and mapping == "train":
            lines[replace[0] - 1] = replace[1]
        open(os.path.join(path, f"{mapping}.csv"), "w").write("\n".join(lines) + "\n")
    with open(os.path.join(path, SPEC_FILE), "w") as f:
        yaml.safe_dump(LIST_SPEC, f)


def test_csv_multi_hot_fields_header_and_empty_numericals(tmp_path):
    write_list_csv(tmp_path / "csv")
    transcode_main(["--input", str(tmp_path / "csv"), "--output", str(tmp_path / "bin"), "--header", "--chunk_size", "3"])
    spec = FeatureSpec.from_yaml(str(tmp_path / "bin" / SPEC_FILE))
    assert spec.cardinalities == [5, 10] and spec.max_hotness == [None, 3]
    want = {"train": ([1, 0, 1, 0], [[0.5, 7], [0, -1.5], [2, 0], [1000, 0.25]], [2, 0, 4, 1], [[3, 1, 4], [], [9], [1, 1]]),
            "eval": ([0, 1], [[1, 2], [0, 1]], [3, 0], [[], [2, 7, 5]])}
    data = SplitBinaryDataset(spec, SPLITS)
    data.validate()
    for split, (labels, numerical, cat, tags) in want.items():
        got = data.batch(split, 0, data.rows(split))
        np.testing.assert_array_equal(got["labels"], labels)
        np.testing.assert_array_equal(got["numerical"], numerical)
        np.testing.assert_array_equal(got["categorical"][0], cat)
        ragged = got["categorical"][1]
        assert [list(ragged.values[a:b]) for a, b in zip(ragged.row_splits, ragged.row_splits[1:])] == tags


LIST_ERRORS = [
    (2, "1,0.5,3|1|4|2,2,7", "train.csv: feature 'tags', line 2: 4 ids, more than its max_hotness 3"),
    (3, "0,,5|x,0,-1.5", "train.csv: line 3, column 3: 'x' is not a number"),
    (2, "1,0.5,3|1.5,2,7", "train.csv: feature 'tags', line 2: ids must be integers, got 1.5"),
    (5, "0,1e3,1|-1,1,0.25", "train.csv: feature 'tags', line 5: ids must be in [0, 10), got -1.0"),
    (4, ",2,9,4,", "train.csv: line 4, column 1: '' is not a number"),   # a label must be there
    (4, "1,2,9,,", "train.csv: line 4, column 4: '' is not a number"),   # and a one-hot id
]


@pytest.mark.parametrize("line,text,fragment", LIST_ERRORS, ids=[e[2][-36:] for e in LIST_ERRORS])
def test_bad_multi_hot_csv_fails_naming_file_feature_and_line(tmp_path, capsys, line, text, fragment):
    write_list_csv(tmp_path / "csv", (line, text))
    with pytest.raises(SystemExit) as info:
        transcode_main(["--input", str(tmp_path / "csv"), "--output", str(tmp_path / "bin"), "--header"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err == f"error: {tmp_path / 'csv'}/{fragment}", err


def test_csv_chunks_have_no_offsets_files():
    raw = copy.deepcopy(LIST_SPEC)
    raw["source_spec"]["train"][0]["offsets"] = ["train.offsets.csv"]
    with pytest.raises(DatasetError, match=r"source_spec.train\[0\].offsets: csv chunks have no offsets files"):
        FeatureSpec.from_dict(raw, chunk_type="csv")


def test_generated_multi_hot_csv_transcodes_to_the_generated_binary_dataset(tmp_path):
    """gen_csv.py's multi-hot fields, through transcode.py, hold the ids generate_dataset.py writes."""
    raw = copy.deepcopy(LIST_SPEC)
    raw["feature_spec"]["tags"]["cardinality"] = 10
    raw["feature_spec"]["num_0"] = raw["feature_spec"]["num_1"] = {"dtype": "float32"}
    gen_csv(FeatureSpec.from_dict(raw, str(tmp_path / "csv"), chunk_type="csv"), 300, 50, seed=3, alpha=1.05)
    transcode(str(tmp_path / "csv"), str(tmp_path / "csv" / SPEC_FILE), str(tmp_path / "bin"), block=64)
    spec = split_binary_spec(["num_0", "num_1"], {"cat": 5, "tags": 10}, max_hotness={"tags": 3},
                             numerical_dtype="float32", base_dir=str(tmp_path / "ref"))
    generate(spec, 300, 50, seed=3, alpha=1.05)
    got = SplitBinaryDataset(FeatureSpec.from_yaml(str(tmp_path / "bin" / SPEC_FILE)), SPLITS)
    want = SplitBinaryDataset(spec, SPLITS)
    for split, rows in (("train", 300), ("eval", 50)):
        a, b = got.batch(split, 0, rows), want.batch(split, 0, rows)
        np.testing.assert_array_equal(a["labels"], b["labels"])
        np.testing.assert_allclose(a["numerical"], b["numerical"], rtol=1e-6)
        np.testing.assert_array_equal(a["categorical"][0], b["categorical"][0])
        for x, y in zip(a["categorical"][1], b["categorical"][1]):
            np.testing.assert_array_equal(x, y)
        assert len(b["categorical"][1].values) > rows   # multi-hot rows of several ids


def test_a_side_feature_misaligned_with_its_history_is_one_line(tmp_path):
    """The spec's metadata aligned_with (as preproc.raw writes it): a side feature holding another
    count of ids than its history in some row stops the loader at the first such batch, naming the
    file, row and both features; with the same counts it reads."""
    path = tmp_path / "data"
    spec = make_dataset(path, rows=400, eval_rows=100, hot={"c1": 3, "c2": 3})
    spec.metadata["aligned_with"] = {"c2": "c1"}
    with pytest.raises(DatasetError) as info:
        every_batch(SplitBinaryDataset(spec, SPLITS))
    line = str(info.value)
    row = int(line.split()[2][:-1])
    counts = [np.diff(np.fromfile(path / "train" / f"{c}.offsets.bin", np.int64))[row] for c in ("c2", "c1")]
    assert counts[0] != counts[1] and line == (
        f"{path}/train/c2.offsets.bin: row {row}: feature 'c2' holds {counts[0]} ids, the history 'c1' it is aligned "
        f"with (the spec's metadata aligned_with) {counts[1]}: a side feature holds one id per event of its history")
    for mapping in ("train", "test"):   # c2 made c1's copy: aligned
        shutil.copy(path / mapping / "c1.offsets.bin", path / mapping / "c2.offsets.bin")
        np.fromfile(path / mapping / "c1.bin", spec.dtype("c1")).astype(spec.dtype("c2")).tofile(path / mapping / "c2.bin")
    every_batch(SplitBinaryDataset(spec, SPLITS))
