"""The native frontend is safe to expose (docs/deployment.md, "What the server trusts"), tried on a
real deployment/serve.py: it listens on 127.0.0.1 by default; a gzip bomb is refused with the
server's memory bounded; slow connections are capped and dropped; every malformed request is
answered with an error status and counted as refused; with a token and TLS, HTTP, gRPC and
/metrics need the token (health stays open) and speak TLS."""
import http.client
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest

from deployment.client import ServingClient, free_ports, request_batches
from tests.support.horovod_run import ROOT
from tests.support.serving import parse_metrics, port_flags, script, stop_server
from tests.test_serving import data_flags, eval_dataset, trained  # noqa: F401 (trained: a fixture)

REQUESTS = 'dlrm_inference_requests_total{model="dlrm",protocol="%s",status="%s"}'
LIMIT_MB = 8


def start(log, ports, *args):
    """serve.py with `args` on ports (http, grpc, metrics), --address left at its default."""
    return subprocess.Popen([sys.executable, "deployment/serve.py", *args, *port_flags(ports)], cwd=ROOT,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def proc_status(pid) -> dict:
    """/proc/<pid>/status: its VmHWM and VmRSS (KiB) and Threads."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) for k in ("VmHWM", "VmRSS", "Threads")}


def refused(port, protocol="http", context=None, token=None, status="refused") -> float:
    """The count of `protocol`'s requests answered with `status` in /metrics on `port`."""
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=30) if context else \
        http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    response = connection.getresponse()
    assert response.status == 200
    return parse_metrics(response.read().decode())[0][REQUESTS % (protocol, status)]


def exchange(port, raw: bytes, context=None, closed=False):
    """Sends `raw` on a new connection to `port` (over TLS with `context`): (status, body as text) of
    the answer; `closed`: also asserts that the server then closed the connection."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    with context.wrap_socket(s, server_hostname="localhost") if context else s as s:
        s.sendall(raw)
        response = http.client.HTTPResponse(s)
        response.begin()
        answer = response.status, response.read().decode()
        assert not closed or s.recv(1) == b"", answer
        return answer


def peak_rise_mib(pid, action):
    """`action()`'s result and how far process `pid`'s peak memory rose during it, MiB: VmHWM, reset
    to its memory then (/proc/<pid>/clear_refs), before and after."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    before = proc_status(pid)["VmHWM"]
    result = action()
    return result, (proc_status(pid)["VmHWM"] - before) / 1024


def post(body: bytes, headers: str = "", length=None) -> bytes:
    """An inference request's bytes: `body` with Content-Length (`length` if given) and `headers`."""
    length = len(body) if length is None else length
    return (f"POST /v2/models/dlrm/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n{headers}\r\n"
            .encode() + body)


def request_json(numerical, categorical) -> dict:
    return {"inputs": [{"name": "numerical_features", "datatype": "FP32", "shape": list(numerical.shape),
                        "data": numerical.reshape(-1).tolist()},
                       {"name": "categorical_features", "datatype": "INT64", "shape": list(categorical.shape),
                        "data": categorical.reshape(-1).tolist()}]}


@pytest.fixture(scope="module")
def bounded(trained, tmp_path_factory):
    """(server, ports, log, data): the export served with no --address, an 8 MiB request bound, 16
    connections and a 2 s read timeout."""
    _, _, data, repo = trained
    log = tmp_path_factory.mktemp("bounded") / "server.log"
    ports = free_ports(3)
    server = start(log, ports, f"--model_repository={repo}", f"--max_request_mb={LIMIT_MB}", "--max_connections=16",
                   "--read_timeout_s=2")
    try:
        ServingClient("http", f"127.0.0.1:{ports[0]}", "dlrm").wait_ready(120)
        yield server, ports, log, data
    finally:
        stop_server(server, ports, log)


