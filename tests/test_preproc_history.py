"""User histories built from event logs by preproc.raw (preproc/history.py), against a pure-Python
reference: ties, several users, empty histories, histories longer than max_length, late events,
only positive events, the split, raw ids, partitioning, day after day with --vocab_from; the
spec's errors; the MovieLens guide's DIN trains on the output, exports and serves."""
import os
import random
import shutil

import numpy as np
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import yaml

from preproc import raw, raw_spec
from preproc.raw_source import RawSource
from tests.support.horovod_run import ROOT
from tests.test_preproc_raw import key, load, ragged, run_raw, tree, write_log
from utils.errors import ConfigError, DatasetError

SPEC = {
    "inputs": {"paths": ["log.csv"]},
    "label": "click",
    "categorical": [{"column": "user"},
                    {"column": "item", "threshold": 2},
                    {"name": "history", "history_of": "item", "user": "user", "time": "ts", "max_length": 3},
                    {"name": "clicked", "history_of": "item", "user": "user", "time": "ts", "max_length": 2,
                     "only_positive": True}],
    "split": {"test": 0.2, "validation": 0.2},
}


NO_THRESHOLD = dict(SPEC, categorical=[SPEC["categorical"][0], {"column": "item"}, *SPEC["categorical"][2:]])


@pytest.fixture(scope="module")
def spark(spark_local):
    spark_local.conf.set("spark.sql.shuffle.partitions", "4")
    return spark_local


def reference(events, max_length, only_positive=False):
    """Per event (user, time, item, click) of `events`: the items of the last `max_length` events
    of its user strictly before its time (ties in file order), oldest first; events without a
    user or an item (or unclicked, with only_positive) count for none."""
    in_time_order = sorted(enumerate(events), key=lambda e: (e[1][1], e[0]))
    histories = []
    for user, time, _, _ in events:
        before = [item for _, (u, t, item, click) in in_time_order
                  if u == user and u and item and t < time and (click or not only_positive)]
        histories.append(before[-max_length:])
    return histories


def events_log(rows, seed, start=0, users=5):
    """(user, time, item, click) events in a random file order: many ties, some missing users and
    items, times from `start`."""
    rng = random.Random(seed)
    events = []
    for _ in range(rows):
        user = "" if rng.random() < 0.05 else f"u{rng.randrange(users)}"
        item = "" if rng.random() < 0.05 else f"i{int(rng.paretovariate(1.0)) % 12}"
        events.append((user, start + rng.randrange(40), item, int(rng.random() < 0.4)))
    return events


def write_events(folder, events, name="log.csv"):
    write_log(folder, ["click,user,item,ts"] + [f"{c},{u},{i},{t}" for u, t, i, c in events], name)


def write_spec(folder, spec=SPEC, **changes):
    path = folder / "raw.yaml"
    path.write_text(yaml.safe_dump(dict(spec, **changes)))
    return str(path)


def read_all(output):
    """The rows of train, test and validation in turn: (spec, {feature: per-row values})."""
    columns = {}
    for mapping in ("train", "test", "validation"):
        spec, data = load(output, mapping)
        for name, values in zip(spec.categorical, data["categorical"]):
            columns.setdefault(name, []).extend(ragged(values) if hasattr(values, "row_splits") else values.tolist())
    return spec, columns


def item_ids(columns, events):
    """Item value -> id, from the output's item column (missing items are not in histories)."""
    ids = {}
    for (_, _, item, _), i in zip(events, columns["item"]):
        assert ids.setdefault(item, i) == i
    return ids


