"""Growing vocabularies (preproc --vocab_capacity, --vocab_from, --freeze_vocab): capacities, ids of
new values by hand and against a Counter reference, capacity limits, a chain of days, old files."""
import json
import os
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from preproc import generate, vocab, vocab_info
from preproc.criteo import options, parse_capacity, parse_thresholds, parser
from preproc.pipeline import Options, run
from tests import test_preproc
from tests.test_preproc import line, load, read_tree, write_text
from utils.errors import ConfigError

spark = test_preproc.spark          # the fixture: a local Spark session per module

ALL_TRAIN = {"test_fraction": 0.0, "validation_fraction": 0.0}


def day(spark, tmp_path, name, rows, **kw):
    """Preprocesses `rows` (C1, C2, C3 values) as training rows only; returns (output, spec, train, log)."""
    out, messages = tmp_path / name, []
    raw = write_text(tmp_path / f"{name}.txt", [line("1", ["1"], cats) for cats in rows])
    run(spark, Options([raw], str(out), **ALL_TRAIN, **kw), log=messages.append)
    spec, train = load(out, "train")
    return out, spec, train, messages


def entries(out, feature):
    got = np.load(out / "vocab" / f"{feature}.npy")
    return got["value"].tolist(), got["count"].tolist(), got["generation"].tolist()


def info(out):
    return json.loads((out / "vocab" / "vocab.json").read_text())


# Day 0 (threshold 2): C1 a x3, b x2, c x1 -> a 1, b 2; C2 10 x3, 20 x2 -> 10 1, 20 2; C3 none.
DAY0 = [["a", "10"], ["a", "10"], ["a", "10"], ["b", "20"], ["b", "20"], ["c", "30"]]
# Day 1: C1 new d x3, e x2, f x2 (e before f: a tie), 77 x1 (rare); C2 new 40 x3, 50 x2, 60 x1.
DAY1 = [["d", "40"], ["d", "40"], ["d", "40"], ["f", "50"], ["e", "50"], ["e", "10"], ["f", "60"], ["a", ""],
        ["77", "20"]]


def test_capacity_flag_and_spec(spark, tmp_path):
    """Capacity = ceil(headroom x (K + 1)) or the rows given per feature; the spec's cardinality and
    dtype follow it; a per-feature capacity below K + 1 is one error naming the feature."""
    out, spec, train, _ = day(spark, tmp_path, "d0", DAY0, thresholds=parse_thresholds("2"),
                              headroom=Fraction(3, 2), capacity_rows={2: 200})
    assert spec.cardinalities[:4] == [5, 5, 200, 2]               # ceil(1.5 x 3) = 5; C3 given; ceil(1.5 x 1) = 2
    assert [spec.dtype(f).name for f in ("cat_0", "cat_2")] == ["int8", "int16"]
    np.testing.assert_array_equal(train["categorical"][0], [1, 1, 1, 2, 2, 0])
    assert entries(out, "cat_0") == ([0xA, 0xB], [3, 2], [0, 0])
    assert info(out)["generation"] == 0
    assert info(out)["features"]["cat_0"] == {"capacity": 5, "threshold": 2,
                                              "generations": [{"generation": 0, "first_id": 1, "end_id": 3}]}
    report = spec.metadata["vocabularies"]
    assert report["mode"] == "new" and report["features"]["cat_2"] == {
        "ids": 0, "capacity": 200, "ids_left": 199, "added": 0, "past_capacity": 0, "past_capacity_rows": 0}
    _, spec, _, _ = day(spark, tmp_path, "plain", DAY0, thresholds=parse_thresholds("2"))
    assert spec.cardinalities[:3] == [3, 3, 1]                      # default: no headroom (K + 1)
    with pytest.raises(ConfigError, match=r"^--vocab_capacity: C2 \(cat_1\) needs at least 3 rows \(2 values \+ "
                                          r"id 0\), got 2$"):
        day(spark, tmp_path, "small", DAY0, thresholds=parse_thresholds("2"), capacity_rows={1: 2})


