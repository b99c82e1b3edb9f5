"""Criteo preprocessing on Spark (preproc/): a hand-made TSV against hand-computed ids, logs,
thresholds and splits; day layout with gzip; bad lines; determinism; vocabulary reuse; training."""
import gzip
import math
import os
import random
import subprocess

import numpy as np
import pytest

from dataloading.feature_spec import SPEC_FILE, FeatureSpec
from dataloading.split_binary import SplitBinaryDataset
from preproc import criteo, generate
from preproc import layout as layouts
from preproc.criteo import parse_thresholds
from preproc.pipeline import Options, run
from preproc.session import spark_session
from tests.support.horovod_run import ROOT
from utils.errors import ConfigError, DatasetError
from tests.support.warm_python import PYTHON


def line(label, ints=(), cats=()):
    return "\t".join([label, *ints, *[""] * (13 - len(ints)), *cats, *[""] * (26 - len(cats))])


# label, I1, I2, C1, C2; every other field missing.
HAND = [
    line("1", ["0", "-1"], ["a", "10"]),
    line("0", ["5", "-3"], ["b", "10"]),
    line("1", ["", "2"], ["a", "2f"]),
    line("0", ["1", ""], ["", "10"]),
    line("1", ["abc", "0"], ["a", "10"]),      # line 5: bad (I1 is not an integer)
    line("1", ["97", "0"], ["B", "2f"]),       # B is b
    line("0", ["2", "1"], ["a", "ff"]),        # test
    line("1", ["3", "1"], ["c", "10"]),        # test
    line("0", ["0", "0"], ["b", "2f"]),        # validation
    line("1", ["0", "0"], ["00a", "10"]),      # validation (00a is a)
]


@pytest.fixture(scope="module")
def spark(spark_local):
    """The suite's local Spark session, 4 shuffle partitions."""
    spark_local.conf.set("spark.sql.shuffle.partitions", "4")
    return spark_local


def write_text(path, lines):
    data = ("\n".join(lines) + "\n").encode()
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wb") as f:
        f.write(data)
    return str(path)


def opts(inputs, output, **kw):
    kw.setdefault("test_fraction", 0.2)
    kw.setdefault("validation_fraction", 0.2)
    return Options([str(i) for i in inputs], str(output), **kw)


def load(output, mapping):
    spec = FeatureSpec.from_yaml(os.path.join(output, SPEC_FILE))
    data = SplitBinaryDataset(spec, {"x": mapping})
    return spec, data.batch("x", 0, data.rows("x"))


def test_hand_made_file(spark, tmp_path):
    raw = write_text(tmp_path / "train.txt", HAND)
    out = tmp_path / "out"
    messages = []
    summary = run(spark, opts([raw], out, thresholds=parse_thresholds("2,C2:3")), log=messages.append)
    # 10 lines: 6 training lines (one bad), then 2 test and 2 validation lines (fractions 0.2).
    assert summary["rows"] == {"train": 5, "test": 2, "validation": 2}
    assert summary["bad_lines"] == 1 and messages == [f"skipped 1 bad line (first: {raw}:5: I1 is not an integer)"]
    # C1 in training: a x2, b x2 (a tie: a first), missing x1; C2: 10 x3, 2f x2 (threshold 3: rare).
    spec, train = load(out, "train")
    assert spec.cardinalities == [3, 2] + [1] * 24
    assert spec.features["cat_0"].dtype == "int8"
    log = math.log
    expected_numerical = [[log(3), log(2)], [log(8), 0.0], [0.0, log(5)], [log(4), 0.0], [log(100), log(3)]]
    np.testing.assert_array_equal(train["numerical"][:, :2], np.float16(expected_numerical).astype(np.float32))
    assert not train["numerical"][:, 2:].any()
    np.testing.assert_array_equal(train["labels"], [1, 0, 1, 0, 1])
    np.testing.assert_array_equal(train["categorical"][0], [1, 2, 1, 0, 2])
    np.testing.assert_array_equal(train["categorical"][1], [1, 1, 0, 1, 0])
    for k in range(2, 26):
        assert not train["categorical"][k].any()
    _, test = load(out, "test")
    np.testing.assert_array_equal(test["labels"], [0, 1])
    np.testing.assert_array_equal(test["categorical"][0], [1, 0])       # a; c unseen in training
    np.testing.assert_array_equal(test["categorical"][1], [0, 1])       # ff unseen; 10
    np.testing.assert_array_equal(test["numerical"][:, :2], np.float16([[log(5), log(4)], [log(6), log(4)]]))
    _, validation = load(out, "validation")
    np.testing.assert_array_equal(validation["categorical"][0], [2, 1])
    np.testing.assert_array_equal(validation["categorical"][1], [0, 1])
    vocab = np.load(out / "vocab" / "cat_0.npy")
    assert vocab["value"].tolist() == [0xA, 0xB] and vocab["count"].tolist() == [2, 2]
    assert np.load(out / "vocab" / "cat_1.npy")["value"].tolist() == [0x10]
    assert spec.metadata["frequency_threshold"]["cat_1"] == 3 and spec.metadata["frequency_threshold"]["cat_0"] == 2