def listening(port):
    """The local addresses (hex, as /proc/net/tcp* write them) of the sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


def test_listens_on_loopback_only_by_default(bounded):
    _, ports, _, _ = bounded
    for port in ports:
        # 127.0.0.1 (gRPC's as an IPv6 socket's v4-mapped ::ffff:127.0.0.1), and nothing else
        assert listening(port) in (["0100007F"], ["0000000000000000FFFF00000100007F"]), (port, listening(port))
        with socket.socket() as s:   # another address of this machine (the loopback's 127/8)
            assert s.connect_ex(("127.0.0.2", port)) != 0


def test_a_gzip_bomb_is_refused_with_memory_bounded(bounded):
    """1 GiB of zeros gzipped into ~1 MiB: 413 once 8 MiB are decompressed, the server's peak memory
    up by far less than that GiB; a good gzip-encoded request is answered."""
    server, ports, log, data = bounded
    numerical, categorical, _ = next(request_batches(eval_dataset(data), 4, 4))
    good = zlib.compressobj(wbits=31)
    good = good.compress(json.dumps(request_json(numerical, categorical)).encode()) + good.flush()
    status, body = exchange(ports[0], post(good, "Content-Encoding: gzip\r\n"))
    assert status == 200 and len(json.loads(body)["outputs"]) == 3, body
    bomb, chunk = zlib.compressobj(1, wbits=31), bytes(1 << 20)
    bomb = b"".join(bomb.compress(chunk) for _ in range(1024)) + bomb.flush()
    assert len(bomb) < 8 << 20
    count = refused(ports[2])
    (status, body), rise = peak_rise_mib(server.pid,
                                         lambda: exchange(ports[0], post(bomb, "Content-Encoding: gzip\r\n")))
    assert status == 413 and f"exceeds {LIMIT_MB << 20} bytes once decompressed (gzip)" in body, (status, body)
    assert rise < 200, rise
    assert refused(ports[2]) == count + 1


def test_slow_connections_are_capped_and_dropped(bounded):
    """100 connections sending half a request head, one more dripping a byte every 0.3 s: at most
    16 held (threads bounded, the others refused at once), each dropped 2 s after it began."""
    server, ports, log, data = bounded
    threads = proc_status(server.pid)["Threads"]
    count = refused(ports[2])
    drip = socket.create_connection(("127.0.0.1", ports[0]), timeout=10)
    stop = threading.Event()

    def dripping():
        for byte in b"POST /v2/models/dlrm/infer HTTP/1.1\r\nHost: x\r\n" * 10:
            if stop.wait(0.3):
                return
            try:
                drip.send(bytes([byte]))
            except OSError:
                return
    threading.Thread(target=dripping, daemon=True).start()
    start_time = time.monotonic()
    slow = []
    for _ in range(100):
        s = socket.create_connection(("127.0.0.1", ports[0]), timeout=10)
        s.sendall(b"POST /v2/models/dlrm/infer HTTP/1.1\r\nHost: x\r\n")
        slow.append(s)
    time.sleep(0.5)
    held = proc_status(server.pid)["Threads"]
    assert held <= threads + 16 + 2, (threads, held)

    def closed_by_server(s) -> float:
        """Seconds after start_time when the server closed `s` (its answer, if any, read)."""
        try:
            while s.recv(65536):
                pass
        except ConnectionResetError:
            pass
        return time.monotonic() - start_time
    ends = [closed_by_server(s) for s in [drip, *slow]]
    stop.set()
    assert max(ends) < 2 + 3, ends   # socket.timeout (10 s) if one were still held
    assert ends[0] >= 1.5, ends[0]   # the drip went on until its 2 s ran out
    for s in [drip, *slow]:
        s.close()
    assert refused(ports[2]) >= count + 100 - 16
    numerical, categorical, _ = next(request_batches(eval_dataset(data), 4, 4))
    client = ServingClient("http", f"127.0.0.1:{ports[0]}", "dlrm")
    first = client.infer(numerical, categorical)["logits"]
    time.sleep(2.5)   # its kept-alive connection dropped meanwhile: tritonclient connects again
    np.testing.assert_array_equal(client.infer(numerical, categorical)["logits"], first)
    client.close()
    assert proc_status(server.pid)["Threads"] <= threads + 2


def test_malformed_requests_are_answered_and_counted(bounded):
    """Each gets an error status (none a closed connection), is counted as refused, and leaves no
    traceback in the server's log; ids must be integers in INT64's range (JSON true and false are
    not, alone, among integers or in a nested list), numericals numbers (true is not)."""
    from tritonclient.utils import InferenceServerException
    server, ports, log, data = bounded
    numerical, categorical, _ = next(request_batches(eval_dataset(data), 1, 1))
    good = request_json(numerical, categorical)

    def with_data(k, values) -> bytes:
        """The good request with `values` as input k's data."""
        doc = request_json(numerical, categorical)
        doc["inputs"][k]["data"] = values
        return post(json.dumps(doc).encode())
    row = categorical.reshape(-1).tolist()
    with_ids = lambda value: with_data(1, [value, *row[1:]])  # noqa: E731
    ids = "input 'categorical_features' for model 'dlrm': values must be integers in INT64's range"
    cases = [   # (request bytes, status, part of the message)
        (with_ids(10 ** 30), 400, ids),
        (with_ids(2 ** 63), 400, ids),
        (with_ids(1.7), 400, ids),
        (with_ids("abc"), 400, ids),
        (with_ids(True), 400, ids),
        (with_data(1, [False] * len(row)), 400, ids),
        (with_data(1, [[False, *row[1:]]]), 400, ids),
        (with_data(0, [True, *numerical.reshape(-1).tolist()[1:]]), 400,
         "input 'numerical_features' for model 'dlrm': values must be numbers"),
        (post(json.dumps(dict(good, outputs=[1])).encode()), 400, "outputs[0] must be an object"),
        (post(json.dumps(dict(good, inputs=["abc"])).encode()), 400, "inputs[0] must be an object"),
        (post(json.dumps(dict(good, parameters=[])).encode()), 400, "the request's parameters must be an object"),
        (post(json.dumps({"inputs": [dict(good["inputs"][0], shape=[1.0, 3]), good["inputs"][1]]}).encode()), 400,
         "shape must be a list of non-negative integers"),
        (post(b"[1]"), 400, "malformed inference request: not a JSON object"),
        (post(b"[" * 5000), 400, "malformed inference request"),   # nested past the recursion limit
        (post(b"{}", length="abc"), 400, "Content-Length must be a non-negative integer, got 'abc'"),
        (post(b"{}", length=(LIMIT_MB << 20) + 1), 413, f"exceeds {LIMIT_MB << 20} bytes"),
        (b"POST /v2/models/dlrm/infer HTTP/1.1\r\nHost: x\r\n\r\n", 411, "needs Content-Length"),
        (b"POST /v2/models/dlrm/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411,
         "Transfer-Encoding is not supported"),
        (post(b"{}", f"Cookie: {'x' * (70 << 10)}\r\n"), 431, "request line and headers exceed 65536 bytes"),
        (post(b"{}", "Content-Encoding: br\r\n"), 400, "unsupported Content-Encoding 'br'"),
        (post(zlib.compress(b"{}" * 100)[:-4], "Content-Encoding: deflate\r\n"), 400, "malformed deflate body"),
    ]
    count = refused(ports[2])
    for raw, status, message in cases:
        answer = exchange(ports[0], raw)
        assert answer[0] == status and message in answer[1], (raw[:200], answer)
    assert refused(ports[2]) == count + len(cases)
    # over gRPC: a message past --max_request_mb (and the model's largest), sent as is or gzipped (64 MiB of
    # zeros in ~64 KiB), and metadata past --max_header_kb: gRPC refuses them itself (counted all the same)
    count = refused(ports[2], "grpc")
    client = ServingClient("grpc", f"127.0.0.1:{ports[1]}", "dlrm")
    for size, compression, headers in ((3 << 20, None, None), (16 << 20, "gzip", None),
                                       (1, None, {"x-padding": "x" * (256 << 10)})):
        tensors = [client.api.InferInput("numerical_features", [1, size], "FP32"),
                   client.api.InferInput("categorical_features", list(categorical.shape), "INT64")]
        tensors[0].set_data_from_numpy(np.zeros((1, size), np.float32))
        tensors[1].set_data_from_numpy(categorical)
        with pytest.raises(InferenceServerException) as error:
            client.client.infer("dlrm", tensors, compression_algorithm=compression, headers=headers)
        assert "RESOURCE_EXHAUSTED" in str(error.value.status()), error.value
    np.testing.assert_array_equal(client.infer(numerical, categorical)["logits"].shape, (1, 1))
    client.close()
    assert refused(ports[2], "grpc") == count + 3
    assert "Traceback" not in log.read_text()


