"""What the server trusts (docs/deployment.md, "What the server trusts"): from an updates folder
only what deploy.py writes is taken (every file as its manifest lists it, rows finite, no symbolic
link, no hidden or unfinished folder; full exports only with --updates_allow_full_exports); the
repository's files are checked at start-up (--skip_checksums skips it); a Redis value that is not
finite is not served; an export onto a full device is one line, the old repository intact."""
import json
import os
import re
import shutil

import numpy as np
import pytest

from deployment.client import ServingClient, free_ports
from deployment.exporter.repository import ExportError, write_delta_repository, write_repository
from deployment.repository_format import DELTA_INFO, RepositoryError, file_crc32, file_entries, read_delta
from deployment.serving.live import Model, Updater, check_export
from deployment.serving.tiers import TierConfig
from tests.support.redis_server import RedisServer
from tests.support.small_disk import fill, tmpfs
from tests.support.live_exports import make_delta, read_info
from tests.test_live_serving import requests, wait_for
from tests.support.serving import script, start_server, stop_server


@pytest.fixture
def exports(live_exports):
    return live_exports


def resigned(directory):
    """Recomputes delta.json's sizes and checksums for the delta's files as they are now (what anyone
    who can write the updates folder can do); returns the delta.json content."""
    path = os.path.join(directory, DELTA_INFO)
    info = json.loads(open(path).read())
    for table in info["tables"]:
        for key in ("ids", "rows"):
            file = os.path.join(directory, table[key]["file"])
            if os.path.isfile(file):
                table[key].update(bytes=os.path.getsize(file), crc32=file_crc32(file))
    info["files"] = file_entries(directory, DELTA_INFO)
    open(path, "w").write(json.dumps(info))
    return info


def nan_delta(exports, out):
    """A delta 8 -> 16 whose first row of table 1 is NaN, its checksums recomputed."""
    make_delta(exports[8], exports[16], out)
    rows_path = os.path.join(out, "table_1.rows.npy")
    rows = np.load(rows_path)
    rows[0] = np.nan
    np.save(rows_path, rows)
    resigned(out)
    return out, len(rows)


