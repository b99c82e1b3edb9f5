"""The tiers' settings (TierConfig, from flags or one JSON file) and how the cache budget is
shared among the tables (cache_capacities).

Cache budget (`TierConfig.cache_bytes`): tables whose rows fit an equal share of what is left are
held whole (smallest first, no index); the others split the rest equally, each paying 4 bytes per
table row for its slot index and 4 * D + 24 bytes per cached row (the row, and storage/row_cache.py's);
the shares of the tables of one width form their cache, so hot rows of any of them compete.
"""
import dataclasses
import json
import urllib.parse
from typing import List, Optional, Sequence, Tuple

from storage.row_cache import INDEX_BYTES, POLICIES, SLOT_BYTES
from utils.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """The tiers' settings (one JSON file: `from_file`, or flags)."""
    cache_bytes: int = 1 << 30          # the cache's memory budget over every table
    policy: str = "lru"                 # lru or lfu: which cached rows make room for new ones
    redis_url: Optional[str] = None     # redis://host:port/db: the shared tier (none: no Redis)
    redis_chunk: int = 4096             # keys per MGET, MSET or fill script call
    redis_timeout_s: float = 0.5        # connect and reply timeout
    redis_retry_s: float = 1.0          # first wait before reconnecting (doubles up to 30 s)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ConfigError(f"cache policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("cache_bytes", "redis_chunk", "redis_timeout_s", "redis_retry_s"):
            if not getattr(self, name) >= (0 if name == "cache_bytes" else 1e-9):
                raise ConfigError(f"{name} must be {'>= 0' if name == 'cache_bytes' else 'positive'}, "
                                  f"got {getattr(self, name)}")
        if self.redis_url is not None and not _redis_url_ok(self.redis_url):
            raise ConfigError(f"redis_url must be redis://host:port/db (or unix://path), got {self.redis_url!r}")

    @classmethod
    def from_file(cls, path: str) -> "TierConfig":
        """The settings in JSON file `path` (keys: the fields; the others keep their defaults)."""
        try:
            with open(path) as f:
                values = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: unreadable tier settings ({e})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known) if isinstance(values, dict) else ["(not an object)"]
        if unknown:
            raise ConfigError(f"{path}: unknown tier settings {unknown} (known: {sorted(known)})")
        return cls(**values)


def _redis_url_ok(url: str) -> bool:
    """Whether `url` is redis://host[:port][/db] or unix://path."""
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port
    except ValueError:
        return False
    if parts.scheme == "unix":
        return bool(parts.path)
    return parts.scheme == "redis" and bool(parts.hostname) and (parts.path in ("", "/") or
                                                                 parts.path[1:].isdigit())


def cache_capacities(shapes: Sequence[Tuple[int, int]], budget: int) -> List[Optional[int]]:
    """Per table (rows, D): None where the table is held whole, else its cache's rows (see the
    module's docstring)."""
    order = sorted(range(len(shapes)), key=lambda f: shapes[f][0] * shapes[f][1])
    out: List[Optional[int]] = [None] * len(shapes)
    left = budget
    for k, f in enumerate(order):
        rows, dim = shapes[f]
        share = left // (len(order) - k)
        if rows * dim * 4 <= share:
            left -= rows * dim * 4
            continue
        out[f] = int(min(rows, max(0, share - INDEX_BYTES * rows) // (4 * dim + SLOT_BYTES)))
        left -= share
    return out
