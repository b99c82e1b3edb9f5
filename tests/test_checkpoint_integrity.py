"""Checkpoint integrity: the manifest records every piece's CRC-32 and every reader verifies the
pieces it reads, so a changed byte is one error line naming the file and the tensor (at restore,
and when deployment/deploy.py exports), unless verification is skipped; a manifest without the
checksums is refused unless it is. A damaged manifest (not JSON, not readable, lacking a field, a
piece outside the checkpoint's folder) or a checkpoint path in a symbolic link loop is one line
naming the file, in process, through dlrm.py and deploy.py; a save leaves a damaged checkpoint of
its root alone. A save that runs out of space (a small tmpfs, and ENOSPC injected at the write)
is one error line naming the root and the bytes, leaves no partial checkpoint and keeps the earlier
ones and `latest`: at one rank in process and at two Gloo ranks through dlrm.py. So does marking
the best checkpoint (--keep_best_checkpoint) on a full disk, `best` kept."""
import errno
import json
import os
import re
import shutil
import subprocess
import zlib

import numpy as np
import pytest
import tensorflow as tf

import run.loop as run_loop
from parallel_embedding.collectives import SingleProcess
from storage import checkpoint
from storage.checkpoint import Entry
from tests.support.configs import tiny_config
from tests.support.horovod_run import ROOT, Ranks, horovodrun
from tests.test_checkpoint_pruning import scripted_auc  # noqa: F401 (a fixture)
from tests.support.small_disk import fill, free_bytes, tmpfs
from tests.support.runs import DATA, MODEL, PLACEMENT
from utils.errors import CheckpointError, StoreError
from tests.support.warm_python import PYTHON

TABLE, KERNEL, BIAS, SLOT = "embedding/table_1", "top_mlp/dense_0/kernel", "top_mlp/dense_0/bias", \
    "bottom_mlp/dense_1/kernel/m"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """ROOT of a tiny model's checkpoint after 10 steps (ckpt-10)."""
    root = str(tmp_path_factory.mktemp("trained") / "ck")
    run_loop.run(tiny_config(save_checkpoint_path=root, max_steps=10))
    return root


def copy(root, to):
    shutil.copytree(root, to)
    return str(to)


def piece_path(root, name, k=0):
    manifest = checkpoint.read_manifest(root)
    return os.path.join(manifest["path"], manifest["tensors"][name]["pieces"][k]["file"])


def flip(path):
    """Flips the lowest bit of the first value of the .npy at `path` (float32: the least
    significant bit of its mantissa, so the value stays finite)."""
    offset = np.load(path, mmap_mode="r").offset
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 1
    with open(path, "wb") as f:
        f.write(data)


def mismatch(path, name, root):
    """The error line a changed piece gives."""
    recorded = checkpoint.read_manifest(root)[checkpoint.CHECKSUMS][os.path.basename(path)]
    crc = zlib.crc32(open(path, "rb").read())
    return (f"{path}: tensor {name} changed on disk since it was written (CRC-32 {crc:08x}, the manifest records "
            f"{recorded:08x})")


def error_lines(out):
    """The `error:` lines of a command's stderr (TensorFlow's own log lines aside), having checked
    that it ends with them and holds no traceback."""
    lines = out.stderr.strip().splitlines()
    errors = [line for line in lines if "error: " in line]
    assert "Traceback" not in out.stderr and lines[-len(errors):] == errors, out.stderr[-3000:]
    return errors


def all_tensors(root):
    return {n: checkpoint.read_tensor(root, n) for n in checkpoint.read_manifest(root)["tensors"]}


# ---------------------------------------------------------------------------------------------
# Checksums

def test_the_manifest_records_every_piece_files_crc32(trained):
    manifest = checkpoint.read_manifest(trained)
    files = {p["file"] for t in manifest["tensors"].values() for p in t["pieces"]}
    assert set(manifest[checkpoint.CHECKSUMS]) == files
    for file in files:
        with open(os.path.join(manifest["path"], file), "rb") as f:
            assert manifest[checkpoint.CHECKSUMS][file] == zlib.crc32(f.read()), file