def test_histories_against_the_reference(spark, tmp_path):
    """Random events (ties, late ones, missing users and items, rare items) of every mapping against
    the reference, for all events and for clicks only; a split by column (rows not in file
    order) gives the same histories."""
    events = events_log(60, seed=1) + [("u9", 5, "i1", 1), ("u9", 5, "i2", 1), ("u9", 3, "i3", 0),
                                       ("u9", 9, "i1", 0), ("u9", 9, "i2", 1), ("u9", 20, "i3", 1)]
    write_events(tmp_path, events)
    summary = run_raw(spark, write_spec(tmp_path), tmp_path / "out")
    assert summary["rows"] == {"train": 40, "test": 13, "validation": 13}
    spec, columns = read_all(tmp_path / "out")
    assert spec.max_hotness == [None, None, 3, 2]
    assert spec.cardinalities[2] == spec.cardinalities[3] == spec.cardinalities[1]
    assert spec.dtype("history") == spec.dtype("item")
    ids = item_ids(columns, events)
    assert 0 in {i for item, i in ids.items() if item} and len(set(ids.values())) > 3   # rare items: id 0
    for name, length, positive in (("history", 3, False), ("clicked", 2, True)):
        expected = [[ids[i] for i in h] for h in reference(events, length, positive)]
        assert columns[name] == expected
        assert [] in expected and any(len(h) == length for h in expected)
    # u9 (the last six events, test and validation): the ties at 5 and at 9 never see each other
    assert columns["history"][-6:] == [[ids["i3"]], [ids["i3"]], [],
                                       [ids[i] for i in ("i3", "i1", "i2")], [ids[i] for i in ("i3", "i1", "i2")],
                                       [ids[i] for i in ("i2", "i1", "i2")]]
    assert columns["clicked"][-6:] == [[], [], [], [ids["i1"], ids["i2"]], [ids["i1"], ids["i2"]],
                                       [ids["i2"], ids["i2"]]]
    by_time = dict(SPEC, split={"by": "column", "column": "ts", "test_from": 30, "validation_from": 35})
    run_raw(spark, write_spec(tmp_path, by_time), tmp_path / "by_time")
    _, columns = read_all(tmp_path / "by_time")
    order = sorted(range(len(events)), key=lambda k: (events[k][1] >= 30) + (events[k][1] >= 35))
    ids = item_ids(columns, [events[k] for k in order])                 # (other training rows: other ids)
    assert columns["history"] == [[ids[i] for i in reference(events, 3)[k]] for k in order]
    assert spec.metadata["categorical"]["clicked"] == ("history of item: its ids in the last 2 events of the same "
                                                       "user strictly before the event's ts, oldest first "
                                                       "(positive events only)")


def test_same_histories_whatever_the_partitioning_and_raw_ids(spark, tmp_path):
    """Several splits, blocks and buckets of users, and a shuffle: the same files, from Parquet
    too; with the item's raw ids, the history holds the items' keys (int64) and is a raw-id
    feature."""
    events = events_log(400, seed=2, users=30)
    write_events(tmp_path, events)
    spec_path = write_spec(tmp_path)
    outputs = []
    for split_bytes, block_bytes, bucket_rows, buckets in ((1 << 30, 32 << 20, 1 << 20, 1), (1500, 700, 37, 2)):
        out = tmp_path / f"out{bucket_rows}"
        run_raw(spark, spec_path, out, "--shuffle", "--part_rows=100", split_bytes=split_bytes,
                block_bytes=block_bytes, history_bucket_rows=bucket_rows, history_buckets=buckets)
        outputs.append({f: v for f, v in tree(out).items() if ".history/" not in f})
    assert outputs[0] == outputs[1] and len([f for f in outputs[0] if f.startswith("train/history.part")]) == 3
    _, columns = read_all(tmp_path / "out37")                         # the rows shuffled: compare the multisets
    vocabulary = np.load(tmp_path / "out37" / "vocab" / "item.npy")["value"].tolist()
    ids = {item: vocabulary.index(key(item)) + 1 if key(item) in vocabulary else 0 for _, _, item, _ in events}
    assert sorted(zip(columns["item"], columns["history"])) == \
        sorted(zip((ids[e[2]] if e[2] else 0 for e in events), ([ids[i] for i in h] for h in reference(events, 3))))
    states = [np.sort(np.concatenate([np.load(p) for p in sorted((tmp_path / f"out{b}/vocab/history.history")
                                                                 .glob("*.npy"))]), order=["user", "time"])
              for b in (1 << 20, 37)]
    assert [len(list((tmp_path / f"out{b}/vocab/history.history").glob("*.npy"))) > 1 for b in (1 << 20, 37)] == \
        [False, True]
    np.testing.assert_array_equal(states[0], states[1])
    pq.write_table(pacsv.read_csv(str(tmp_path / "log.csv")), str(tmp_path / "log.parquet"))
    run_raw(spark, write_spec(tmp_path, inputs={"paths": ["log.parquet"], "format": "parquet"}), tmp_path / "parquet",
            "--shuffle", "--part_rows=100")
    assert {f: v for f, v in tree(tmp_path / "parquet").items() if ".history/" not in f} == outputs[0]
    run_raw(spark, write_spec(tmp_path, NO_THRESHOLD), tmp_path / "raw", "--raw_id_columns=item")
    spec, columns = read_all(tmp_path / "raw")
    assert spec.raw_id_features == ["item", "history", "clicked"]
    expected = [[key(i) - 2 ** 64 * (key(i) >= 2 ** 63) for i in h] for h in reference(events, 3)]
    assert columns["history"] == expected


