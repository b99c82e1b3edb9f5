"""The Redis tier, optional, shared by several servers or instances: a real Redis server
(redis://host:port/db); key `<model>:<export run>:<export step>:<feature>:<id>`, value the version
it was written at (_TAG_BYTES: the step in 16 hex digits, 8 bytes of a hash of the run) and the
row's float32 bytes.

Versions: in Redis a lookup takes only values written at the version its store holds (other
servers sharing it may serve older or newer ones); values are written where a key is absent or
holds an older version's (a smaller step), so a fill never overwrites an update. After an update
Redis holds the rows it changed at the new version; the others are read from the store once more
and rewritten at it as requests ask for them.

Redis down, at start-up or later: lookups go on from the cache and the store; one log line says
so, one says when it is back. Reconnection is tried on a lookup at most every `redis_retry_s`
(doubling to 30 s). Rows an update could not write to Redis stay there at their older version,
which servers at the new one do not take.
"""
import hashlib
import queue
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from deployment.repository_format import Version
from deployment.serving.tiers.config import TierConfig

_MAX_RETRY_S = 30.0
_FILLS_WAITING = 64      # requests' fills queued for Redis at most; more are dropped (counted)
_TAG_BYTES = 24          # a Redis value's version: its step as 16 hex digits, 8 bytes of its run's hash
# Sets each key to its value where it is absent or holds an older version's (a smaller step): a
# fill never overwrites an update, a late update never overwrites a newer one.
_SET_NEWER = """for i, key in ipairs(KEYS) do
  local held = tonumber(redis.call('GETRANGE', key, 0, 15), 16) or -1
  if held < tonumber(string.sub(ARGV[i], 1, 16), 16) then redis.call('SET', key, ARGV[i]) end
end
return 0"""


def _tag(version: Version) -> bytes:
    """The first _TAG_BYTES bytes of a Redis value written at `version`."""
    return b"%016x" % version.step + hashlib.blake2b(version.run.encode(), digest_size=8).digest()


