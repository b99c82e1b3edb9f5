"""The collectives the hybrid-parallel model needs, behind one small interface.

`SingleProcess` is the identity at world size 1 and imports no Horovod; `HorovodCollectives`
implements the same calls with Horovod (Gloo, MPI or NCCL underneath). Every tensor collective
takes an explicit `name`: ranks build different graphs (each holds other tables), so Horovod's
default names, derived from tensor names, would not match across ranks.
"""
import os
import re
import socket
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from utils.launcher import launched

# A rank's process killed on this host has closed its sockets (the failure another rank sees) a
# moment before it reads as exited: how long a failing rank looks for it before naming a peer.
EXIT_WAIT_S = 2.0


class SingleProcess:
    """World size 1: every collective is the identity."""
    rank = 0
    size = 1

    def alltoall(self, tensor: tf.Tensor, counts, name: str):
        """Sends tensor[sum(counts[:j]) : sum(counts[:j+1])] to rank j (along axis 0; `counts`: N
        ints); returns the concatenation of what every rank sent here, in rank order."""
        return tensor

    def allreduce_sum(self, tensors: Sequence[tf.Tensor], name: str) -> List[tf.Tensor]:
        return list(tensors)

    def allgather(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        """Concatenates every rank's tensor along axis 0, in rank order."""
        return tensor

    def gather(self, array: np.ndarray, name: str) -> np.ndarray:
        """Rank 0: every rank's array concatenated along axis 0, in rank order; other ranks: no
        rows. Nothing is pickled and only rank 0 receives."""
        return array

    def broadcast_variables(self, variables: Sequence[tf.Variable]):
        """Sets every rank's variables to rank 0's values."""

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's Python object, in rank order."""
        return [obj]

    def broadcast_object(self, obj: Any, name: str) -> Any:
        return obj

    def barrier(self, name: str):
        """Returns once every rank has reached the barrier of the same name."""

    def largest(self, value: int, name: str) -> int:
        """The largest of every rank's `value` (one allreduce of one int32)."""
        return int(value)

    def ranks_by_host(self) -> Dict[str, List[int]]:
        """Every host's ranks: {hostname: [rank, ...]}, hosts in the order of their first rank."""
        return {socket.gethostname(): [0]}

    def failure(self, error: BaseException) -> Optional[str]:
        """One line describing `error` if it is a failed collective (another rank died, hung or
        became unreachable), else None; it names the lost rank first where that can be known."""
        return None


class HorovodCollectives(SingleProcess):
    """The collectives over all Horovod ranks (`horovod.tensorflow`, initialised here)."""

    def __init__(self):
        import horovod.tensorflow as hvd
        hvd.init()
        use_one_gpu(hvd.local_rank())   # before the first TensorFlow op (allgather_object is one)
        self._hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        if os.environ.get("DLRM_CPU_AFFINITY", "auto") != "off":
            pin_to_local_share(hvd.local_rank(), hvd.local_size())
        self._processes = self.allgather_object((socket.gethostname(), os.getpid(), _addresses()), name="processes")

    def alltoall(self, tensor, counts, name):
        out, _ = self._hvd.alltoall(tensor, splits=counts, name=name, ignore_name_scope=True)
        return out

    def allreduce_sum(self, tensors, name):
        return self._hvd.grouped_allreduce(list(tensors), op=self._hvd.Sum, name=name, ignore_name_scope=True)

    def allgather(self, tensor, name):
        return self._hvd.allgather(tensor, name=name, ignore_name_scope=True)

    def gather(self, array, name):
        counts = [len(array)] + [0] * (self.size - 1)   # everything to rank 0
        out, _ = self._hvd.alltoall(tf.constant(array), splits=counts, name=name, ignore_name_scope=True)
        return out.numpy()

    def broadcast_variables(self, variables):
        self._hvd.broadcast_variables(list(variables), root_rank=0)

    def allgather_object(self, obj, name):
        return self._hvd.allgather_object(obj, name=name)

    def broadcast_object(self, obj, name):
        return self._hvd.broadcast_object(obj, root_rank=0, name=name)

    def barrier(self, name):
        self._hvd.allreduce(tf.zeros([1]), op=self._hvd.Sum, name=name, ignore_name_scope=True).numpy()

    def largest(self, value, name):
        return int(self._hvd.allreduce(tf.constant([int(value)], tf.int32), op=self._hvd.Max, name=name,
                                       ignore_name_scope=True).numpy()[0])

    def ranks_by_host(self):
        hosts: Dict[str, List[int]] = {}
        for r, (h, *_) in enumerate(self._processes):
            hosts.setdefault(h, []).append(r)
        return hosts

    def failure(self, error):
        from horovod.common.exceptions import HorovodInternalError
        text = str(error)
        if not isinstance(error, HorovodInternalError) and not (
                isinstance(error, tf.errors.OpError) and re.search(r"gloo|horovod|mpi", text, re.I)):
            return None
        # Gloo's own reason (peer closed the connection, a receive timed out) when it is there.
        reason = re.search(r"gloo/[\w/.]+:\d+\] ([^\n]+)", text)
        # The op: a graph node's name (less the name scopes of the Keras layers it runs in), or an
        # eager call's ("{{function_node __wrapped__<op>_device_...}}").
        node = re.search(r"\{\{node (?:[\w.-]+/)*(\w+)\}\}", text) or \
            re.search(r"\{\{function_node __wrapped__(\w+?)_device_", text)
        where = f"the collective {node.group(1)!r}" if node else "a collective operation"
        lines = [re.sub(r"\{\{[^}]*\}\}\s*", "", line).strip() for line in text.splitlines()]
        lines = [line for line in lines if line] or [type(error).__name__]
        why = reason.group(1) if reason else next((line.split(". ")[0] for line in lines if "Horovod" in line),
                                                  lines[0])
        return f"{self._lost_ranks(text)}; rank {self.rank} saw {where} fail ({why})"

    def _lost_ranks(self, text: str) -> str:
        """Which rank was lost: this host's other ranks whose process has exited or is stopped; else,
        at 2 ranks, the other one (the only peer there is); else an unnamed peer rank, with the host
        of the connection Gloo's message names (a rank there failed first, or saw another fail)."""
        host = socket.gethostname()
        local = [(r, h, pid) for r, (h, pid, _) in enumerate(self._processes) if h == host and r != self.rank]
        deadline = time.monotonic() + (EXIT_WAIT_S if local else 0.0)
        while True:   # a killed process closes its sockets (what Gloo saw) before it reads as exited
            lost = [f"rank {r} of {self.size} {state} (process {pid} on {h})"
                    for r, h, pid in local for state in [_process_state(pid)] if state]
            if lost:
                return ", ".join(lost)
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        lost = "died, hung or became unreachable (HOROVOD_GLOO_TIMEOUT_SECONDS bounds the wait)"
        if self.size == 2:
            return f"rank {1 - self.rank} of 2 (on {self._processes[1 - self.rank][0]}) {lost}"
        peer = re.search(r"\[([0-9a-fA-F.:]+)\]:\d+", text)
        there = [r for r, (_, _, addresses) in enumerate(self._processes)
                 if peer and peer.group(1) in addresses and r != self.rank]
        if not there:
            return f"a peer rank {lost}"
        return (f"a peer rank {lost}, first seen on the connection to {self._processes[there[0]][0]} "
                f"({peer.group(1)}: rank{'s' if len(there) > 1 else ''} {', '.join(map(str, there))})")


def _addresses() -> List[str]:
    """This host's IPv4 addresses, one per interface that has one (Linux; elsewhere none)."""
    try:
        import fcntl
        import struct
        found = []
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:   # SIOCGIFADDR: the interface's address, at bytes 20-24 of its ifreq
                    found.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915,
                                                              struct.pack("256s", name.encode()[:15]))[20:24]))
                except OSError:
                    pass
        return found
    except (ImportError, OSError, AttributeError):
        return []


