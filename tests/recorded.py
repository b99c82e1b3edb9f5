"""The built-in trainer's steps (nn.trainer.Trainer over nn.model.RankingModel) recorded at commit
0230845 in tests/data/trainer_0230845/ (its README.md says how): the reference that ranking.Model's
step is checked against, bit for bit, since that trainer is no longer the run's.

steps.json: per test module ("ranking_api", "ranking_layers", "dynamic_api"): "initial" (the
tensors before the first step), per case its "losses" (one per step) and "final" tensors, and
"dense_entries" (the names of the model's dense weights in a checkpoint). A tensor is recorded by
`digest`: tables "table_<t>" (the model's table variables in order), dense weights by checkpoint
name ("bottom_mlp/dense_0/kernel").
"""
import hashlib
import json
import os

import numpy as np

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "trainer_0230845")


def recorded(module: str) -> dict:
    """steps.json's record of test module `module`."""
    with open(os.path.join(FIXTURE, "steps.json")) as f:
        return json.load(f)[module]


def digest(x) -> str:
    """`x`'s record, "<dtype>[<shape>] <the first 16 hex digits of the sha256 of its C-order
    bytes>": equal records are the same values, bit for bit."""
    x = np.ascontiguousarray(x)
    return f"{x.dtype.name}{list(x.shape)} {hashlib.sha256(x.tobytes()).hexdigest()[:16]}"


def model_state(model, rename=lambda path: path) -> dict:
    """A ranking.Model's tensors named as recorded: the tables of its layer "hybrid_embedding"
    "table_<t>" (this rank's table variables in order) and its Keras weights by `rename(path)`, as
    NumPy arrays."""
    tables = model.get_layer("hybrid_embedding").table_variables
    state = {f"table_{t}": v.numpy() for t, v in enumerate(tables)}
    state.update({rename(w.path): w.numpy() for w in model.weights})
    return state


def assert_as_recorded(state: dict, want: dict, what: str):
    """`state` (name -> array) holds exactly the recorded tensors `want` (name -> digest), bit for bit."""
    assert sorted(state) == sorted(want), what
    wrong = [f"{name}: {digest(state[name])} (sum {float(np.sum(state[name], dtype=np.float64)):.9g}), "
             f"recorded {want[name]}" for name in sorted(want) if digest(state[name]) != want[name]]
    assert not wrong, f"{what}: not the recorded values:\n" + "\n".join(wrong)