def test_histories_continue_day_after_day(spark, tmp_path):
    """Day 1 sees day 0's events and day 2 both (each day later than the one before), the item's
    new values growing its vocabulary on day 1, frozen on day 2; an output without the history's
    state cannot continue."""
    days = [events_log(50, seed=3 + d, start=100 * d, users=6) for d in range(3)]
    whole = dict(SPEC, split={"test": 0, "validation": 0})
    before = []
    for d, events in enumerate(days):
        write_events(tmp_path, events, f"day{d}.csv")
        flags = ["--vocab_capacity=3"] if d == 0 else ["--vocab_from", str(tmp_path / f"day{d - 1}")] + \
            ["--freeze_vocab"] * (d == 2)
        run_raw(spark, write_spec(tmp_path, whole, inputs={"paths": [f"day{d}.csv"]}), tmp_path / f"day{d}", *flags)
        spec, columns = read_all(tmp_path / f"day{d}")
        ids = item_ids(columns, events)
        assert len(set(ids.values())) > 3
        for name, length, positive in (("history", 3, False), ("clicked", 2, True)):
            assert columns[name] == [[ids[i] for i in h] for h in reference(before + events, length, positive)[
                len(before):]]
        assert spec.metadata["vocabularies"]["generation"] == min(d, 1)        # day 2 frozen
        before += events
    assert any(columns["history"][k] != [ids[i] for i in h] for k, h in enumerate(reference(events, 3)))
    shutil.rmtree(tmp_path / "day2" / "vocab" / "clicked.history")
    with pytest.raises(DatasetError, match=rf"^--vocab_from {tmp_path / 'day2'}: no history state of clicked there "
                                           r"\(vocab/clicked.history/: a history continues only from an output that "
                                           r"built it\)$"):
        run_raw(spark, write_spec(tmp_path, whole, inputs={"paths": ["day0.csv"]}), tmp_path / "day3",
                "--vocab_from", str(tmp_path / "day2"))
    assert not (tmp_path / "day3").exists()


def test_a_later_day_sees_the_kept_events_only(spark, tmp_path):
    """An event of a later day earlier than its user's kept events sees the kept ones before it, not
    the older events they displaced (as documented); a later one sees the last max_length."""
    spec = dict(SPEC, categorical=NO_THRESHOLD["categorical"][:3], split={"test": 0, "validation": 0})
    write_events(tmp_path, [("u1", t, f"i{t}", 1) for t in range(1, 6)], "day0.csv")
    write_events(tmp_path, [("u1", 3.5, "i9", 1), ("u1", 10, "i9", 1), ("u2", 1, "i9", 1)], "day1.csv")
    run_raw(spark, write_spec(tmp_path, spec, inputs={"paths": ["day0.csv"]}), tmp_path / "d0", "--vocab_capacity=2")
    run_raw(spark, write_spec(tmp_path, spec, inputs={"paths": ["day1.csv"]}), tmp_path / "d1",
            "--vocab_from", str(tmp_path / "d0"))
    vocabulary = np.load(tmp_path / "d1" / "vocab" / "item.npy")["value"].tolist()
    ids = {f"i{t}": vocabulary.index(key(f"i{t}")) + 1 for t in (3, 4, 5, 9)}
    assert len(set(ids.values())) == 4
    _, columns = read_all(tmp_path / "d1")
    assert columns["history"] == [[ids["i3"]], [ids["i9"], ids["i4"], ids["i5"]], []]


