"""Stopping a process cleanly on SIGTERM (what SLURM and Kubernetes send before preemption) and
SIGINT; every entry point runs its work through `exit_on_signal`.

`install` takes both signals over for the whole process. Outside training's steps a signal
raises `Interrupted` in the main thread at once (inference, export, preprocessing: what they
write goes under a temporary name, removed as the exception passes; a writer calls `check`
before renaming into place, as such an exception can be lost in a library's callback). Inside
the loop (`defer`) and an evaluation (`deferred`: an exception raised inside TensorFlow's Python
can abort the process) a signal only marks the stop: the loop finishes its step or batch, every
rank agrees at a step or batch boundary (`requested`: one small collective every CHECK_EVERY
steps), the run writes a checkpoint and raises `Interrupted`. From the stop on, a second signal
to this process (another one, or the first again DUPLICATE_S or more later), or `grace_s`
seconds passing, ends the process at once (os._exit) after abandoning the checkpoint being
written (`saving`), so the previous checkpoint stays the newest; once the checkpoint is written,
with the stop's own line.
The exit code is 128 + the signal's number (EXIT_CODES), as a shell reports a process a signal
ended.
"""
import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from typing import Callable, Optional, TypeVar

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_CODES = {s: 128 + s for s in SIGNALS}   # SIGTERM 143, SIGINT 130
DEFAULT_GRACE_S = 120.0
T = TypeVar("T")
# Several ranks agree on a stop every CHECK_EVERY steps (one allreduce of an int32: 2.7 ms at 2
# Gloo ranks on a loaded 2-core machine, against W1's ~120 ms step; docs/training.md#preemption).
CHECK_EVERY = 10
# The first signal again this soon after it is the same stop delivered twice (a scheduler that
# signals every process of a job, and the launcher passing its own on to the ranks), not a second.
DUPLICATE_S = 2.0


class Interrupted(BaseException):
    """The run stopped on `signum`; `line` says so (printed by the entry point when `announce`),
    `code` is the exit code. A BaseException, as KeyboardInterrupt: raised wherever the signal
    lands, it must not be taken for an error by `except Exception` (TensorFlow's AutoGraph has one)."""

    def __init__(self, signum: int, line: str, announce: bool = True):
        super().__init__(line)
        self.signum, self.line, self.announce, self.code = signum, line, announce, EXIT_CODES[signum]


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class _State:
    """The process's preemption state (the signal handlers are process-wide)."""
    grace_s = DEFAULT_GRACE_S
    unfinished = "nothing saved"
    deferring = False
    signum: Optional[int] = None   # the signal stopping the run (this process's, or another rank's)
    signalled = False              # whether this process has received one itself
    first: Optional[int] = None    # the first signal it received, and when (time.monotonic)
    first_at = 0.0
    saving: Optional[str] = None   # the temporary folder of the checkpoint being written
    stopping: Optional[tuple] = None   # (line or None, exit code) once the run has saved and is ending
    timer: Optional[threading.Timer] = None
    lock = threading.Lock()
    stderr = None   # the real sys.stderr, once a signal stopped the work outside training's steps


def _real_stderr():
    return _State.stderr or sys.stderr


def _silence_libraries():
    """From a stop outside training's steps on, what libraries write to sys.stderr about the call
    the signal interrupted is dropped (TensorFlow's SavedModel writer prints the traceback of the
    exception it caught before raising its own): the entry point's one line says what happened."""
    if _State.stderr is None:
        _State.stderr, sys.stderr = sys.stderr, open(os.devnull, "w")


def exit_on_signal(body: Callable[[], T], unfinished: str, grace_s: float = DEFAULT_GRACE_S) -> T:
    """body()'s result, run with SIGTERM and SIGINT handled (`install`): a signal ends the process
    with one line on stderr ("stopped by SIGTERM: `unfinished`" outside training's steps) and its
    exit code, also where it surfaces as a library's own error, or where its exception was lost
    (`check`) and body() returned."""
    install(grace_s, unfinished)
    try:
        result = body()
        check()
        return result
    except Interrupted as e:
        _exit_stopped(e.line if e.announce else None, e.code)
    except Exception:   # e.g. TensorFlow or Horovod reporting the interrupted call
        if _State.signum is None:
            raise
        _exit_stopped(f"stopped by {signal_name(_State.signum)}: {unfinished}", EXIT_CODES[_State.signum])


def _exit_stopped(line: Optional[str], code: int):
    """Says `line` and ends the process with `code` once what it wrote is flushed, without the
    interpreter's finalisation: a tf.data iterator stopped mid-batch can deadlock or abort in its
    destructor (its prefetch thread waiting on the interpreter lock the finaliser holds)."""
    if line is not None:
        print(line, file=_real_stderr())
    for stream in (sys.stdout, sys.stderr, _real_stderr()):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def install(grace_s: float = DEFAULT_GRACE_S, unfinished: str = "nothing saved"):
    """Handles SIGTERM and SIGINT from now on (main thread only), with `grace_s` seconds from the
    first signal for training's step and checkpoint to finish; `unfinished` ends the line of a
    signal outside training's steps."""
    _State.grace_s, _State.unfinished = grace_s, unfinished
    for s in SIGNALS:
        signal.signal(s, _on_signal)


