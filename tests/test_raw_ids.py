"""Raw ids (preproc --raw_id_columns): the columns' values become 64-bit keys (an integer itself, a
hex number its value, a string SipHash-2-4 + splitmix64, checked here against a pure-Python
computation), with no vocabulary; the feature spec marks them (`raw_ids: true`, int64, no
cardinality); split-binary and split-TFRecord readers give them as int64; the other columns'
files are byte for byte those of the mode off; bad flags and specs stop in one line; training
refuses a raw-id feature without a dynamic table."""
import math
import os
import re
import struct

import numpy as np
import pandas as pd
import pytest
import yaml

from dataloading.feature_spec import SPEC_FILE, FeatureSpec, split_binary_spec
from dataloading.split_binary import SplitBinaryDataset
from dataloading.writer import MappingWriter
from preproc import criteo, distinct, generate, raw
from preproc.pipeline import run
from parallel_embedding.planner import DynamicOptions
from utils.errors import ConfigError, DatasetError
from tests.support.warm_python import PYTHON

M64 = (1 << 64) - 1


def _rotl(x, b):
    return ((x << b) | (x >> (64 - b))) & M64


def siphash24(key: bytes, data: bytes) -> int:
    """SipHash-2-4 (Aumasson and Bernstein), one byte string at a time."""
    k0, k1 = struct.unpack("<QQ", key)
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]

    def sip_round():
        v[0] = (v[0] + v[1]) & M64
        v[1] = _rotl(v[1], 13) ^ v[0]
        v[0] = _rotl(v[0], 32)
        v[2] = (v[2] + v[3]) & M64
        v[3] = _rotl(v[3], 16) ^ v[2]
        v[0] = (v[0] + v[3]) & M64
        v[3] = _rotl(v[3], 21) ^ v[0]
        v[2] = (v[2] + v[1]) & M64
        v[1] = _rotl(v[1], 17) ^ v[2]
        v[2] = _rotl(v[2], 32)

    whole = len(data) - len(data) % 8
    last = (len(data) & 0xFF) << 56 | int.from_bytes(data[whole:], "little")
    for m in [struct.unpack_from("<Q", data, i)[0] for i in range(0, whole, 8)] + [last]:
        v[3] ^= m
        sip_round()
        sip_round()
        v[0] ^= m
    v[2] ^= 0xFF
    for _ in range(4):
        sip_round()
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def string_key(text: str) -> int:
    """The documented key of a string: SipHash-2-4 of its UTF-8 bytes under the key
    b"0123456789123456", then splitmix64's finaliser; as a signed int64 (the id on disk)."""
    z = siphash24(b"0123456789123456", text.encode("utf-8"))
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return signed(z ^ (z >> 31))


def signed(key: int) -> int:
    return key - (1 << 64) if key >= 1 << 63 else key


def test_the_string_hash_is_siphash_then_splitmix():
    words = ["", "a", "news", "héllo wörld ✓", "x" * 7, "y" * 8, "z" * 9, "abcdefghijklmnopq" * 3, "日本"]
    keys = pd.util.hash_array(np.array(words, object), categorize=False).view(np.int64)
    assert keys.tolist() == [string_key(w) for w in words]


HEADER = "click,price,user,site,color,tags,other"
LINES = [
    "1,1.5,7,news,0a,a|b,x",
    "0,,-3,shop,ffffffffffffffff,,y",
    "1,2,9223372036854775807,héllo,,b|c|a,x",
    "0,3,,news,1,a,x",
    "1,4,-9223372036854775808,,7fffffffffffffff,c,y",
    "0,5,7,blog,10,a|a,z",
]
SPEC = {
    "inputs": {"paths": ["log.csv"]},
    "label": "click",
    "numerical": ["price"],
    "categorical": [{"column": "user", "type": "int"},
                    "site",
                    {"column": "color", "type": "hex"},
                    {"column": "tags", "delimiter": "|", "max_hotness": 3},
                    {"column": "other", "threshold": 2}],
    "split": {"test": 0, "validation": 0},
}
RAW = ["user", "site", "color", "tags"]


