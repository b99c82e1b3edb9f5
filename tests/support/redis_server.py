"""A real Redis server for tests: Debian's redis-server (tools/setup_env.sh installs it) on a free
local port, without persistence, in a temporary directory; stopped, killed or restarted on the
same port by the test."""
import shutil
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """`start()` / `kill()` / `stop()`; `url` is redis://127.0.0.1:<port>/0 for the server's life."""

    def __init__(self, directory: str, port: int = 0):
        binary = shutil.which("redis-server")
        assert binary, "redis-server is missing: run tools/setup_env.sh as root (it installs Debian's redis-server)"
        self.binary, self.directory, self.port = binary, str(directory), port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = None

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.directory, "--loglevel", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"redis-server exited ({self.process.returncode}), port {self.port}"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        raise AssertionError(f"redis-server did not answer on port {self.port} within {timeout} s")

    def kill(self):
        """SIGKILL, as a crash; waits for the process."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop(self):
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
            self.process = None