def grpc_method(port, name, streaming=False, cert=None):
    """Method `name` of the server's GRPCInferenceService on `port` (over TLS trusting `cert`), unary
    or stream-unary (the same on the wire), taking and giving bytes."""
    import grpc
    channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(open(cert, "rb").read())) \
        if cert else grpc.insecure_channel(f"127.0.0.1:{port}")
    return (channel.stream_unary if streaming else channel.unary_unary)(f"/inference.GRPCInferenceService/{name}")


def test_malformed_grpc_messages_are_answered_and_counted(bounded):
    """Bytes that are not a ModelInferRequest, and a call that ends without a message: INVALID_ARGUMENT
    (gRPC alone answered INTERNAL), counted as refused."""
    import grpc
    from tritonclient.grpc import service_pb2
    _, ports, log, _ = bounded
    count = refused(ports[2], "grpc")
    for call, message in ((lambda: grpc_method(ports[1], "ModelInfer")(b"\xff\xff\xff\xff"),
                           "malformed request: DecodeError: Error parsing message"),
                          (lambda: grpc_method(ports[1], "ModelInfer", streaming=True)(iter(())),
                           "malformed request: ValueError: no request message")):
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.value.details(), \
            error.value
    live = grpc_method(ports[1], "ServerLive")(service_pb2.ServerLiveRequest().SerializeToString())
    assert service_pb2.ServerLiveResponse.FromString(live).live
    assert refused(ports[2], "grpc") == count + 2
    assert "Traceback" not in log.read_text()