@pytest.fixture(scope="module")
def spark(spark_local):
    """The suite's local Spark session, 2 shuffle partitions."""
    spark_local.conf.set("spark.sql.shuffle.partitions", "2")
    return spark_local


def write_spec(folder, spec=SPEC):
    path = folder / "raw.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def run_raw(spark, spec_path, output, *flags):
    return run(spark, raw.options(raw.parser().parse_args(["--spec", spec_path, "--output", str(output), *flags])),
               log=lambda m: None)


def files(root, mapping="train"):
    return {name: (root / mapping / name).read_bytes() for name in sorted(os.listdir(root / mapping))}


def ragged(ids):
    return [ids.values[a:b].tolist() for a, b in zip(ids.row_splits[:-1], ids.row_splits[1:])]


def test_raw_ids_of_a_small_csv(spark, tmp_path):
    (tmp_path / "log.csv").write_text("\n".join([HEADER] + LINES) + "\n", encoding="utf-8")
    spec_path = write_spec(tmp_path)
    summary = run_raw(spark, spec_path, tmp_path / "raw", "--raw_id_columns=" + ",".join(RAW))
    run_raw(spark, spec_path, tmp_path / "off")
    assert summary["rows"] == {"train": 6, "test": 0, "validation": 0} and summary["bad_lines"] == 0
    spec = FeatureSpec.from_yaml(str(tmp_path / "raw" / SPEC_FILE))
    assert spec.raw_id_features == RAW and spec.cardinalities == [None] * 4 + [3]
    on_disk = yaml.safe_load((tmp_path / "raw" / SPEC_FILE).read_text())["feature_spec"]
    assert on_disk["user"] == {"dtype": "int64", "raw_ids": True}
    assert on_disk["tags"] == {"dtype": "int64", "max_hotness": 3, "raw_ids": True}
    assert "raw_ids" not in on_disk["other"] and "user" in summary["raw_ids"]
    assert spec.metadata["categorical"]["user"] == "user (int); raw ids: the key as int64"
    # distinct keys of the training rows, missing values not counted: exact at these counts
    assert summary["distinct_ids"] == spec.metadata["distinct_ids"] == {"user": 4, "site": 4, "color": 5, "tags": 3}
    # no vocabulary for the raw-id columns; the other column's as with the mode off
    assert sorted(os.listdir(tmp_path / "raw" / "vocab")) == ["other.npy", "vocab.json"]
    vocabularies = [(tmp_path / out / "vocab" / "other.npy").read_bytes() for out in ("raw", "off")]
    assert vocabularies[0] == vocabularies[1]
    assert list(summary["vocabularies"]["features"]) == ["other"]

    data = SplitBinaryDataset(spec, {"train": "train"})
    assert data.id_dtype == np.int64
    batch = data.batch("train", 0, 6)
    user, site, color, tags, other = batch["categorical"]
    assert user.dtype == np.int64 and user.tolist() == [7, -3, 2 ** 63 - 1, 0, -2 ** 63, 7]   # missing: 0
    assert site.tolist() == [string_key(s) for s in ("news", "shop", "héllo", "news")] + [0, string_key("blog")]
    assert color.tolist() == [10, -1, 0, 1, 2 ** 63 - 1, 16]
    assert tags.values.dtype == np.int64 and tags.row_splits.tolist() == [0, 2, 2, 5, 6, 7, 9]
    assert tags.values.tolist() == [string_key(t) for t in "ab" "bca" "a" "c" "aa"]
    assert other.tolist() == [1, 2, 1, 1, 2, 0]
    np.testing.assert_array_equal(np.fromfile(tmp_path / "raw" / "train" / "user.part00000.bin", np.int64), user)

    # everything but the raw-id columns is byte for byte the mode off's
    raw_files, off = files(tmp_path / "raw"), files(tmp_path / "off")
    changed = {n for n in off if raw_files[n] != off[n]}
    assert set(raw_files) == set(off) and changed == {"user.part00000.bin", "site.part00000.bin",
                                                      "color.part00000.bin", "tags.part00000.bin"}
    # shuffled rows go through Spark's sort as records: the same ids, in the rows' new order
    run_raw(spark, spec_path, tmp_path / "shuffled", "--raw_id_columns=" + ",".join(RAW), "--shuffle")
    shuffled = SplitBinaryDataset(FeatureSpec.from_yaml(str(tmp_path / "shuffled" / SPEC_FILE)),
                                  {"train": "train"}).batch("train", 0, 6)
    order = [batch["numerical"][:, 0].tolist().index(v) for v in shuffled["numerical"][:, 0].tolist()]
    assert sorted(order) == list(range(6)) and order != list(range(6))
    for k in (0, 1, 2, 4):
        assert shuffled["categorical"][k].tolist() == batch["categorical"][k][order].tolist()
    assert ragged(shuffled["categorical"][3]) == [ragged(tags)[i] for i in order]

    off_spec = FeatureSpec.from_yaml(str(tmp_path / "off" / SPEC_FILE))
    assert off_spec.raw_id_features == [] and off_spec.features["other"] == spec.features["other"]
    assert SplitBinaryDataset(off_spec, {"train": "train"}).id_dtype == np.int32


