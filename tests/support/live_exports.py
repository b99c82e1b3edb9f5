"""The exports the live-serving tests serve and update (conftest.py's session fixture
`live_exports`): a DLRM trained on multi-hot files (mean combiner), 2 epochs of 12 steps,
exported at STEPS with the monolithic and tables forms; and the deltas between two of them."""
import json
import os
import re
import shutil

import numpy as np

import run.loop as run_loop
from deployment.exporter.deltas import write_delta
from deployment.exporter.repository import write_repository
from deployment.repository_format import export_version
from run.config import build_config
from tests.support.configs import TINY
from tests.support.datasets import write_dataset

STEPS = (8, 16, 24)


class Exports(dict):
    """{step: repository}; `run`: the first 8 characters of the training run's id, as versions name it."""
    run = ""


def build(tmp) -> Exports:
    """Trains and exports under folder `tmp` (a pathlib.Path)."""
    data = write_dataset(tmp / "data", {"c0": 3, "c3": 2})
    cfg = build_config(dict(TINY, dataset_type="split_binary", dataset_path=data, epochs=2, max_steps=24,
                            checkpoint_every_n_steps=8, keep_checkpoints=3, multi_hot_combiner="mean",
                            save_checkpoint_path=str(tmp / "ckpt")),
                       present={"dataset_type", "dataset_path", "epochs", "max_steps", "save_checkpoint_path",
                                "checkpoint_every_n_steps", "keep_checkpoints", "multi_hot_combiner"})
    run_loop.run(cfg)
    checkpoints = {int(re.match(r"ckpt-(\d+)", d).group(1)): str(tmp / "ckpt" / d)
                   for d in os.listdir(tmp / "ckpt") if d.startswith("ckpt-")}
    assert sorted(checkpoints) == list(STEPS)
    repos = Exports()
    for step in STEPS:
        repos[step] = str(tmp / f"repo{step}")
        write_repository(checkpoints[step], repos[step], forms=["monolithic", "tables"])
    repos.run = export_version(repos[8]).run[:8]
    return repos


def tables_of(repo):
    """The export's four tables (its tables form), as arrays."""
    return [np.load(os.path.join(repo, "dlrm_tables", f"table_{f}.npy")) for f in range(4)]


def read_info(repo) -> dict:
    """The export's export.json."""
    with open(os.path.join(repo, "export.json")) as f:
        return json.load(f)


def make_delta(base_repo, new_repo, out):
    """A delta from export `base_repo` to export `new_repo`: the rows that differ, the new dense model."""
    base, new = tables_of(base_repo), tables_of(new_repo)
    changed = [np.flatnonzero((a != b).any(1)) for a, b in zip(base, new)]
    assert sum(map(len, changed)) > 0
    info = read_info(new_repo)
    write_delta(out, "dlrm", export_version(base_repo), export_version(new_repo), info["signature"],
                [(f, len(b), ids, b[ids]) for f, (b, ids) in enumerate(zip(new, changed))],
                lambda path: shutil.copytree(os.path.join(new_repo, "dlrm_dense", "1", "model.savedmodel"), path))
    return out
