"""Imports TensorFlow with its start-up lines held to TF_CPP_MIN_LOG_LEVEL.

TensorFlow 2.21's two shared libraries (the framework and the Python wrapper) each log, while they
load and before absl::InitializeLog, "oneDNN custom operations are on" and "Could not find cuda
drivers" through absl, which ignores TF_CPP_MIN_LOG_LEVEL: every start printed them twice, at any
level. `import_tensorflow` passes what the process writes to stderr during the import through
`keep`: absl-format INFO and WARNING lines below the level are dropped, a repeated line once, the
absl banner only at level 0; ERROR and FATAL lines and everything else pass, as they come, but
one: "failed call to cuInit" after "Could not find cuda drivers" (no CUDA driver on the machine:
the first device enumeration fails, saying nothing more; it runs inside the filter, at the import
under absl's app.run, where TensorFlow registers it, and by `import_tensorflow` itself elsewhere).
Where a driver is found, its failure passes.
"""
import os
import re
import sys
import threading

_ABSL_LINE = re.compile(r"([IWEF])\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] (.*)")
_ABSL_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_NO_DRIVER, _CUINIT_FAILED = "Could not find cuda drivers", "failed call to cuInit"


def keep(line: str, level: int, seen: set) -> bool:
    """Whether stderr line `line` (no newline) passes at TF_CPP_MIN_LOG_LEVEL `level`; `seen`: the
    absl messages already passed (updated)."""
    if line == _ABSL_BANNER:
        return level == 0 and _note(line, seen)
    absl = _ABSL_LINE.fullmatch(line)
    if not absl:
        return True
    severity, message = absl.groups()
    if message.startswith(_NO_DRIVER):
        seen.add(_NO_DRIVER)
    if message.startswith(_CUINIT_FAILED) and _NO_DRIVER in seen:
        return False
    if severity in "IW" and "IW".index(severity) < level:
        return False
    return _note(message, seen)


def _note(message: str, seen: set) -> bool:
    """True the first time `message` is seen."""
    if message in seen:
        return False
    seen.add(message)
    return True


def import_tensorflow():
    """`import tensorflow` with its stderr start-up lines filtered by `keep` (a no-op once imported)."""
    if "tensorflow" in sys.modules:
        return
    try:
        level = int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        level = 0
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    saved = os.dup(2)
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward():
        seen = set()
        with os.fdopen(read_end, "r", errors="replace") as lines:
            for line in lines:
                if keep(line.rstrip("\n"), level, seen):
                    os.write(saved, line.encode())

    forwarder = threading.Thread(target=forward, daemon=True)
    forwarder.start()
    try:
        import tensorflow
        tensorflow.config.list_physical_devices("GPU")   # the first enumeration: its cuInit line, if any
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)   # closes the pipe's last write end: the forwarder reads to its end
        forwarder.join()
        os.close(saved)