def test_criteo_raw_ids_of_a_generated_log(spark, tmp_path):
    table = generate.generate(400, seed=3)
    generate.write(table, str(tmp_path / "day.tsv"))
    args = ["--input", str(tmp_path / "day.tsv"), "--test_fraction=0", "--validation_fraction=0",
            "--frequency_threshold=2"]
    run(spark, criteo.options(criteo.parser().parse_args(args + ["--output", str(tmp_path / "off")])),
        log=lambda m: None)
    lines = []
    run(spark, criteo.options(criteo.parser().parse_args(args + ["--output", str(tmp_path / "raw"),
                                                                 "--raw_id_columns=C1,C3"])), log=lines.append)
    spec = FeatureSpec.from_yaml(str(tmp_path / "raw" / SPEC_FILE))
    assert spec.raw_id_features == ["cat_0", "cat_2"]
    exact = {f"cat_{k}": len({v for v in table.column(f"C{k + 1}").to_pylist() if v is not None}) for k in (0, 2)}
    estimated = spec.metadata["distinct_ids"]
    assert set(estimated) == set(exact) and all(abs(estimated[f] - n) <= 0.02 * n for f, n in exact.items()), \
        (estimated, exact)
    assert "distinct ids in the training rows (estimated, for --dynamic_tables): " \
        f"C1 (cat_0) {estimated['cat_0']:,}, C3 (cat_2) {estimated['cat_2']:,}" in lines, lines
    batch = SplitBinaryDataset(spec, {"train": "train"}).batch("train", 0, 400)
    for k, column in ((0, "C1"), (2, "C3")):     # 8-digit hex hashes, as the real logs have: their numbers
        expected = [0 if v is None else int(v, 16) for v in table.column(column).to_pylist()]
        assert batch["categorical"][k].tolist() == expected and max(expected) >= 2 ** 31
    raw_files, off = files(tmp_path / "raw"), files(tmp_path / "off")
    assert {n for n in off if raw_files[n] != off[n]} == {"cat_0.part00000.bin", "cat_2.part00000.bin"}
    assert sorted(os.listdir(tmp_path / "raw" / "vocab")) == sorted(
        n for n in os.listdir(tmp_path / "off" / "vocab") if n not in ("cat_0.npy", "cat_2.npy"))