@pytest.mark.parametrize("name", [TABLE, KERNEL, BIAS, SLOT])
def test_a_changed_byte_fails_the_restore_in_one_line_naming_file_and_tensor(trained, tmp_path, name, capsys):
    """Evaluating reads the weights, resuming the optimizer's slots too: each verifies what it reads."""
    root = copy(trained, tmp_path / "ck")
    path = piece_path(root, name)
    flip(path)
    run = dict(max_steps=12) if name == SLOT else dict(mode="eval")
    with pytest.raises(CheckpointError) as info:
        run_loop.run(tiny_config(restore_checkpoint_path=root, **run))
    assert str(info.value) == mismatch(path, name, root)
    # Skipping verification restores the changed value (one element differs) and evaluates.
    changed, saved = checkpoint.read_tensor(root, name, verify=False), checkpoint.read_tensor(trained, name)
    assert np.sum(changed != saved) == 1
    capsys.readouterr()
    result = run_loop.run(tiny_config(restore_checkpoint_path=root, skip_checkpoint_checksums=True, **run))
    assert result["samples"] == 1000
    assert "(written at 1 rank(s); not verified: --skip_checkpoint_checksums)" in capsys.readouterr().out


# dlrm.py evaluating a checkpoint of `trained`'s model (with --restore_checkpoint_path).
EVAL_MODEL = ["--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--dataset_type=synthetic",
              "--synthetic_cardinalities=20,50,7,30", "--synthetic_num_numerical=3", "--synthetic_eval_rows=1000",
              "--valid_batch_size=500", "--optimizer=adam", "--mode=eval"]