@pytest.mark.slow
def test_the_updater_takes_only_what_deploy_py_writes(exports, tmp_path):
    model = Model(exports[8])
    numerical, categorical = requests(100, seed=6)
    before = model.infer(numerical, categorical)
    updates, outside = tmp_path / "updates", tmp_path / "outside"
    updates.mkdir()
    make_delta(exports[8], exports[16], str(outside))
    make_delta(exports[8], exports[16], str(updates / ".d16.tmp-export"))   # a writer's temporary folder
    _, nan_rows = nan_delta(exports, str(updates / "nan"))
    make_delta(exports[8], exports[16], str(updates / "bare"))
    os.remove(updates / "bare" / DELTA_INFO)                              # no manifest
    os.symlink(outside, updates / "link")                                 # a folder outside
    absolute = make_delta(exports[8], exports[16], str(updates / "absolute"))
    info = json.loads(open(os.path.join(absolute, DELTA_INFO)).read())
    info["tables"][0]["rows"]["file"] = "/etc/hostname"
    open(os.path.join(absolute, DELTA_INFO), "w").write(json.dumps(info))
    dotdot = make_delta(exports[8], exports[16], str(updates / "dotdot"))
    info = json.loads(open(os.path.join(dotdot, DELTA_INFO)).read())
    info["files"].append({"file": "../outside/table_0.rows.npy", "bytes": 1, "crc32": 0})
    open(os.path.join(dotdot, DELTA_INFO), "w").write(json.dumps(info))
    make_delta(exports[8], exports[16], str(updates / "extra"))
    (updates / "extra" / "run_me.py").write_text("print('hello')\n")           # a file not listed
    make_delta(exports[8], exports[16], str(updates / "inner_link"))
    os.remove(updates / "inner_link" / "table_0.rows.npy")
    os.symlink(outside / "table_0.rows.npy", updates / "inner_link" / "table_0.rows.npy")
    shutil.copytree(exports[16], updates / "full16")
    lines = []
    updater = Updater(model, str(updates), log=lines.append)
    updater.poll()
    updater.poll()   # nothing new: nothing said
    assert sorted(lines) == sorted([
        f"refused update {updates / 'absolute'}: {updates / 'absolute' / DELTA_INFO}: names '/etc/hostname', "
        f"not a relative path inside {updates / 'absolute'}",
        f"not yet an update {updates / 'bare'}: no delta.json or export.json (deploy.py writes an update "
        "elsewhere and renames it in); taken once one appears",
        f"refused update {updates / 'dotdot'}: {updates / 'dotdot' / DELTA_INFO}: names "
        f"'../outside/table_0.rows.npy', not a relative path inside {updates / 'dotdot'}",
        f"refused update {updates / 'extra'}: {updates / 'extra' / 'run_me.py'}: not listed in delta.json",
        f"refused update {updates / 'full16'}: a full export, whose SavedModel would run in the server: taken only "
        "with --updates_allow_full_exports",
        f"refused update {updates / 'inner_link'}: {updates / 'inner_link' / 'table_0.rows.npy'}: a symbolic link "
        "(an update holds regular files only)",
        f"refused update {updates / 'link'}: a symbolic link (updates are folders written by deploy.py and "
        "renamed in)",
        f"refused update {updates / 'nan'}: {updates / 'nan' / 'table_1.rows.npy'}: 1 of {nan_rows} rows hold NaN "
        "or infinite values"]), lines
    assert model.version.step == 8
    for key in before:
        np.testing.assert_array_equal(model.infer(numerical, categorical)[key], before[key])
    make_delta(exports[8], exports[16], str(tmp_path / "bare"))
    os.rename(tmp_path / "bare" / DELTA_INFO, updates / "bare" / DELTA_INFO)   # its manifest appears
    updater.poll()
    assert model.version.step == 16 and len(lines) == 9 and lines[-1].startswith(f"applied update {updates / 'bare'}")
    (tmp_path / "allowed").mkdir()
    os.rename(updates / "full16", tmp_path / "allowed" / "full16")
    allowed = []
    Updater(Model(exports[8]), str(tmp_path / "allowed"), log=allowed.append, allow_full_exports=True).poll()
    assert len(allowed) == 1 and allowed[0].startswith(f"applied update {tmp_path / 'allowed' / 'full16'} (full "
                                                       "export): serving step 16")


@pytest.mark.slow
def test_serve_refuses_full_exports_and_nan_deltas_unless_allowed(exports, tmp_path):
    """serve.py --updates: a full export and a NaN delta dropped in are refused in one line each,
    the answers unchanged; with --updates_allow_full_exports the full export is taken."""
    numerical, categorical = requests(64, seed=7)
    expected = {step: Model(exports[step]).infer(numerical, categorical) for step in (8, 24)}
    ready, updates = tmp_path / "ready", tmp_path / "updates"
    updates.mkdir()
    nan_delta(exports, str(ready / "nan"))
    shutil.copytree(exports[24], ready / "full24")
    for allowed, log in ((False, tmp_path / "refusing.log"), (True, tmp_path / "allowing.log")):
        ports = free_ports(3)
        server = start_server(log, ports, f"--model_repository={exports[8]}", f"--updates={updates}",
                              "--poll_seconds=0.2", *["--updates_allow_full_exports"] * allowed)
        try:
            client = ServingClient("grpc", f"localhost:{ports[1]}", "dlrm")
            client.wait_ready(120)
            if not allowed:
                for name in ("nan", "full24"):
                    os.rename(ready / name, updates / name)
                wait_for(lambda: log.read_text().count("refused update") == 2, "two refusals")
            else:
                wait_for(lambda: "applied update" in log.read_text(), "the full export taken")
            out = client.infer(numerical, categorical, ("logits", "model_version"))
        finally:
            stop_server(server, ports, log)
        step = 24 if allowed else 8
        np.testing.assert_array_equal(out["logits"], expected[step]["logits"])
        np.testing.assert_array_equal(out["model_version"], np.full((64, 1), step))
        events = sorted(line for line in log.read_text().splitlines() if " update " in line)
        if allowed:
            assert len(events) == 2 and events[0].startswith(f"applied update {updates / 'full24'} (full export)")
            assert events[1].startswith(f"refused update {updates / 'nan'}: ")
        else:
            assert events == [
                f"refused update {updates / 'full24'}: a full export, whose SavedModel would run in the server: taken "
                "only with --updates_allow_full_exports",
                f"refused update {updates / 'nan'}: {updates / 'nan' / 'table_1.rows.npy'}: 1 of "
                f"{len(np.load(updates / 'nan' / 'table_1.rows.npy'))} rows hold NaN or infinite values"]