def _process_state(pid: int) -> Optional[str]:
    """'has exited' (a zombie counts as exited) or 'is stopped' (SIGSTOP, a debugger) for process
    `pid` of this host, else None (running, or no procfs to tell)."""
    if not os.path.isdir("/proc/self"):
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "has exited"
    return {"Z": "has exited", "X": "has exited", "T": "is stopped", "t": "is stopped"}.get(state)


def use_one_gpu(local_rank: int):
    """Makes the GPU of local rank `local_rank` (modulo the GPUs this process can see) its only
    visible GPU, with memory growth on; no-op without GPUs. A single process takes local rank 0:
    the first GPU CUDA_VISIBLE_DEVICES lets it see. Must run before TensorFlow's first op, which
    initialises TensorFlow on every visible GPU and fixes the choice (TensorFlow then refuses it)."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        gpu = gpus[local_rank % len(gpus)]
        tf.config.set_visible_devices(gpu, "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)


def pin_to_local_share(local_rank: int, local_size: int) -> Optional[List[int]]:
    """Binds this process (every thread it has, and so every thread it starts) to local rank
    `local_rank`'s share of its host's CPUs: the r-th of `local_size` equal blocks. Ranks that
    share cores without binding lost about a fifth of W1's 2-rank throughput (36k against 44k
    samples/s) to migrations and cache misses.
    Only when the process may use every CPU (no launcher or cpuset has divided them already)
    and there are at least as many CPUs as local ranks; returns the share, or None."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if local_size < 2 or len(cpus) < local_size or len(cpus) != os.cpu_count():
        return None
    share = cpus[local_rank * len(cpus) // local_size:(local_rank + 1) * len(cpus) // local_size]
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), share)
        except ProcessLookupError:   # the thread has ended meanwhile
            pass
    return share


def make_collectives():
    """Horovod's collectives when launched by horovodrun/mpirun, else the single process; either
    way this process's GPU is chosen (use_one_gpu), so call it before any TensorFlow op."""
    if launched():
        return HorovodCollectives()
    use_one_gpu(0)
    return SingleProcess()
