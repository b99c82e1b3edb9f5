"""Spec-driven preprocessing of raw CSV/Parquet logs (preproc.raw): a hand-made CSV with every
expected id and value written out, CSV and Parquet alike, partitioning, bad input, the spec's
errors, training DCNv2 and DLRM on a log without numerical features."""
import gzip
import math
import os
import random
import subprocess

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import yaml

from dataloading.feature_spec import SPEC_FILE, FeatureSpec
from dataloading.split_binary import SplitBinaryDataset
from preproc import raw, raw_spec
from preproc.raw_source import RawSource
from tests.support.horovod_run import ROOT, horovodrun
from utils.errors import ConfigError, DatasetError
from tests.support.warm_python import PYTHON

HEADER = "click,price,count,site,color,user,tags,device,ts,day"
GOOD = [
    "1,1.5,0,news,0a,7,a|b,ios,0,1",            # ts 0: Thursday 00:00 UTC
    "0,,5,news,A,-3,b,android,3600,1",          # A is 0a
    "1,2,1,shop,ff,7,a||c,ios,90000,1",         # an empty entry; Friday 01:00
    "0,3,,blog,,12,,web,,1",                    # no tags, no color, no ts
]
BAD = [
    "1,x,2,news,0a,7,a,ios,0,1",                # line 6
    "1,4,2,shop,zz,7,a,ios,0,1",                # line 7
    "0,5,1,shop,1,8,a|b|c|d,ios,0,1",           # line 8
    "2,1,1,news,1,7,a,ios,0,1",                 # line 9
    "1,1,1,news",                               # line 10
]
TEST = ["0,0.5,3,shop,10,9,c|a,web,7200,2"]
VALIDATION = ["1,2,0,zine,0A,7,d,ios,-3600,3"]    # Wednesday 23:00
SPEC = {
    "inputs": {"paths": ["log.csv"]},
    "label": "click",
    "numerical": [{"column": "price", "transform": "none", "fill": -1},
                  "count",
                  {"column": "price", "name": "price_clip", "transform": "clip", "min": 0, "max": 2.5}],
    "categorical": [{"column": "site", "threshold": 2},
                    {"column": "color", "type": "hex"},
                    {"column": "user", "type": "int", "threshold": 1},
                    {"column": "tags", "delimiter": "|", "max_hotness": 3, "threshold": 2},
                    {"column": "device", "buckets": 5},
                    {"column": "ts", "name": "hour", "derive": "hour"},
                    {"column": "ts", "name": "weekday", "derive": "weekday"}],
    "split": {"by": "column", "column": "day", "test_from": 2, "validation_from": 3},
}


@pytest.fixture(scope="module")
def spark(spark_local):
    """The suite's local Spark session, 4 shuffle partitions."""
    spark_local.conf.set("spark.sql.shuffle.partitions", "4")
    return spark_local


def write_spec(folder, spec=SPEC, **inputs):
    spec = dict(spec, inputs=dict(spec["inputs"], **inputs))
    path = folder / "raw.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def write_log(folder, lines, name="log.csv"):
    (folder / name).write_text("\n".join(lines) + "\n")


def run_raw(spark, spec_path, output, *flags, log=lambda m: None, **kw):
    from preproc.pipeline import run
    args = raw.parser().parse_args(["--spec", spec_path, "--output", str(output), *flags])
    opts = raw.options(args)
    for k, v in kw.items():
        setattr(opts, k, v)
    return run(spark, opts, log=log)


def load(output, mapping):
    spec = FeatureSpec.from_yaml(os.path.join(output, SPEC_FILE))
    data = SplitBinaryDataset(spec, {"x": mapping})
    return spec, data.batch("x", 0, data.rows("x"))


def ragged(ids):
    return [ids.values[a:b].tolist() for a, b in zip(ids.row_splits[:-1], ids.row_splits[1:])]


def key(text):
    return int(pd.util.hash_array(np.array([text], object), categorize=False)[0])