def test_strict_stops_at_bad_lines(spark, tmp_path):
    raw = write_text(tmp_path / "train.txt", HAND + ["1\t2\t3", line("7")])
    with pytest.raises(DatasetError, match=rf"--strict: 3 bad lines \(first: {raw}:5: I1 is not an integer; "
                                           rf"{raw}:11: 3 fields, expected 40; {raw}:12: label must be 0 or 1\)"):
        run(spark, opts([raw], tmp_path / "out", strict=True))
    assert not (tmp_path / "out" / SPEC_FILE).exists()


def test_malformed_lines_and_inputs_that_stop_the_run(spark, tmp_path):
    """Random bytes and a carriage return inside a line are bad lines with their number (--strict:
    one error naming them); an empty input, a mapping whose every line is bad, a fraction that
    rounds to no line and a last day too short to halve stop the run with one error, writing nothing."""
    garbage = random.Random(0).randbytes(500).replace(b"\n", b"")
    raw = tmp_path / "train.txt"
    raw.write_bytes(b"\n".join([h.encode() for h in HAND[:6]] + [garbage, line("1", ["1"], ["a\rb"]).encode()] +
                               [h.encode() for h in HAND[6:]]) + b"\n")
    summary = run(spark, opts([raw], tmp_path / "out"), log=lambda m: None)
    # 12 lines: 8 train (lines 5, 7, 8 bad), then 2 test and 2 validation lines (fractions 0.2)
    assert summary["rows"] == {"train": 5, "test": 2, "validation": 2}
    assert summary["first_bad_lines"] == [f"{raw}:5: I1 is not an integer", f"{raw}:7: not UTF-8 text",
                                          f"{raw}:8: a carriage return inside the line"]
    out = tmp_path / "o2"
    with pytest.raises(DatasetError, match=rf"^--strict: 3 bad lines \(first: {raw}:5: .*; {raw}:7: not UTF-8 text; "):
        run(spark, opts([raw], out, strict=True))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DatasetError, match=rf"^{empty}: no lines to read \(an empty input\)$"):
        run(spark, opts([empty], out))
    bad_end = write_text(tmp_path / "bad_end.txt", HAND[:8] + [line("7"), line("x")])
    with pytest.raises(DatasetError, match=rf"^validation: no rows: its 2 lines are all bad; 3 bad lines \(first: "
                                           rf"{bad_end}:5: I1 is not an integer; {bad_end}:9: label must be 0 or 1; "):
        run(spark, opts([bad_end], out))
    with pytest.raises(DatasetError, match=r"^validation: no lines: 0.04 of the 10 input lines rounds to none"):
        run(spark, opts([bad_end], out, validation_fraction=0.04))
    days = tmp_path / "days"
    days.mkdir()
    write_text(days / "day_0", HAND[:2])
    write_text(days / "day_1", HAND[2:3])
    with pytest.raises(DatasetError, match=r"^test: no lines: the last day, day_1, has 1 line\(s\), too few to halve"):
        run(spark, Options([str(days)], str(out)))
    assert not out.exists()


