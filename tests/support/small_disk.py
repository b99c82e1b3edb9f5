"""A small device for the tests of full disks: a tmpfs mounted for the test (mounting needs
root; skipped where it is refused), and a ballast file that fills it."""
import contextlib
import os
import shutil
import subprocess

import pytest


@contextlib.contextmanager
def tmpfs(path, size: str):
    """A tmpfs of `size` (mount's spelling: "1m") mounted at the new directory `path`, unmounted after."""
    os.makedirs(path)
    if shutil.which("mount") is None:
        pytest.skip("no mount command here to mount a tmpfs")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs was refused ({mounted.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def free_bytes(path) -> int:
    return shutil.disk_usage(path).free


def fill(disk, leave: int) -> int:
    """Writes the ballast file `disk`/ballast so that about `leave` bytes stay free; returns the bytes free."""
    with open(os.path.join(disk, "ballast"), "ab") as f:
        f.write(bytes(max(free_bytes(disk) - leave, 0)))
    return free_bytes(disk)
