"""Turns a checkpoint (written at any number of ranks) into a Triton model repository.

    python deployment/deploy.py --checkpoint=runs/demo/checkpoints --output=runs/demo/model_repository

The checkpoint's manifest holds the model's shape, so no model flags are needed; a checkpoint of
main.py --model=FILE needs FILE again (--model=FILE: its dense part is FILE's model, with the
hyper-parameters of the checkpoint's signature). Writes the
monolithic SavedModel, the ensemble (sparse + dense SavedModels) and their config.pbtxt files, or,
for tables larger than --max_tables_in_memory_gb, the dense SavedModel and the tables as .npy
files (see deployment/exporter/repository.py and docs/deployment.md). With --delta_from, writes
instead the rows updated since an earlier export and the dense model (deployment/exporter/
deltas.py), for a running server to apply. The last line says what was written.

    python deployment/deploy.py --checkpoint=runs/day1/checkpoints --delta_from=runs/day0/model_repository \
        --output=runs/updates/day1
"""
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

from deployment.exporter.repository import (MEMORY_FRACTION, ExportError, Settings, default_tables_limit,  # noqa: E402
                                            gib, write_delta_repository, write_repository)
from deployment.repository_format import RepositoryError  # noqa: E402
from utils import preemption  # noqa: E402
from utils.errors import CheckpointError  # noqa: E402
from utils.tensorflow_startup import import_tensorflow  # noqa: E402

flags.DEFINE_string("checkpoint", None, "checkpoint directory (a ckpt-<step> or the root holding `latest`)")
flags.DEFINE_string("output", None, "model repository directory to write")
flags.DEFINE_string("model_name", None, "Triton model name (default: dlrm or dcnv2, from the checkpoint's model, or "
                    "the model file's name)")
flags.DEFINE_string("model", None, "the model file (main.py --model=FILE) that wrote the checkpoint, for a model "
                    "file's checkpoint (its dense part is that file's model)")
flags.DEFINE_list("forms", None, "what to export: monolithic (one SavedModel), ensemble (sparse + dense), tables "
                  "(the dense SavedModel and one .npy file per table, streamed from the checkpoint); default "
                  "monolithic,ensemble, or tables when the tables exceed --max_tables_in_memory_gb")
flags.DEFINE_float("max_tables_in_memory_gb", None, "the most GiB of tables the monolithic and ensemble forms may "
                   f"hold (they hold every table in memory); default {MEMORY_FRACTION:g} of physical memory")
flags.DEFINE_integer("max_batch_size", Settings.max_batch_size, "max_batch_size of every model's config.pbtxt")
flags.DEFINE_enum("instance_kind", Settings.instance_kind, ["gpu", "cpu"], "where Triton runs the model instances")
flags.DEFINE_integer("instances", Settings.instances, "model instances per device")
flags.DEFINE_integer("max_queue_delay_us", Settings.max_queue_delay_us, "dynamic batching: longest wait for "
                     "more requests, microseconds")
flags.DEFINE_float("host_table_mb", 4096.0, "embedding tables larger than this (MiB) are placed in host memory "
                   "and gathered on the CPU; the others go with the model's instances")
flags.DEFINE_string("delta_from", None, "write a delta against this earlier export (a model repository or a delta "
                    "written by deploy.py) instead of a full export: the rows updated since it, and the dense model")
flags.DEFINE_bool("skip_checkpoint_checksums", False, "export without verifying the checksums of the checkpoint's "
                  "pieces (faster; a piece changed on disk then goes unnoticed); a checkpoint whose manifest "
                  "records no checksums exports only with it")
flags.DEFINE_bool("overwrite", False, "replace an existing --output (once the new repository is complete)")
flags.mark_flags_as_required(["checkpoint", "output"])
FLAGS = flags.FLAGS


def settings_from_flags() -> Settings:
    for name in ("max_batch_size", "instances"):
        if FLAGS[name].value < 1:
            raise ExportError(f"--{name} must be positive, got {FLAGS[name].value}")
    for name in ("max_queue_delay_us", "host_table_mb", "max_tables_in_memory_gb"):
        if FLAGS[name].value is not None and FLAGS[name].value < 0:
            raise ExportError(f"--{name} must be >= 0, got {FLAGS[name].value}")
    return Settings(FLAGS.max_batch_size, FLAGS.instance_kind, FLAGS.instances, FLAGS.max_queue_delay_us)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)   # not a line per SavedModel file written
    # SIGTERM/SIGINT: one line, exit code 143/130; the export is written under a temporary name, removed
    preemption.exit_on_signal(export, f"the export to {FLAGS.output} unfinished (nothing written there)")