def test_a_vocabulary_does_not_become_raw_ids_day_after_day(spark, tmp_path):
    (tmp_path / "log.csv").write_text("\n".join([HEADER] + LINES) + "\n", encoding="utf-8")
    spec_path = write_spec(tmp_path)
    run_raw(spark, spec_path, tmp_path / "d0", "--raw_id_columns=site")
    run_raw(spark, spec_path, tmp_path / "d1", "--raw_id_columns=site", "--vocab_from", str(tmp_path / "d0"))
    with pytest.raises(DatasetError, match=r"^--raw_id_columns: user has a vocabulary in --vocab_from .*/d0 \(a "
                                           r"feature keeps its ids day after day: raw ids need a new first dataset\)$"):
        run_raw(spark, spec_path, tmp_path / "d2", "--raw_id_columns=site,user", "--vocab_from", str(tmp_path / "d0"))
    assert not (tmp_path / "d2").exists()
    spec = FeatureSpec.from_yaml(str(tmp_path / "d1" / SPEC_FILE))
    assert spec.raw_id_features == ["site"] and spec.metadata["vocabularies"]["mode"] == "grown"


@pytest.mark.parametrize("flags,message", [
    (["--raw_id_columns=user,sight"], "--raw_id_columns: 'sight' is not a categorical feature "
                                      "(user, site, color, tags, other, or all)"),
    (["--raw_id_columns=,"], "--raw_id_columns: name the columns (or all)"),
    (["--raw_id_columns=other"], "--raw_id_columns: other has a threshold in"),
    (["--raw_id_columns=user", "--vocab_capacity=user:10"],
     "--vocab_capacity: user has raw ids (--raw_id_columns): no vocabulary to set"),
])
def test_raw_spec_flags_are_refused_in_one_line(tmp_path, flags, message):
    with pytest.raises(ConfigError) as e:
        raw.options(raw.parser().parse_args(["--spec", write_spec(tmp_path), "--output", str(tmp_path / "o"), *flags]))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flags,message", [
    (["--raw_id_columns=C0"], "--raw_id_columns: 'C0' is not a categorical feature (C1..C26 or cat_0..cat_25, or all)"),
    (["--raw_id_columns=C3", "--frequency_threshold=2,C3:4"],
     "--frequency_threshold: C3 has raw ids (--raw_id_columns): no vocabulary to set"),
    (["--raw_id_columns=all", "--frequency_threshold=2"],
     "--frequency_threshold has no effect: every column has raw ids (--raw_id_columns)"),
    (["--raw_id_columns=all", "--vocab_capacity=2"],
     "--vocab_capacity has no effect: every column has raw ids (--raw_id_columns)"),
])
def test_criteo_flags_are_refused_in_one_line(tmp_path, flags, message):
    with pytest.raises(ConfigError) as e:
        criteo.options(criteo.parser().parse_args(["--input", "x", "--output", str(tmp_path), *flags]))
    assert str(e.value) == message


def test_criteo_raw_ids_keep_the_other_thresholds():
    opts = criteo.options(criteo.parser().parse_args(["--input", "x", "--output", "o", "--raw_id_columns=C2",
                                                      "--frequency_threshold=3,C5:4"]))
    assert opts.thresholds == [3, 0, 3, 3, 4] + [3] * 21
    assert opts.source.schema.raw_ids == ["cat_1"] and 1 not in opts.source.schema.counted
    # the name training gives a column is accepted too, for every per-feature flag
    same = criteo.options(criteo.parser().parse_args(["--input", "x", "--output", "o", "--raw_id_columns=cat_1",
                                                      "--frequency_threshold=3,cat_4:4"]))
    assert same.thresholds == opts.thresholds and same.source.schema.raw_ids == ["cat_1"]


