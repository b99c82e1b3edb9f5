"""deployment/serving/live.py: the tables form served from NumPy lookups and the dense SavedModel (the
monolithic SavedModel's predictions), versions swapped in while requests run (deltas as row
overlays written into the tables once older requests finished, full exports), refusals of broken
and out-of-order updates; and deployment/serve.py --updates under continuous requests."""
import os
import re
import shutil
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from deployment.client import ServingClient, free_ports
from deployment.exporter.repository import write_repository
from deployment.repository_format import PAD, DeltaError, export_version
from deployment.serving.errors import BadRequest, UpdateRefused
from deployment.serving.live import Model, Updater
from tests.support.live_exports import STEPS, make_delta, read_info, tables_of
from tests.support.serving import port_flags, script, start_server, stop_server

@pytest.fixture
def exports(live_exports):
    return live_exports


def requests(n, seed=0):
    """numerical [n, 3] float32, categorical [n, 7] int64 over TINY's cardinalities [20, 50, 7, 30]
    (features 0 and 3 multi-hot, 3 and 2 columns), with padding and a row without ids."""
    rng = np.random.default_rng(seed)
    categorical = np.concatenate([rng.integers(0, c, (n, h)) for c, h in ((20, 3), (50, 1), (7, 1), (30, 2))], 1)
    multi_hot = np.array([1, 1, 1, 0, 0, 1, 1], bool)
    categorical[(rng.random(categorical.shape) < 0.3) & multi_hot] = PAD
    categorical[0, 0:3] = PAD
    return rng.normal(size=(n, 3)).astype(np.float32), categorical.astype(np.int64)


def monolithic(repo, numerical, categorical):
    f = tf.saved_model.load(os.path.join(repo, "dlrm", "1", "model.savedmodel")).signatures["serving_default"]
    return {k: v.numpy() for k, v in f(numerical_features=tf.constant(numerical),
                                       categorical_features=tf.constant(categorical)).items()}


