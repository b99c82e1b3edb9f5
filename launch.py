"""horovodrun, with the same arguments, for runs that may be stopped by a signal:

    python launch.py -np 2 -H localhost:2 python dlrm.py --save_checkpoint_path=ckpt ...

A SIGTERM or SIGINT (Ctrl-C) this process receives is passed, as it is, to the ranks on this
host: they finish their step, checkpoint and exit 143 or 130 (utils/preemption.py), taking the
grace their `--preemption_grace_s` gives them, while ranks on other hosts learn of the stop from
them. (horovodrun itself sends every rank SIGTERM and SIGKILLs it 5 s later, whatever its save
still has to write, and reports the stop as a failure, with a traceback and exit code 1.) A
second signal (another one, or the first again 2 s or more later) is passed on too and the ranks
end at once; horovodrun's own termination follows as a backstop, as it does at once when no rank
runs on this host. The exit code is the ranks': 0, the signal's 143 or 130 when every rank that
did not finish stopped on it, else the code of the rank that failed first (then one line says
how the ranks ended). A rank that exits on the stop waits (up to OTHERS_S) for the other
ranks' own exits before horovodrun hears of it: horovodrun ends every rank still running when
one exits non-zero, and a rank ended so is reported as if it had finished. Gloo only (--gloo is implied; --mpi, --jsrun and elastic runs are
refused: use horovodrun for them).
"""
import signal
import sys
import threading
import time
import types
from typing import Dict, List, Optional, Tuple

import psutil

from utils import preemption
from utils.launcher import RANK_VARIABLES

OTHERS_S = 60.0   # how long a rank stopped by the signal waits for the others to stop too
USAGE = "usage: python launch.py [horovodrun's options] COMMAND (python launch.py --help: horovodrun's options)"


class Job:
    """The ranks' exits (rank -> (code, when)) and the signals this process has received."""

    def __init__(self):
        self.exits: Dict[int, Tuple[int, float]] = {}
        self.received: List[Tuple[int, float]] = []
        self.shutdown = threading.Event()   # set: horovodrun's own termination of every rank
        self.running = 0                    # ranks launched and not exited
        self.changed = threading.Condition()

    def execute(self, execute):
        """horovodrun's `safe_shell_exec.execute` of a rank, which returns its exit code: after a stop
        a rank that exits with the signal's code waits for the other ranks' exits (OTHERS_S at most,
        or until a second signal) before the code goes back to horovodrun."""
        def run_rank(command, **kwargs):
            with self.changed:
                self.running += 1
            try:
                code = execute(command, **kwargs)
            finally:
                with self.changed:
                    self.running -= 1
                    self.changed.notify_all()
            if self.received and code in preemption.EXIT_CODES.values():
                with self.changed:
                    self.changed.wait_for(lambda: self.running == 0 or self.shutdown.is_set(), timeout=OTHERS_S)
            return code
        return run_rank

    def on_signal(self, signum, frame):
        first = not self.received
        if not first and signum == self.received[0][0] and time.monotonic() - self.received[0][1] < \
                preemption.DUPLICATE_S:
            return
        self.received.append((signum, time.monotonic()))
        ranks = local_ranks()
        for p in ranks:
            try:
                p.send_signal(signum)
            except psutil.NoSuchProcess:
                pass
        name = preemption.signal_name(signum)
        if not ranks:
            print(f"launch: {name} received; no rank runs on this host: horovodrun stops them "
                  f"(SIGTERM, SIGKILL 5 s later)", file=sys.stderr, flush=True)
            self.shutdown.set()
        elif first:
            print(f"launch: {name} received: passed to the ranks on this host ({len(ranks)}); they finish their "
                  f"step, checkpoint and stop (a second signal stops them at once)", file=sys.stderr, flush=True)
        else:
            print(f"launch: a second signal ({name}): passed to the ranks on this host, which end at once",
                  file=sys.stderr, flush=True)
            self.shutdown.set()
        if self.shutdown.is_set():
            with self.changed:
                self.changed.notify_all()

    def outcome(self) -> Tuple[int, Optional[str]]:
        """The exit code and the line saying how the ranks ended (None when all finished)."""
        failed = {r: c for r, (c, _) in self.exits.items() if c != 0}
        if not failed:
            return 0, None
        codes = set(failed.values())
        stopped = [s for s in preemption.SIGNALS if {preemption.EXIT_CODES[s]} == codes]
        if stopped:
            code = codes.pop()
            finished = set(self.exits) - set(failed)
            return code, (f"launch: stopped by {preemption.signal_name(stopped[0])}: {_ranks(failed)} exited "
                          f"{code}{f' ({_ranks(finished)} had finished)' if finished else ''}; "
                          f"rank 0's line names the checkpoint")
        rank = min(failed, key=lambda r: self.exits[r][1])
        return failed[rank], (f"error: rank {rank} exited {failed[rank]} first; the other ranks were then stopped "
                              f"(exit codes: {', '.join(f'rank {r} {c}' for r, (c, _) in sorted(self.exits.items()))})")


def _ranks(ranks) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


def local_ranks() -> List[psutil.Process]:
    """This process's descendants that are ranks (their environment names a rank)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if any(rank in p.environ() for rank, _ in RANK_VARIABLES):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def refusal(args) -> Optional[str]:
    if args.use_mpi or args.use_jsrun:
        return "error: launch.py runs Gloo jobs only: drop --mpi/--jsrun, or use horovodrun"
    if args.host_discovery_script is not None or args.min_num_proc is not None:
        return "error: launch.py does not run elastic jobs (--host-discovery-script, --min-np): use horovodrun"
    if not args.command:
        return USAGE
    return None


def main(argv: List[str]) -> int:
    from horovod.runner import gloo_run, launch
    sys.argv = ["launch.py", *argv]
    args = launch.parse_args()   # --help and argument errors exit here, as horovodrun's
    line = refusal(args)
    if line:
        print(line, file=sys.stderr)
        return 2
    args.use_gloo = True
    job = Job()
    for s in preemption.SIGNALS:
        signal.signal(s, job.on_signal)
    gloo_run.register_shutdown_event = lambda: job.shutdown   # instead of horovodrun's handlers
    exec_command_fn = gloo_run._exec_command_fn

    def recording_exec_command_fn(settings):
        run = exec_command_fn(settings)

        def exec_command(command, slot_info, events):
            code, when = run(command, slot_info, events)
            job.exits[slot_info.rank] = (code, when)
            return code, when
        return exec_command

    gloo_run._exec_command_fn = recording_exec_command_fn
    gloo_run.safe_shell_exec = types.SimpleNamespace(execute=job.execute(gloo_run.safe_shell_exec.execute))
    try:
        launch._run(args)
    except RuntimeError as e:   # horovodrun's report of a rank's non-zero exit, or its own failure
        if not job.exits:
            print(f"error: horovodrun: {' '.join(str(e).split())}", file=sys.stderr)
            return 1
    code, line = job.outcome()
    if line:
        print(line, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
