"""A Python interpreter with TensorFlow already imported, for the tests' subprocesses.

    python tests/support/warm_python.py --serve SOCKET   the server: imports PRELOAD, then forks a child
                                                 per request (TensorFlow's runtime never started)
    python tests/support/warm_python.py ARGS...          as `python ARGS...` (a script and its arguments,
                                                 -m module or -c code, after -u or not), run in
                                                 a child of the server named by
                                                 $WARM_PYTHON_SOCKETS; a plain `python ARGS...`
                                                 (exec) where none is set or ARGS hold another
                                                 interpreter option

A fresh Python spends 5-6 s of CPU importing TensorFlow, Keras and Horovod before a tiny run's own
1-2 s of work. The client (this file without --serve, importing nothing heavy) sends its argv,
working directory, environment and standard file descriptors (SCM_RIGHTS) to a server; the server
forks, the child takes them over as its own (`os.environ`, `sys.argv`, `sys.path` as `python
script` sets it, fds 0-2, buffering by PYTHONUNBUFFERED), reseeds NumPy's global generator and
runs the script as `__main__`. The client relays the signals it gets (SIGTERM, SIGINT, SIGHUP,
SIGUSR1, SIGUSR2, SIGQUIT) to the child and exits with the child's status (killed by a signal: by
the same signal); a client that dies takes the child and its process group with it. So each run is
a new process that starts from the same pristine state, as a fresh interpreter would: nothing of
one run reaches the next.

What differs from a fresh interpreter, and stays with fresh processes in the tests: the child's
pid is not the client's, the interpreter's hash seed is the server's (so $WARM_PYTHON_SOCKETS
names one server per rank slot: rank r of a Horovod launch is forked by server r mod n, so ranks
keep distinct hash seeds as separate interpreters have), TensorFlow's import-time start-up lines
are not printed again, the objects the server preloaded sit in the collector's permanent generation
(gc.freeze: a child's collections and its exit never walk them, so that an exit costs ~0.25 s of
CPU instead of ~1.3 s), and environment variables read while TensorFlow's libraries load (not by
its runtime, which starts in the child) are the server's: a request whose LOAD_TIME variables
differ from the server's runs in a fresh interpreter instead (the server answers "fresh").
"""
import array
import os
import signal
import socket
import sys

PYTHON = [sys.executable, os.path.abspath(__file__)]   # the command that stands for `python` in the tests
PRELOAD = ("numpy", "yaml", "absl.app", "absl.flags", "tensorflow", "keras", "horovod.tensorflow")
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
SOCKETS = "WARM_PYTHON_SOCKETS"   # the servers' socket paths, separated by os.pathsep
EXECUTABLE = "WARM_PYTHON"   # executable()
# Variables TensorFlow reads while its libraries load: a request that sets them otherwise runs fresh.
LOAD_TIME = ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL", "TF_CPP_VMODULE", "TF_ENABLE_ONEDNN_OPTS")
_FDS = 3   # stdin, stdout, stderr
_OWN_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]   # the server's


# --------------------------------------------------------------------------------------------
# The client.

def _server_socket() -> str:
    paths = [p for p in os.environ.get(SOCKETS, "").split(os.pathsep) if p]
    if not paths:
        return ""
    slot = int(os.environ.get("HOROVOD_RANK", "0") or 0)
    return paths[slot % len(paths)]


def _send(sock, payload: bytes):
    sock.sendall(len(payload).to_bytes(8, "little") + payload)


def _receive(sock) -> bytes:
    size = int.from_bytes(_exactly(sock, 8), "little")
    return _exactly(sock, size)