def test_booleans_are_values_of_bool_inputs_only():
    """ServedModel.run (in process) of a model with BOOL, INT8 and FP32 inputs: the BOOL input takes
    booleans (JSON lists, flat or nested; gRPC's bool_contents) and nothing else; the others refuse
    them, alone, among numbers or nested."""
    from deployment.serving.native import GRPC_CONTENTS, RequestError, ServedModel, TensorSpec, Values
    model = ServedModel("toy", [TensorSpec("mask", np.bool_, (2,)), TensorSpec("ids", np.int8, (2,)),
                                TensorSpec("x", np.float32, (2,))], [TensorSpec("y", np.float32, (1,))], 4,
                        lambda mask, ids, x: {"y": (mask * ids * x).sum(1, keepdims=True)})

    def run(mask, ids, x):
        return model.run([("mask", "BOOL", [1, 2], mask), ("ids", "INT8", [1, 2], ids), ("x", "FP32", [1, 2], x)],
                         None)["y"].tolist()
    assert run([True, False], [3, 5], [0.5, 2]) == run([[True, False]], [[3, 5]], [[0.5, 2]]) == [[1.5]]
    contents = {datatype: Values(values, GRPC_CONTENTS[datatype][1])
                for datatype, values in (("BOOL", [False, True]), ("INT8", [3, 5]), ("FP32", [0.5, 2.0]))}
    assert run(*contents.values()) == [[10.0]]
    for mask, ids, x, refused_input, what in (
            ([1, 0], [3, 5], [0.5, 2], "mask", "booleans"),
            ([True, False], [True, False], [0.5, 2], "ids", "integers in INT8's range"),
            ([True, False], [3, True], [0.5, 2], "ids", "integers in INT8's range"),
            ([True, False], [[False, 5]], [0.5, 2], "ids", "integers in INT8's range"),
            ([True, False], [3, 5], [True, 2.0], "x", "numbers"),
            ([True, False], [3, 5], [[0.5], [False]], "x", "numbers")):
        with pytest.raises(RequestError) as error:
            run(mask, ids, x)
        assert error.value.code == "INVALID_ARGUMENT" and str(error.value) == (
            f"[request id: <id_unknown>] input '{refused_input}' for model 'toy': values must be {what}")


def test_an_input_named_twice_is_refused(bounded):
    """Over HTTP and gRPC: 400 / INVALID_ARGUMENT naming it, counted as refused (the client's error),
    not as failed."""
    from tritonclient.utils import InferenceServerException
    _, ports, log, data = bounded
    numerical, categorical, _ = next(request_batches(eval_dataset(data), 1, 1))
    doc = request_json(numerical, categorical)
    doc["inputs"][0] = doc["inputs"][1]
    message = "input 'categorical_features' already exists in request for model 'dlrm'"
    counts = [refused(ports[2], protocol, status=status) for protocol in ("http", "grpc")
              for status in ("refused", "failed")]
    status, body = exchange(ports[0], post(json.dumps(doc).encode()))
    assert status == 400 and message in body, (status, body)
    client = ServingClient("grpc", f"127.0.0.1:{ports[1]}", "dlrm")
    twice = [client.api.InferInput("categorical_features", list(categorical.shape), "INT64") for _ in range(2)]
    for tensor in twice:
        tensor.set_data_from_numpy(categorical)
    with pytest.raises(InferenceServerException) as error:
        client.client.infer("dlrm", twice)
    assert "INVALID_ARGUMENT" in str(error.value.status()) and message in error.value.message(), error.value
    client.close()
    assert [refused(ports[2], protocol, status=status) for protocol in ("http", "grpc")
            for status in ("refused", "failed")] == [counts[0] + 1, counts[1], counts[2] + 1, counts[3]]
    assert "Traceback" not in log.read_text()