def test_dynamic_tables_from_the_datasets_distinct_ids(tmp_path):
    """--dynamic_tables=all:<factor>x: every raw-id feature, its capacity the factor times its
    distinct ids in the spec's metadata (rounded up); an entry of its own wins; a feature named as
    preprocessing named it (the metadata's columns); the refusals in one line."""
    from tests.support.flag_defaults import build
    write_raw_dataset(tmp_path, np.arange(4), np.zeros(0, np.int64), np.zeros(4, np.int64))
    spec_path = tmp_path / SPEC_FILE
    on_disk = yaml.safe_load(spec_path.read_text())
    data = dict(dataset_type="split_binary", dataset_path=str(tmp_path), eval_mapping="train")
    with pytest.raises(ConfigError, match=r"^--dynamic_tables entry 'all:2x': a capacity of 2x the distinct ids "
                                          r"needs ids's count in the dataset's metadata .*: give its rows$"):
        build(**data, dynamic_tables=["all:2x"])
    on_disk["metadata"] = {"distinct_ids": {"ids": 1001, "hot": 30}, "columns": {"ids": "user_id", "c": "C2"}}
    spec_path.write_text(yaml.safe_dump(on_disk))
    assert build(**data, dynamic_tables=["all:1.5x"]).dynamic_tables == {0: DynamicOptions(1502), 2: DynamicOptions(45)}
    assert build(**data, dynamic_tables=["all:1.5x:2:lfu", "user_id:64"]).dynamic_tables == {
        0: DynamicOptions(64), 2: DynamicOptions(45, 2, "lfu")}
    assert build(**data, dynamic_tables=["all:0.1x:1:lru:0:2"]).dynamic_tables == {
        0: DynamicOptions(101, shards=2), 2: DynamicOptions(3, shards=2)}
    assert build(**data, dynamic_tables=["user_id:2x", "hot:8"]).data.shape.cardinalities == [2002, 5, 8]
    with pytest.raises(ConfigError, match=r"^feature ids has raw ids .*: it needs a dynamic table "
                                          r"\(--dynamic_tables=ids:<capacity>, or all:<factor>x for every raw-id "
                                          r"feature\) \(its training rows have about 1,001 distinct ids\)$"):
        build(**data)
    for entries, message in ((["all:2x", "all:3x"], "'all' is given twice"),
                             (["all:0x"], "the factor of the distinct ids must be above 0"),
                             (["all:2y"], "expected <feature>:<capacity>"),
                             (["C2:2x", "all:2x"], "a capacity of 2x the distinct ids needs c's count")):
        with pytest.raises(ConfigError, match=message) as e:
            build(**data, dynamic_tables=entries)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^--dynamic_tables entry 'all:10': 'all' means every feature with raw ids, "
                                          r"and this dataset has none"):
        build(dynamic_tables=["all:10"])


def raw_spec_dict(**feature):
    spec = split_binary_spec(["n"], {"ids": None, "c": 5}, mappings=["train"])
    raw_entry = spec.to_dict()
    raw_entry["feature_spec"]["ids"] = dict(raw_entry["feature_spec"]["ids"], **feature)
    return raw_entry


@pytest.mark.parametrize("change,message", [
    (dict(cardinality=100), "feature_spec.ids.cardinality: a raw-id feature (raw_ids: true) has none"),
    (dict(dtype="int32"), "feature_spec.ids.dtype: raw ids are int64, got 'int32'"),
    (dict(raw_ids="yes"), "feature_spec.ids.raw_ids: must be true or false, got 'yes'"),
    (dict(alpha=1.1), "feature_spec.ids.alpha: a raw-id feature has no synthetic ids to shape"),
])
def test_the_feature_spec_validates_raw_ids(change, message):
    assert FeatureSpec.from_dict(raw_spec_dict()).raw_id_features == ["ids"]
    with pytest.raises(DatasetError) as e:
        FeatureSpec.from_dict(raw_spec_dict(**change))
    assert message in str(e.value) and "\n" not in str(e.value)
    numerical = raw_spec_dict()
    numerical["feature_spec"]["n"]["raw_ids"] = True
    with pytest.raises(DatasetError, match="feature_spec.n.raw_ids: only categorical features have raw_ids"):
        FeatureSpec.from_dict(numerical)


