"""utils.logger.RunLogger's progress line: up to three dynamic tables each with its counts; more,
their sums and the three that refused and evicted the most ids, every table's counts still in
the step record of the JSON log."""
import io
import json

from utils.logger import RunLogger


def progress(tmp_path, tables):
    out = io.StringIO()
    log = RunLogger(str(tmp_path / "log.json"), out=out)
    store = {f"embedding/{name}/{count}": value for name, counts in tables.items() for count, value in counts.items()}
    log.progress(5, 10, 0.5, 0.01, 64, 0.1, store=store)
    log.close()
    record = json.loads((tmp_path / "log.json").read_text().splitlines()[-1])
    return out.getvalue().strip(), record


def counts(live, admitted, evicted, refused):
    return dict(live=live, admitted=admitted, evicted=evicted, refused=refused)


def test_three_dynamic_tables_each_with_its_counts(tmp_path):
    line, _ = progress(tmp_path, {"a": counts(4, 5, 1, 0), "b": counts(7, 7, 0, 2), "c": counts(1, 1, 0, 0)})
    assert line.endswith(" | embedding/a: 4 live, 5 admitted, 1 evicted, 0 refused | embedding/b: 7 live, 7 admitted, "
                         "0 evicted, 2 refused | embedding/c: 1 live, 1 admitted, 0 evicted, 0 refused")


def test_many_dynamic_tables_in_sums_and_the_worst_three(tmp_path):
    tables = {f"cat_{i}": counts(100 + i, 200, 0, 0) for i in range(26)}
    tables["cat_3"] = counts(50, 2000, 1950, 7)
    tables["cat_7"] = counts(50, 900, 850, 0)
    tables["cat_9"] = counts(50, 90, 40, 7)
    tables["cat_12"] = counts(50, 60, 10, 0)
    line, record = progress(tmp_path, tables)
    live = sum(t["live"] for t in tables.values())
    admitted = sum(t["admitted"] for t in tables.values())
    worst = "embedding/cat_3 7/1,950, embedding/cat_9 7/40, embedding/cat_7 0/850"
    assert line.endswith(f" | 26 dynamic tables: {live:,} live, {admitted:,} admitted, 2,850 evicted, 14 refused | "
                         f"most refused and evicted: {worst}")
    assert len(line) < 300
    assert all(record[f"embedding/{name}/{c}"] == v for name, t in tables.items() for c, v in t.items())


def test_many_tables_none_short_of_rows_show_only_their_sums(tmp_path):
    line, _ = progress(tmp_path, {f"t{i}": counts(3, 3, 0, 0) for i in range(5)})
    assert line.endswith(" | 5 dynamic tables: 15 live, 15 admitted, 0 evicted, 0 refused")
