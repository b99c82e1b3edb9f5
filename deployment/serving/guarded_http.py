"""What the serving frontends check before a request reaches the model (docs/deployment.md, "What
the server trusts"): `Safeguards` (TLS, a bearer token, bounds and a read timeout) and an HTTP
server keeping them (`http_serving`), for native.py's KServe v2 endpoint and metrics.py's /metrics.

The HTTP server runs each connection on a thread of its own, at most `max_connections` at once (one
over it gets 503 and is closed at once, unread). A request's head (request line and headers, at
most `max_header_bytes`) and body (its Content-Length, at most `max_request_bytes`) must arrive
within `read_timeout_s` of its first byte being awaited (the TLS handshake included), else the
connection is dropped. With a token, every path but the handler's `open_paths` needs
`Authorization: Bearer <token>`, checked once the head is read (without it: 401, the body unread,
the connection closed). Refusals are answered with a status and a JSON {"error": message},
counted by the server's `on_refused()`, and close the connection when its body is left unread.
"""
import dataclasses
import hmac
import http.server
import json
import socket
import ssl
import threading
import time
from contextlib import contextmanager
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class Safeguards:
    """A frontend's TLS, token and bounds (serve.py's flags; the defaults are those of no flag)."""
    token: Optional[str] = None            # bearer token the requests must carry; None: none needed
    tls_cert_file: Optional[str] = None    # PEM certificate (chain) and its key: TLS; None: plain TCP
    tls_key_file: Optional[str] = None
    max_request_bytes: int = 64 << 20      # a request's body after decompression (gRPC: a message)
    max_header_bytes: int = 64 << 10       # a request's line and headers (gRPC: its metadata)
    max_connections: int = 64              # per HTTP endpoint: connections; gRPC: calls in flight
    read_timeout_s: float = 30.0           # a request not received whole by then: connection dropped
    tls_client_ca_file: Optional[str] = None   # PEM CA certificate(s): with TLS, every client must present a
    #                                            certificate one of them signed (mutual TLS); None: none asked

    def ssl_context(self) -> Optional[ssl.SSLContext]:
        """The server's TLS context (None without TLS); ssl.SSLError or OSError for files it cannot load."""
        if not self.tls_cert_file:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        if self.tls_client_ca_file:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cafile=self.tls_client_ca_file)
        return context

    def authorized(self, authorization: Optional[str]) -> bool:
        """Whether an Authorization header (gRPC: `authorization` metadata) value carries the token."""
        if self.token is None:
            return True
        return hmac.compare_digest((authorization or "").encode("latin-1", "replace"),
                                   f"Bearer {self.token}".encode())


class _HeadTooLarge(Exception):
    pass


class _BoundedLines:
    """readline() of `rfile`, at most `budget` bytes in all (then _HeadTooLarge): a request's head."""

    def __init__(self, rfile, budget: int):
        self.rfile, self.budget = rfile, budget

    def readline(self, limit: int = -1) -> bytes:
        line = self.rfile.readline(self.budget + 1 if limit < 0 else min(limit, self.budget + 1))
        self.budget -= len(line)
        if self.budget < 0:
            raise _HeadTooLarge
        return line