SIDES = dict(SPEC, categorical=[{"column": "user"}, {"column": "item"}, {"column": "kind", "type": "int"},
                                 {"name": "history", "history_of": "item", "user": "user", "time": "ts",
                                  "max_length": 3, "only_positive": True},
                                 {"name": "history_kind", "history_of": "kind", "aligned_with": "history"},
                                 {"gaps_of": "history"}],
             split={"test": 0, "validation": 0})


def side_reference(events, kinds, max_length):
    """Per event: (the kinds of its history's events, their gap ids), from the reference's rule:
    1 + floor(log2(gap)), 1 below 2."""
    in_time_order = sorted(enumerate(events), key=lambda e: (e[1][1], e[0]))
    out = []
    for user, time, _, _ in events:
        before = [(kinds[k], time - t) for k, (u, t, item, click) in in_time_order
                  if u == user and u and item and t < time and click][-max_length:]
        out.append(([k for k, _ in before], [1 + min(62, int(np.floor(np.log2(max(g, 1.0))))) for _, g in before]))
    return out


def test_side_features_follow_the_history_event_by_event(spark, tmp_path):
    """A history's aligned side feature (each kept event's kind, an int where 0 is a value; id 0
    where it has none) and its
    time gaps, against the reference, on day 0 and on day 1 continuing day 0 (--vocab_from), with
    the gaps of day 0's events seen from day 1; the feature spec names them; the spec's errors."""
    rng = random.Random(5)
    days = [[e + (rng.choice(["", "0", "1", "2"]),) for e in events_log(70, seed=9 + d, start=300 * d, users=4)]
            for d in range(2)]
    days[1] += [("u1", 2000.5, "i1", 1, "0"), ("u1", 2001, "i2", 1, "1"), ("u1", 2003.5, "i3", 1, "")]
    before = []
    for d, day in enumerate(days):
        write_log(tmp_path, ["click,user,item,ts,kind"] + [f"{c},{u},{i},{t},{k}" for u, t, i, c, k in day],
                  f"day{d}.csv")
        flags = ["--vocab_from", str(tmp_path / "day0")] if d else []
        run_raw(spark, write_spec(tmp_path, SIDES, inputs={"paths": [f"day{d}.csv"]}), tmp_path / f"day{d}", *flags)
        spec, columns = read_all(tmp_path / f"day{d}")
        kind_ids = {}
        for e, i in zip(day, columns["kind"]):
            assert kind_ids.setdefault(e[4], i) == i
        kind_ids.update({k: 0 for k in [e[4] for e in before] if k not in kind_ids})   # (only day 0's: not in day 1)
        expected = side_reference([e[:4] for e in before + day], [e[4] for e in before + day], 3)[len(before):]
        assert columns["history_kind"] == [[kind_ids[k] for k in kinds] for kinds, _ in expected]
        assert columns["history_gaps"] == [gaps for _, gaps in expected]
        assert [len(h) for h in columns["history"]] == [len(h) for h in columns["history_kind"]]
        assert any(0 in h for h in columns["history_kind"]) and len({g for h in columns["history_gaps"] for g in h}) > 3
        before += day
    assert columns["history_gaps"][-2][-1] == 1 and columns["history_gaps"][-1][-2:] == [2, 2]   # 0.5; 3, 2.5
    assert columns["history_kind"][-1][-2:] == [kind_ids["0"], kind_ids["1"]] and kind_ids["0"] > 0
    assert spec.max_hotness[-3:] == [3, 3, 3] and spec.cardinalities[-1] == 64
    assert spec.cardinalities[-2] == spec.cardinalities[2]
    assert spec.metadata["categorical"]["history_gaps"] == ("time gaps of history's events: 1 + floor(log2(the "
                                                            "event's ts - theirs)), 1 below 2, at most 63")
    assert spec.metadata["categorical"]["history_kind"] == "kind of history's events, aligned with them (missing: id 0)"
    assert spec.metadata["aligned_with"] == {"history_kind": "history", "history_gaps": "history"}   # the loader checks it


