"""A real SLURM cluster on this machine for the tests: munged, slurmctld on the first of the test's
hosts (tests/support/netns_hosts.py) and a slurmd on each, every node with all this machine's CPUs, with
a slurm.conf, state and logs of their own under a folder, on free ports; jobs are submitted from
the first host with `sbatch` as users submit them (`SLURM_CONF` names the cluster's
configuration). `close` cancels the jobs and stops the daemons (the hosts are the caller's)."""
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from typing import Optional

from tests.support import netns_hosts

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "scontrol", "scancel", "sinfo")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")   # a job's states once it has ended


def missing() -> Optional[str]:
    """Why no cluster can be started here (None: it can)."""
    absent = [c for c in DAEMONS + COMMANDS if not shutil.which(c) and not os.path.exists(f"/usr/sbin/{c}")]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing: make setup installs it)"
    if os.geteuid() != 0:
        return "slurmd runs jobs as their users, which needs root"
    return netns_hosts.missing()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """SLURM under `root` with a node per host of `hosts` (a netns_hosts.Hosts), named as the host."""

    def __init__(self, root: str, hosts: netns_hosts.Hosts):
        self.root, self.hosts, self.nodes = root, hosts, hosts.names
        for sub in ("munge", "state", "log", *(f"spool/{n}" for n in self.nodes)):
            os.makedirs(os.path.join(root, sub), exist_ok=True)
        key = os.path.join(root, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.conf = os.path.join(root, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(self._configuration(_free_port(), _free_port()))
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self._processes = []
        munge = os.path.join(root, "munge")
        subprocess.run([_daemon("munged"), "--force", f"--key-file={key}", f"--socket={munge}/socket",
                        f"--pid-file={munge}/pid", f"--log-file={munge}/log", f"--seed-file={munge}/seed"],
                       check=True, capture_output=True, timeout=30)
        self._munge_pid = os.path.join(munge, "pid")
        for host, daemon in [(self.nodes[0], ["slurmctld"])] + [(n, ["slurmd", "-N", n]) for n in self.nodes]:
            log = open(os.path.join(root, "log", f"{daemon[0]}-{host}.out"), "w")
            self._processes.append(hosts.popen(host, _daemon(daemon[0]), *daemon[1:], "-D", "-f", self.conf,
                                               stdout=log, stderr=subprocess.STDOUT, env=self.env))
        self.wait_idle()

    def _configuration(self, ctld_port: int, slurmd_port: int) -> str:
        r, addresses = self.root, self.hosts.addresses
        return "\n".join([
            "ClusterName=tests", f"SlurmctldHost={self.nodes[0]}({addresses[self.nodes[0]]})",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}", "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={r}/munge/socket", "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool/%n", f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid", f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SchedulerType=sched/builtin",
            "ReturnToService=2", "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "KillWait=30",
            *(f"NodeName={n} NodeAddr={addresses[n]} CPUs={os.cpu_count()} State=UNKNOWN" for n in self.nodes),
            "PartitionName=tests Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", ""])

    def run(self, *command, timeout: int = 60) -> subprocess.CompletedProcess:
        """A SLURM command (sbatch, scontrol, ...) against this cluster, run on its first host."""
        return self.hosts.run(self.nodes[0], *command, timeout=timeout, env=self.env)

    def wait_idle(self, timeout: float = 60):
        """Until every node is idle (no job running or completing)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-N", "-o", "%T")
            if out.returncode == 0 and out.stdout.split() == ["idle"] * len(self.nodes):
                return
            time.sleep(0.2)
        logs = os.path.join(self.root, "log")
        raise RuntimeError(f"the test cluster's nodes did not become idle in {timeout} s; its logs: {logs}")

    def submit(self, *args, env=None) -> int:
        """`sbatch --parsable ARGS` with this process's environment and `env`; the job's id."""
        out = self.hosts.run(self.nodes[0], "sbatch", "--parsable", *args, timeout=60, env={**self.env, **(env or {})})
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """The job's fields (`scontrol show job -o`): JobState, ExitCode, Restarts, ..."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout))

    def wait(self, job_id: int, timeout: float = 600, restarts: int = 0) -> dict:
        """The job's fields once it has ended (after `restarts` requeues)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in ENDED and \
                    int(fields.get("Restarts", 0)) >= restarts and fields.get("Reason") != "BeginTime":
                return fields
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout} s")

    def close(self):
        self.run("scancel", "--full", "--user=root")
        for p in self._processes:
            p.send_signal(signal.SIGTERM)
        for p in self._processes:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        try:
            with open(self._munge_pid) as f:
                os.kill(int(f.read().strip()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
