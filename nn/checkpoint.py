"""Checkpoints: named variables as .npy files plus a JSON manifest, written atomically.

Layout of a checkpoint root:

    ROOT/ckpt-<step>/manifest.json     step, model signature, extra state, variable -> file
    ROOT/ckpt-<step>/<variable>.npy
    ROOT/latest                        name of the newest complete checkpoint

A checkpoint directory is written under a temporary name and renamed when complete; `latest`
is replaced atomically afterwards, so a crash at any point leaves the previous checkpoint
readable. The two newest checkpoints are kept.
"""
import json
import os
import shutil
from typing import Dict

import numpy as np

MANIFEST = "manifest.json"
LATEST = "latest"
KEEP = 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be read into this model; the message names file and variable."""


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: str, variables: Dict, step: int, signature: dict, state: dict = None) -> str:
    """Writes ROOT/ckpt-<step> and points ROOT/latest at it; returns its path."""
    os.makedirs(root, exist_ok=True)
    name = f"ckpt-{step}"
    tmp = os.path.join(root, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    files = {}
    for var_name, var in sorted(variables.items()):
        files[var_name] = var_name.replace("/", ".") + ".npy"
        with open(os.path.join(tmp, files[var_name]), "wb") as f:
            np.save(f, var.numpy())
            f.flush()
            os.fsync(f.fileno())
    manifest = {"step": int(step), "signature": signature, "state": state or {}, "files": files}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    final = os.path.join(root, name)
    if os.path.exists(final):   # re-saving the same step: move the old copy aside first
        old = os.path.join(root, f".old-{name}-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    with open(os.path.join(root, LATEST + ".tmp"), "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(root, LATEST + ".tmp"), os.path.join(root, LATEST))
    _fsync_dir(root)
    _prune(root, keep=KEEP)
    return final


def _prune(root, keep):
    steps = sorted((int(d.split("-", 1)[1]), d) for d in os.listdir(root)
                   if d.startswith("ckpt-") and d.split("-", 1)[1].isdigit())
    for _, d in steps[:-keep]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def resolve(path: str) -> str:
    """A checkpoint directory from either itself or a root holding `latest`."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    raise CheckpointError(f"{path}: no checkpoint here (neither {MANIFEST} nor {LATEST})")


def read_manifest(path: str) -> dict:
    ckpt = resolve(path)
    with open(os.path.join(ckpt, MANIFEST)) as f:
        manifest = json.load(f)
    manifest["path"] = ckpt
    return manifest


def restore(path: str, variables: Dict, signature: dict) -> dict:
    """Loads every variable from the checkpoint at `path` (checked first) and returns its manifest."""
    manifest = read_manifest(path)
    ckpt = manifest["path"]
    for key, value in signature.items():
        if manifest["signature"].get(key) != value:
            raise CheckpointError(f"{ckpt}: written with {key}={manifest['signature'].get(key)}, "
                                  f"this run has {key}={value}")
    files = manifest["files"]
    missing = sorted(set(variables) - set(files))
    extra = sorted(set(files) - set(variables))
    if missing or extra:
        raise CheckpointError(f"{ckpt}: variables differ from this model's "
                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
    arrays = {}
    for name, var in variables.items():
        file = os.path.join(ckpt, files[name])
        try:
            arrays[name] = np.load(file)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{file}: cannot read variable {name}: {e}")
        if tuple(arrays[name].shape) != tuple(var.shape):
            raise CheckpointError(f"{file}: variable {name} has shape {arrays[name].shape}, "
                                  f"the model expects {tuple(var.shape)}")
    for name, var in variables.items():
        var.assign(arrays[name])
    return manifest