def test_a_deltas_graph_is_never_loaded_and_a_store_it_updated_passes_the_start_up_check(exports, tmp_path):
    """The delta's saved_model.pb replaced by garbage (checksums recomputed): applied through the
    tiers all the same (only its variables are read), the kept dense model is the export's graph
    with the delta's variables, and a restart serves step 16; the export's files check, but the
    table files the delta rewrote."""
    repo = str(shutil.copytree(exports[8], tmp_path / "repo"))
    delta = make_delta(exports[8], exports[16], str(tmp_path / "d16"))
    graph = os.path.join(delta, "dlrm_dense", "1", "model.savedmodel", "saved_model.pb")
    open(graph, "wb").write(b"not a graph")
    resigned(delta)
    model = Model(repo, TierConfig(800))
    model.apply_delta(read_delta(delta))
    model.close()
    kept = os.path.join(repo, "dlrm_tables", "dense-16")
    assert open(os.path.join(kept, "saved_model.pb"), "rb").read() == open(os.path.join(
        repo, "dlrm_dense", "1", "model.savedmodel", "saved_model.pb"), "rb").read()
    numerical, categorical = requests(32, seed=11)
    restarted = Model(repo, TierConfig(800))
    np.testing.assert_array_equal(restarted.infer(numerical, categorical)["logits"],
                                  Model(exports[16]).infer(numerical, categorical)["logits"])
    restarted.close()
    check_export(repo)   # table files rewritten by the delta: not checked; the rest as listed
    with open(os.path.join(repo, "dlrm_tables", "tables.json"), "a") as f:
        f.write(" ")
    with pytest.raises(RepositoryError, match=f"^{repo}/dlrm_tables/tables.json: 1[0-9]+ bytes, export.json says "):
        check_export(repo)