@pytest.mark.slow
def test_hand_made_log(spark, tmp_path):
    write_log(tmp_path, [HEADER] + GOOD + BAD + TEST + VALIDATION)
    messages = []
    summary = run_raw(spark, write_spec(tmp_path), tmp_path / "out", log=messages.append)
    assert summary["rows"] == {"train": 4, "test": 1, "validation": 1} and summary["bad_lines"] == 5
    log_path = str(tmp_path / "log.csv")
    assert messages == [f"skipped 5 bad lines (first: {log_path}:6: price is not a number, got 'x'; "
                        f"{log_path}:7: color is not a hex number of at most 16 digits, got 'zz'; "
                        f"{log_path}:8: tags has more than max_hotness 3 values, got 'a|b|c|d'; "
                        f"{log_path}:9: label click must be 0 or 1, got '2'; {log_path}:10: 4 fields, expected 10)"]
    spec, train = load(tmp_path / "out", "train")
    assert spec.numerical == ["price", "count", "price_clip"]
    assert spec.categorical == ["site", "color", "user", "tags", "device", "hour", "weekday"]
    # site: news x2 (id 1), shop and blog rare; color: 0a x2, ff; user: 7 x2, then the tie 12 and -3 by
    # uint64 key (-3 is 2^64 - 3); tags (threshold 2): a x2, b x2 (tie by key), c rare; hour: 1 x2, 0;
    # weekday: Thursday (3) x2, Friday (4); device: hashed into 5 buckets.
    assert spec.cardinalities == [2, 3, 4, 3, 6, 3, 3]
    assert spec.max_hotness == [None, None, None, 3, None, None, None]
    assert key("b") < key("a")
    np.testing.assert_array_equal(train["labels"], [1, 0, 1, 0])
    np.testing.assert_array_equal(train["numerical"], np.float16([[1.5, math.log(3), 1.5], [-1, math.log(8), 0],
                                                                  [2, math.log(4), 2], [3, 0, 2.5]]))
    site, color, user, tags, device, hour, weekday = train["categorical"]
    assert site.tolist() == [1, 1, 0, 0] and color.tolist() == [1, 1, 2, 0] and user.tolist() == [1, 3, 1, 2]
    assert ragged(tags) == [[2, 1], [1], [2, 0], []]
    bucket = {d: 1 + key(d) % 5 for d in ("ios", "android", "web")}
    assert device.tolist() == [bucket["ios"], bucket["android"], bucket["ios"], bucket["web"]]
    assert hour.tolist() == [2, 1, 1, 0] and weekday.tolist() == [1, 1, 2, 0]
    _, test = load(tmp_path / "out", "test")
    assert test["labels"].tolist() == [0]
    np.testing.assert_array_equal(test["numerical"], np.float16([[0.5, math.log(6), 0.5]]))
    assert [c.tolist() for k, c in enumerate(test["categorical"]) if k != 3] == \
        [[0], [0], [0], [bucket["web"]], [0], [1]]
    assert ragged(test["categorical"][3]) == [[0, 2]]
    _, validation = load(tmp_path / "out", "validation")
    np.testing.assert_array_equal(validation["numerical"], np.float16([[2, math.log(3), 2]]))
    assert [c.tolist() for k, c in enumerate(validation["categorical"]) if k != 3] == \
        [[0], [1], [1], [bucket["ios"]], [0], [0]]                      # 23:00 on a Wednesday: unseen
    assert ragged(validation["categorical"][3]) == [[0]]
    vocab = np.load(tmp_path / "out" / "vocab" / "user.npy")
    assert vocab["value"].tolist() == [7, 12, 2 ** 64 - 3] and vocab["count"].tolist() == [2, 1, 1]
    assert not (tmp_path / "out" / "vocab" / "device.npy").exists()
    assert spec.metadata["categorical"]["device"] == "device (string); hashed: id 1 + key % 5"


def test_strict_and_missing_column(spark, tmp_path):
    write_log(tmp_path, [HEADER] + GOOD + BAD + TEST + VALIDATION)
    with pytest.raises(DatasetError, match=r"^--strict: 5 bad lines \(first: .*log.csv:6: price is not a number"):
        run_raw(spark, write_spec(tmp_path), tmp_path / "out", "--strict")
    assert not (tmp_path / "out" / SPEC_FILE).exists()
    write_log(tmp_path, [HEADER] + GOOD + TEST + VALIDATION, "good.csv")
    write_log(tmp_path, [HEADER.replace("device", "gadget")] + GOOD, "other.csv")
    summary = run_raw(spark, write_spec(tmp_path, paths=["good.csv", "other.csv"]), tmp_path / "out2")
    assert summary["rows"] == {"train": 4, "test": 1, "validation": 1}
    other = tmp_path / "other.csv"
    assert summary["first_bad_lines"] == [f"{other}:{k}: no column 'device' in the file" for k in range(2, 6)]


