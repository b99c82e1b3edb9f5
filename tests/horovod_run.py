"""Runs a Python script under `horovodrun -np N --gloo` on this machine, for the multi-rank tests."""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def horovodrun(np: int, args, timeout: int = 600, env=None) -> subprocess.CompletedProcess:
    """`horovodrun -np np -H localhost:np --gloo python *args` from the repository root."""
    launcher = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    assert shutil.which(launcher), "horovodrun missing: the set-up did not install Horovod"
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([launcher, "-np", str(np), "-H", f"localhost:{np}", "--gloo", sys.executable, *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=environment)
