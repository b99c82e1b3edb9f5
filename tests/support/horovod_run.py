"""Runs a Python script as N Gloo ranks on this machine, for the multi-rank tests: under
`horovodrun`, or started one by one (`start_ranks`) so a test can stop or kill a single rank
without the launcher tearing the others down."""
import os
import shutil
import subprocess
import sys

from tests.support.warm_python import PYTHON


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _environment(env):
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", **(env or {}))


def horovodrun(np: int, args, timeout: int = 600, env=None) -> subprocess.CompletedProcess:
    """`horovodrun -np np -H localhost:np --gloo python *args` from the repository root."""
    launcher = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    assert shutil.which(launcher), "horovodrun missing: the set-up did not install Horovod"
    return subprocess.run([*PYTHON, launcher, "-np", str(np), "-H", f"localhost:{np}", "--gloo", *PYTHON, *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_environment(env))


class Ranks:
    """`python *args` as np Gloo ranks, each its own fresh interpreter (what horovodrun sets up,
    without its supervision; a test stops, kills and names these very processes): `processes[r]`
    is rank r, its output (stdout and stderr) goes to `logs[r]`."""

    def __init__(self, np: int, args, log_dir: str, env=None):
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousServer
        self._server = RendezvousServer(False)
        slots = get_host_assignments(parse_hosts(f"localhost:{np}"), np)
        port = self._server.start()
        self._server.init(slots)
        self.logs = [os.path.join(log_dir, f"rank{s.rank}.log") for s in slots]
        self.processes = []
        for s, log in zip(slots, self.logs):
            rank_env = dict(HOROVOD_HOSTNAME=s.hostname, HOROVOD_RANK=s.rank, HOROVOD_SIZE=s.size,
                            HOROVOD_LOCAL_RANK=s.local_rank, HOROVOD_LOCAL_SIZE=s.local_size,
                            HOROVOD_CROSS_RANK=s.cross_rank, HOROVOD_CROSS_SIZE=s.cross_size,
                            HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1", HOROVOD_GLOO_RENDEZVOUS_PORT=port,
                            HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE="lo")
            with open(log, "w") as out:
                self.processes.append(subprocess.Popen(
                    [sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                    env=_environment(dict(env or {}, **{k: str(v) for k, v in rank_env.items()}))))

    def output(self, rank: int) -> str:
        with open(self.logs[rank]) as f:
            return f.read()

    def close(self):
        for p in self.processes:
            if p.poll() is None:
                p.kill()
            p.wait()
        self._server.stop()