def test_malformed_csv_lines_are_bad_lines(spark, tmp_path, capsys):
    """An unterminated quote (not the last line, and the last), bytes that are not UTF-8, a
    carriage return inside a line: bad lines with their file and line, the good lines kept; with
    --strict the command line stops with one `error:` line naming them (exit 2), writing nothing.
    A fraction split in another order: validation before test."""
    garbage = random.Random(0).randbytes(300).replace(b"\n", b"").replace(b"\r", b"")
    lines = [HEADER.encode()] + [g.encode() for g in GOOD] + [
        b'1,2,0,"shop,ff,7,a,ios,0,1',                 # line 6
        garbage,                                        # line 7 (a quote inside would run on: bad either way)
        b"0,1,1,news,0a,7,a,ios,0,1\r1,2",             # line 8
        b"1,2,3,news,0a,7,b,ios,0,1"] + [t.encode() for t in TEST + VALIDATION] + [b'0,1,1,"news']   # line 12
    (tmp_path / "log.csv").write_bytes(b"\n".join(lines) + b"\n")
    spec = dict(SPEC, split={"test": 0.3, "validation": 0.2, "order": ["train", "validation", "test"]})
    spec_path = write_spec(tmp_path, spec)
    messages = []
    summary = run_raw(spark, spec_path, tmp_path / "out", log=messages.append)
    path = tmp_path / "log.csv"
    assert summary["first_bad_lines"] == [f"{path}:6: an unterminated quote", f"{path}:7: not UTF-8 text",
                                          f"{path}:8: a carriage return inside the line",
                                          f"{path}:12: an unterminated quote"]
    # 11 lines: 6 train (2 bad), then round(2.2) = 2 validation lines (1 bad), then round(3.3) = 3 test lines (1 bad)
    assert summary["rows"] == {"train": 4, "test": 2, "validation": 1} and summary["bad_lines"] == 4
    assert messages[0].startswith("skipped 4 bad lines (first: ")
    _, validation = load(tmp_path / "out", "validation")
    _, test = load(tmp_path / "out", "test")
    assert validation["labels"].tolist() == [1] and test["labels"].tolist() == [0, 1]
    np.testing.assert_array_equal(validation["numerical"][:, 0], np.float16([2]))     # line 9: price 2
    assert raw.main(["--spec", spec_path, "--output", str(tmp_path / "strict"), "--strict"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: --strict: 4 bad lines (first: {path}:6: an unterminated quote; {path}:7: not UTF-8 text; "
                   f"{path}:8: a carriage return inside the line; {path}:12: an unterminated quote)"]
    assert not (tmp_path / "strict").exists()


def test_inputs_that_stop_the_run(spark, tmp_path):
    """One error line and nothing written (no output folder, or the earlier dataset untouched) for an
    empty input, a column no input has, a file of random bytes (every line bad; as .gz or Parquet:
    unreadable), a mapping a split names that gets no row; a bound left out leaves that mapping
    empty on purpose."""
    out = tmp_path / "out"

    def fails(message, spec, **inputs):
        with pytest.raises(DatasetError, match=message):
            run_raw(spark, write_spec(tmp_path, spec, **inputs), out)
        assert not out.exists()

    write_log(tmp_path, [HEADER], "header.csv")
    (tmp_path / "empty.csv").write_bytes(b"")
    fails(r"header.csv and 1 more input file: no lines to read \(an empty input\)$", SPEC,
          paths=["header.csv", "empty.csv"])
    write_log(tmp_path, [HEADER] + GOOD + TEST + VALIDATION)
    prise = dict(SPEC, numerical=["prise"])
    fails(rf"^{tmp_path / 'log.csv'}: no column 'prise', which the spec names \(columns: click, price, count, ",
          prise)
    (tmp_path / "random.bin").write_bytes(random.Random(1).randbytes(3000))
    headerless = {"header": False, "columns": HEADER.split(",")}
    fails(rf"^train: no rows: its \d+ lines are all bad; \d+ bad lines \(first: {tmp_path / 'random.bin'}:1: ",
          dict(SPEC, split={"test": 0, "validation": 0}), paths=["random.bin"], **headerless)
    fails(rf"^{tmp_path / 'random.bin'}: no column 'click', which the spec names \(columns: none readable\)$",
          SPEC, paths=["random.bin"])
    for name, message, inputs in (("random.gz", "Not a gzipped file", {}),
                                  ("random.parquet", "Parquet magic bytes not found", {"format": "parquet"})):
        (tmp_path / name).write_bytes(random.Random(2).randbytes(100))
        fails(rf"^{tmp_path / name}: cannot read it \({message}", SPEC, paths=[name], **inputs)
    fails(r"^validation: no rows: no row falls in it \(by day: test from 2, validation from 4\)$",
          dict(SPEC, split={"by": "column", "column": "day", "test_from": 2, "validation_from": 4}))
    fails(r"^test: no lines: 0.05 of the 6 input lines rounds to none \(a fraction of 0 leaves it empty on purpose\)$",
          dict(SPEC, split={"test": 0.05, "validation": 0.2}))
    summary = run_raw(spark, write_spec(tmp_path, dict(SPEC, split={"by": "column", "column": "day", "test_from": 2})),
                      out)
    assert summary["rows"] == {"train": 4, "test": 2, "validation": 0}
    before = tree(out)
    with pytest.raises(DatasetError, match="^train: no rows"):
        run_raw(spark, write_spec(tmp_path, dict(SPEC, split={"by": "column", "column": "day", "test_from": 0})), out)
    assert tree(out) == before and (out / SPEC_FILE).exists()


def test_split_by_files(spark, tmp_path):
    """split by files: the rows of the test and validation files, in file order, the others train."""
    write_log(tmp_path, [HEADER] + GOOD[:2], "a.csv")
    write_log(tmp_path, [HEADER] + VALIDATION, "v.csv")
    write_log(tmp_path, [HEADER] + GOOD[2:] + TEST, "t.csv")
    spec = dict(SPEC, split={"by": "files", "test_files": ["t.csv"], "validation_files": ["v.csv"]})
    summary = run_raw(spark, write_spec(tmp_path, spec, paths=["a.csv", "t.csv", "v.csv"]), tmp_path / "out")
    assert summary["rows"] == {"train": 2, "test": 3, "validation": 1}
    _, test = load(tmp_path / "out", "test")
    np.testing.assert_array_equal(test["numerical"][:, 0], np.float16([2, 3, 0.5]))     # t.csv's prices
    _, validation = load(tmp_path / "out", "validation")
    assert validation["labels"].tolist() == [1]


def test_vocabularies_grow_with_vocab_from(spark, tmp_path):
    """A second log encoded with the first one's ids; its frequent new values take the next ids
    (room from --vocab_capacity=2); hashed ids stay as they are; empty test/validation mappings (no
    bounds: everything trains)."""
    write_log(tmp_path, [HEADER] + GOOD + TEST + VALIDATION)
    run_raw(spark, write_spec(tmp_path), tmp_path / "first", "--vocab_capacity=2")
    write_log(tmp_path, [HEADER, "1,1,1,zine,0a,7,a,ios,0,1", "0,1,1,zine,ff,5,e,ios,0,1", "1,1,1,news,0a,5,e,web,0,1"],
              "day2.csv")
    all_train = dict(SPEC, split={"by": "column", "column": "day"})
    summary = run_raw(spark, write_spec(tmp_path, all_train, paths=["day2.csv"]), tmp_path / "second", "--vocab_from",
                      str(tmp_path / "first"))
    assert summary["rows"] == {"train": 3, "test": 0, "validation": 0}
    first, _ = load(tmp_path / "first", "train")
    spec, train = load(tmp_path / "second", "train")
    # capacities ceil(2 x (K + 1)): site 2 -> 4, color 3 -> 6, user 4 -> 8, tags 3 -> 6, hour/weekday 3 -> 6;
    # device: 5 buckets + 1.
    assert first.cardinalities == spec.cardinalities == [4, 6, 8, 6, 6, 6, 6]
    site, color, user, tags, device, hour, weekday = train["categorical"]
    assert site.tolist() == [2, 2, 1] and user.tolist() == [1, 4, 4] and ragged(tags) == [[2], [3], [3]]
    assert color.tolist() == [1, 2, 1] and device.tolist() == [1 + key(d) % 5 for d in ("ios", "ios", "web")]
    assert spec.metadata["vocabularies"]["generation"] == 1
    assert spec.metadata["vocabularies"]["features"]["site"]["added"] == 1
    _, test = load(tmp_path / "second", "test")
    assert test["labels"].shape == (0,) and ragged(test["categorical"][3]) == []


def tree(root):
    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            path = os.path.join(folder, f)
            if f != SPEC_FILE:
                out[os.path.relpath(path, root)] = open(path, "rb").read()
    return out


def test_csv_and_parquet_give_the_same_output(spark, tmp_path):
    write_log(tmp_path, [HEADER] + GOOD + TEST + VALIDATION)
    table = pacsv.read_csv(str(tmp_path / "log.csv"))            # typed columns: ints, doubles, strings
    assert str(table.schema.field("user").type) == "int64" and str(table.schema.field("price").type) == "double"
    pq.write_table(table, str(tmp_path / "log.parquet"))
    run_raw(spark, write_spec(tmp_path), tmp_path / "csv")
    run_raw(spark, write_spec(tmp_path, paths=["log.parquet"], format="parquet"), tmp_path / "parquet")
    csv, parquet = tree(tmp_path / "csv"), tree(tmp_path / "parquet")
    assert len(csv) > 20 and csv == parquet


def generated_log(path, rows, seed=0):
    """A click log: 3 string columns, a list column, a timestamp, a 0/1 label; no numbers."""
    rng = random.Random(seed)
    lines = ["label,ad,site,user,tags,ts"]
    for _ in range(rows):
        ad = f"ad{int(rng.paretovariate(1.2)) % 50}"
        tags = "|".join(rng.choice("abcdefgh") for _ in range(rng.randint(0, 4)))
        click = int(ad in ("ad1", "ad2") and rng.random() < 0.6 or rng.random() < 0.1)
        lines.append(f"{click},{ad},s{rng.randint(0, 30)},u{rng.randint(0, 500)},{tags},{rng.randint(0, 10 ** 6)}")
    path.write_text("\n".join(lines) + "\n")


NO_NUMERICALS = {
    "inputs": {"paths": ["log.csv"]},
    "label": "label",
    "categorical": [{"column": "ad", "threshold": 2}, "site", {"column": "user", "buckets": 100},
                    {"column": "tags", "delimiter": "|", "max_hotness": 4},
                    {"column": "ts", "name": "hour", "derive": "hour"}],
    "split": {"test": 0.1, "validation": 0.1},
}


def test_same_output_whatever_the_partitioning(spark, tmp_path):
    generated_log(tmp_path / "log.csv", 3000)
    spec_path = write_spec(tmp_path, NO_NUMERICALS)
    outputs = []
    for split_bytes, block_bytes in ((1 << 30, 32 << 20), (5000, 2000)):
        out = tmp_path / f"out{split_bytes}"
        run_raw(spark, spec_path, out, "--shuffle", "--part_rows=1000", split_bytes=split_bytes,
                block_bytes=block_bytes)
        outputs.append(tree(out))
    assert outputs[0] == outputs[1] and len([f for f in outputs[0] if f.startswith("train/tags.part")]) == 3
    _, train = load(tmp_path / f"out{5000}", "train")
    assert train["numerical"].shape == (2400, 0)
    assert max(len(r) for r in ragged(train["categorical"][3])) == 4


@pytest.mark.slow
def test_output_without_numericals_trains(spark, tmp_path):
    """DCNv2 and DLRM (its bottom MLP without input: a learned constant) train on a log without numbers,
    DCNv2 also at 2 Gloo ranks."""
    generated_log(tmp_path / "log.csv", 4000, seed=1)
    run_raw(spark, write_spec(tmp_path, NO_NUMERICALS), tmp_path / "out", "--shuffle")
    flags = [f"--dataset_path={tmp_path / 'out'}", "--dataset_type=split_binary", "--batch_size=256",
             "--valid_batch_size=400", "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1",
             "--optimizer=adam", "--learning_rate=0.003", "--warmup_steps=2", "--decay_start_step=8",
             "--decay_steps=4", "--max_steps=8", "--evals_per_epoch=0"]
    for script in ("dcnv2.py", "dlrm.py"):
        result = subprocess.run([*PYTHON, script, *flags], cwd=ROOT, capture_output=True, text=True,
                                timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
        assert result.returncode == 0, f"{script}: {result.stderr[-2000:]}"
        assert "auc" in (result.stdout + result.stderr).lower()
    result = horovodrun(2, ["dcnv2.py", *flags], timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "2 ranks" in result.stdout + result.stderr


@pytest.mark.parametrize("change, message", [
    ({"label": None}, r"raw.yaml: label: missing"),
    ({"colour": 1}, r"raw.yaml: colour: unknown key"),
    ({"categorical": [{"column": "tags", "delimiter": "|"}]},
     r"raw.yaml: categorical\[0\].max_hotness: a multi-hot column needs both"),
    ({"categorical": [{"column": "site", "type": "float"}]}, r"categorical\[0\].type: must be string or hex or int"),
    ({"numerical": [{"column": "price", "min": 0}]}, r"numerical\[0\].transform: clip takes min"),
    ({"numerical": ["site"], "categorical": ["site"]}, r"feature name 'site' is used twice"),
    ({"split": {"by": "column", "column": "day", "test": 0.1}}, r"split.test: only a split by fraction"),
    ({"split": {"test_files": ["x.csv"]}}, r"split.test_files: only a split by files takes it"),
    ({"split": {"order": ["train", "test"]}}, r"split.order: must be train, test and validation in some order"),
    ({"split": {"by": "files", "order": ["test", "train", "validation"]}}, r"split.order: only a split by fraction"),
    ({"split": {"test": 0.6, "validation": 0.5}}, r"split.validation: test \+ validation must be below 1"),
    ({"inputs": {"paths": ["x.csv"], "header": False}}, r"inputs.columns: missing"),
    ({"label": {"column": "click", "positive": [1], "threshold": 2}}, r"label.threshold: give positive or"),
])
def test_spec_errors_name_the_key(tmp_path, change, message):
    spec = {k: v for k, v in dict(SPEC, **change).items() if v is not None}
    path = tmp_path / "raw.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=message):
        raw_spec.load(str(path))


def source_rows(spec, path):
    """All Rows of one file read by the RawSource of `spec` (no Spark), concatenated per field."""
    source = RawSource(raw_spec.parse(spec, "spec", str(path.parent)))
    blocks = [r for s in source.plan([str(path)], 1 << 20) for r in source.rows(s, 1 << 20)]
    assert len(blocks) == 1
    return blocks[0]


def test_label_rules_headerless_gzip_tsv_and_parquet_lists(tmp_path):
    """Labels by a set of positive values and by a threshold; a .gz TSV without header; a Parquet
    list column read as lists (empty entries dropped, too long -> bad)."""
    with gzip.open(tmp_path / "log.tsv.gz", "wt") as f:
        f.write("yes\t4.5\tA\nno\t1\tB\nmaybe\t\tC\n\t3\tD\n")
    spec = {"inputs": {"paths": ["log.tsv.gz"], "delimiter": "\t", "header": False,
                       "columns": ["answer", "rating", "item"]},
            "label": {"column": "answer", "positive": ["yes", "maybe"]}, "categorical": ["item"]}
    rows = source_rows(spec, tmp_path / "log.tsv.gz")
    assert rows.labels.tolist() == [1, 0, 1] and rows.lines.tolist() == [0, 1, 2]
    assert rows.bad == [(3, "label answer is missing")]
    assert rows.categorical[0][0].tolist() == [key(v) for v in "ABC"]
    spec["label"] = {"column": "rating", "threshold": 3}
    rows = source_rows(spec, tmp_path / "log.tsv.gz")
    assert rows.labels.tolist() == [1, 0, 1] and rows.lines.tolist() == [0, 1, 3]
    assert rows.bad == [(2, "label rating is missing")]
    table = pa.table({"click": [1, 0, 1], "tags": [["x", "", "y"], [], ["x", "y", "z", "w"]]})
    pq.write_table(table, str(tmp_path / "log.parquet"))
    spec = {"inputs": {"paths": ["log.parquet"], "format": "parquet"}, "label": "click",
            "categorical": [{"column": "tags", "delimiter": "|", "max_hotness": 3}]}
    rows = source_rows(spec, tmp_path / "log.parquet")
    keys, lengths = rows.categorical[0]
    assert lengths.tolist() == [2, 0] and keys.tolist() == [key("x"), key("y")]
    assert rows.bad == [(2, "tags has more than max_hotness 3 values, got ['x', 'y', 'z', 'w']")]