def test_a_missing_or_bad_time_is_a_bad_line(spark, tmp_path):
    write_log(tmp_path, ["click,user,item,ts", "1,u1,a,1", "1,u1,b,", "0,u1,c,x", "1,u1,d,2"])
    summary = run_raw(spark, write_spec(tmp_path, split={"test": 0, "validation": 0}), tmp_path / "out")
    path = tmp_path / "log.csv"
    assert summary["first_bad_lines"] == [f"{path}:3: ts (a history's time) is missing",
                                          f"{path}:4: ts (a history's time) is not a number, got 'x'"]
    _, columns = read_all(tmp_path / "out")
    assert columns["history"] == [[], [columns["item"][0]]]


HISTORY = {"name": "history", "history_of": "item", "user": "user", "time": "ts", "max_length": 3}


@pytest.mark.parametrize("entry, message", [
    (dict(HISTORY, max_length=None), "categorical[2].max_length: missing"),
    (dict(HISTORY, max_length=0), "categorical[2].max_length: must be a positive integer, got 0"),
    (dict(HISTORY, max_length="50"), "categorical[2].max_length: must be a positive integer, got '50'"),
    (dict(HISTORY, user=None), "categorical[2].user: missing"),
    (dict(HISTORY, only_positive="yes"), "categorical[2].only_positive: must be true or false, got 'yes'"),
    (dict(HISTORY, history_of="itme"),
     "categorical[2].history_of: 'itme' is not a categorical feature of the spec (user, item, tags)"),
    (dict(HISTORY, history_of="tags"),
     "categorical[2].history_of: tags is multi-hot: a history takes the ids of a one-hot feature"),
    (dict(HISTORY, history_of="history"),
     "categorical[2].history_of: history is a history: a history takes the ids of a one-hot feature"),
    (dict(HISTORY, column="item"), "categorical[2].column: unknown key (expected name, history_of, user, time, "
                                   "max_length, only_positive)"),
])
def test_spec_errors(tmp_path, entry, message):
    spec = dict(SPEC, categorical=["user", "item", {k: v for k, v in entry.items() if v is not None},
                                   {"column": "tags", "delimiter": "|", "max_hotness": 2}])
    path = write_spec(tmp_path, spec)
    with pytest.raises(ConfigError) as e:
        raw_spec.load(path)
    assert str(e.value) == f"{path}: {message}"


@pytest.mark.parametrize("entry, message", [
    ({"gaps_of": "item"}, "categorical[3].gaps_of: 'item' is not a history of the spec with items of its own (its "
                          "histories: history)"),
    ({"gaps_of": "history", "max_length": 2}, "categorical[3].max_length: unknown key (expected name, gaps_of)"),
    ({"history_of": "kind", "aligned_with": "history_gaps"},
     "categorical[3].aligned_with: 'history_gaps' is not a history of the spec with items of its own (its "
     "histories: history)"),
    ({"history_of": "kind", "aligned_with": "history", "user": "user"},
     "categorical[3].user: unknown key (expected name, history_of, aligned_with)"),
    ({"history_of": "tags", "aligned_with": "history"},
     "categorical[3].history_of: tags is multi-hot: a history takes the ids of a one-hot feature"),
])
def test_side_feature_errors(tmp_path, entry, message):
    spec = dict(SPEC, categorical=["user", "kind", HISTORY, entry, {"gaps_of": "history"},
                                   {"column": "tags", "delimiter": "|", "max_hotness": 2}, "item"])
    path = write_spec(tmp_path, spec)
    with pytest.raises(ConfigError) as e:
        raw_spec.load(path)
    assert str(e.value) == f"{path}: {message}"