def export():
    """Writes the repository or delta the flags ask for; prints its summary line."""
    given = [f"--{n}" for n in ("forms", "max_tables_in_memory_gb") if FLAGS[n].present]
    if FLAGS.delta_from and given:   # before TensorFlow starts
        print(f"error: {', '.join(given)}: no effect with --delta_from (a delta holds rows and the dense model)",
              file=sys.stderr)
        sys.exit(2)
    import_tensorflow()   # before the exporter loads it, so that its start-up lines honour TF_CPP_MIN_LOG_LEVEL
    try:
        if FLAGS.delta_from:
            start = time.perf_counter()
            info = write_delta_repository(FLAGS.checkpoint, FLAGS.output, FLAGS.delta_from, FLAGS.model_name,
                                          FLAGS.overwrite, verify=not FLAGS.skip_checkpoint_checksums,
                                          model_file=FLAGS.model)
            print(delta_summary(info, FLAGS.output, time.perf_counter() - start) + unverified())
            return
        settings = settings_from_flags()
        limit = default_tables_limit() if FLAGS.max_tables_in_memory_gb is None else \
            int(FLAGS.max_tables_in_memory_gb * 2 ** 30)
        info = write_repository(FLAGS.checkpoint, FLAGS.output, FLAGS.model_name, settings, FLAGS.host_table_mb,
                                FLAGS.forms, FLAGS.overwrite, limit, verify=not FLAGS.skip_checkpoint_checksums,
                                model_file=FLAGS.model)
    except (RepositoryError, CheckpointError) as e:   # ExportError and DeltaError among them
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(summary(info, FLAGS.output, chosen=FLAGS.forms is None, limit=limit) + unverified())


def unverified() -> str:
    """What the summary line adds when the checkpoint's checksums were not verified."""
    return "; checkpoint not verified: --skip_checkpoint_checksums" if FLAGS.skip_checkpoint_checksums else ""


def delta_summary(info: dict, out: str, seconds: float) -> str:
    """One line: what the delta `out` (delta.json content `info`) holds."""
    rows = sum(t["count"] for t in info["tables"])
    size = sum(t[k]["bytes"] for t in info["tables"] for k in ("ids", "rows", "live") if k in t)
    dynamic = [t for t in info["tables"] if t.get("dynamic")]
    evicted = f", {sum(t['evicted'] for t in dynamic):,} ids evicted from {len(dynamic)} dynamic table(s)" \
        if dynamic else ""
    return (f"exported delta {info['base']['step']} -> {info['new']['step']} to {out}: {rows:,} updated rows in "
            f"{len(info['tables'])} table(s){evicted} ({size / 2 ** 20:.1f} MiB) and the dense model, "
            f"{seconds:.1f} s")


def summary(info: dict, out: str, chosen: bool, limit: int) -> str:
    """One line: what the repository `out` (export.json content `info`) holds; `chosen`: its forms
    were chosen by the tables' size against `limit` bytes."""
    parts = [f"SavedModels {', '.join(info['models'])}"]
    if info["ensemble"]:
        parts.append(f"ensemble {info['ensemble']}")
    if info["host_tables"]:
        parts.append(f"tables {info['host_tables']} in host memory")
    files = info["table_files"]
    if files:
        parts.append(f"table files {os.path.join(out, files['directory'])} ({files['tables']} tables, "
                     f"{gib(files['bytes'])})")
    line = (f"exported {info['checkpoint']} (step {info['step']}, written at {info['written_at_ranks']} rank(s)) "
            f"to {out}: {'; '.join(parts)}")
    if chosen and files and files.get("dynamic"):
        line += f"; tables form chosen: table {files['dynamic'][0]} is dynamic (raw 64-bit ids)"
    elif chosen and files:
        line += f"; tables form chosen: the tables take more than --max_tables_in_memory_gb ({gib(limit)})"
    return line


if __name__ == "__main__":
    app.run(main)