def _on_signal(signum, frame):
    if _State.signalled:
        if signum == _State.first and time.monotonic() - _State.first_at < DUPLICATE_S:
            return   # the same stop, delivered twice
        if _State.stopping is not None:   # saved, on its way out: end now, with the stop's own line
            _exit_stopped(*_State.stopping)
        _exit_now(signum, f"a second signal ({signal_name(signum)})")
    _State.signalled, _State.first, _State.first_at = True, signum, time.monotonic()
    if _State.signum is not None:   # already stopping on another rank's signal
        return
    _State.signum = signum
    if not _State.deferring:
        _silence_libraries()
        raise Interrupted(signum, f"stopped by {signal_name(signum)}: {_State.unfinished}")
    _start_grace_timer()


def _start_grace_timer():
    with _State.lock:
        if _State.timer is None:
            _State.timer = threading.Timer(_State.grace_s, _exit_now,
                                           (_State.signum, f"the grace period (--preemption_grace_s="
                                                           f"{_State.grace_s:g}) ran out"))
            _State.timer.daemon = True
            _State.timer.start()


def _exit_now(signum: int, why: str):
    """Ends the process at once with signum's exit code, abandoning the checkpoint being written
    (renamed aside first: if its save renamed it into place meanwhile, that one wins and is whole)."""
    tmp, what = _State.saving, "nothing was being written"
    if tmp is not None:
        aside = f"{tmp}.abandoned-{os.getpid()}"
        try:
            os.rename(tmp, aside)
            shutil.rmtree(aside, ignore_errors=True)
            what = f"the checkpoint being written ({tmp}) was removed; the previous one is the newest"
        except OSError:   # already renamed into place (or never created)
            what = "the checkpoint being written had already been completed or not yet begun"
    _real_stderr().write(f"stopped at once: {why}; {what}\n")
    _real_stderr().flush()
    os._exit(EXIT_CODES.get(signum, 128 + signum))


def check():
    """Raises Interrupted if a signal has stopped the work outside training's steps: its exception,
    raised wherever the main thread was, is lost where Python ignores exceptions (a finaliser or a
    library's callback, as TensorFlow runs many). A writer calls this before it renames what it
    wrote into place."""
    if _State.signum is not None and not _State.deferring:
        raise Interrupted(_State.signum, f"stopped by {signal_name(_State.signum)}: {_State.unfinished}")


def received() -> Optional[int]:
    """The signal stopping the run, or None."""
    return _State.signum


def defer():
    """From now on (training's steps) a signal only marks a stop, acted on at the next step
    boundary (`requested`, `stop`)."""
    _State.deferring = True


def undefer(line: str, announce: bool):
    """Signals raise Interrupted again; one marked meanwhile and not acted on raises it now, saying
    `line` after the signal's name."""
    _State.deferring = False
    if _State.signum is not None:
        stop(_State.signum, line, announce)


@contextlib.contextmanager
def deferred():
    """`defer` for the block (an evaluation, whose loop asks `requested` after each batch); after
    it, the state before: outside training's steps, a stop marked meanwhile raises Interrupted
    there, saying "stopped by <signal>: `unfinished`"."""
    before, _State.deferring = _State.deferring, True
    try:
        yield
    finally:
        _State.deferring = before
        if _State.signum is not None and not before:
            _silence_libraries()
        check()


def requested(comm, step: int) -> Optional[int]:
    """Whether any rank of `comm` has received a signal, asked after training batch `step` by
    every rank (one small collective every CHECK_EVERY steps; every step at one rank, where it
    costs nothing): the signal (this rank's, else the largest number any rank received), or None.
    A rank that learns of the stop from another takes its signal and starts its own grace period now."""
    if comm.size > 1 and step % CHECK_EVERY:
        return None
    signum = comm.largest(_State.signum or 0, "preemption")
    if not signum:
        return None
    if _State.signum is None:
        _State.signum = signum
        _start_grace_timer()
    return _State.signum


def stop(signum: int, line: str, announce: bool):
    """Ends the deferred stop: raises Interrupted, saying "stopped by <signal> `line`" (the caller
    has saved what it had to; a later signal ends the process at once with that line)."""
    _State.deferring = False
    e = Interrupted(signum, f"stopped by {signal_name(signum)} {line}", announce)
    _State.stopping = (e.line if announce else None, e.code)
    raise e


@contextlib.contextmanager
def saving(tmp: str):
    """Marks the checkpoint being written into the temporary folder `tmp` (removed if the process
    must end before it is complete)."""
    _State.saving = tmp
    try:
        yield
    finally:
        _State.saving = None