def test_growth_by_hand_and_chain(spark, tmp_path):
    """Day 1 grows day 0's vocabularies: old ids kept, new frequent values next (count desc, value
    asc) up to capacity, the rest id 0 and counted; day 2 (from day 1, threshold overridden) keeps
    every earlier id."""
    day0, spec0, _, _ = day(spark, tmp_path, "d0", DAY0, thresholds=parse_thresholds("2"), headroom=Fraction(2),
                            capacity_rows={1: 4})
    assert spec0.cardinalities[:3] == [6, 4, 2]
    day1, spec1, train, log = day(spark, tmp_path, "d1", DAY1, vocab_from=str(day0))
    assert spec1.cardinalities == spec0.cardinalities
    assert [spec1.dtype(f) for f in spec1.categorical] == [spec0.dtype(f) for f in spec0.categorical]
    np.testing.assert_array_equal(train["categorical"][0], [3, 3, 3, 5, 4, 4, 5, 1, 0])     # d 3, e 4, f 5, 77 0
    np.testing.assert_array_equal(train["categorical"][1], [3, 3, 3, 0, 0, 1, 0, 0, 2])     # 40 3; 50 past capacity
    assert entries(day1, "cat_0") == ([0xA, 0xB, 0xD, 0xE, 0xF], [4, 2, 3, 2, 2], [0, 0, 1, 1, 1])
    assert entries(day1, "cat_1") == ([0x10, 0x20, 0x40], [4, 3, 3], [0, 0, 1])
    vocab1 = info(day1)
    assert vocab1["generation"] == 1
    assert vocab1["features"]["cat_0"]["generations"] == [{"generation": 0, "first_id": 1, "end_id": 3},
                                                          {"generation": 1, "first_id": 3, "end_id": 6}]
    assert vocab1["features"]["cat_1"]["generations"][1] == {"generation": 1, "first_id": 3, "end_id": 4}
    assert vocab1["features"]["cat_1"]["capacity"] == 4 and vocab1["features"]["cat_1"]["threshold"] == 2
    report = spec1.metadata["vocabularies"]
    assert report["mode"] == "grown" and report["generation"] == 1
    assert report["features"]["cat_0"] == {"ids": 5, "capacity": 6, "ids_left": 0, "added": 3, "past_capacity": 0,
                                           "past_capacity_rows": 0}
    assert report["features"]["cat_1"] == {"ids": 3, "capacity": 4, "ids_left": 0, "added": 1, "past_capacity": 1,
                                           "past_capacity_rows": 2}
    assert log == ["cat_1: capacity 4 full: 1 new values (2 training rows) -> id 0",
                   "vocabulary generation 1: 4 values added, 1 past capacity"]

    # Day 2 from day 1, threshold 3: C1 full (ab x3 past capacity); C2 full; C3 7 x3 gets id 1, 8 x2 rare.
    day2_rows = [["ab", "50", "7"], ["ab", "50", "7"], ["ab", "50", "8"], ["d", "20", "7"], ["a", "", "8"]]
    day2, spec2, train, _ = day(spark, tmp_path, "d2", day2_rows, vocab_from=str(day1),
                                thresholds=parse_thresholds("3"))
    assert spec2.cardinalities == spec0.cardinalities
    np.testing.assert_array_equal(train["categorical"][0], [0, 0, 0, 3, 1])
    np.testing.assert_array_equal(train["categorical"][1], [0, 0, 0, 2, 0])
    np.testing.assert_array_equal(train["categorical"][2], [1, 1, 0, 1, 0])
    for feature in ("cat_0", "cat_1", "cat_2"):
        before, after = entries(day1, feature), entries(day2, feature)
        assert after[0][:len(before[0])] == before[0] and after[2][:len(before[2])] == before[2]
    assert entries(day2, "cat_2") == ([7], [3], [2])
    vocab2 = info(day2)
    assert vocab2["generation"] == 2 and vocab2["features"]["cat_2"]["threshold"] == 3
    assert vocab2["features"]["cat_0"]["generations"][2] == {"generation": 2, "first_id": 6, "end_id": 6}
    assert vocab2["features"]["cat_2"]["generations"][2] == {"generation": 2, "first_id": 1, "end_id": 2}
    assert spec2.metadata["vocabularies"]["features"]["cat_0"]["past_capacity_rows"] == 3

    # --freeze_vocab: day 1's vocabularies as they are, 50 and ab still id 0, nothing counted.
    frozen, spec3, train, _ = day(spark, tmp_path, "d2f", day2_rows, vocab_from=str(day1), freeze_vocab=True)
    np.testing.assert_array_equal(train["categorical"][0], [0, 0, 0, 3, 1])
    np.testing.assert_array_equal(train["categorical"][2], [0, 0, 0, 0, 0])
    assert read_tree(frozen / "vocab") == read_tree(day1 / "vocab")
    assert spec3.metadata["vocabularies"]["features"]["cat_0"] == {"ids": 5, "capacity": 6, "ids_left": 0}


def test_old_vocab_files_grow_as_generation_0(spark, tmp_path):
    """An output of the code before growth ((value, count) files, no vocab.json) grows exactly as
    the same output with them: generation 0, capacities from its spec, thresholds from its metadata."""
    day0, _, _, _ = day(spark, tmp_path, "d0", DAY0, thresholds=parse_thresholds("2,C2:3"), headroom=Fraction(2))
    old = tmp_path / "old"
    os.makedirs(old / "vocab")
    (old / "feature_spec.yaml").write_bytes((day0 / "feature_spec.yaml").read_bytes())
    for name in os.listdir(day0 / "vocab"):
        if name.endswith(".npy"):
            new = np.load(day0 / "vocab" / name)
            stored = np.zeros(len(new), [("value", "<u8"), ("count", "<i8")])
            stored["value"], stored["count"] = new["value"], new["count"]
            np.save(old / "vocab" / name, stored)
    assert vocab.load(str(old), "cat_0").tolist() == np.load(day0 / "vocab" / "cat_0.npy").tolist()
    assert vocab_info.load(str(old), ["cat_0", "cat_1"]) == {
        "generation": 0, "features": {f: info(day0)["features"][f] for f in ("cat_0", "cat_1")}}
    from_new, _, _, _ = day(spark, tmp_path, "a", DAY1, vocab_from=str(day0))
    from_old, _, _, _ = day(spark, tmp_path, "b", DAY1, vocab_from=str(old))
    assert read_tree(from_new / "vocab") == read_tree(from_old / "vocab")
    assert entries(from_old, "cat_1") == ([0x10, 0x40], [4, 3], [0, 1])           # C2 threshold 3 kept


