"""TensorFlow's process-wide settings, the run's profiler and its tables' plan (placement and storage
tiers): the reference's --cpu, --inter_op_parallelism, --intra_op_parallelism, --tfdata_debug,
--profiler_start_step/--profiled_rank and --cpu_offloading_threshold_gb, the placement flags and
--embedding_memory_budget_gb, and the compute dtype of --amp and --loss_scale."""
import os
from typing import Optional

from parallel_embedding.planner import BudgetError, Plan, TierOptions, plan_tables
from run.config import RunConfig
from utils.errors import ConfigError
from utils.logger import tensorboard_dir

PROFILED_STEPS = 100   # as the reference


def compute_dtype(cfg: RunConfig):
    """The dense part's compute dtype: float32, or under --amp ranking.precision.amp_dtype()
    (float16 on a GPU, bfloat16 on the CPU). --loss_scale without float16 is a ConfigError."""
    import ranking.precision   # its amp_dtype read when called (tests pose as a GPU)
    import tensorflow as tf
    dtype = ranking.precision.amp_dtype() if cfg.runtime.amp else tf.float32
    if cfg.runtime.loss_scale is not None and dtype != tf.float16:
        raise ConfigError(f"--loss_scale applies to float16 AMP (--amp on a GPU); this run computes in "
                          f"{dtype.name}, which needs no loss scaling")
    return dtype


def configure_tensorflow(cpu: bool = False, inter_op: Optional[int] = None, intra_op: Optional[int] = None,
                         tfdata_debug: bool = False):
    """Applies the settings TensorFlow reads once, when its runtime starts. Call it before any
    TensorFlow op (main.py: before the collectives, whose first op starts TensorFlow and which
    pick a GPU); later, TensorFlow refuses the thread counts with a RuntimeError.

    cpu: hides every GPU from CUDA (so from TensorFlow and Horovod). inter_op, intra_op: thread
    pool sizes (None or 0: TensorFlow's choice). Raises ConfigError for a negative count."""
    for name, value in (("inter_op_parallelism", inter_op), ("intra_op_parallelism", intra_op)):
        if value is not None and value < 0:
            raise ConfigError(f"--{name} must be >= 0 (0: TensorFlow's choice), got {value}")
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    import tensorflow as tf
    if cpu and tf.config.list_physical_devices("GPU"):
        raise RuntimeError("--cpu came too late: CUDA had started and sees GPUs")
    if inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    if intra_op:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op)
    if tfdata_debug:
        tf.data.experimental.enable_debug_mode()


def embedding_plan(cfg: RunConfig, world_size: int, slots: int, on_gpu: bool) -> Plan:
    """The tables' plan of the flags at `world_size` ranks: one planner call
    (parallel_embedding.planner.plan_tables) with the placement flags and the tiers of
    `tier_options`. Raises ConfigError (one line) for a budget below a rank's smallest plan, or
    tables on disk without --embedding_store_path."""
    p, budget = cfg.parallelism, cfg.storage.embedding_memory_budget_gb
    try:
        plan = plan_tables(cfg.data.cardinalities, cfg.model.embedding_dims, world_size, p.dist_strategy,
                           p.column_slice_threshold, p.row_slice_threshold, p.data_parallel_threshold,
                           tiers=tier_options(cfg, slots, on_gpu), dynamic=cfg.dynamic_tables)
    except BudgetError as e:
        raise ConfigError(f"--embedding_memory_budget_gb={budget}: {e}") from None
    disk = [(r, f) for r, f, t in plan.tiers if t.kind == "disk"]
    if disk and not cfg.storage.embedding_store_path:
        raise ConfigError(f"--embedding_memory_budget_gb={budget} puts {len(disk)} table shard(s) on disk (feature "
                          f"{disk[0][1]} on rank {disk[0][0]} first): give --embedding_store_path, a directory for "
                          "their files")
    return plan


def tier_options(cfg: RunConfig, slots: int, on_gpu: bool) -> TierOptions:
    """The storage tiers of the flags (`slots` optimizer slots per parameter):
    --embedding_memory_budget_gb puts the largest tables of a rank over it on disk, with caches for
    the ids of the batches in flight (two training batches, the one in its step and the next,
    staged, and two evaluation batches while training evaluates); on a GPU,
    --cpu_offloading_threshold_gb puts the largest tables left in memory in host memory."""
    budget = cfg.storage.embedding_memory_budget_gb
    threshold = cfg.storage.cpu_offloading_threshold_gb
    rows = batch_rows(cfg)
    return TierOptions(slots, None if budget is None else max(1, int(budget * 2 ** 30)),
                       [2 * rows * (hotness or 1) for hotness in cfg.data.max_hotness],
                       threshold * 2 ** 30 if threshold is not None and on_gpu else None)


def batch_rows(cfg: RunConfig) -> int:
    """The samples whose ids a disk tier's caches hold at once, before doubling for the batch
    staged ahead: in training a training and an evaluation batch, else the largest batch."""
    batch, valid_batch = cfg.training.batch_size, cfg.evaluation.valid_batch_size
    return {"train": batch + valid_batch, "eval": valid_batch,
            "inference": max(cfg.evaluation.inference_batch_sizes)}[cfg.mode]


def offloading_line(threshold_gb: int, table_bytes: int, rank: int, on_gpu: bool) -> str:
    """What --cpu_offloading_threshold_gb means for this rank's `table_bytes` of embedding tables
    (parameters, as the reference counts them): on a GPU, tables above the threshold go to host
    memory (`tier_options`; the plan's tier column says which)."""
    size = f"rank {rank}'s tables take {table_bytes / 2 ** 30:.3g} GiB"
    if not on_gpu:
        return f"--cpu_offloading_threshold_gb={threshold_gb}: {size}, all in host memory already (no GPU)"
    if table_bytes > threshold_gb * 2 ** 30:
        return (f"--cpu_offloading_threshold_gb={threshold_gb}: {size}; the largest go to host memory until those "
                "left in GPU memory take at most the threshold (the plan's tier column)")
    return f"--cpu_offloading_threshold_gb={threshold_gb}: {size}, all in GPU memory (at most the threshold)"


class StepProfiler:
    """--profiler_start_step: a TensorFlow profile (TensorBoard's Profile tab; a .xplane.pb file
    under <log dir>/plugins/profile/) of training steps [start, start + PROFILED_STEPS), cut at
    the end of training, on --profiled_rank only."""

    def __init__(self, cfg: RunConfig, rank: int, first_step: int, total_steps: int):
        self.start = self.stop = None
        settings = cfg.runtime
        if settings.profiler_start_step is None:
            return
        if not first_step <= settings.profiler_start_step < total_steps:
            raise ConfigError(f"--profiler_start_step={settings.profiler_start_step} is not a step of this run "
                              f"(it trains steps {first_step}..{total_steps - 1})")
        if rank == settings.profiled_rank:
            self.start = settings.profiler_start_step
            self.stop = min(self.start + PROFILED_STEPS, total_steps)
            self.logdir, self.rank = tensorboard_dir(settings.log_path), rank

    def before_step(self, step: int):
        """Call with the 0-based index of the step about to run."""
        if step == self.start:
            import tensorflow as tf
            tf.profiler.experimental.start(self.logdir)

    def after_step(self, steps_done: int):
        if steps_done == self.stop:
            import tensorflow as tf
            tf.profiler.experimental.stop()
            print(f"profile of training steps {self.start}..{self.stop - 1} (rank {self.rank}) "
                  f"written to {os.path.join(self.logdir, 'plugins', 'profile')}", flush=True)