class RedisTier:
    """Rows in a Redis server shared by servers (see the module's docstring). Every method answers
    None / does nothing while the server is down; `log` gets one line when it goes down and one
    when it is back."""

    def __init__(self, url: str, prefix: str, config: TierConfig, log: Callable[[str], None]):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        self._errors = (redis.RedisError, OSError)
        self.url, self._prefix, self._chunk, self._log = url, prefix, config.redis_chunk, log
        self._client = redis.Redis.from_url(url, socket_timeout=config.redis_timeout_s,
                                            socket_connect_timeout=config.redis_timeout_s,
                                            retry=Retry(NoBackoff(), 1))   # a pooled connection a restart broke
        self._set_newer = self._client.register_script(_SET_NEWER)
        self._first_wait = self._wait = config.redis_retry_s
        self._lock, self._count_lock = threading.Lock(), threading.Lock()
        self.up, self._next_try = False, 0.0
        self.downs = self.fills_dropped = self.nonfinite = 0
        if not self._reconnect():
            self.downs = 1
            self._log(f"{url}: Redis unreachable at start-up; answering from the cache and the store, "
                      f"reconnecting every {self._wait:g} s or more")
        self._fills: queue.Queue = queue.Queue(_FILLS_WAITING)
        self._filler = threading.Thread(target=self._send_fills, name="redis-fills", daemon=True)
        self._filler.start()

    def keys(self, feature: int, ids: np.ndarray) -> list:
        """The keys of a feature's rows `ids` [n]: [n] bytes."""
        return np.strings.add(np.bytes_(f"{self._prefix}:{feature}:".encode()), ids.astype("S20")).tolist()

    def _chunks(self, n: int) -> range:
        return range(0, n, self._chunk)

    def _run(self, commands: Callable) -> Optional[list]:
        """`commands(pipeline)` queued and sent at once; their replies, or None if Redis is down."""
        if not self.up and not self._try_reconnect():
            return None
        try:
            pipe = self._client.pipeline(transaction=False)
            commands(pipe)
            return pipe.execute()
        except self._errors as e:
            self._down(e)
            return None

    def get(self, requests: Sequence[Tuple[list, int]], version: Version) -> Optional[List[Tuple[np.ndarray, np.ndarray]]]:
        """Per request (keys [n], D): (found [n] bool, the rows found [found, D] float32), found =
        held at `version` and finite (values of other versions or widths are not; values not finite
        are not, and counted in `nonfinite`). One round trip for all; None if Redis is down."""
        keys = [k for request_keys, _ in requests for k in request_keys]
        replies = self._run(lambda pipe: [pipe.mget(keys[s:s + self._chunk]) for s in self._chunks(len(keys))])
        if replies is None:
            return None
        values = [v for reply in replies for v in reply]
        tag = np.frombuffer(_tag(version), np.uint8)
        out, start = [], 0
        for request_keys, dim in requests:
            part, width = values[start:start + len(request_keys)], _TAG_BYTES + 4 * dim
            start += len(request_keys)
            found = np.fromiter((v is not None and len(v) == width for v in part), bool, len(part))
            block = np.frombuffer(b"".join(v for v, ok in zip(part, found) if ok), np.uint8).reshape(-1, width)
            rows = block[:, _TAG_BYTES:].copy().view(np.float32)
            current = (block[:, :_TAG_BYTES] == tag).all(1)
            finite = np.isfinite(rows).all(1)
            if not finite[current].all():   # a miss: read from the store instead, counted
                with self._count_lock:
                    self.nonfinite += int((current & ~finite).sum())
            found[found] = current & finite
            out.append((found, rows[current & finite]))
        return out

    def set(self, blocks: Sequence[Tuple[int, np.ndarray, np.ndarray]], version: Version):
        """Per block (feature, ids [n], rows [n, D]): the rows at `version`, written where a key is
        absent or holds an older version's. One round trip for all; nothing if Redis is down."""
        tag = np.frombuffer(_tag(version), np.uint8)
        keys, values = [], []
        for feature, ids, rows in blocks:
            data = np.empty((len(rows), _TAG_BYTES + 4 * rows.shape[1]), np.uint8)
            data[:, :_TAG_BYTES] = tag
            data[:, _TAG_BYTES:] = np.ascontiguousarray(rows, np.float32).view(np.uint8)
            keys += self.keys(feature, ids)
            values += data.view(f"V{data.shape[1]}").reshape(-1).tolist()
        self._run(lambda pipe: [self._set_newer(keys=keys[s:s + self._chunk], args=values[s:s + self._chunk],
                                                client=pipe) for s in self._chunks(len(keys))])

    def fill(self, blocks: Sequence[Tuple[int, np.ndarray, np.ndarray]], version: Version):
        """`set`, sent by a thread of its own (a request does not wait for it); dropped while
        _FILLS_WAITING others wait."""
        try:
            self._fills.put_nowait((blocks, version))
        except queue.Full:
            with self._lock:
                self.fills_dropped += 1

    def _send_fills(self):
        while True:
            fill = self._fills.get()
            try:
                if fill is None:
                    return
                self.set(*fill)
            finally:
                self._fills.task_done()

    def drain(self):
        """Returns once the fills queued so far are sent."""
        self._fills.join()

    def _down(self, error):
        with self._lock:
            if self.up:
                self.up, self.downs = False, self.downs + 1
                self._next_try, self._wait = time.monotonic() + self._first_wait, self._first_wait
                self._log(f"{self.url}: Redis unreachable ({error}); answering from the cache and the store, "
                          f"reconnecting every {self._first_wait:g} s or more")

    def _try_reconnect(self) -> bool:
        """Whether Redis is up again: one thread tries, once the back-off has passed."""
        if time.monotonic() < self._next_try or not self._lock.acquire(blocking=False):
            return False
        try:
            if self.up or time.monotonic() < self._next_try:
                return self.up
            if self._reconnect():
                self._log(f"{self.url}: Redis reachable again")
                return True
            self._next_try = time.monotonic() + self._wait
            self._wait = min(2 * self._wait, _MAX_RETRY_S)
            return False
        finally:
            self._lock.release()

    def _reconnect(self) -> bool:
        """Pings; sets `up`."""
        try:
            self._client.ping()
        except self._errors:
            self._next_try = time.monotonic() + self._wait
            return False
        self.up, self._wait = True, self._first_wait
        return True

    def close(self):
        self._fills.put(None)
        self._filler.join()
        self._client.close()