def test_split_order():
    """A fraction split puts the mappings in the order asked for (--split_order), its lines in
    file order; every mapping is named once; no effect with the day split."""
    layout = layouts.by_fraction(10, 0.2, 0.3, 4, -1, ("train", "validation", "test"))
    mapping, part, _ = layout.assign(np.arange(10))
    assert mapping.tolist() == [0] * 5 + [2] * 3 + [1] * 2 and layout.lines == {"train": 5, "test": 2, "validation": 3}
    assert part.tolist() == [0, 0, 0, 0, 1, 3, 3, 3, 2, 2]
    args = ["--input", "x.txt", "--output", "out"]
    assert criteo.options(criteo.parser().parse_args(args + ["--split_order=validation,test,train"])).order == \
        ("validation", "test", "train")
    assert criteo.options(criteo.parser().parse_args(args)).order is None
    for bad, message in (("--split_order=train,test", "is not train, test and validation in some order"),
                         ("--split_order=train,test,test", "is not train, test and validation"),
                         ("--split=day", "--split_order has no effect with --split=day")):
        with pytest.raises(ConfigError, match=message):
            criteo.options(criteo.parser().parse_args(args + [bad] + ["--split_order=train,validation,test"] *
                                                      (bad == "--split=day")))


def test_days_and_gzip(spark, tmp_path):
    """day_0 and day_1.gz train (frequencies over both), day_2 halves: test 1 line, validation 2."""
    raw = tmp_path / "raw"
    raw.mkdir()
    write_text(raw / "day_0", [line("1", ["1"], ["a"]), line("0", ["2"], ["b"])])
    write_text(raw / "day_1.gz", [line("1", ["3"], ["b"]), line("0", ["4"], ["b"]), line("1", [], ["c"])])
    write_text(raw / "day_2", [line("0", ["5"], ["a"]), line("1", ["6"], ["b"]), line("0", ["7"], ["c"])])
    out = tmp_path / "out"
    summary = run(spark, Options([str(raw)], str(out), thresholds=parse_thresholds("2")))
    assert summary["rows"] == {"train": 5, "test": 1, "validation": 2} and summary["bad_lines"] == 0
    spec, train = load(out, "train")
    assert spec.cardinalities[0] == 2                                    # only b (3 times) passes 2
    np.testing.assert_array_equal(train["labels"], [1, 0, 1, 0, 1])
    np.testing.assert_array_equal(train["categorical"][0], [0, 1, 1, 1, 0])
    np.testing.assert_array_equal(train["numerical"][:, 0], np.float16(np.log([4, 5, 6, 7, 0 + 1]) * [1, 1, 1, 1, 0]))
    _, test = load(out, "test")
    np.testing.assert_array_equal(test["numerical"][:, 0], np.float16([math.log(8)]))
    _, validation = load(out, "validation")
    np.testing.assert_array_equal(validation["categorical"][0], [1, 0])
    with pytest.raises(DatasetError, match="no effect: the inputs are split by day"):
        run(spark, Options([str(raw)], str(tmp_path / "o2"), fractions_given=True))


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "criteo.tsv"
    generate.write(generate.generate(20000, seed=3, bad_fraction=0.002), str(path))
    return str(path)


@pytest.mark.slow
def test_generated_labels_follow_the_value_effects():
    """--value_effects: each value of the named columns has one effect on the label, the same in
    every file; weight 0 (or none) leaves the lines bit for bit as they were."""
    assert generate.generate(3000, seed=4, value_effects={"C3": 0.0}).equals(generate.generate(3000, seed=4))

    def positive_rate(table, column="C3", least=400):   # by value, for the values seen at least `least` times
        labels = np.array(table.column("label").to_pylist()).astype(int)
        values = np.array(table.column(column).to_pylist(), object)
        return {v: labels[values == v].mean() for v in set(values) - {None} if (values == v).sum() >= least}

    rates = [positive_rate(generate.generate(40000, seed=s, value_effects={"C3": 3.0})) for s in (1, 2)]
    plain = [positive_rate(generate.generate(40000, seed=s)) for s in (1, 2)]
    common = sorted(set(rates[0]) & set(rates[1]) & set(plain[0]) & set(plain[1]))
    assert len(common) >= 10

    def correlation(a, b):
        return np.corrcoef([a[v] for v in common], [b[v] for v in common])[0, 1]

    assert correlation(*rates) > 0.9 and abs(correlation(*plain)) < 0.7
    assert generate.parse_value_effects("C3:1,C21:0.5") == {"C3": 1.0, "C21": 0.5}
    for bad in ("C0:1", "C3", "C3:x"):
        with pytest.raises(SystemExit, match=f"^--value_effects entry '{bad}': expected Ck:W"):
            generate.parse_value_effects(bad)


def read_tree(root):
    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(folder, f), "rb") as fh:
                out[os.path.relpath(os.path.join(folder, f), root)] = fh.read()
    return out