def reference_grow(values, counts, rows, threshold, capacity):
    """The grown (values, counts, generation 1 flags) and training ids by Counter and sorted()."""
    seen = Counter(v for v in rows if v is not None)
    old = dict(zip(values, counts))
    new = sorted((v for v in seen if v not in old and seen[v] >= threshold), key=lambda v: (-seen[v], v))
    new = new[:max(capacity - 1 - len(values), 0)]
    grown = list(values) + new
    ids = {v: k + 1 for k, v in enumerate(grown)}
    counts = [old.get(v, 0) + seen[v] for v in grown]
    return grown, counts, [0] * len(values) + [1] * len(new), [ids.get(v, 0) for v in rows]


def generated_rows(path):
    with open(path) as f:
        fields = [text.rstrip("\n").split("\t")[14:] for text in f]
    return [[int(row[k], 16) if row[k] else None for row in fields] for k in range(26)]


def test_growth_against_a_reference_and_any_partitioning(spark, tmp_path):
    """Generated days (shared and new values): the grown vocabularies and training ids equal a
    Counter reference for every feature, whatever the splits; some features reach capacity."""
    raw0, raw1 = tmp_path / "day0.tsv", tmp_path / "day1.tsv"
    generate.write(generate.generate(3000, seed=1), str(raw0))
    generate.write(generate.generate(3000, seed=2), str(raw1))
    day0 = tmp_path / "d0"
    run(spark, Options([str(raw0)], str(day0), **ALL_TRAIN, thresholds=parse_thresholds("2"), headroom=Fraction(6, 5)),
        log=lambda m: None)
    outs = []
    for split_bytes, block_bytes in ((1 << 30, 8 << 20), (100 << 10, 30 << 10)):
        outs.append(tmp_path / f"d1-{split_bytes}")
        run(spark, Options([str(raw1)], str(outs[-1]), **ALL_TRAIN, vocab_from=str(day0), split_bytes=split_bytes,
                           block_bytes=block_bytes), log=lambda m: None)
    assert read_tree(outs[0]) == read_tree(outs[1])
    spec, train = load(outs[0], "train")
    rows, full = generated_rows(raw1), 0
    for k, feature in enumerate(spec.categorical):
        values, counts, _ = entries(day0, feature)
        grown, counts, generations, ids = reference_grow(values, counts, rows[k], 2, spec.cardinalities[k])
        assert entries(outs[0], feature) == (grown, counts, generations), feature
        np.testing.assert_array_equal(train["categorical"][k], ids, err_msg=feature)
        full += spec.metadata["vocabularies"]["features"][feature]["past_capacity"] > 0
    assert full >= 3


def test_flags():
    assert parse_capacity("1.5") == (Fraction(3, 2), {})
    assert parse_capacity("2,C3:1000000") == (Fraction(2), {2: 1000000})
    assert parse_capacity("C26:7") == (Fraction(1), {25: 7})
    for bad in ("0.5", "C3:0", "C27:5", "x", "C3:1.5"):
        with pytest.raises(ConfigError, match="^--vocab_capacity"):
            parse_capacity(bad)
    assert vocab_info.capacity(3, Fraction(11, 10), None, "C1") == 4           # ceil(3.3), exactly
    assert vocab_info.capacity(10, Fraction(11, 10), None, "C1") == 11         # 1.1 x 10 is 11 (not 12)
    base = ["--input", "x", "--output", "y"]
    assert options(parser().parse_args(base)).thresholds is None
    for extra, message in ((["--freeze_vocab"], "--freeze_vocab needs --vocab_from"),
                           (["--vocab_from", "z", "--vocab_capacity", "2"], "--vocab_capacity has no effect"),
                           (["--vocab_from", "z", "--freeze_vocab", "--frequency_threshold", "2"],
                            "--frequency_threshold has no effect with --freeze_vocab")):
        with pytest.raises(ConfigError, match=message):
            options(parser().parse_args(base + extra))


def test_grow_unit():
    """vocab.grow on its own: counts added, new values ranked, cut at capacity, report."""
    old = vocab.rank(np.array([5, 9], np.uint64), np.array([4, 7], np.int64), 1)
    values, counts = np.array([1, 9, 2, 3, 4], np.uint64), np.array([2, 1, 5, 2, 1], np.int64)
    grown, report = vocab.grow(old, values, counts, 2, 5, 3)
    assert grown["value"].tolist() == [9, 5, 2, 1] and grown["count"].tolist() == [8, 4, 5, 2]
    assert grown["generation"].tolist() == [0, 0, 3, 3]
    assert report == {"added": 2, "past_capacity": 1, "past_capacity_rows": 2}     # 3 (count 2) past capacity
    assert old["count"].tolist() == [7, 4]                                            # not modified
