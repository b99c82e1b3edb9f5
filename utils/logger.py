"""Run logging: progress lines on stdout, a JSON-lines log and TensorBoard scalars."""
import json
import os
import sys
import time
from typing import Optional


def tensorboard_dir(log_path: str) -> str:
    """Where TensorBoard scalars go for a JSON log at `log_path`."""
    return os.path.splitext(log_path)[0] + "_tb"


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# A dynamic table's figures (DistributedEmbedding.dynamic_stats) on the progress line: each
# table's, for up to SHOWN_TABLES tables; for more, their sums and the SHOWN_TABLES tables that
# refused and evicted the most ids (every table's figures stay in the log's records).
DYNAMIC_COUNTS = ("live", "admitted", "evicted", "refused")
SHOWN_TABLES = 3


class RunLogger:
    """Writes `kind`-tagged JSON records to `log_path` (if given), scalars to TensorBoard, and
    human-readable lines to `out`; a logger that is not `enabled` (ranks other than 0) is silent."""

    def __init__(self, log_path: str = "", out=None, enabled: bool = True):
        self.out = out or sys.stdout
        self.enabled = enabled
        self._file = None
        self._tb = None
        if log_path and enabled:
            os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
            self._file = open(log_path, "a")
            import tensorflow as tf
            self._tb = tf.summary.create_file_writer(tensorboard_dir(log_path))

    def print(self, line: str):
        if self.enabled:
            print(line, file=self.out, flush=True)

    def record(self, kind: str, step: Optional[int] = None, **fields):
        """One JSON line; numeric fields also become TensorBoard scalars `<kind>/<field>`."""
        if self._file:
            entry = {"kind": kind, "time": round(time.time(), 3)}
            if step is not None:
                entry["step"] = int(step)
            entry.update(fields)
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()
        if self._tb and step is not None:
            import tensorflow as tf
            with self._tb.as_default():
                for key, value in fields.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        tf.summary.scalar(f"{kind}/{key}", value, step=int(step))
            self._tb.flush()

    def progress(self, step: int, total: int, loss: float, step_seconds: float, batch_size: int, lr: float,
                 store: Optional[dict] = None, heads: Optional[dict] = None):
        """The progress line, and a `step` record; `store`: the embedding store's figures
        (DistributedEmbedding.store_stats): the disk tier's, if it has tables on disk, and each
        dynamic table's counts (`<table>/live`, `/admitted`, `/evicted`, `/refused`; see
        SHOWN_TABLES), each
        sequence's `<layer>/<feature>/truncated` (shown as "truncated ids"); `heads`: a
        model with heads, each head's loss by "<head>_loss" (shown after the loss, their sum)."""
        throughput = batch_size / step_seconds
        eta = (total - step) * step_seconds
        each = "".join(f" | {key[:-len('_loss')]} loss {value:.5f}" for key, value in (heads or {}).items())
        line = (f"step {step}/{total} | eta {_duration(eta)} | loss {loss:.5f}{each} | "
                f"step {1000 * step_seconds:.1f} ms | {throughput:,.0f} samples/s | lr {lr:.6g}")
        tables = {}
        for key, value in (store or {}).items():
            table, _, count = key.rpartition("/")
            if table and count in DYNAMIC_COUNTS:
                tables.setdefault(table, {})[count] = value
        if len(tables) <= SHOWN_TABLES:
            for table, counts in tables.items():
                line += " | " + f"{table}: " + ", ".join(f"{counts[c]:,} {c}" for c in DYNAMIC_COUNTS)
        elif tables:   # their sums, and the tables short of rows first
            line += f" | {len(tables)} dynamic tables: " + ", ".join(
                f"{sum(t.get(c, 0) for t in tables.values()):,} {c}" for c in DYNAMIC_COUNTS)
            worst = sorted(tables, key=lambda t: (-tables[t].get("refused", 0), -tables[t].get("evicted", 0), t))
            worst = [t for t in worst[:SHOWN_TABLES] if tables[t].get("refused", 0) or tables[t].get("evicted", 0)]
            if worst:
                line += " | most refused and evicted: " + ", ".join(
                    f"{t} {tables[t].get('refused', 0):,}/{tables[t].get('evicted', 0):,}" for t in worst)
        truncated = {key[:-len("/truncated")]: value for key, value in (store or {}).items()
                     if key.endswith("/truncated")}
        if truncated:
            line += " | truncated ids: " + ", ".join(f"{name} {n:,}" for name, n in truncated.items())
        if store and "cache_hit_rate" in store:
            line += (f" | cache hits {100 * store['cache_hit_rate']:.1f}% | disk read "
                     f"{store['store_mb_read_per_step']:.3g} MB/step, written {store['store_mb_written_per_step']:.3g}"
                     f" MB/step | waited {store['store_wait_ms_per_step']:.1f} ms/step")
        self.print(line)
        self.record("step", step, loss=loss, **(heads or {}), step_ms=1000 * step_seconds,
                    samples_per_s=throughput, lr=lr, **(store or {}))

    def close(self):
        if self._file:
            self._file.close()
        if self._tb:
            self._tb.close()