def test_a_changed_byte_is_one_error_line_on_the_command_line(trained, tmp_path):
    root = copy(trained, tmp_path / "ck")
    path = piece_path(root, TABLE)
    flip(path)
    model = [*EVAL_MODEL, f"--restore_checkpoint_path={root}"]
    out = subprocess.run([*PYTHON, "dlrm.py", *model], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 2 and error_lines(out) == [f"error: {mismatch(path, TABLE, root)}"], out.stderr[-3000:]
    skipped = subprocess.run([*PYTHON, "dlrm.py", *model, "--skip_checkpoint_checksums"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert skipped.returncode == 0 and "not verified: --skip_checkpoint_checksums" in skipped.stdout, skipped.stderr


def deploy(*args):
    return subprocess.run([*PYTHON, "deployment/deploy.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


@pytest.mark.parametrize("forms,name", [("monolithic", TABLE), ("tables", TABLE), ("tables", KERNEL)])
def test_deploy_of_a_changed_checkpoint_is_one_error_line(trained, tmp_path, forms, name):
    """The exporter's readers: whole tables (monolithic), tables a block at a time (tables form),
    the dense model's variables (restored)."""
    root = copy(trained, tmp_path / "ck")
    path = piece_path(root, name)
    flip(path)
    out = deploy(f"--checkpoint={root}", f"--output={tmp_path / 'repo'}", f"--forms={forms}")
    assert out.returncode == 2 and error_lines(out) == [f"error: {mismatch(path, name, root)}"], out.stderr[-3000:]
    assert not os.path.exists(tmp_path / "repo")


@pytest.mark.parametrize("forms,name", [("monolithic", TABLE), ("tables", TABLE), ("tables", KERNEL)])
def test_deploy_skip_checkpoint_checksums_exports_a_changed_checkpoint(trained, tmp_path, forms, name):
    root = copy(trained, tmp_path / "ck")
    flip(piece_path(root, name))
    out = deploy(f"--checkpoint={root}", f"--output={tmp_path / 'repo'}", f"--forms={forms}",
                 "--skip_checkpoint_checksums")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].endswith("; checkpoint not verified: --skip_checkpoint_checksums")
    assert os.path.exists(tmp_path / "repo" / "export.json")
    if forms == "tables" and name == TABLE:   # the changed value exported as it is now on disk
        exported = np.load(tmp_path / "repo" / "dlrm_tables" / "table_1.npy")
        assert exported[0, 0] == checkpoint.read_tensor(root, TABLE, verify=False)[0, 0]
        assert exported[0, 0] != checkpoint.read_tensor(trained, TABLE)[0, 0]


SIGNATURE = {"model": "integrity-test"}


@pytest.fixture
def two_pieces(tmp_path):
    """A checkpoint of tensor "t" [10, 4] in two pieces (rows 0:5 and 5:10), the second changed:
    (its path, the saved tensor, the second piece's path)."""
    array = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
    path = checkpoint.save(str(tmp_path / "ck"), [Entry("t", tf.Variable(array[:5]), (10, 4)),
                                                  Entry("t", tf.Variable(array[5:]), (10, 4), 5)],
                           1, SIGNATURE, SingleProcess())
    changed = piece_path(path, "t", 1)
    flip(changed)
    return path, array, changed


def test_each_reader_verifies_the_pieces_it_reads(two_pieces):
    path, array, changed = two_pieces
    line = mismatch(changed, "t", path)
    manifest = checkpoint.read_manifest(path)
    with pytest.raises(CheckpointError) as info:
        checkpoint.read_tensor(path, "t")
    assert str(info.value) == line
    with pytest.raises(CheckpointError) as info:
        next(checkpoint.read_blocks(path, "t"))
    assert str(info.value) == line
    with pytest.raises(CheckpointError) as info:
        checkpoint.gather_rows(manifest, "t", np.array([1, 7]))
    assert str(info.value) == line
    # Rows of the intact piece only: it alone is read and verified.
    np.testing.assert_array_equal(checkpoint.gather_rows(manifest, "t", np.array([1, 4])), array[[1, 4]])
    # Not verified: the changed value is read.
    expected = array.copy()
    expected[5, 0] = np.frombuffer((array[5, 0].view(np.uint32) ^ 1).tobytes(), np.float32)[0]
    np.testing.assert_array_equal(checkpoint.read_tensor(path, "t", verify=False), expected)
    np.testing.assert_array_equal(np.concatenate([b for _, b in checkpoint.read_blocks(path, "t", verify=False)]),
                                  expected)
    np.testing.assert_array_equal(checkpoint.gather_rows(manifest, "t", np.array([1, 5]), verify=False),
                                  expected[[1, 5]])


def test_restore_verifies_the_pieces_this_rank_reads_before_any_change(two_pieces):
    path, array, changed = two_pieces
    first, overlapping = tf.Variable(np.zeros((5, 4), np.float32)), tf.Variable(np.zeros((5, 4), np.float32))
    checkpoint.restore(path, [Entry("t", first, (10, 4))], SIGNATURE, {"t"})   # rows 0:5: the intact piece
    np.testing.assert_array_equal(first.numpy(), array[:5])
    first.assign(np.zeros((5, 4), np.float32))
    with pytest.raises(CheckpointError) as info:   # rows 0:5 and 3:8 (this one reads the changed piece)
        checkpoint.restore(path, [Entry("t", first, (10, 4)), Entry("t", overlapping, (10, 4), 3)], SIGNATURE, {"t"})
    assert str(info.value) == mismatch(changed, "t", path)
    assert not first.numpy().any() and not overlapping.numpy().any()


def edit_manifest(root, change):
    """Rewrites the manifest of the checkpoint ROOT names as `change(manifest)` leaves it; returns its path."""
    file = os.path.join(checkpoint.resolve(root), checkpoint.MANIFEST)
    with open(file) as f:
        manifest = json.load(f)
    change(manifest)
    with open(file, "w") as f:
        json.dump(manifest, f)
    return file


def without_checksums(root):
    """Removes the checksums from ROOT's checkpoint; returns the line a verifying reader refuses it with."""
    file = edit_manifest(root, lambda m: m.pop(checkpoint.CHECKSUMS))
    return (f"{file}: records no checksums of the checkpoint's pieces ('crc32'), so they cannot be verified; "
            "--skip_checkpoint_checksums (verify=False) reads them unverified")


def test_a_checkpoint_without_checksums_restores_only_with_skip_checkpoint_checksums(trained, tmp_path, capsys):
    """Every verifying reader refuses it in one line naming the manifest and the flag (gather_rows
    of no rows too); skipping verification restores it, the restore line saying so, and its readers
    read it; resumed training writes a checkpoint with checksums."""
    root = copy(trained, tmp_path / "ck")
    line = without_checksums(root)
    with pytest.raises(CheckpointError) as info:
        run_loop.run(tiny_config(mode="eval", restore_checkpoint_path=root))
    assert str(info.value) == line
    manifest = checkpoint.read_manifest(root)
    variable = tf.Variable(np.zeros(manifest["tensors"][KERNEL]["shape"], np.float32))
    for read in (lambda: checkpoint.read_tensor(root, TABLE), lambda: next(checkpoint.read_blocks(root, TABLE)),
                 lambda: checkpoint.gather_rows(manifest, TABLE, np.array([], np.int64)),
                 lambda: checkpoint.restore(root, [Entry(KERNEL, variable, tuple(variable.shape))], {}, {KERNEL},
                                            extra_ok=True)):
        with pytest.raises(CheckpointError) as info:
            read()
        assert str(info.value) == line
    assert not variable.numpy().any()
    capsys.readouterr()
    result = run_loop.run(tiny_config(mode="eval", restore_checkpoint_path=root, skip_checkpoint_checksums=True))
    assert result["samples"] == 1000
    out = capsys.readouterr().out
    assert out.count("not verified") == 1 and "(written at 1 rank(s); not verified: --skip_checkpoint_checksums)" in out
    for name, value in all_tensors(trained).items():
        np.testing.assert_array_equal(checkpoint.read_tensor(root, name, verify=False), value, err_msg=name)
    run_loop.run(tiny_config(save_checkpoint_path=root, restore_checkpoint_path=root, max_steps=12,
                             skip_checkpoint_checksums=True))
    assert checkpoint.CHECKSUMS in checkpoint.read_manifest(root)


def damaged(root, kind):
    """Damages the checkpoint of ROOT (a copy) as `kind` says; returns (the path to restore from,
    the one line every reader refuses it with)."""
    ckpt = checkpoint.resolve(root)
    file = os.path.join(ckpt, checkpoint.MANIFEST)
    name = checkpoint.read_manifest(root)["tensors"][TABLE]["pieces"][0]["file"]
    not_a_manifest = f"{file}: not a checkpoint manifest as storage/checkpoint.py writes one: "
    outside = f"{file}: piece {{!r}} of tensor {TABLE} is not a file name in the checkpoint's folder {ckpt}; " \
              f"no piece is read from elsewhere"

    def piece(file_name):
        edit_manifest(root, lambda m: m["tensors"][TABLE]["pieces"][0].update(file=file_name))
    if kind == "truncated":
        text = open(file).read()[:100]
        open(file, "w").write(text)
        with pytest.raises(ValueError) as error:
            json.loads(text)
        return root, f"{file}: not a checkpoint manifest ({error.value})"
    if kind == "a list":
        open(file, "w").write("[]")
        return root, not_a_manifest + "a JSON list, not an object"
    if kind == "no tensors":
        edit_manifest(root, lambda m: m.pop("tensors"))
        return root, not_a_manifest + "no 'tensors' (dict)"
    if kind == "a piece without rows":
        edit_manifest(root, lambda m: m["tensors"][TABLE]["pieces"][0].pop("rows"))
        return root, not_a_manifest + f"a piece of tensor {TABLE} lacks its file, rows or columns"
    if kind == "unreadable":   # a directory (the tests may run as root, whom no permission stops)
        os.remove(file)
        os.mkdir(file)
        return root, f"{file}: cannot read the checkpoint's manifest: Is a directory"
    if kind == "a symbolic link loop":
        loop = os.path.join(root, "loop")
        os.symlink(loop, loop)
        return loop, f"{loop}: cannot read it: Too many levels of symbolic links"
    if kind == "latest in a loop":
        os.remove(os.path.join(root, "latest"))
        os.symlink(os.path.join(root, "latest"), os.path.join(root, "latest"))
        return root, f"{os.path.join(root, 'latest')}: cannot read it: Too many levels of symbolic links"
    if kind == "../piece":
        piece(f"../{name}")
        return root, outside.format(f"../{name}")
    if kind == "an absolute piece":
        piece(os.path.join(ckpt, name))
        return root, outside.format(os.path.join(ckpt, name))
    if kind == "a piece linked out":
        shutil.move(os.path.join(ckpt, name), os.path.join(root, name))
        os.symlink(os.path.join("..", name), os.path.join(ckpt, name))
        return root, (f"{file}: piece {name!r} of tensor {TABLE} is a symbolic link to {os.path.join(root, name)}, "
                      f"outside the checkpoint's folder {ckpt}")
    raise ValueError(kind)


DAMAGES = ["truncated", "a list", "no tensors", "a piece without rows", "unreadable", "a symbolic link loop",
           "latest in a loop", "../piece", "an absolute piece", "a piece linked out"]


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_damaged_manifest_is_one_line_naming_it(trained, tmp_path, kind):
    """Every reader (read_manifest, a restore, with verification skipped too) refuses it."""
    root = copy(trained, tmp_path / "ck")
    path, line = damaged(root, kind)
    for read in (lambda: checkpoint.read_manifest(path), lambda: checkpoint.read_tensor(path, KERNEL, verify=False),
                 lambda: run_loop.run(tiny_config(mode="eval", restore_checkpoint_path=path,
                                                  skip_checkpoint_checksums=True))):
        with pytest.raises(CheckpointError) as info:
            read()
        assert str(info.value) == line


@pytest.mark.parametrize("kind", ["truncated", "a symbolic link loop", "a piece linked out", "no checksums"])
def test_a_damaged_checkpoint_is_one_error_line_of_dlrm_and_deploy(trained, tmp_path, kind):
    root = copy(trained, tmp_path / "ck")
    path, line = (root, without_checksums(root)) if kind == "no checksums" else damaged(root, kind)
    restored = subprocess.run([*PYTHON, "dlrm.py", *EVAL_MODEL, f"--restore_checkpoint_path={path}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert restored.returncode == 2 and error_lines(restored) == [f"error: {line}"], restored.stderr[-3000:]
    exported = deploy(f"--checkpoint={path}", f"--output={tmp_path / 'repo'}")
    assert exported.returncode == 2 and error_lines(exported) == [f"error: {line}"], exported.stderr[-3000:]
    assert not os.path.exists(tmp_path / "repo")
    if kind == "no checksums":   # skipping verification exports it
        exported = deploy(f"--checkpoint={path}", f"--output={tmp_path / 'repo'}", "--forms=tables",
                          "--skip_checkpoint_checksums")
        assert exported.returncode == 0, exported.stderr[-3000:]
        assert exported.stdout.strip().splitlines()[-1].endswith(
            "; checkpoint not verified: --skip_checkpoint_checksums")


def test_a_save_leaves_a_damaged_checkpoint_of_its_root_alone(tmp_path):
    """Neither counted (the next write's sequence) nor pruned: the save goes on, nothing removed."""
    root = str(tmp_path / "ck")
    variable = tf.Variable(np.ones((3, 2), np.float32))
    first = checkpoint.save(root, [Entry("t", variable, (3, 2))], 1, SIGNATURE, SingleProcess(), keep=1)
    with open(os.path.join(first, checkpoint.MANIFEST), "a") as f:
        f.write("{")
    for step in (2, 3):
        path = checkpoint.save(root, [Entry("t", variable, (3, 2))], step, SIGNATURE, SingleProcess(), keep=1)
    assert sorted(os.listdir(root)) == ["ckpt-1", "ckpt-3", "latest"]
    assert checkpoint.read_manifest(path)["sequence"] == 2


# ---------------------------------------------------------------------------------------------
# A full disk

@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs mounted at tmp_path/disk (the injected ENOSPC tests stand in where it is refused)."""
    with tmpfs(tmp_path / "disk", "8m") as disk:
        yield disk


def pieces_bytes(root):
    """The bytes of the pieces of the checkpoint ROOT/latest names."""
    manifest = checkpoint.read_manifest(root)
    return sum(os.path.getsize(os.path.join(manifest["path"], p["file"]))
               for t in manifest["tensors"].values() for p in t["pieces"])


def assert_left_as_it_was(root, name, before):
    """ROOT holds the checkpoint `name` alone, `latest` names it, its tensors are `before`."""
    assert sorted(os.listdir(root)) == [name, "latest"]
    assert open(os.path.join(root, "latest")).read().strip() == name
    after = all_tensors(root)
    assert set(after) == set(before)
    for n in before:
        np.testing.assert_array_equal(after[n], before[n], err_msg=n)


def no_space_line(root, step, size, free=None, rank=None, written=None):
    """A regular expression of the error line of a save of `step` whose pieces take `size` bytes
    out of space (`free` bytes free, any when None) on `rank` (None: one rank) writing `written`
    (a regular expression of the path in ROOT; default a piece of the checkpoint)."""
    on_rank = "" if rank is None else f" on rank {rank}"
    written = written or rf"\.tmp-ckpt-{step}/[^/ ]+\.npy"
    free = r"[\d,]+ \([\d.]+ MiB\)" if free is None else rf"{free:,} \({free / 2 ** 20:.1f} MiB\)"
    return (rf"{re.escape(root)}: out of space \(ENOSPC{on_rank} writing {written}\) saving the checkpoint of step "
            rf"{step}: its pieces take {size:,} bytes \({size / 2 ** 20:.1f} MiB\), {free} were free when the save "
            rf"began; its partial files are removed, latest still names ckpt-\d+")


def test_a_full_disk_at_one_rank(small_disk):
    root = str(small_disk / "ck")
    run_loop.run(tiny_config(save_checkpoint_path=root, max_steps=10))
    before, size = all_tensors(root), pieces_bytes(root)
    free = fill(small_disk, leave=16 * 4096)   # 16 pages: less than the pieces need (a page each at least)
    with pytest.raises(StoreError) as info:
        run_loop.run(tiny_config(save_checkpoint_path=root, restore_checkpoint_path=root))
    assert re.fullmatch(no_space_line(root, 40, size, free), str(info.value)), str(info.value)
    assert_left_as_it_was(root, "ckpt-10", before)
    os.remove(small_disk / "ballast")   # space again: the same run saves
    assert run_loop.run(tiny_config(save_checkpoint_path=root, restore_checkpoint_path=root))["steps"] == 40
    assert open(os.path.join(root, "latest")).read().strip() == "ckpt-40"


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def written_in_part(path, text):
    """Writes a part of `text` to `path` (through checkpoint._writing), then finds the disk full."""
    with checkpoint._writing(path) as f:
        f.write(text[:5].encode())
        no_space()


@pytest.mark.parametrize("at", ["piece", "manifest", "latest"])
def test_enospc_injected_at_the_write(trained, tmp_path, monkeypatch, at):
    """ENOSPC raised by the write of the fourth piece, of the manifest, or of the new `latest`
    (after the checkpoint was moved into place): no trace of the save is left."""
    root = copy(trained, tmp_path / "ck")
    before, size = all_tensors(root), pieces_bytes(root)
    if at == "piece":
        calls, save = [], np.save

        def failing_save(f, array):
            calls.append(1)
            if len(calls) == 4:
                no_space()
            save(f, array)
        monkeypatch.setattr(checkpoint.np, "save", failing_save)
        written = None
    else:
        write_text, file = checkpoint._write_text, {"manifest": "manifest.json", "latest": "latest.tmp"}[at]
        written = {"manifest": r"\.tmp-ckpt-40/manifest\.json", "latest": r"latest\.tmp"}[at]

        def failing_write(path, text):
            (written_in_part if os.path.basename(path) == file else write_text)(path, text)
        monkeypatch.setattr(checkpoint, "_write_text", failing_write)
    with pytest.raises(StoreError) as info:
        run_loop.run(tiny_config(save_checkpoint_path=root, restore_checkpoint_path=root))
    monkeypatch.undo()
    assert re.fullmatch(no_space_line(root, 40, size, written=written), str(info.value)), str(info.value)
    assert_left_as_it_was(root, "ckpt-10", before)


def best_on_a_full_disk(root, scripted_auc, fill_disk):  # noqa: F811 (the fixture's value)
    """--keep_best_checkpoint, evaluations at steps 10 and 20 with AUCs 0.6 and 0.8; `fill_disk()`
    runs once ckpt-20 is saved, before `best` may name it. Checks the one line (ROOT, the file, the
    bytes) and that nothing saved is lost: ckpt-20 saved whole, `latest` naming it, `best` still
    ckpt-10, no partial file."""
    mark_best = checkpoint.mark_best

    def filling(root_, path, *args):
        if os.path.basename(path) == "ckpt-20":
            fill_disk()
        return mark_best(root_, path, *args)
    scripted_auc([0.6, 0.8, 0.7, 0.75])
    checkpoint.mark_best = filling
    try:
        with pytest.raises(StoreError) as info:
            run_loop.run(tiny_config(save_checkpoint_path=root, evals_per_epoch=4, keep_best_checkpoint=True))
    finally:
        checkpoint.mark_best = mark_best
    text = "ckpt-20\nauc=0.8\n"
    assert re.fullmatch(rf"{re.escape(root)}: out of space \(ENOSPC writing best\.tmp\) marking ckpt-20 the best "
                        rf"checkpoint \(auc 0\.80000\): best takes {len(text)} bytes, [\d,]+ were free; its partial "
                        rf"file is removed, ckpt-20 is saved, best still names ckpt-10", str(info.value)), str(info.value)
    assert sorted(os.listdir(root)) == ["best", "ckpt-10", "ckpt-20", "latest"]
    assert open(os.path.join(root, "latest")).read() == "ckpt-20\n"
    assert open(os.path.join(root, "best")).read() == "ckpt-10\nauc=0.6\n"
    assert checkpoint.read_manifest(root)["step"] == 20
    all_tensors(root)   # every piece read, verified against its checksum


def test_marking_the_best_checkpoint_on_a_full_disk(small_disk, scripted_auc):  # noqa: F811
    root = str(small_disk / "ck")
    best_on_a_full_disk(root, scripted_auc, lambda: fill(small_disk, leave=0))
    assert free_bytes(small_disk) == 0


def test_enospc_injected_marking_the_best_checkpoint(tmp_path, scripted_auc, monkeypatch):  # noqa: F811
    """ENOSPC raised by the write of best.tmp, a part written."""
    write_text = checkpoint._write_text

    def failing_write(path, text):
        (written_in_part if os.path.basename(path) == "best.tmp" else write_text)(path, text)
    best_on_a_full_disk(str(tmp_path / "ck"), scripted_auc,
                        lambda: monkeypatch.setattr(checkpoint, "_write_text", failing_write))


def test_marking_the_best_checkpoint_out_of_space_fails_alike_on_every_rank(trained, tmp_path, monkeypatch):
    """Rank 0 writes `best`; rank 1 raises the same line, from what rank 0 broadcasts."""
    root = copy(trained, tmp_path / "ck")
    sent = []

    class Rank:
        def __init__(self, rank):
            self.rank = rank

        def broadcast_object(self, obj, name):
            if self.rank == 0:
                sent.append((obj, name))
                return obj
            assert name == sent[0][1]
            return sent[0][0]
    monkeypatch.setattr(checkpoint, "_write_text", written_in_part)
    lines = []
    for rank in (0, 1):
        with pytest.raises(StoreError) as info:
            checkpoint.mark_best(root, os.path.join(root, "ckpt-10"), 0.7, Rank(rank))
        lines.append(str(info.value))
    assert lines[0] == lines[1] and lines[0].endswith("ckpt-10 is saved, no best was written before"), lines
    assert sorted(os.listdir(root)) == ["ckpt-10", "latest"]


@pytest.fixture(scope="module")
def two_ranks_trained(tmp_path_factory):
    """ROOT of a checkpoint written by dlrm.py at 2 Gloo ranks after 6 of 12 steps (ckpt-6)."""
    root = tmp_path_factory.mktemp("two_ranks") / "ck"
    out = horovodrun(2, ["dlrm.py", *MODEL, *DATA, *PLACEMENT, "--max_steps=6", f"--save_checkpoint_path={root}"])
    assert out.returncode == 0, out.stderr[-3000:]
    return str(root)


def resumed_at_two_ranks(root, log_dir, before=()):
    """dlrm.py at 2 Gloo ranks (each its own process: horovodrun would add its own traceback to a
    failure) resuming ROOT's checkpoint and saving into ROOT (`before`: Python's arguments before
    the script): their exit codes and outputs."""
    ranks = Ranks(2, [*before, "dlrm.py", *MODEL, *DATA, *PLACEMENT, f"--save_checkpoint_path={root}",
                      f"--restore_checkpoint_path={root}"], str(log_dir))
    try:
        return [p.wait(timeout=600) for p in ranks.processes], [ranks.output(r) for r in range(2)]
    finally:
        ranks.close()


def assert_failed_at_two_ranks(codes, outputs, pattern):
    """Every rank exited 1 with the same one error line, which matches `pattern`."""
    errors = [[line for line in out.splitlines() if line.startswith("error: ")] for out in outputs]
    assert codes == [1, 1] and not any("Traceback" in out for out in outputs), [out[-3000:] for out in outputs]
    assert [len(e) for e in errors] == [1, 1] and errors[0] == errors[1], errors
    assert re.fullmatch(pattern, errors[0][0][len("error: "):]), errors[0][0]


@pytest.mark.slow
def test_a_full_disk_at_two_ranks(two_ranks_trained, small_disk):
    root = copy(two_ranks_trained, small_disk / "ck")
    before, size = all_tensors(root), pieces_bytes(root)
    free = fill(small_disk, leave=16 * 4096)
    codes, outputs = resumed_at_two_ranks(root, small_disk.parent)
    assert_failed_at_two_ranks(codes, outputs, no_space_line(root, 12, size, free, rank="[01]"))
    assert_left_as_it_was(root, "ckpt-6", before)


# Every piece rank 1 writes finds the disk full (numpy.save raises ENOSPC); rank 0 writes its own.
ENOSPC_ON_RANK_1 = """
import errno, os, runpy, sys
import numpy as np
if os.environ["HOROVOD_RANK"] == "1":
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    np.save = no_space
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_enospc_on_one_of_two_ranks(two_ranks_trained, tmp_path):
    """Rank 1 alone runs out of space: both ranks agree, and end with the same line."""
    root = copy(two_ranks_trained, tmp_path / "ck")
    before, size = all_tensors(root), pieces_bytes(root)
    codes, outputs = resumed_at_two_ranks(root, tmp_path, before=["-c", ENOSPC_ON_RANK_1])
    assert_failed_at_two_ranks(codes, outputs, no_space_line(root, 12, size, rank=1))
    assert_left_as_it_was(root, "ckpt-6", before)


@pytest.mark.parametrize("size", [0, 1, 4095, 8192, 8193, 3 * 4096 + 17])
def test_file_crc32_over_windows_equals_zlibs_of_the_whole_file(tmp_path, monkeypatch, size):
    """file_crc32 maps a file a window at a time (here 8 KiB): its CRC is zlib's of all the bytes,
    whether the file is empty, shorter than a window, a window exactly or windows and a tail."""
    from utils import files
    monkeypatch.setattr(files, "CRC_WINDOW", 8192)
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    assert files.file_crc32(str(tmp_path / "f")) == zlib.crc32(data)
