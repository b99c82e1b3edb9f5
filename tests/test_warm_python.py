"""tests/support/warm_python.py, the tests' `python`: a run forked from a warm server takes the caller's
argv, working directory, environment and standard streams, and its exit status and signals; a
request under other load-time settings runs in a fresh interpreter."""
import os
import signal
import subprocess
import time

from tests.support.warm_python import LOAD_TIME, PYTHON

SHOW = ("import os, sys; print(sys.argv[1:], os.getcwd(), os.environ.get('PROBE'), "
        "'tensorflow' in sys.modules); sys.stderr.write('to stderr\\n'); sys.exit(int(sys.argv[1]))")


def test_a_forked_run_takes_the_callers_arguments_directory_environment_streams_and_status(tmp_path):
    out = subprocess.run([*PYTHON, "-c", SHOW, "3", "x y"], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ, PROBE="here"), timeout=120)
    assert out.returncode == 3
    assert out.stdout == f"['3', 'x y'] {tmp_path} here True\n"   # TensorFlow already imported: forked
    assert out.stderr == "to stderr\n"


def test_other_load_time_settings_run_in_a_fresh_interpreter(tmp_path):
    assert "TF_CPP_MIN_LOG_LEVEL" in LOAD_TIME
    out = subprocess.run([*PYTHON, "-c", SHOW, "0"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PROBE="fresh", TF_CPP_MIN_LOG_LEVEL="1"))
    assert out.returncode == 0 and out.stdout == f"['0'] {tmp_path} fresh False\n", out.stderr


def test_a_signal_to_the_caller_reaches_the_run(tmp_path):
    ready = tmp_path / "ready"
    code = f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(120)"
    proc = subprocess.Popen([*PYTHON, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM   # the run's own status: killed by the relayed signal
