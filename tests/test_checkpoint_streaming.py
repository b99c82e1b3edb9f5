"""Streamed checkpoint entries (row sources kept on disk): saved and restored a block at a time,
exactly, and interchangeable with the pieces of variables."""
import io
import os

import numpy as np
import pytest
import tensorflow as tf

from storage import checkpoint
from storage.checkpoint import Entry
from parallel_embedding.collectives import SingleProcess
from utils.errors import CheckpointError

SIGNATURE = {"model": "streaming-test"}


class Source:
    """A RowSource over a numpy array [rows, cols]; records the row count of every call."""

    def __init__(self, array):
        self.array = array
        self.shape, self.dtype = array.shape, array.dtype
        self.reads, self.writes = [], []

    def read_rows(self, start, stop):
        self.reads.append(stop - start)
        return self.array[start:stop].copy()

    def write_rows(self, start, values):
        self.writes.append(len(values))
        self.array[start:start + len(values)] = values

    @property
    def largest(self):
        return max(self.reads + self.writes)


def random(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def save(root, entries):
    return checkpoint.save(str(root), entries, 1, SIGNATURE, SingleProcess())


def restore(path, entries, names):
    return checkpoint.restore(path, entries, SIGNATURE, set(names))


def row_entries(name, array, bounds, streamed):
    """Entries of `array` [rows, cols] cut at rows `bounds` (0 < ... < rows), as ranks hold it."""
    cuts = [0, *bounds, len(array)]
    return [Entry(name, Source(array[a:b].copy()) if streamed else tf.Variable(array[a:b]), array.shape, a)
            for a, b in zip(cuts, cuts[1:])]


def test_streamed_and_variable_entries_are_interchangeable(tmp_path):
    """A table saved from a source restores into a variable with a spare row (num_rows), and the
    reverse; a dense tensor beside it as a plain variable."""
    table, dense = random((50, 6)), random((4, 3), seed=1)
    path = save(tmp_path / "a", [Entry("table", Source(table.copy()), table.shape),
                                 Entry("dense", tf.Variable(dense), dense.shape)])
    spare = np.full((1, 6), 7.0, np.float32)
    var, dense_var = tf.Variable(np.zeros((51, 6), np.float32)), tf.Variable(np.zeros((4, 3), np.float32))
    var[50:].assign(spare)
    restore(path, [Entry("table", var, table.shape, num_rows=50), Entry("dense", dense_var, dense.shape)],
            ["table", "dense"])
    np.testing.assert_array_equal(var.numpy(), np.concatenate([table, spare]))
    np.testing.assert_array_equal(dense_var.numpy(), dense)

    path = save(tmp_path / "b", [Entry("table", tf.Variable(np.concatenate([table, spare])), table.shape,
                                       num_rows=50), Entry("dense", tf.Variable(dense), dense.shape)])
    source = Source(np.zeros((50, 6), np.float32))
    restore(path, [Entry("table", source, table.shape), Entry("dense", dense_var, dense.shape)], ["table", "dense"])
    np.testing.assert_array_equal(source.array, table)


@pytest.mark.parametrize("saved_streamed", [True, False])
@pytest.mark.parametrize("bounds", [[12], []])
def test_three_row_pieces_restore_into_other_streamed_pieces(tmp_path, saved_streamed, bounds):
    tensor = random((30, 5))
    path = save(tmp_path, row_entries("t", tensor, [7, 19], saved_streamed))
    np.testing.assert_array_equal(checkpoint.read_tensor(path, "t"), tensor)
    targets = row_entries("t", np.zeros_like(tensor), bounds, streamed=True)
    restore(path, targets, ["t"])
    np.testing.assert_array_equal(np.concatenate([e.variable.array for e in targets]), tensor)


def test_blocks_hold_at_most_block_bytes(tmp_path, monkeypatch):
    """Blocks of 3 rows: every read and write of a source is at most 3 rows, and blocks that
    straddle the saved pieces' boundaries still restore exactly."""
    tensor = random((30, 5))
    monkeypatch.setattr(checkpoint, "BLOCK_BYTES", 3 * 5 * 4)
    saved = row_entries("t", tensor, [7, 19], streamed=True)
    path = save(tmp_path, saved)
    targets = row_entries("t", np.zeros_like(tensor), [11], streamed=True)
    restore(path, targets, ["t"])
    np.testing.assert_array_equal(np.concatenate([e.variable.array for e in targets]), tensor)
    sources = [e.variable for e in saved + targets]
    assert max(s.largest for s in sources) == 3
    assert [sum(s.reads) for s in sources[:3]] == [7, 12, 11] and [sum(s.writes) for s in sources[3:]] == [11, 19]
    monkeypatch.setattr(checkpoint, "BLOCK_BYTES", 1)   # less than a row: one row a block
    targets[0].variable.array[:] = 0
    restore(path, targets[:1], ["t"])
    np.testing.assert_array_equal(targets[0].variable.array, tensor[:11])
    assert targets[0].variable.writes[-11:] == [1] * 11


@pytest.mark.parametrize("shape,dtype", [((50, 6), np.float32), ((7, 3), np.float16), ((1, 4), np.int64),
                                         ((0, 4), np.float32), ((9, 2), ">f8")])
@pytest.mark.parametrize("block_rows", [2, None])
def test_streamed_piece_is_the_file_np_save_writes(tmp_path, monkeypatch, shape, dtype, block_rows):
    array = random(shape, dtype)
    if block_rows:
        monkeypatch.setattr(checkpoint, "BLOCK_BYTES", block_rows * shape[1] * array.itemsize)
    path = save(tmp_path, [Entry("t/slot", Source(array.copy()), shape)])
    (piece,) = checkpoint.read_manifest(path)["tensors"]["t/slot"]["pieces"]
    assert piece == {"file": "t.slot.r0-%d.c0-%d.npy" % shape, "rows": [0, shape[0]], "cols": [0, shape[1]]}
    expected = io.BytesIO()
    np.save(expected, array)
    with open(os.path.join(path, piece["file"]), "rb") as f:
        assert f.read() == expected.getvalue()


def broken_restore(path, source, shape, plain):
    before = plain.numpy()
    with pytest.raises(CheckpointError) as info:
        restore(path, [Entry("dense", plain, (4, 3)), Entry("t", source, shape)], ["t", "dense"])
    assert source.writes == [] and not source.array.any()
    np.testing.assert_array_equal(plain.numpy(), before)   # an entry before it is untouched too
    return str(info.value)


def test_uncovered_region_or_wrong_shape_fails_before_any_write(tmp_path):
    tensor = random((30, 5))
    gap = row_entries("t", tensor, [7, 19], streamed=True)
    del gap[1]   # rows 7:19 saved by no rank
    path = save(tmp_path / "gap", gap + [Entry("dense", tf.Variable(random((4, 3))), (4, 3))])
    plain = tf.Variable(np.zeros((4, 3), np.float32))
    message = broken_restore(path, Source(np.zeros((30, 5), np.float32)), (30, 5), plain)
    assert "pieces of t do not cover rows 0:30, columns 0:5" in message

    path = save(tmp_path / "whole", row_entries("t", tensor, [7, 19], streamed=True)
                + [Entry("dense", tf.Variable(random((4, 3))), (4, 3))])
    message = broken_restore(path, Source(np.zeros((30, 6), np.float32)), (30, 6), plain)
    assert "tensor t has shape (30, 5), the model expects (30, 6)" in message
    message = broken_restore(path, Source(np.zeros((30, 6), np.float32)), (30, 5), plain)   # the source is wider
    assert "do not cover rows 0:30, columns 0:6" in message


def test_a_source_must_give_the_rows_asked_for_and_be_whole(tmp_path):
    source = Source(random((5, 2)))
    source.read_rows = lambda start, stop: np.zeros((1, 2), np.float32)
    with pytest.raises(CheckpointError, match=r"t: read_rows\(0, 5\) gave shape \(1, 2\), not \(5, 2\)"):
        save(tmp_path, [Entry("t", source, (5, 2))])
    with pytest.raises(ValueError, match="streamed entry"):
        Entry("t", Source(random((5, 2))), (5, 2), num_rows=4)


def test_tensors_of_every_rank_save_and_restore_whole(tmp_path):
    """Keras weights of 0 to 4 dimensions (a counter, a bias, a kernel, MultiHeadAttention's 3-D
    kernels, a 4-D convolution's) are whole pieces, restored exactly."""
    values = {f"w{len(shape)}": random(shape, seed=len(shape)) for shape in [(), (3,), (4, 5), (2, 3, 4), (2, 2, 3, 2)]}
    saved = {name: tf.Variable(v) for name, v in values.items()}
    path = checkpoint.save(str(tmp_path), checkpoint.replicated_entries(saved), 1, SIGNATURE, SingleProcess())
    restored = {name: tf.Variable(tf.zeros_like(v)) for name, v in values.items()}
    checkpoint.restore(path, checkpoint.replicated_entries(restored), SIGNATURE, set(values))
    for name, v in values.items():
        np.testing.assert_array_equal(restored[name].numpy(), v)