def test_grpc_calls_in_flight_are_capped_and_counted(trained, tmp_path):
    """--max_connections=4: 4 calls whose message waits hold the cap (the frontend's 8 threads run
    them); a call more is refused at once with RESOURCE_EXHAUSTED and counted (gRPC's own cap
    counted none); the 4, once sent, are answered."""
    import grpc
    from tritonclient.grpc import service_pb2
    _, _, data, repo = trained
    numerical, categorical, _ = next(request_batches(eval_dataset(data), 2, 2))
    request = service_pb2.ModelInferRequest(model_name="dlrm", inputs=[
        service_pb2.ModelInferRequest.InferInputTensor(name="numerical_features", datatype="FP32",
                                                       shape=list(numerical.shape)),
        service_pb2.ModelInferRequest.InferInputTensor(name="categorical_features", datatype="INT64",
                                                       shape=list(categorical.shape))],
        raw_input_contents=[numerical.astype(np.float32).tobytes(), categorical.astype(np.int64).tobytes()])
    go = threading.Event()

    def held_message():
        go.wait(120)
        yield request.SerializeToString()
    ports, log = free_ports(3), tmp_path / "server.log"
    server = start(log, ports, f"--model_repository={repo}", "--max_connections=4")
    try:
        ServingClient("http", f"127.0.0.1:{ports[0]}", "dlrm").wait_ready(120)
        count = refused(ports[2], "grpc")
        infer, live = grpc_method(ports[1], "ModelInfer", streaming=True), grpc_method(ports[1], "ServerLive")
        held, again = [infer.future(held_message()) for _ in range(4)], 0
        deadline = time.monotonic() + 120

        def in_flight_refused(error) -> bool:
            return error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and \
                error.details() == "more than 4 calls in flight"
        while True:   # a call more is answered (a thread is free) until the 4 are in
            for k, call in enumerate(held):   # one that came while the call more was in flight was refused
                if call.done():
                    assert in_flight_refused(call), call.exception()
                    held[k], again = infer.future(held_message()), again + 1
            try:
                live(service_pb2.ServerLiveRequest().SerializeToString(), timeout=30)
            except grpc.RpcError as error:
                assert in_flight_refused(error), error
                break
            assert time.monotonic() < deadline, "the 4 calls were not taken in"
            time.sleep(0.05)
        assert refused(ports[2], "grpc") == count + 1 + again
        go.set()
        for call in held:
            assert service_pb2.ModelInferResponse.FromString(call.result(timeout=60)).outputs
        assert refused(ports[2], "grpc") == count + 1 + again
    finally:
        go.set()
        stop_server(server, ports, log)


@pytest.fixture(scope="module")
def guarded(trained, tmp_path_factory):
    """(ports, token, TLS context trusting the server, certificate file, data, token file, server): the
    export served with --auth_token_file and a self-signed certificate for 127.0.0.1 and localhost."""
    _, _, data, repo = trained
    tmp = tmp_path_factory.mktemp("guarded")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(tmp / "key.pem"),
                    "-out", str(tmp / "cert.pem")], check=True, capture_output=True)
    token = "s3cret-token"
    (tmp / "token").write_text(token + "\n")
    ports, log = free_ports(3), tmp / "server.log"
    server = start(log, ports, f"--model_repository={repo}", f"--auth_token_file={tmp / 'token'}",
                   f"--tls_cert_file={tmp / 'cert.pem'}", f"--tls_key_file={tmp / 'key.pem'}")
    try:
        ServingClient("http", f"localhost:{ports[0]}", "dlrm", token, str(tmp / "cert.pem")).wait_ready(120)
        yield (ports, token, ssl.create_default_context(cafile=str(tmp / "cert.pem")), str(tmp / "cert.pem"), data,
               str(tmp / "token"), server)
    finally:
        stop_server(server, ports, log)