def flipped(repo, tmp_path, name, file):
    """A copy of `repo` whose file `file` has its last byte flipped."""
    copy = tmp_path / name
    shutil.copytree(repo, copy)
    with open(copy / file, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    return copy


def test_a_changed_export_file_is_refused_at_start_up_unless_skipped(exports, tmp_path):
    dense = "dlrm_dense/1/model.savedmodel/variables/variables.data-00000-of-00001"
    for name, file in (("dense", dense), ("table", "dlrm_tables/table_2.npy")):
        repo = flipped(exports[8], tmp_path, name, file)
        result = script("serve.py", f"--model_repository={repo}", "--address=127.0.0.1",
                        *[f"--{n}_port={p}" for n, p in zip(("http", "grpc", "metrics"), free_ports(3))])
        assert result.returncode == 2 and result.stderr.strip().splitlines()[-1:] == [
            f"error: {repo / file}: CRC-32 differs from export.json's (a corrupt or partial file)"], \
            result.stderr[-2000:]
    check_export(exports[8])   # the original is as listed
    ports, log = free_ports(3), tmp_path / "skipping.log"
    server = start_server(log, ports, f"--model_repository={repo}", "--skip_checksums")
    try:
        client = ServingClient("grpc", f"localhost:{ports[1]}", "dlrm")
        client.wait_ready(120)
        numerical, categorical = requests(16, seed=8)
        assert client.infer(numerical, categorical, ("model_version",))["model_version"].tolist() == [[8]] * 16
    finally:
        stop_server(server, ports, log)


def test_the_exporter_checksums_table_and_delta_files_as_it_writes_them(exports, tmp_path, monkeypatch):
    """An export's table files and a delta's ids and rows get their CRC-32 as they are written, not
    read back (the SavedModels' files, which TensorFlow writes, are, and the small text files);
    each listed CRC-32 is the file's."""
    import deployment.repository_format as repository_format
    crc32, read = repository_format.file_crc32, []
    monkeypatch.setattr(repository_format, "file_crc32", lambda path: read.append(path) or crc32(path))
    checkpoint_path = read_info(exports[16])["checkpoint"]
    write_repository(checkpoint_path, str(tmp_path / "repo"), forms=["tables"])
    write_delta_repository(checkpoint_path, str(tmp_path / "d16"), exports[8])
    monkeypatch.undo()
    assert not [path for path in read if path.endswith(".npy")], read
    assert any("/dlrm_dense/1/model.savedmodel/" in path for path in read), read
    for directory, manifest in ((tmp_path / "repo", "export.json"), (tmp_path / "d16", DELTA_INFO)):
        listed = json.loads((directory / manifest).read_text())["files"]
        assert listed == file_entries(str(directory), manifest)   # every file read now
        assert sum(e["file"].endswith(".npy") for e in listed) == (4 if manifest == "export.json" else 8), listed
    check_export(str(tmp_path / "repo"))


def test_a_nan_value_in_redis_is_not_served(exports, tmp_path):
    server = RedisServer(tmp_path).start()
    repo = shutil.copytree(exports[24], tmp_path / "repo")
    tiered = Model(str(repo), TierConfig(0, "lru", server.url))   # no cache: every row from Redis or the store
    try:
        numerical, categorical = requests(64, seed=9)
        expected = Model(exports[24]).infer(numerical, categorical)
        tiered.infer(numerical, categorical)
        redis_tier = tiered._current.tables.redis
        redis_tier.drain()
        key = redis_tier.keys(1, np.array([categorical[0, 3]]))[0]   # feature 1's id of the first request
        value = redis_tier._client.get(key)
        assert value is not None
        redis_tier._client.set(key, value[:24] + np.full((len(value) - 24) // 4, np.nan, np.float32).tobytes())
        out = tiered.infer(numerical, categorical)
        for key in ("logits", "predictions"):
            np.testing.assert_array_equal(out[key], expected[key])
        assert tiered.stats()["redis"]["nonfinite"] >= 1
    finally:
        tiered.close()
        server.stop()


@pytest.fixture
def small_device(tmp_path):
    """A 1 MiB tmpfs."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        yield disk


def test_an_export_onto_a_full_device_is_one_line_and_keeps_the_old_one(exports, small_device, tmp_path):
    checkpoints = {step: read_info(exports[step])["checkpoint"] for step in (8, 16)}
    repo = small_device / "repo"
    first = script("deploy.py", f"--checkpoint={checkpoints[8]}", f"--output={repo}", "--forms=monolithic,tables")
    assert first.returncode == 0, first.stderr[-2000:]
    exported = (repo / "export.json").read_text()
    fill(small_device, 64 << 10)
    free = shutil.disk_usage(small_device).free
    full = script("deploy.py", f"--checkpoint={checkpoints[16]}", f"--output={repo}", "--forms=monolithic,tables",
                  "--overwrite")
    line = full.stderr.strip().splitlines()[-1]
    assert full.returncode == 2 and re.fullmatch(
        rf"error: {re.escape(str(repo))}: no space left on device: it needs (about [0-9,]+ bytes, {free:,} were free|"
        rf"more than the {free:,} bytes free) in {re.escape(str(small_device))} \(the partial copy removed; the "
        r"existing one unchanged\)", line), full.stderr[-3000:]
    assert "Traceback" not in full.stderr
    assert sorted(os.listdir(small_device)) == ["ballast", "repo"] and (repo / "export.json").read_text() == exported
    check_export(str(repo))
    fill(small_device, 4 << 10)
    with pytest.raises(ExportError) as e:
        write_delta_repository(checkpoints[16], str(small_device / "d16"), exports[8])
    assert re.fullmatch(rf"{re.escape(str(small_device / 'd16'))}: no space left on device: it needs (about [0-9,]+ "
                        r"bytes, [0-9,]+ were free|more than the [0-9,]+ bytes free) in "
                        rf"{re.escape(str(small_device))} \(the partial copy removed; nothing written\)",
                        str(e.value)), str(e.value)
    assert sorted(os.listdir(small_device)) == ["ballast", "repo"]