def test_csv_specs_take_no_raw_ids():
    entry = raw_spec_dict()
    for chunk in entry["source_spec"]["train"]:
        chunk["type"] = "csv"
    with pytest.raises(DatasetError, match="feature_spec.ids.raw_ids: csv chunks take ids in"):
        FeatureSpec.from_dict(entry, chunk_type="csv")


def write_raw_dataset(folder, ids, hot_ids, lengths):
    spec = split_binary_spec(["n"], {"ids": None, "c": 5, "hot": None}, mappings=["train"], max_hotness={"hot": 3},
                             base_dir=str(folder))
    with MappingWriter(spec, "train") as writer:
        writer.write({"n": np.zeros(len(ids), np.float16), "label": np.ones(len(ids), bool), "ids": ids,
                      "c": np.arange(len(ids)) % 5, "hot": (hot_ids, lengths)})
    spec.to_yaml(str(folder / SPEC_FILE))
    return spec


def test_readers_give_int64_raw_ids(tmp_path):
    from dataloading.split_tfrecords import open_split_tfrecords
    from dataloading.to_tfrecords import convert
    ids = np.array([2 ** 63 - 1, -2 ** 63, 0, -1, 2 ** 40 + 3, 5, 6, 7], np.int64)
    hot_ids, lengths = np.array([2 ** 50, -7, 3, 2 ** 62], np.int64), np.array([1, 0, 2, 0, 1, 0, 0, 0])
    spec = write_raw_dataset(tmp_path / "bin", ids, hot_ids, lengths)
    data = SplitBinaryDataset(spec, {"train": "train"})
    data.validate()
    got = data.batch("train", 0, 8)["categorical"]
    assert got[0].dtype == np.int64 and got[0].tolist() == ids.tolist() and got[1].dtype == np.int64
    assert got[2].values.tolist() == hot_ids.tolist()
    convert(spec, str(tmp_path / "tfr"), ["train"], 4, 0)
    tfr = open_split_tfrecords(str(tmp_path / "tfr" / SPEC_FILE), {"train": "train"})
    assert tfr.spec.raw_id_features == ["ids", "hot"] and tfr.id_dtype == np.int64
    tfr.validate()
    again = tfr.batch("train", 0, 8)["categorical"]
    assert again[0].tolist() == ids.tolist() and again[2].values.tolist() == hot_ids.tolist()
    assert again[1].tolist() == got[1].tolist()


def test_training_refuses_raw_ids_without_a_dynamic_table(tmp_path):
    from tests.support.flag_defaults import build
    write_raw_dataset(tmp_path, np.arange(4), np.zeros(0, np.int64), np.zeros(4, np.int64))
    for overrides in (dict(dataset_type="split_binary", dataset_path=str(tmp_path), eval_mapping="train"),
                      dict(dataset_path=str(tmp_path), synthetic_dataset_use_feature_spec=True)):
        with pytest.raises(ConfigError) as e:
            build(**overrides)
        assert "\n" not in str(e.value)
    assert str(e.value) == (f"--synthetic_dataset_use_feature_spec: feature ids of {tmp_path / SPEC_FILE} has raw ids "
                            "(no cardinality to draw synthetic ids from)")
    with pytest.raises(ConfigError, match=r"^feature ids has raw ids \(preprocessed with --raw_id_columns\): it needs "
                                          r"a dynamic table \(--dynamic_tables=ids:<capacity>, or all:<factor>x for "
                                          r"every raw-id feature\)$"):
        build(dataset_type="split_binary", dataset_path=str(tmp_path), eval_mapping="train")