def test_the_token_is_required_over_tls(guarded):
    """HTTPS: health open, metadata, inference and /metrics 401 without the token (or with a wrong
    one); gRPC over TLS: UNAUTHENTICATED without it, ServerLive open; with it, both answer."""
    from tritonclient.utils import InferenceServerException
    ports, token, context, cert, data, _, _ = guarded
    numerical, categorical, _ = next(request_batches(eval_dataset(data), 4, 4))

    def get(port, path, headers=None):
        connection = http.client.HTTPSConnection("localhost", port, context=context, timeout=30)
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    bearer = {"Authorization": f"Bearer {token}"}
    counts = [refused(ports[2], protocol, context, token) for protocol in ("http", "grpc")]
    assert get(ports[0], "/v2/health/live")[0] == get(ports[0], "/v2/health/ready")[0] == 200
    assert get(ports[0], "/v2/models/dlrm")[0] == get(ports[2], "/metrics")[0] == 401
    assert get(ports[0], "/v2/models/dlrm", {"Authorization": "Bearer wrong"})[0] == 401
    assert get(ports[0], "/v2/models/dlrm", bearer)[0] == 200 and get(ports[2], "/metrics", bearer)[0] == 200
    for protocol, port in (("http", ports[0]), ("grpc", ports[1])):
        good = ServingClient(protocol, f"localhost:{port}", "dlrm", token, cert).infer(numerical, categorical)
        assert good["logits"].shape == (4, 1)
        anonymous = ServingClient(protocol, f"localhost:{port}", "dlrm", "", cert)
        with pytest.raises(InferenceServerException) as error:
            anonymous.infer(numerical, categorical)
        assert ("401" if protocol == "http" else "UNAUTHENTICATED") in str(error.value.status()), error.value
        assert anonymous.client.is_server_live()
    # counted: the two GETs of the inference port without the token (/metrics' own refusals are not) and the
    # inference without it
    assert [refused(ports[2], p, context, token) for p in ("http", "grpc")] == [counts[0] + 3, counts[1] + 1]
    with pytest.raises(ssl.SSLError):   # a client that does not trust the self-signed certificate
        http.client.HTTPSConnection("localhost", ports[0], context=ssl.create_default_context(),
                                    timeout=30).request("GET", "/v2/health/live")


def test_the_token_is_checked_before_the_body_is_read(guarded):
    """A POST without the token, its head alone sent (Content-Length 1 MiB): 401 at once and the
    connection closed, counted; the body is not waited for (it would be, for --read_timeout_s)."""
    ports, token, context, _, _, _, _ = guarded
    count = refused(ports[2], "http", context, token)
    status, body = exchange(ports[0], post(b"", length=1 << 20), context, closed=True)
    assert status == 401 and "missing or wrong bearer token" in body, (status, body)
    assert refused(ports[2], "http", context, token) == count + 1


def varint(n: int) -> bytes:
    """`n` as a protobuf varint (a negative one as its 64 bits' two's complement, 10 bytes)."""
    out, n = bytearray(), n & (1 << 64) - 1
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out) + bytes([n])


def field(message, name: str, payload: bytes) -> bytes:
    """The wire bytes of field `name` of protobuf class `message` holding `payload` (length-delimited)."""
    return varint(message.DESCRIPTOR.fields_by_name[name].number << 3 | 2) + varint(len(payload)) + payload


def contents_request(numerical, ids: bytes, shape) -> bytes:
    """A ModelInferRequest's bytes: `numerical` [B, 3] in fp32_contents, categorical_features of
    `shape` with `ids` (packed varints, as written) as its int64_contents."""
    from tritonclient.grpc import service_pb2
    request, tensor = service_pb2.ModelInferRequest, service_pb2.ModelInferRequest.InferInputTensor
    numerical = tensor(name="numerical_features", datatype="FP32", shape=list(numerical.shape),
                       contents=service_pb2.InferTensorContents(fp32_contents=numerical.reshape(-1)))
    categorical = tensor(name="categorical_features", datatype="INT64", shape=list(shape)).SerializeToString() + \
        field(tensor, "contents", field(service_pb2.InferTensorContents, "int64_contents", ids))
    return request(model_name="dlrm", inputs=[numerical]).SerializeToString() + field(request, "inputs", categorical)


