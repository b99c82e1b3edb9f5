"""The earlier built-in trainer's steps, recorded in tests/data/recorded_trainer/ (its README.md
says when and how): the reference that ranking.Model's
step is checked against, bit for bit, since that trainer is no longer the run's.

steps.json: per test module ("ranking_api", "ranking_layers", "dynamic_api"): "initial" (the
tensors before the first step), per case its "losses" (one per step) and "final" tensors, and
"dense_entries" (the names of the model's dense weights in a checkpoint). A tensor is recorded by
`digest`: tables "table_<t>" (the model's table variables in order), dense weights by checkpoint
name ("bottom_mlp/dense_0/kernel").

The bits of a trained value depend on the CPU: oneDNN picks its matrix kernels, and so the order of
their sums, by the instructions the CPU has. This module's fixtures and tests/data/builtin_checkpoints/
were written on AMD EPYC CPUs with AVX-512 and AVX512_BF16 (`recording_cpu()`), where the tests
compare bit for bit; on another CPU they compare every recorded loss and value within float32
rounding (`RTOL`: bfloat16 and float16 steps within their own; a CPU with AVX512_FP16 computes float16
natively), and a trained tensor recorded only by its
digest is checked by name only (the losses after it carry its values).
"""
import functools
import hashlib
import json
import os

import numpy as np

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "recorded_trainer")


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


# Off the recording CPU: a recorded value's relative tolerance, by the dtype its step computed in.
RTOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 2e-2}


@functools.lru_cache(maxsize=None)
def recording_cpu() -> bool:
    """Whether this machine's CPU is of the kind the fixtures were written on: AMD, with AVX512_BF16."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return "AuthenticAMD" in info and "avx512_bf16" in flags


def assert_values_as_recorded(got, want, what: str, dtype: str = "float32"):
    """`got` (numbers, or an array) equals the recorded `want` bit for bit on the recording CPU,
    elsewhere within RTOL[dtype] of each value or of the largest (a sum's rounding is relative to
    its terms); integers exactly."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype.kind == want.dtype.kind, f"{what}: {got.dtype}{list(got.shape)}, " \
                                                                          f"recorded {want.dtype}{list(want.shape)}"
    if recording_cpu() or got.dtype.kind not in "fc":
        assert np.array_equal(got, want), f"{what}: {got.tolist()} is not the recorded {want.tolist()}"
    else:
        np.testing.assert_allclose(got, want, rtol=RTOL[dtype], atol=RTOL[dtype] * np.max(np.abs(want), initial=0),
                                   err_msg=what)


def assert_as_recorded(state: dict, want: dict, what: str, trained: bool = False):
    """`state` (name -> array) holds exactly the recorded tensors `want` (name -> digest), bit for
    bit; `trained` tensors off the recording CPU by name only (module docstring)."""
    assert sorted(state) == sorted(want), what
    if trained and not recording_cpu():
        return
    wrong = [f"{name}: {digest(state[name])} (sum {float(np.sum(state[name], dtype=np.float64)):.9g}), "
             f"recorded {want[name]}" for name in sorted(want) if digest(state[name]) != want[name]]
    assert not wrong, f"{what}: not the recorded values:\n" + "\n".join(wrong)
