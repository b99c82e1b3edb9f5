"""deployment/serve.py and the deployment scripts as the serving tests start them: a script run,
a server started on given ports and stopped (exit 0, ports freed), one request's answer, and the
Prometheus metrics it serves, parsed."""
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request

from deployment.client import ServingClient, free_ports
from tests.support.horovod_run import ROOT
from tests.support.warm_python import PYTHON


def script(name, *args):
    """deployment/NAME with `args`, run to its end (its CompletedProcess, text)."""
    return subprocess.run([*PYTHON, f"deployment/{name}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def start_server(log_path, ports, *args):
    """serve.py with `args` on ports (http, grpc, metrics)."""
    return subprocess.Popen([sys.executable, "deployment/serve.py", *args, "--address=127.0.0.1",
                             *port_flags(ports)],
                            cwd=ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def served_outputs(log_path, repository, numerical, categorical, outputs, *args, protocol="grpc"):
    """serve.py on `repository` (with `args`) on free ports: its answer's `outputs` to one request of
    model m, the server stopped after (stop_server's checks)."""
    ports = free_ports(3)
    server = start_server(log_path, ports, f"--model_repository={repository}", *args)
    try:
        client = ServingClient(protocol, f"localhost:{ports[0 if protocol == 'http' else 1]}", "m")
        client.wait_ready(120)
        out = client.infer(numerical, categorical, outputs)
        client.close()
    finally:
        stop_server(server, ports, log_path)
    return out


def port_flags(ports):
    """serve.py's flags of ports (http, grpc, metrics)."""
    return [f"--{name}_port={p}" for name, p in zip(("http", "grpc", "metrics"), ports)]


def stop_server(server, ports, log_path):
    """SIGTERM; the server exits with 0 and frees its ports."""
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    for port in ports:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0


def parse_metrics(text):
    """Prometheus' text format -> ({sample `name{labels}`: value}, {family: type}), checking that
    each sample's family has its HELP and TYPE lines before it and counters end in _total."""
    samples, types, helped = {}, {}, set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name in helped and name not in types and (kind == "counter") == name.endswith("_total"), line
            types[name] = kind
        else:
            key, value = line.rsplit(" ", 1)
            name = key.split("{")[0]
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in types or types.get(family) == "histogram", line
            assert key not in samples, line
            samples[key] = float(value)
    return samples, types


def scrape(port):
    """GET /metrics on `port` of 127.0.0.1, parsed (parse_metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse_metrics(response.read().decode())