class GuardedHandler(http.server.BaseHTTPRequestHandler):
    """A handler whose do_GET / do_POST find the token checked (but on `open_paths`) and then the
    request's body read in `self.body`; `reply` answers, `refuse` answers an error and counts it."""
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    open_paths: tuple = ()   # paths served without the token
    body: bytes = b""

    def log_message(self, *args):   # no line per request
        pass

    def setup(self):
        self.timeout = self.server.safeguards.read_timeout_s   # each read; the server's deadline bounds them all
        self.server.arm(self)
        if self.server.ssl_context is not None:
            self.request.settimeout(self.timeout)
            self.request = self.server.ssl_context.wrap_socket(self.request, server_side=True,
                                                               do_handshake_on_connect=False)
            self.request.do_handshake()
        super().setup()

    def reply(self, status: int, body: bytes = b"", headers: Optional[dict] = None):
        head = [f"HTTP/1.1 {status} {self.responses.get(status, ('',))[0]}", f"Content-Length: {len(body)}",
                *(f"{k}: {v}" for k, v in (headers or {"Content-Type": "application/json"}).items())]
        if self.close_connection:
            head.append("Connection: close")
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)   # one write: no Nagle wait

    def refuse(self, status: int, message: str, close: bool = False, headers: Optional[dict] = None):
        """Answers `status` with {"error": message} and counts a refusal; `close`: then closes the connection."""
        self.close_connection = self.close_connection or close
        self.server.on_refused()
        self.reply(status, json.dumps({"error": message}).encode(), dict({"Content-Type": "application/json"},
                                                                       **(headers or {})))

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None):
        """http.server's refusals of a malformed head (400, 414, 431, 505, 501), as refuse's."""
        self.request_version = getattr(self, "request_version", None) or "HTTP/1.1"
        self.refuse(code, message or self.responses.get(code, ("",))[0], close=True)

    def handle_one_request(self):
        try:
            self.server.arm(self)
            head, self.rfile = self.rfile, _BoundedLines(self.rfile, self.server.safeguards.max_header_bytes)
            try:
                self.raw_requestline = self.rfile.readline(65537)
                if not self.raw_requestline:
                    self.close_connection = True
                    return
                if not self.parse_request():   # it has answered
                    return
            except _HeadTooLarge:
                return self.send_error(431, f"request line and headers exceed "
                                            f"{self.server.safeguards.max_header_bytes} bytes")
            finally:
                self.rfile = head
            path = self.path.split("?", 1)[0].rstrip("/")
            if path not in self.open_paths and not self.server.safeguards.authorized(self.headers.get("Authorization")):
                return self.refuse(401, "missing or wrong bearer token (Authorization: Bearer <token>)", close=True,
                                   headers={"WWW-Authenticate": "Bearer"})
            if not self._read_body():
                return
            self.server.disarm(self)
            method = getattr(self, f"do_{self.command}", None)
            if method is None:
                return self.refuse(501, f"unsupported method {self.command!r}")
            method()
            self.wfile.flush()
        except (TimeoutError, ConnectionError, ssl.SSLError):
            self.close_connection = True

    def _read_body(self) -> bool:
        """Reads the body into self.body; False (having answered, or the client gone) if it cannot."""
        self.body = b""
        if self.headers.get("Transfer-Encoding"):
            self.refuse(411, "Transfer-Encoding is not supported: send Content-Length", close=True)
            return False
        if len(self.headers.get_all("Content-Length") or ()) > 1:
            self.refuse(400, "more than one Content-Length", close=True)
            return False
        length = self.headers.get("Content-Length")
        if length is None:
            if self.command == "POST":
                self.refuse(411, "a POST needs Content-Length", close=True)
                return False
            return True
        length = length.strip()
        if not (length.isascii() and length.isdigit()):
            self.refuse(400, f"Content-Length must be a non-negative integer, got {length[:40]!r}", close=True)
            return False
        limit = self.server.safeguards.max_request_bytes
        if int(length) > limit:
            self.refuse(413, f"request body of {int(length)} bytes exceeds {limit} bytes", close=True)
            return False
        self.body = self.rfile.read(int(length))
        if len(self.body) < int(length):   # the client went away, or its time ran out
            self.close_connection = True
            return False
        return True


class _GuardedServer(http.server.ThreadingHTTPServer):
    """ThreadingHTTPServer with at most max_connections connections, each request's reading
    bounded in time (arm/disarm; a reaper thread shuts the connections whose time ran out)."""
    daemon_threads = True
    request_queue_size = 128   # the listen backlog: connections beyond it wait (SYN retries), not refused

    def __init__(self, address, handler, safeguards: Safeguards, on_refused: Callable[[], None]):
        super().__init__(address, handler)
        self.safeguards, self.on_refused = safeguards, on_refused
        self.ssl_context = safeguards.ssl_context()
        self._slots = threading.BoundedSemaphore(safeguards.max_connections)
        self._deadlines, self._lock, self._closed = {}, threading.Lock(), threading.Event()
        threading.Thread(target=self._reap, name="read-deadlines", daemon=True).start()

    def arm(self, handler):
        with self._lock:
            self._deadlines[handler.client_address] = (time.monotonic() + self.safeguards.read_timeout_s, handler)

    def disarm(self, handler):
        with self._lock:
            self._deadlines.pop(handler.client_address, None)

    def _reap(self):
        while not self._closed.wait(min(0.25, self.safeguards.read_timeout_s / 4)):
            now = time.monotonic()
            with self._lock:
                late = [(k, h) for k, (deadline, h) in self._deadlines.items() if deadline < now]
                for k, _ in late:
                    del self._deadlines[k]
            for _, h in late:
                try:   # the plain socket's shutdown (not SSLSocket's, which would drop its TLS state under a reader)
                    socket.socket.shutdown(h.request, socket.SHUT_RDWR)
                except OSError:
                    pass

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.on_refused()
            if self.ssl_context is None:
                body = json.dumps({"error": f"more than {self.safeguards.max_connections} connections"}).encode()
                try:
                    request.setblocking(False)
                    request.send(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: "
                                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                except OSError:
                    pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request, client_address):
        try:
            self.RequestHandlerClass(request, client_address, self)
        finally:
            with self._lock:
                self._deadlines.pop(client_address, None)

    def handle_error(self, request, client_address):   # a connection that failed (a reset, a bad handshake)
        pass

    def server_close(self):
        self._closed.set()
        super().server_close()


@contextmanager
def http_serving(handler, address: str, port: int, name: str, safeguards: Safeguards,
                 on_refused: Callable[[], None] = lambda: None):
    """Serves `handler` (a GuardedHandler class) on `port` of `address` as `safeguards` say while
    the block runs; `on_refused()` is called for each request or connection refused."""
    server = _GuardedServer((address, port), handler, safeguards, on_refused)
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
