"""Checks of runs' outputs: two checkpoints or run folders alike bit for bit, a --log_path file's
records, the one error line of a failed run; and the flags that put tables on disk (`tiered`),
with the disk shards a printed plan names."""
import json
import os
import re
import subprocess

import numpy as np

from storage import checkpoint

BUDGET = "--embedding_memory_budget_gb=0.0001"


def tiered(store):
    """The flags that put tables on disk, their files in `store` (created empty)."""
    os.makedirs(store, exist_ok=True)
    return [BUDGET, f"--embedding_store_path={store}"]


def disk_units(stdout: str) -> dict:
    """{(rank, feature): cache rows} of the shards the printed plan puts on disk (horovodrun's
    line prefixes allowed)."""
    shard = re.compile(r"(?:\[\d+\]<stdout>:)?(\d+)\s+(\d+)\s+(?:whole|row|column)\s.*\sdisk\s+([\d,]+)")
    found = (shard.match(line) for line in stdout.splitlines())
    return {(int(m[1]), int(m[2])): int(m[3].replace(",", "")) for m in found if m}


def assert_same_checkpoint(got, want):
    """Every tensor of checkpoint `got` (a directory or root) equals `want`'s, bit for bit."""
    a, b = checkpoint.read_manifest(str(got)), checkpoint.read_manifest(str(want))
    assert a["step"] == b["step"] and sorted(a["tensors"]) == sorted(b["tensors"])
    differ = [n for n in a["tensors"] if not np.array_equal(checkpoint.read_tensor(a["path"], n),
                                                            checkpoint.read_tensor(b["path"], n))]
    assert not differ, differ


def assert_same_run_folders(got, want, steps=(12, 24)):
    """Run folder `got` wrote the checkpoints (`ckpt/ckpt-<step>`) of run folder `want`, bit for bit,
    and evaluated alike (its log.json's eval records, at exactly `steps`)."""
    for step in steps:
        assert_same_checkpoint(got / "ckpt" / f"ckpt-{step}", want / "ckpt" / f"ckpt-{step}")
    evals = [[(r["step"], r["auc"], r["logloss"]) for r in log_records(out / "log.json") if r["kind"] == "eval"]
             for out in (want, got)]
    assert evals[0] == evals[1] and [e[0] for e in evals[1]] == list(steps), evals


def log_records(path) -> list:
    """A --log_path file's records."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def error_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def one_error(proc: subprocess.CompletedProcess, code: int) -> str:
    """The one error line of a run that exited with `code`."""
    assert proc.returncode == code and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]
