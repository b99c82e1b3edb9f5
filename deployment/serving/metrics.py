"""Prometheus metrics of the native serving frontend (native.py), served as text
(exposition format 0.0.4) at GET /metrics on their own port, as guarded_http.py guards (TLS and
the bearer token when given).

Every metric is named dlrm_* and labelled with the served model's name:

- dlrm_inference_requests_total{protocol, status}: inference requests answered, status success,
  refused (a bad request: INVALID_ARGUMENT, NOT_FOUND; and any request or connection refused
  before it reached the model: malformed, too large, without the token, over the connection
  cap; gRPC: any call cancelled before its message arrived, as gRPC cancels one too large) or
  failed (the model's error: INTERNAL);
- dlrm_inference_samples_total: the batch sizes of the successful requests, summed;
- dlrm_inference_request_duration_seconds{protocol}: a histogram of the time the successful
  requests took in ServedModel.run (checks, decoding, the model);
- from the `stats` callable, read at each scrape: the served version's step and the lookup tiers'
  counts (STATS). The tiers count from their making: a full export served makes new ones, and
  their counters restart from 0 (as after a restart, which Prometheus' rate() allows for).
"""
import bisect
import threading
from typing import Callable, Optional

from deployment.serving.guarded_http import GuardedHandler, Safeguards, http_serving

BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)   # seconds; +Inf after them
PROTOCOLS = ("http", "grpc")
STATUSES = ("success", "refused", "failed")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# (part, key) of a stats dict -> the metric dlrm_<part>_<key> (+ _total for counters): type, help
STATS = {
    ("model", "version_step"): ("gauge", "Training step of the served model version."),
    ("cache", "lookups"): ("counter", "Ids looked up in the lookup tiers' cache (every feature's, as requested)."),
    ("cache", "hits"): ("counter", "Ids found in the cache (or in a table it holds whole)."),
    ("cache", "bytes"): ("gauge", "Bytes the cache holds (its rows and the tables it holds whole)."),
    ("cache", "rows"): ("gauge", "Rows in the cache (of the tables not held whole)."),
    ("store", "rows_read"): ("counter", "Rows read from the table files (the store)."),
    ("redis", "lookups"): ("counter", "Ids the cache missed, asked of Redis (unique per request)."),
    ("redis", "hits"): ("counter", "Ids found in Redis."),
    ("redis", "up"): ("gauge", "1 while Redis answers, 0 while it is unreachable."),
    ("redis", "outages"): ("counter", "Times Redis became unreachable (at start-up included)."),
    ("redis", "fills_dropped"): ("counter", "Requests' rows read from the store not written to Redis: too many waited."),
    ("redis", "nonfinite"): ("counter", "Values in Redis holding NaN or infinity, not served (read from the store)."),
}


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


class Metrics:
    """Counts of the inference requests of model `model` (thread-safe), rendered with what
    `stats() -> {"model": {"version_step"}, "cache": {...}, "store": {...}, "redis": {...}}`
    (keys in STATS; a part or key missing: its metric is not rendered) returns at each scrape."""

    def __init__(self, model: str, stats: Optional[Callable[[], dict]] = None):
        self.label = f'model="{_escape(model)}"'
        self.stats = stats
        self._lock = threading.Lock()
        self._requests = {p: dict.fromkeys(STATUSES, 0) for p in PROTOCOLS}
        self._samples = 0
        self._buckets = {p: [0] * (len(BUCKETS) + 1) for p in PROTOCOLS}   # per bucket, not cumulative
        self._seconds = dict.fromkeys(PROTOCOLS, 0.0)

    def observe(self, protocol: str, status: str, seconds: float = 0.0, batch: int = 0):
        """One request over `protocol` (PROTOCOLS) answered with `status` (STATUSES); a successful
        one took `seconds` for `batch` samples."""
        bucket = bisect.bisect_left(BUCKETS, seconds)   # the first bound >= seconds: le semantics
        with self._lock:
            self._requests[protocol][status] += 1
            if status == "success":
                self._samples += batch
                self._buckets[protocol][bucket] += 1
                self._seconds[protocol] += seconds

    def render(self) -> str:
        """The metrics in Prometheus' text format."""
        with self._lock:
            requests = {p: dict(counts) for p, counts in self._requests.items()}
            samples, buckets, seconds = self._samples, {p: list(b) for p, b in self._buckets.items()}, \
                dict(self._seconds)
        lines = []

        def family(name: str, kind: str, help: str, samples):
            lines.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{suffix}{{{self.label}{labels}}} {value}" for suffix, labels, value in samples)

        family("dlrm_inference_requests_total", "counter", "Inference requests answered, by protocol and status "
               "(refused: a bad request; failed: the model's error).",
               [("", f',protocol="{p}",status="{s}"', n) for p in PROTOCOLS for s, n in requests[p].items()])
        family("dlrm_inference_samples_total", "counter", "Samples (batch sizes summed) of the successful requests.",
               [("", "", samples)])
        histogram = []
        for p in PROTOCOLS:
            total = 0
            for bound, count in zip((*map(repr, BUCKETS), "+Inf"), buckets[p]):
                total += count
                histogram.append(("_bucket", f',protocol="{p}",le="{bound}"', total))
            histogram += [("_sum", f',protocol="{p}"', repr(seconds[p])), ("_count", f',protocol="{p}"', total)]
        family("dlrm_inference_request_duration_seconds", "histogram",
               "Seconds the successful requests took in the model server (checks, decoding, the model).", histogram)
        stats = self.stats() if self.stats else {}
        for (part, key), (kind, help) in STATS.items():
            if key in stats.get(part, {}):
                family(f"dlrm_{part}_{key}{'_total' if kind == 'counter' else ''}", kind, help,
                       [("", "", int(stats[part][key]))])
        return "\n".join(lines) + "\n"

    def serving(self, address: str, port: int, safeguards: Safeguards = Safeguards()):
        """A context: GET /metrics on `port` of `address` answers `render()` while it runs."""
        return http_serving(type("Handler", (_Handler,), {"metrics": self}), address, port, "metrics", safeguards)


class _Handler(GuardedHandler):
    metrics: Metrics = None

    def do_GET(self):
        if self.path.split("?", 1)[0] != "/metrics":
            return self.refuse(404, "Not Found")
        self.reply(200, self.metrics.render().encode(), {"Content-Type": CONTENT_TYPE})