def test_unknown_columns_and_flags_naming_a_history(tmp_path):
    write_events(tmp_path, [("u1", 1, "a", 1)])
    spec = raw_spec.load(write_spec(tmp_path, categorical=["user", "item", dict(HISTORY, time="when")]))
    with pytest.raises(DatasetError) as e:
        RawSource(spec).plan([str(tmp_path / "log.csv")], 1 << 20)
    assert str(e.value) == f"{tmp_path / 'log.csv'}: no column 'when', which the spec names (columns: click, user, " \
                           "item, ts)"
    path = write_spec(tmp_path)
    for flag, message in (("--raw_id_columns=history", f"--raw_id_columns: history is a history in {path}: it has "
                                                       "the ids of item (raw when item is in --raw_id_columns)"),
                          ("--vocab_capacity=2,clicked:100", f"--vocab_capacity: clicked is a history in {path}: it "
                                                             "has the capacity of item")):
        with pytest.raises(ConfigError) as e:
            raw.options(raw.parser().parse_args(["--spec", path, "--output", str(tmp_path / "out"), flag]))
        assert str(e.value) == message
    all_raw = ["--spec", write_spec(tmp_path, NO_THRESHOLD), "--output", str(tmp_path / "out"), "--raw_id_columns=all"]
    (tmp_path / "d0" / "vocab").mkdir(parents=True)
    opts = raw.options(raw.parser().parse_args(all_raw + ["--vocab_from", str(tmp_path / "d0")]))
    assert opts.source.schema.raw_ids == ["user", "item", "history", "clicked"] and opts.vocab_from
    for flags, message in ((["--vocab_capacity=2"], "--vocab_capacity has no effect: every column has raw ids "
                                                    "(--raw_id_columns)"),
                           (["--vocab_from", str(tmp_path / "d0"), "--freeze_vocab"],
                            "--freeze_vocab has no effect: every column has raw ids (--raw_id_columns)")):
        with pytest.raises(ConfigError) as e:
            raw.options(raw.parser().parse_args(all_raw + flags))
        assert str(e.value) == message


def guide_spec() -> str:
    """The raw spec of docs/sequences.md's MovieLens guide, as the page writes it."""
    page = open(os.path.join(ROOT, "docs", "sequences.md")).read()
    guide = page[page.index("## From a MovieLens ratings file"):]
    return guide[guide.index("```yaml\n") + 8:guide.index("```", guide.index("```yaml\n") + 8)]