@pytest.mark.slow
def test_dlrm_trains_on_raw_ids_with_dynamic_tables(spark, tmp_path):
    """A Criteo-format log preprocessed with raw ids for C1 and C3 (no vocabulary) trains with those
    two tables dynamic: the raw-id features' tables take their capacity's rows, every id their
    maps admit is one of the log's keys; without --dynamic_tables the run is refused in one line."""
    import subprocess
    from storage import checkpoint
    table = generate.generate(600, seed=5)
    generate.write(table, str(tmp_path / "day.tsv"))
    run(spark, criteo.options(criteo.parser().parse_args([
        "--input", str(tmp_path / "day.tsv"), "--test_fraction=0", "--validation_fraction=0",
        "--frequency_threshold=2", "--output", str(tmp_path / "raw"), "--raw_id_columns=C1,C3"])), log=lambda m: None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [*PYTHON, "dlrm.py", "--dataset_type=split_binary", f"--dataset_path={tmp_path / 'raw'}",
            "--eval_mapping=train", "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1",
            "--batch_size=64", "--valid_batch_size=200", "--max_steps=9", "--print_freq=3", "--cpu"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    refused = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    distinct = {f: len({v for v in table.column(c).to_pylist() if v is not None}) for f, c in ((0, "C1"), (2, "C3"))}
    assert re.fullmatch(r"error: feature cat_0 has raw ids \(preprocessed with --raw_id_columns\): it needs a dynamic "
                        r"table \(--dynamic_tables=cat_0:<capacity>, or all:<factor>x for every raw-id feature\) "
                        r"\(its training rows have about [0-9,]+ distinct ids\)", refused.stderr.splitlines()[-1]), \
        refused.stderr
    # every raw-id feature at 1.25x its distinct ids, C3 (cat_2, named as preprocessing named it) at 48 rows
    proc = subprocess.run(args + ["--dynamic_tables=all:1.25x,C3:48:1:lru",
                                  f"--save_checkpoint_path={tmp_path / 'ck'}"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    last = [line for line in proc.stdout.splitlines() if line.startswith("step 9/9")][0]
    evicted = re.search(r"embedding/table_2: 48 live, (\d+) admitted, (\d+) evicted", last)
    assert evicted and int(evicted.group(2)) > 0 and "embedding/table_0: " in last, last
    assert re.search(r"eval at step 9: auc 0\.\d+", proc.stdout), proc.stdout
    manifest = checkpoint.read_manifest(str(tmp_path / "ck"))
    keys = {0: {0 if v is None else int(v, 16) for v in table.column("C1").to_pylist()},
            2: {0 if v is None else int(v, 16) for v in table.column("C3").to_pylist()}}
    capacity_0 = manifest["signature"]["cardinalities"][0]
    counted = FeatureSpec.from_yaml(str(tmp_path / "raw" / SPEC_FILE)).metadata["distinct_ids"]["cat_0"]
    assert abs(counted - distinct[0]) <= 0.02 * distinct[0] and capacity_0 == math.ceil(1.25 * counted)
    assert manifest["signature"]["cardinalities"][2] == 48
    for f, capacity in ((0, capacity_0), (2, 48)):
        ids = checkpoint.read_tensor(manifest["path"], f"embedding/table_{f}/ids")[:, 0]
        assert 0 < len(ids) <= capacity and set(ids.tolist()) <= keys[f] and len(set(ids.tolist())) == len(ids)


@pytest.mark.parametrize("n", [0, 1, 1000, 50_000, 1_000_000])
def test_the_distinct_sketch_counts_a_union_within_its_error(n):
    """Keys in three overlapping pieces (every key twice or more), sketched apart and merged: the
    estimate within 3 standard errors (2.4%) of the exact count, exact for a handful; consecutive
    keys (ids 0..n-1, as integer columns hold) as well as random ones."""
    rng = np.random.default_rng(n)
    for keys in (rng.integers(0, 2 ** 64, n, dtype=np.uint64), np.arange(n, dtype=np.uint64)):
        pieces = [keys[: 2 * n // 3], keys[n // 3:], keys[::2]]
        registers = distinct.sketch(pieces[0])
        for piece in pieces[1:]:
            registers = distinct.merged(registers, distinct.sketch(piece))
        estimate = distinct.estimate(registers)
        assert abs(estimate - n) <= (0 if n < 2 else 0.024 * n), (n, estimate)