def test_values_past_the_shapes_are_refused_before_they_are_built(guarded):
    """With the default bounds (64 MiB), values are counted before they become Python objects. gRPC:
    60M ids for a row's 7 (60 MB of varints, gzipped to ~60 KiB) get RESOURCE_EXHAUSTED, gRPC
    stopping at the model's largest message (90 KiB); 25,600 ids (within it, past the model's 3,072
    values) RESOURCE_EXHAUSTED naming the input; 8 INVALID_ARGUMENT. HTTP: 60 MB of JSON ids gzipped
    to ~60 KiB get 413 before they are parsed. The server's peak memory rises by less than 32 MiB for
    the gRPC ones and 160 MiB for the HTTP one (its body, 57 MiB decompressed), not by the GiBs of
    their values as lists; each is counted; then the largest requests of values (256 rows as gRPC
    contents and as nested JSON) are answered."""
    import grpc
    from tritonclient.grpc import service_pb2
    ports, token, context, cert, data, _, server = guarded
    numerical, categorical, _ = next(request_batches(eval_dataset(data), 256, 256))
    width, infer = categorical.shape[1], grpc_method(ports[1], "ModelInfer", cert=cert)

    def call(numerical, ids: bytes, shape, compression=None) -> bytes:
        return infer(contents_request(numerical, ids, shape), metadata=[("authorization", f"Bearer {token}")],
                     compression=compression, timeout=120)

    def refusal(ids: bytes, compression=None):
        with pytest.raises(grpc.RpcError) as error:
            call(numerical[:1], ids, [1, width], compression)
        return error.value.code(), error.value.details()
    counts = [refused(ports[2], protocol, context, token) for protocol in ("http", "grpc")]
    for ids, compression, code, message, bound in (
            (bytes(60_000_000), grpc.Compression.Gzip, "RESOURCE_EXHAUSTED", "message larger than max", 32),
            (bytes(25_600), None, "RESOURCE_EXHAUSTED", "input 'categorical_features' brings the request to 25603 "
             "values, more than the 3072 of model 'dlrm''s largest (max_batch_size 256)", 32),
            (bytes(width + 1), None, "INVALID_ARGUMENT", "unexpected number of elements for input "
             "'categorical_features' for model 'dlrm'. Expected 7, got 8", 32)):
        (status, details), rise = peak_rise_mib(server.pid, lambda: refusal(ids, compression))
        assert status == grpc.StatusCode[code] and message in details, (status, details)
        assert rise < bound, (len(ids), rise)
    doc = request_json(numerical[:1], categorical[:1])
    doc["inputs"][1]["data"] = "ids"
    text = json.dumps(doc).encode().replace(b'"ids"', b"[" + b"0," * (30_000_000 - 1) + b"0]")
    gzip = zlib.compressobj(wbits=31)
    gzip = gzip.compress(text) + gzip.flush()
    assert len(gzip) < 64 << 10
    (status, body), rise = peak_rise_mib(server.pid, lambda: exchange(ports[0], post(
        gzip, f"Content-Encoding: gzip\r\nAuthorization: Bearer {token}\r\n"), context))
    assert status == 413 and "more than the 7684 of model 'dlrm''s largest (max_batch_size 256)" in body, body
    assert rise < 160, rise
    assert [refused(ports[2], protocol, context, token) for protocol in ("http", "grpc")] == [counts[0] + 1,
                                                                                             counts[1] + 3]
    answer = service_pb2.ModelInferResponse.FromString(call(numerical, b"".join(map(varint, categorical.reshape(
        -1).tolist())), categorical.shape))
    assert dict((o.name, list(o.shape)) for o in answer.outputs)["logits"] == [256, 1]
    doc = request_json(numerical, categorical)
    for tensor, values in zip(doc["inputs"], (numerical, categorical)):
        tensor["data"] = values.tolist()
    status, body = exchange(ports[0], post(json.dumps(doc).encode(), f"Authorization: Bearer {token}\r\n"), context)
    assert status == 200 and json.loads(body)["outputs"][0]["shape"] == [256, 1], body


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_evaluate_accuracy_with_tls_and_the_token(guarded, protocol):
    ports, _, _, cert, data, token_file, _ = guarded
    url = f"localhost:{ports[0 if protocol == 'http' else 1]}"
    common = [*data_flags(data), f"--protocol={protocol}", f"--url={url}", "--batch_size=100", "--max_samples=200",
              f"--tls_ca_file={cert}", "--wait_s=10"]
    result = script("evaluate_accuracy.py", *common, f"--auth_token_file={token_file}")
    assert result.returncode == 0 and f"served dlrm over {protocol}: auc" in result.stdout, result.stderr[-2000:]
    refused = script("evaluate_accuracy.py", *common)
    assert refused.returncode == 2 and "error: " in refused.stderr, refused.stderr[-2000:]