@pytest.mark.slow
def test_the_movielens_guide_serves_what_its_din_predicts(spark, tmp_path):
    """docs/sequences.md's MovieLens guide, its spec as written, on a smaller sample of
    tools/movielens_sample.py: preproc.raw with raw ids, DIN over dynamic tables trained by main.py
    on the history, exported: the tables form predicts the training-time model's logits."""
    from deployment.repository_format import categorical_matrix
    from deployment.serving.live import Model
    from run.config import build_config
    from tests.support.configs import TINY
    from tests.support.exports import reference
    from tests.test_model_export import layout_of, python
    python("--output", str(tmp_path / "ratings.csv"), "--users", "200", "--movies", "300", "--ratings", "6000",
           script="tools/movielens_sample.py")
    (tmp_path / "movielens.yaml").write_text(guide_spec())
    run_raw(spark, str(tmp_path / "movielens.yaml"), tmp_path / "data", "--raw_id_columns=userId,movieId")
    values = dict(TINY, model="examples/din.py", model_param=["candidate=movieId", "width=8"],
                  dataset_type="split_binary", dataset_path=str(tmp_path / "data"),
                  dynamic_tables=["userId:400", "movieId:600", "history:600"], batch_size=256, valid_batch_size=600,
                  warmup_steps=2, decay_start_step=8, decay_steps=4, max_steps=12, evals_per_epoch=0)
    python("--model=examples/din.py", *(f"--model_param={p}" for p in values["model_param"]),
           "--dataset_type=split_binary", f"--dataset_path={tmp_path / 'data'}",
           f"--dynamic_tables={','.join(values['dynamic_tables'])}", "--batch_size=256", "--valid_batch_size=600",
           "--optimizer=adam", "--learning_rate=0.003", "--warmup_steps=2", "--decay_start_step=8",
           "--decay_steps=4", "--max_steps=12", "--evals_per_epoch=0", f"--save_checkpoint_path={tmp_path / 'ckpt'}")
    python(f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'repo'}", "--model_name=m",
           "--model=examples/din.py", script="deployment/deploy.py")
    cfg = build_config(values, present={"model", "model_param", "dataset_type", "dataset_path", "dynamic_tables"})
    batch, logits = reference(cfg, str(tmp_path / "ckpt"), 300)
    _, layout = layout_of(str(tmp_path / "repo"))
    assert layout.max_hotness == [None, None, 50]
    categorical = categorical_matrix(batch["categorical"], layout.max_hotness)
    assert (categorical[:, 2:] >= 0).sum(1).max() > 1 and categorical[:, 1].max() > 300 - 50   # raw ids, histories
    got = Model(str(tmp_path / "repo")).infer(np.asarray(batch["numerical"]), categorical)
    np.testing.assert_allclose(got["logits"][:, 0], logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_an_hstu_ranker_reads_the_time_gaps_and_serves_what_it_predicts(spark, tmp_path):
    """The guide's spec with the history's time gaps (gaps_of): examples/hstu.py with the gaps as a
    side feature of the items and as the attention's key bias, trained by main.py on raw ids and
    exported; the tables form predicts the training-time model's logits, and other gaps other ones."""
    from deployment.repository_format import categorical_matrix
    from deployment.serving.live import Model
    from run.config import build_config
    from tests.support.configs import TINY
    from tests.support.exports import reference
    from tests.test_model_export import layout_of, python
    python("--output", str(tmp_path / "ratings.csv"), "--users", "150", "--movies", "200", "--ratings", "4000",
           script="tools/movielens_sample.py")
    spec = yaml.safe_load(guide_spec())
    spec["categorical"].append({"gaps_of": "history"})
    (tmp_path / "movielens.yaml").write_text(yaml.safe_dump(spec))
    run_raw(spark, str(tmp_path / "movielens.yaml"), tmp_path / "data", "--raw_id_columns=userId,movieId")
    params = ["candidate=movieId", "width=8", "max_length=20", "side=[history_gaps]", "time_bias=history_gaps"]
    flags = dict(dataset_type="split_binary", dataset_path=str(tmp_path / "data"), batch_size=256,
                 valid_batch_size=600, dynamic_tables=["userId:400", "movieId:400", "history:400"], optimizer="adam",
                 learning_rate=0.01, warmup_steps=2, decay_start_step=8, decay_steps=4, max_steps=10, evals_per_epoch=0)
    python("--model=examples/hstu.py", *(f"--model_param={p}" for p in params),
           *(f"--{k}={','.join(v) if isinstance(v, list) else v}" for k, v in flags.items()),
           f"--save_checkpoint_path={tmp_path / 'ckpt'}")
    python(f"--checkpoint={tmp_path / 'ckpt'}", f"--output={tmp_path / 'repo'}", "--model_name=m",
           "--model=examples/hstu.py", script="deployment/deploy.py")
    values = dict(TINY, model="examples/hstu.py", model_param=params, **flags)
    cfg = build_config(values, present={"model", "model_param", *flags})
    batch, logits = reference(cfg, str(tmp_path / "ckpt"), 300)
    _, layout = layout_of(str(tmp_path / "repo"))
    assert layout.max_hotness == [None, None, 50, 50]
    categorical = categorical_matrix(batch["categorical"], layout.max_hotness)
    gaps = categorical[:, 52:]
    assert len(np.unique(gaps[gaps > 0])) > 5 and gaps.max() < 64
    got = Model(str(tmp_path / "repo")).infer(np.asarray(batch["numerical"]), categorical)
    np.testing.assert_allclose(got["logits"][:, 0], logits, rtol=1e-5, atol=1e-5)
    recent = categorical.copy()
    recent[:, 52:][gaps > 0] = 1                                      # every item just before the event
    moved = Model(str(tmp_path / "repo")).infer(np.asarray(batch["numerical"]), recent)["logits"][:, 0]
    assert np.abs(moved - logits)[(gaps > 1).any(1)].min() > 1e-6   # the gaps reach every such sample's logit