def test_predictions_equal_the_monolithic_models(exports):
    numerical, categorical = requests(64)
    for step in (8, 24):
        model = Model(exports[step])
        out = model.infer(numerical, categorical)
        expected = monolithic(exports[step], numerical, categorical)
        np.testing.assert_allclose(out["logits"], expected["logits"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out["predictions"], expected["predictions"], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(out["model_version"], np.full((64, 1), step))
        assert out["model_version"].dtype == np.int64 and np.std(out["logits"]) > 1e-3
    assert str(model.version) == f"step 24 (run {exports.run})"


def test_bad_requests_are_refused_in_one_line(exports):
    model = Model(exports[8])
    numerical, categorical = requests(8)
    for column, value, features in ((4, 7, [2]), (0, 20, [0]), (3, -1, [1]), (6, -2, [3])):
        bad = categorical.copy()
        bad[1, column] = value
        with pytest.raises(BadRequest) as e:
            model.infer(numerical, bad)
        assert str(e.value) == (f"embedding ids out of range [0, cardinality) in features (0-based): {features} "
                                "(cardinalities [20, 50, 7, 30])")
    numerical[3, 1] = np.inf
    with pytest.raises(BadRequest, match="^numerical_features holds NaN or infinite values$"):
        model.infer(numerical, categorical)


def test_a_chain_of_deltas_serves_what_the_new_export_does(exports, tmp_path):
    model = Model(exports[8])
    numerical, categorical = requests(200, seed=1)
    for base, new in ((8, 16), (16, 24)):
        model.apply_delta(read_delta_of(make_delta(exports[base], exports[new], str(tmp_path / f"d{new}"))))
        assert model.version == export_version(exports[new])
        for served, expected in zip(model._current.tables.arrays, tables_of(exports[new])):
            np.testing.assert_array_equal(served, expected)
        assert not model._current.overlay
    fresh = Model(exports[24]).infer(numerical, categorical)
    out = model.infer(numerical, categorical)
    for key in ("logits", "predictions", "model_version"):
        np.testing.assert_array_equal(out[key], fresh[key])


def read_delta_of(directory):
    from deployment.repository_format import read_delta
    return read_delta(directory)


def test_requests_in_flight_finish_on_the_old_version(exports, tmp_path):
    """A request holding the step-8 snapshot: the delta's rows are served from the overlay, the
    tables stay unchanged until it finishes, then take the rows in place."""
    model = Model(exports[8])
    numerical, categorical = requests(100, seed=2)
    old = model.infer(numerical, categorical)
    new = Model(exports[16]).infer(numerical, categorical)
    assert not np.array_equal(old["logits"], new["logits"])
    delta = read_delta_of(make_delta(exports[8], exports[16], str(tmp_path / "d16")))
    tables = model._current.tables.arrays
    before = [t.copy() for t in tables]
    with model.snapshot() as held:
        update = threading.Thread(target=model.apply_delta, args=(delta,))
        update.start()
        deadline = time.monotonic() + 120
        while model.version.step != 16 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert model.version.step == 16 and model._current.overlay and update.is_alive()
        for key in ("logits", "model_version"):   # a later request: the new version, from the overlay
            np.testing.assert_array_equal(model.infer(numerical, categorical)[key], new[key])
            np.testing.assert_array_equal(model.infer_with(held, numerical, categorical)[key], old[key])
        for table, copy in zip(tables, before):
            np.testing.assert_array_equal(table, copy)
    update.join(120)
    assert not update.is_alive() and not model._current.overlay and model._current.tables.arrays is tables
    for table, expected in zip(tables, tables_of(exports[16])):
        np.testing.assert_array_equal(table, expected)
    np.testing.assert_array_equal(model.infer(numerical, categorical)["logits"], new["logits"])


def test_updates_that_do_not_apply_are_refused_and_the_old_version_serves(exports, tmp_path):
    model = Model(exports[8])
    numerical, categorical = requests(50, seed=3)
    old = model.infer(numerical, categorical)
    late = read_delta_of(make_delta(exports[16], exports[24], str(tmp_path / "d24")))
    with pytest.raises(UpdateRefused, match=rf"^its base is step 16 \(run {exports.run}\), serving step 8 \(run {exports.run}\)$"):
        model.apply_delta(late)
    corrupt = make_delta(exports[8], exports[16], str(tmp_path / "d16"))
    rows = os.path.join(corrupt, "table_1.rows.npy")
    data = bytearray(open(rows, "rb").read())
    data[-1] ^= 0xFF
    open(rows, "wb").write(bytes(data))
    with pytest.raises(DeltaError, match="CRC-32"):
        model.apply_delta(read_delta_of(corrupt))
    assert model.version.step == 8 and not model._current.overlay
    np.testing.assert_array_equal(model.infer(numerical, categorical)["logits"], old["logits"])


def test_the_updater_applies_new_updates_in_order_and_refuses_the_rest(exports, tmp_path):
    model = Model(exports[8])
    updates = tmp_path / "updates"
    updates.mkdir()
    lines = []
    updater = Updater(model, str(updates), log=lines.append, allow_full_exports=True)
    make_delta(exports[16], exports[24], str(updates / "b"))   # found with its base: applied after "a"
    make_delta(exports[8], exports[16], str(updates / "a"))
    (updates / "partial").mkdir()                              # being written: left for later
    make_delta(exports[8], exports[16], str(updates / "stale"))  # made after "a", but its base is gone
    (updates / "broken").mkdir()
    (updates / "broken" / "delta.json").write_text("{not json")
    updater.poll()
    assert model.version.step == 24
    assert [re.sub(r"in [0-9.]+ s, -?[0-9.]+ s after", "in T s, T s after", line) for line in lines] == [
        f"refused update {updates / 'broken'}: {updates / 'broken' / 'delta.json'}: unreadable (Expecting property "
        "name enclosed in double quotes: line 1 column 2 (char 1))",
        f"not yet an update {updates / 'partial'}: no delta.json or export.json (deploy.py writes an update "
        "elsewhere and renames it in); taken once one appears",
        f"applied update {updates / 'a'} (delta, {changed(8, 16, exports)}): serving step 16 "
        f"(run {exports.run}), in T s, T s after its delta.json was written",
        f"refused update {updates / 'stale'}: its base is step 8 (run {exports.run}), serving step 16 (run {exports.run})",
        f"applied update {updates / 'b'} (delta, {changed(16, 24, exports)}): serving step 24 "
        f"(run {exports.run}), in T s, T s after its delta.json was written"]
    shutil.copytree(exports[24], updates / "partial" / "repo")   # not a complete update yet
    updater.poll()
    assert len(lines) == 5
    shutil.copytree(exports[16], updates / "full16")
    updater.poll()
    assert model.version.step == 16 and lines[5].startswith(f"applied update {updates / 'full16'} (full export): "
                                                            f"serving step 16 (run {exports.run}), in ")
    numerical, categorical = requests(50, seed=4)
    np.testing.assert_array_equal(model.infer(numerical, categorical)["logits"],
                                  Model(exports[16]).infer(numerical, categorical)["logits"])


def changed(base, new, exports):
    """'<rows> rows in <tables> tables' that differ between two exports."""
    rows = [int((a != b).any(1).sum()) for a, b in zip(tables_of(exports[base]), tables_of(exports[new]))]
    return f"{sum(rows)} rows in {sum(r > 0 for r in rows)} tables"


def test_serve_refuses_updates_without_the_tables_form_in_one_line(exports, tmp_path):
    mono = tmp_path / "mono"
    write_repository(read_info(exports[8])["checkpoint"], str(mono), forms=["monolithic"])
    ports = port_flags(free_ports(3))
    for args, message in (([f"--updates={tmp_path}"], f"error: --updates: {mono} has no table files to update "
                           "(exported with --forms=monolithic): export with --forms including tables"),
                          ([f"--updates={tmp_path}", "--poll_seconds=0"],
                           "error: --poll_seconds must be positive, got 0"),
                          (["--updates_allow_full_exports"],
                           "error: --updates_allow_full_exports: no effect without --updates")):
        result = script("serve.py", f"--model_repository={mono}", "--address=127.0.0.1", *ports, *args)
        assert result.returncode == 2 and result.stderr.strip().splitlines()[-1:] == [message], result.stderr[-2000:]


class Load(threading.Thread):
    """A client sending REQUESTS in turn, over and over, until stopped (paused while `pause` is set):
    per response (time sent, seconds taken, request index, model_version, logits), and the errors."""
    BATCHES = [requests(64, seed=10 + k) for k in range(4)]

    def __init__(self, port):
        super().__init__(daemon=True)
        self.client = ServingClient("grpc", f"localhost:{port}", "dlrm")
        self.responses, self.errors = [], []
        self.stop, self.pause = threading.Event(), threading.Event()

    def run(self):
        k = 0
        while not self.stop.is_set():
            if self.pause.is_set():
                time.sleep(0.01)
                continue
            numerical, categorical = self.BATCHES[k % len(self.BATCHES)]
            start = time.monotonic()
            try:
                out = self.client.infer(numerical, categorical, ("logits", "model_version"))
            except Exception as e:
                self.errors.append(str(e))
                continue
            self.responses.append((start, time.monotonic() - start, k % len(self.BATCHES),
                                   set(out["model_version"][:, 0].tolist()), out["logits"]))
            k += 1

    def finish(self):
        """Stops the client and waits for its last request."""
        self.stop.set()
        if self.is_alive():
            self.join(60)

    def versions(self):
        return [r[3] for r in self.responses]


def wait_for(condition, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.slow
def test_serve_swaps_versions_while_requests_run(exports, tmp_path):
    """serve.py --updates: a delta, a corrupt delta, a stale delta and a full export dropped into the
    updates directory under continuous requests: none fails, every response is exactly the
    response of one version (a fresh model of it), model_version switches 8 -> 16 -> 24."""
    expected = {step: [Model(exports[step]).infer(*batch)["logits"] for batch in Load.BATCHES] for step in STEPS}
    updates, log = tmp_path / "updates", tmp_path / "server.log"
    updates.mkdir()
    ports = free_ports(3)
    server = start_server(log, ports, f"--model_repository={exports[8]}", f"--updates={updates}", "--poll_seconds=0.5",
                          "--updates_allow_full_exports")
    load = Load(ports[1])
    ready = tmp_path / "ready"   # updates made here, renamed into the updates directory
    make_delta(exports[8], exports[16], str(ready / "d16"))
    make_delta(exports[8], exports[16], str(ready / "stale"))
    broken = make_delta(exports[16], exports[24], str(ready / "broken"))
    with open(os.path.join(broken, "table_0.rows.npy"), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"x")
    shutil.copytree(exports[24], ready / "full24")
    try:
        load.client.wait_ready(120)
        load.start()
        wait_for(lambda: len(load.responses) >= 220, "requests before the first update")
        dropped = {16: time.monotonic()}
        os.rename(ready / "d16", updates / "d16")
        wait_for(lambda: {16} in load.versions(), "step 16 served")
        os.rename(ready / "broken", updates / "broken")
        os.rename(ready / "stale", updates / "stale")
        wait_for(lambda: log.read_text().count("refused update") == 2, "two refusals")
        load.pause.set()
        time.sleep(0.5)
        numerical, categorical = requests(200, seed=5)
        out = ServingClient("grpc", f"localhost:{ports[1]}", "dlrm").infer(numerical, categorical,
                                                                           ("logits", "predictions", "model_version"))
        fresh = Model(exports[16]).infer(numerical, categorical)
        for key in out:
            np.testing.assert_array_equal(out[key], fresh[key])
        load.pause.clear()
        dropped[24] = time.monotonic()
        os.rename(ready / "full24", updates / "full24")
        wait_for(lambda: {24} in load.versions(), "step 24 served")
        count = len(load.responses)
        wait_for(lambda: len(load.responses) >= count + 20, "requests after the last update")
    finally:
        load.finish()
        stop_server(server, ports, log)
    assert load.errors == []
    versions = load.versions()
    assert all(len(v) == 1 for v in versions) and sorted(versions, key=min) == versions
    assert {min(v) for v in versions} == set(STEPS)
    for _, _, k, (version,), logits in load.responses:
        np.testing.assert_array_equal(logits, expected[version][k])
    lines = log.read_text().splitlines()
    assert any(line.startswith(f"serving dlrm (tables form, step 8 (run {exports.run}), updates from {updates} every 0.5 s) "
                               f"of ") for line in lines)
    events = {re.sub(r" \(delta, .*| \(full export.*|: .*", "", line): line for line in lines
              if line.startswith(("applied update", "refused update"))}
    assert sorted(events) == sorted(f"{what} update {updates / name}" for what, name in (
        ("applied", "d16"), ("refused", "broken"), ("refused", "stale"), ("applied", "full24"))), events
    assert events[f"refused update {updates / 'broken'}"].endswith(
        f"{updates / 'broken' / 'table_0.rows.npy'}: CRC-32 differs from delta.json's (a corrupt or partial file)")
    assert events[f"refused update {updates / 'stale'}"].endswith(
        f"its base is step 8 (run {exports.run}), serving step 16 (run {exports.run})")
    report_latency(load.responses, dropped)


def report_latency(responses, dropped):
    """Prints the time from an update written to its first response, and p99 latency in steady state
    (before the first update, after 20 requests of warm-up) and from each update written to 2 s after
    it became visible."""
    first = {v: next(r[0] for r in responses if r[3] == {v}) for v in dropped}
    steady = [r[1] for r in responses[20:] if r[0] < min(dropped.values())]
    for v, t in dropped.items():
        swap = [r[1] for r in responses if t <= r[0] <= first[v] + 2]
        print(f"step {v}: visible {first[v] - t:.2f} s after written; p99 {np.percentile(swap, 99) * 1e3:.1f} ms "
              f"during the swap ({len(swap)} requests) vs {np.percentile(steady, 99) * 1e3:.1f} ms steady "
              f"({len(steady)} requests)")