def test_mutual_tls_asks_every_client_for_a_certificate_the_ca_signed(trained, tmp_path):
    """--tls_client_ca_file: HTTPS, gRPC over TLS and /metrics answer a client that presents a
    certificate the CA signed; one presenting none, or one the CA did not sign, fails; and
    evaluate_accuracy.py with --tls_client_cert_file evaluates."""
    from tritonclient.utils import InferenceServerException
    _, _, data, repo = trained
    pem = {name: str(tmp_path / f"{name}.pem") for name in ("server", "server_key", "ca", "ca_key", "client",
                                                             "client_key", "stranger", "stranger_key")}

    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    def self_signed(name, subject, *extra):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", subject, *extra, "-keyout",
                pem[f"{name}_key"], "-out", pem[name])
    self_signed("server", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1")
    self_signed("ca", "/CN=clients' CA")
    self_signed("stranger", "/CN=stranger")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=client", "-keyout", pem["client_key"], "-out",
            str(tmp_path / "client.csr"))
    openssl("x509", "-req", "-in", str(tmp_path / "client.csr"), "-CA", pem["ca"], "-CAkey", pem["ca_key"],
            "-CAcreateserial", "-days", "1", "-out", pem["client"])
    ports, log = free_ports(3), tmp_path / "server.log"
    server = start(log, ports, f"--model_repository={repo}", f"--tls_cert_file={pem['server']}",
                   f"--tls_key_file={pem['server_key']}", f"--tls_client_ca_file={pem['ca']}")
    try:
        ServingClient("http", f"localhost:{ports[0]}", "dlrm", "", pem["server"], pem["client"],
                      pem["client_key"]).wait_ready(120)
        numerical, categorical, _ = next(request_batches(eval_dataset(data), 4, 4))

        def get(port, path, who):
            context = ssl.create_default_context(cafile=pem["server"])
            if who:
                context.load_cert_chain(pem[who], pem[f"{who}_key"])
            connection = http.client.HTTPSConnection("localhost", port, context=context, timeout=30)
            connection.request("GET", path)
            return connection.getresponse().status
        assert get(ports[0], "/v2/health/live", "client") == get(ports[2], "/metrics", "client") == 200
        for who in (None, "stranger"):
            for port, path in ((ports[0], "/v2/health/live"), (ports[2], "/metrics")):
                with pytest.raises(OSError):   # ssl.SSLError or the connection reset: no answer
                    get(port, path, who)
        for protocol, port in (("http", ports[0]), ("grpc", ports[1])):
            url = f"localhost:{port}"
            good = ServingClient(protocol, url, "dlrm", "", pem["server"], pem["client"], pem["client_key"])
            assert good.infer(numerical, categorical)["logits"].shape == (4, 1)
            for who in (None, "stranger"):
                certificate = (pem[who], pem[f"{who}_key"]) if who else ()
                with pytest.raises((InferenceServerException, OSError)):
                    ServingClient(protocol, url, "dlrm", "", pem["server"], *certificate).infer(numerical, categorical)
        common = [*data_flags(data), "--protocol=grpc", f"--url=localhost:{ports[1]}", "--batch_size=100",
                  "--max_samples=200", f"--tls_ca_file={pem['server']}", "--wait_s=10"]
        result = script("evaluate_accuracy.py", *common, f"--tls_client_cert_file={pem['client']}",
                        f"--tls_client_key_file={pem['client_key']}")
        assert result.returncode == 0 and "served dlrm over grpc: auc" in result.stdout, result.stderr[-2000:]
        assert "Traceback" not in log.read_text()
    finally:
        stop_server(server, ports, log)


def test_safety_flag_errors_are_one_line(tmp_path):
    (tmp_path / "empty").write_text("\n")
    for args, message in (
            (["--tls_cert_file=cert.pem"], "error: --tls_cert_file and --tls_key_file go together: give both or "
                                           "neither"),
            ([f"--tls_cert_file={tmp_path / 'no.pem'}", f"--tls_key_file={tmp_path / 'no.key'}"],
             f"error: --tls_cert_file={tmp_path / 'no.pem'}, --tls_key_file={tmp_path / 'no.key'}: cannot load them "
             "(No such file or directory)"),
            ([f"--auth_token_file={tmp_path / 'empty'}"],
             f"error: --auth_token_file={tmp_path / 'empty'}: the token must be one word of printable ASCII "
             "characters"),
            (["--max_request_mb=0"], "error: --max_request_mb must be positive, got 0"),
            (["--tls_client_ca_file=ca.pem"], "error: --tls_client_ca_file: only with --tls_cert_file and "
                                             "--tls_key_file (clients are asked for a certificate over TLS)"),
            (["--frontend=triton", "--auth_token_file=t", "--read_timeout_s=3"],
             "error: --auth_token_file, --read_timeout_s: only with --frontend=native (Triton's frontend has no such "
             "settings here; see docs/deployment.md's 'What the server trusts')")):
        result = script("serve.py", f"--model_repository={tmp_path}", *args)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [message], result.stderr