def test_same_output_whatever_the_partitioning(spark, generated, tmp_path):
    """Byte-identical datasets from 1 split and from 6 splits (with smaller blocks, other shuffle
    partitions), shuffled or not; the shuffle is a seeded permutation of the training rows."""
    outputs = {}
    for shuffle in (False, True):
        for split_bytes, block_bytes, partitions in ((1 << 30, 32 << 20, "4"), (1 << 20, 300 << 10, "3")):
            spark.conf.set("spark.sql.shuffle.partitions", partitions)
            out = tmp_path / f"{shuffle}-{split_bytes}"
            run(spark, opts([generated], out, shuffle=shuffle, split_bytes=split_bytes, block_bytes=block_bytes,
                            part_rows=4000, thresholds=parse_thresholds("3")), log=lambda m: None)
            outputs[shuffle, split_bytes] = read_tree(out)
    spark.conf.set("spark.sql.shuffle.partitions", "4")
    assert outputs[False, 1 << 30] == outputs[False, 1 << 20]
    assert outputs[True, 1 << 30] == outputs[True, 1 << 20]
    plain, shuffled = (tmp_path / f"{s}-{1 << 30}" for s in (False, True))
    spec, a = load(plain, "train")
    _, b = load(shuffled, "train")
    assert len(spec.source["train"][0].files) == 3                      # 12000 training lines / 4000
    rows = lambda batch: sorted(map(tuple, np.column_stack([batch["labels"], batch["numerical"], *batch["categorical"]])))
    assert rows(a) == rows(b) and not np.array_equal(a["categorical"][3], b["categorical"][3])
    assert load(plain, "test")[1]["labels"].tolist() == load(shuffled, "test")[1]["labels"].tolist()


def test_freeze_vocab_encodes_new_data_with_the_same_ids(spark, tmp_path):
    """--vocab_from with --freeze_vocab: the earlier vocabularies as they are (growth:
    tests/test_preproc_vocab.py)."""
    first = tmp_path / "first"
    run(spark, opts([write_text(tmp_path / "a.txt", HAND)], first, thresholds=parse_thresholds("2,C2:3")),
        log=lambda m: None)
    new = write_text(tmp_path / "b.txt", [line("1", ["1"], ["b", "2f"]), line("0", [], ["a", "10"]),
                                         line("1", [], ["a", "10"]), line("0", [], ["d", "10"]), line("1", [], ["c", "10"])])
    second = tmp_path / "second"
    run(spark, opts([new], second, vocab_from=str(first), freeze_vocab=True), log=lambda m: None)
    spec, train = load(second, "train")
    assert spec.cardinalities == FeatureSpec.from_yaml(str(first / SPEC_FILE)).cardinalities
    np.testing.assert_array_equal(train["categorical"][0], [2, 1, 1])   # b, a, a as in `first`
    np.testing.assert_array_equal(train["categorical"][1], [0, 1, 1])
    for name in ("cat_0.npy", "vocab.json"):
        assert (second / "vocab" / name).read_bytes() == (first / "vocab" / name).read_bytes()
    assert spec.metadata["vocabularies"]["mode"] == "frozen" and spec.metadata["frequency_threshold"]["cat_1"] == 3


def test_output_trains_with_dlrm(spark, generated, tmp_path):
    out = tmp_path / "out"
    run(spark, opts([generated], out, shuffle=True, thresholds=parse_thresholds("2")), log=lambda m: None)
    result = subprocess.run(
        [*PYTHON, "dlrm.py", "--dataset_type=split_binary", f"--dataset_path={out}", "--batch_size=256",
         "--valid_batch_size=1000", "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1",
         "--optimizer=adam", "--learning_rate=0.003", "--warmup_steps=2", "--decay_start_step=8",
         "--decay_steps=4", "--max_steps=8", "--evals_per_epoch=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "auc" in (result.stdout + result.stderr).lower()


def test_thresholds_flag():
    assert parse_thresholds("3") == [3] * 26
    assert parse_thresholds("C3:5,C20:2") == [0, 0, 5] + [0] * 16 + [2] + [0] * 6
    assert parse_thresholds("2,C1:7")[:2] == [7, 2]
    for bad in ("C27:3", "x", "C3:y", "-1"):
        with pytest.raises(ConfigError, match="--frequency_threshold"):
            parse_thresholds(bad)


def test_no_java_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(ConfigError, match=r"Spark needs Java \(17\): no `java` on PATH and JAVA_HOME is not set"):
        spark_session("local[1]")
