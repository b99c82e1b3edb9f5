"""Several hosts on this machine for the tests: each a network namespace with its own address on
a private bridge, its own hostname (a UTS namespace), `/etc/hosts` naming every host, and an sshd
that lets root in with a key of the test's own (`/etc/netns/NS/{hosts,ssh}`, mounted over `/etc`'s for
the processes of host NS). The hosts share this machine's file
system and processes, as nodes with a shared file system share the checkout; they reach each
other only (the bridge has no way out), and nothing outside reaches them. `close` stops
everything started in them and removes the namespaces and their `/etc/netns` folders.

    hosts = Hosts(root, ("hosta", "hostb"))   # 10.213.0.1, 10.213.0.2; interface eth1 on each
    hosts.run("hosta", "ssh", "hostb", "hostname")   # -> "hostb"
"""
import itertools
import os
import shutil
import signal
import subprocess
import time
from typing import Dict, Optional, Sequence

SUBNET = "10.213.0"
INTERFACE = "eth1"   # every host's interface on the bridge (the same name on each, as horovodrun wants)
SSHD = "/usr/sbin/sshd"
_MADE = itertools.count()


def missing() -> Optional[str]:
    """Why no hosts can be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    absent = [c for c in ("ip", "nsenter", "unshare", "ssh", "ssh-keygen") if not shutil.which(c)]
    absent += [] if os.path.exists(SSHD) else [SSHD]
    if absent:
        return f"{', '.join(absent)} missing (make setup installs openssh-server and iproute2)"
    probe = f"dlrm-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*command: str):
    out = subprocess.run(list(command), capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {out.stderr.strip()}")


class Hosts:
    """Hosts `names` under `root` (keys, configurations, sshd logs)."""

    def __init__(self, root: str, names: Sequence[str] = ("hosta", "hostb")):
        self.root, self.names = root, list(names)
        self.addresses: Dict[str, str] = {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(self.names)}
        tag = f"dlrm{os.getpid()}-{next(_MADE)}"
        self.namespaces = {n: f"{tag}-{n}" for n in self.names}
        self._switch = f"{tag}-switch"
        self._sshd: Dict[str, subprocess.Popen] = {}
        os.makedirs(root, exist_ok=True)
        try:
            self._network()
            self._ssh()
        except BaseException:
            self.close()
            raise

    def _network(self):
        _sh("ip", "netns", "add", self._switch)
        _sh("ip", "-n", self._switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self._switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            ns = self.namespaces[name]
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", "name", INTERFACE, "netns", ns, "type", "veth",
                "peer", "name", f"port{i}", "netns", self._switch)
            _sh("ip", "-n", self._switch, "link", "set", f"port{i}", "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", INTERFACE)
            _sh("ip", "-n", ns, "link", "set", INTERFACE, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _ssh(self):
        key = os.path.join(self.root, "id_ed25519")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
        shutil.copy(key + ".pub", os.path.join(self.root, "authorized_keys"))
        known = []
        for name in self.names:
            etc = self._etc(name)
            os.makedirs(os.path.join(etc, "ssh"))
            host_key = os.path.join(etc, "ssh", "ssh_host_ed25519_key")
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host_key)
            with open(host_key + ".pub") as f:
                known.append(f"{name},{self.addresses[name]} {' '.join(f.read().split()[:2])}")
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.addresses.items()))
            with open(os.path.join(etc, "ssh", "sshd_config"), "w") as f:
                f.write("\n".join([
                    f"ListenAddress {self.addresses[name]}", "HostKey /etc/ssh/ssh_host_ed25519_key",
                    "PermitRootLogin prohibit-password", "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
                    f"AuthorizedKeysFile {self.root}/authorized_keys", f"PidFile {self.root}/sshd-{name}.pid", ""]))
            with open(os.path.join(etc, "ssh", "ssh_config"), "w") as f:
                f.write("\n".join(["Host *", f"  IdentityFile {key}", f"  UserKnownHostsFile {self.root}/known_hosts",
                                   "  StrictHostKeyChecking yes", "  BatchMode yes", "  LogLevel ERROR", ""]))
        with open(os.path.join(self.root, "known_hosts"), "w") as f:
            f.write("\n".join(known) + "\n")
        os.makedirs("/run/sshd", exist_ok=True)   # sshd's privilege separation directory
        for name in self.names:
            log = open(os.path.join(self.root, f"sshd-{name}.log"), "w")
            self._sshd[name] = self.popen(name, SSHD, "-D", "-e", stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        for name in self.names:
            while self.run(self.names[0], "ssh", name, "true", timeout=20).returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {name} did not answer in 30 s: {self.root}/sshd-{name}.log")
                time.sleep(0.2)

    def _etc(self, name: str) -> str:
        return os.path.join("/etc/netns", self.namespaces[name])

    def command(self, name: str, *command: str) -> list:
        """`command` as run on host `name`: its network, hostname, /etc/hosts and /etc/ssh (mounted
        over this machine's in a mount namespace of its own; /sys stays this machine's, cgroups
        included, which `ip netns exec` would remount without)."""
        etc = self._etc(name)
        return ["nsenter", f"--net=/run/netns/{self.namespaces[name]}", "unshare", "--mount", "--uts",
                "--propagation", "private", "sh", "-c",
                f'hostname "$0" && mount --bind {etc}/hosts /etc/hosts && mount --bind {etc}/ssh /etc/ssh && '
                'exec "$@"', name, *command]

    def popen(self, name: str, *command: str, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(name, *command), start_new_session=True, **kwargs)

    def run(self, name: str, *command: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(name, *command), capture_output=True, text=True, timeout=timeout,
                              **kwargs)

    def pids(self, name: str) -> list:
        """The processes running on host `name`."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[name]], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def close(self):
        for name in self.names:
            for pid in self.pids(name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self._sshd.values():
            p.wait()
        for ns in [*self.namespaces.values(), self._switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for name in self.names:
            shutil.rmtree(self._etc(name), ignore_errors=True)