def _exactly(sock, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _fresh(args):
    """Becomes `python *args`: a fresh interpreter."""
    os.execv(sys.executable, [sys.executable, *args])


def client(args):
    path = _server_socket()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    first = args[1] if args[:1] == ["-u"] else args[0]
    try:
        if first.startswith("-") and first not in ("-c", "-m"):   # an option the child cannot take over
            raise OSError
        sock.connect(path)
    except OSError:   # no server: a fresh interpreter
        _fresh(args)
    import json
    request = json.dumps({"argv": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    sock.sendmsg([len(request).to_bytes(8, "little")],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", range(_FDS)))])
    sock.sendall(request)
    answer = _receive(sock)
    if answer == b"fresh":   # the server's libraries were loaded under other settings
        sock.close()
        _fresh(args)
    child = int(answer)

    def relay(signum, frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass
    for s in RELAYED:
        signal.signal(s, relay)
    while True:
        try:
            status = int(_receive(sock))
            break
        except InterruptedError:
            continue
        except EOFError:   # the server's runner died: as a crash of the child
            status = -signal.SIGKILL
            break
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


# --------------------------------------------------------------------------------------------
# The server.

def start_servers(n: int, directory: str) -> list:
    """Starts n servers with sockets in `directory` (the clients' requests wait while they import);
    sets $WARM_PYTHON_SOCKETS for this process and those it starts. Returns their processes."""
    import subprocess
    paths = [os.path.join(directory, f"python{k}.sock") for k in range(n)]
    servers = []
    for path in paths:
        with open(path + ".log", "w") as log:
            servers.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", path],
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
    import time
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(os.path.exists(p) or s.poll() is not None
                                                 for p, s in zip(paths, servers)):
        time.sleep(0.05)
    os.environ[SOCKETS] = os.pathsep.join(paths)
    command = os.path.join(directory, "python")
    with open(command, "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "{os.path.abspath(__file__)}" "$@"\n')
    os.chmod(command, 0o755)
    os.environ[EXECUTABLE] = command
    return servers


def executable() -> str:
    """One path that stands for `python` (for scripts that take an interpreter's path): a command
    running tests/support/warm_python.py where the servers run, else this interpreter."""
    return os.environ.get(EXECUTABLE, sys.executable)


def serve(path: str):
    import importlib
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)   # requests wait from here while the modules import
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:   # not installed: a run that imports it gets the error itself
            pass
    import gc
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # runners are reaped by the kernel
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _runner(conn)
        conn.close()


def _runner(conn):
    """A forked runner: forks the run's process, tells the client its pid and then its exit status
    (negative: the signal that killed it); kills its process group if the client goes away."""
    import json
    import select
    header, fds, _, _ = conn.recvmsg(8, socket.CMSG_SPACE(_FDS * array.array("i").itemsize))
    received = []
    for level, kind, data in fds:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received.extend(array.array("i", data[:len(data) - len(data) % array.array("i").itemsize]))
    request = json.loads(_exactly(conn, int.from_bytes(header, "little")))
    if any(request["env"].get(name) != os.environ.get(name) for name in LOAD_TIME):
        for fd in received:
            os.close(fd)
        _send(conn, b"fresh")
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _child(request, received)   # never returns
    for fd in received:
        os.close(fd)
    _send(conn, str(pid).encode())
    watch = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([conn, watch], [], [])
        if watch in ready:
            _, wait_status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(wait_status)
            try:
                _send(conn, str(code).encode())
            except OSError:
                pass
            os._exit(0)
        if not conn.recv(1):   # the client is gone: so is its run
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _child(request, fds):
    """Becomes `python *request["argv"]` in request["cwd"] with request["env"]; exits as it does."""
    import io
    import runpy
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for s in RELAYED:
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = list(request["argv"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    if argv[0] == "-u":
        argv.pop(0)
        unbuffered = True
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.FileIO(fd, "w", closefd=False)
        interactive = stream.isatty()
        setattr(sys, name, io.TextIOWrapper(stream if unbuffered else io.BufferedWriter(stream), encoding="utf-8",
                                            errors="backslashreplace" if fd == 2 else "strict",
                                            line_buffering=interactive or fd == 2, write_through=unbuffered))
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in extra and p not in _OWN_PYTHONPATH]
    import numpy
    numpy.random.seed()   # as a fresh interpreter: its own entropy
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[:] = ["", *extra, *base]
        import types
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        main.__builtins__ = __builtins__
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[:] = [os.getcwd(), *extra, *base]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[:] = [os.path.dirname(os.path.realpath(argv[0])), *extra, *base]
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])
