"""Train, evaluate or benchmark a DLRM / DCNv2 model (DLRM defaults; see dlrm.py, dcnv2.py).

    python main.py --mode=train --batch_size=4096 --embedding_dim=16 ...
"""
import dataclasses
import os
import sys
import time
import uuid

from absl import app

from dataloading import position
from dataloading.open import open_dataset
from storage import checkpoint
from nn.model_config import ModelConfig, table_configs
from run import flags as run_flags
from run.config import RunConfig
from utils.errors import CheckpointError, ConfigError, NonFiniteError, StoreError

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def model_config(cfg: RunConfig) -> ModelConfig:
    """The model `cfg` describes."""
    tables = table_configs(cardinalities=cfg.cardinalities, dims=cfg.embedding_dims, max_hotness=cfg.max_hotness,
                           multi_hot_combiner=cfg.multi_hot_combiner)
    return ModelConfig(tables=tables, num_numerical=cfg.num_numerical, bottom_mlp_dims=tuple(cfg.bottom_mlp_dims),
                       top_mlp_dims=tuple(cfg.top_mlp_dims), interaction=cfg.interaction,
                       num_cross_layers=cfg.num_cross_layers, cross_layer_projection_dim=cfg.cross_layer_projection_dim)


def eval_steps(steps_per_epoch: int, evals_per_epoch: int, total_steps: int):
    """Global steps (1-based counts) after which to evaluate: evenly spaced in each epoch."""
    if not evals_per_epoch:
        return set()
    steps = set()
    for epoch_start in range(0, total_steps, steps_per_epoch):
        for k in range(1, evals_per_epoch + 1):
            steps.add(epoch_start + max(1, k * steps_per_epoch // evals_per_epoch))
    return {s for s in steps if s <= total_steps}


class Run:
    """One run of main.py on this rank: builds the dataset, plan, model and trainer for `cfg`."""

    def __init__(self, cfg: RunConfig, comm=None):
        import tensorflow as tf
        from dataloading.batches import RankInput
        from nn.lr_schedule import LearningRateSchedule
        from nn.model import RankingModel
        from nn.trainer import Trainer, amp_dtype
        from parallel_embedding.collectives import SingleProcess
        from parallel_embedding.planner import plan_tables
        from utils.logger import RunLogger

        comm = comm or SingleProcess()
        self.cfg, self.comm = cfg, comm
        self.log = RunLogger(cfg.log_path, enabled=comm.rank == 0)
        self.dataset, self.rows = open_dataset(cfg)
        if cfg.keep_best_checkpoint and not self.rows["eval"]:
            raise ConfigError(f"--keep_best_checkpoint needs an evaluation; --eval_mapping={cfg.eval_mapping} "
                              "has no rows")
        if cfg.validate_dataset:
            self.dataset.validate()
            self.log.print(f"validated every value of {cfg.feature_spec_path} "
                           f"({', '.join(f'{s} {n:,} rows' for s, n in self.rows.items())})")
        self.evaluating = self.rows["eval"] > 0   # only a training run gets this far without eval rows
        if not self.evaluating:
            self.log.print(f"the {cfg.eval_mapping!r} mapping (--eval_mapping) has no rows: training without "
                           "evaluation")
        compute_dtype = amp_dtype() if cfg.amp else tf.float32
        if cfg.loss_scale is not None and compute_dtype != tf.float16:
            raise ConfigError(f"--loss_scale applies to float16 AMP (--amp on a GPU); this run computes in "
                              f"{compute_dtype.name}, which needs no loss scaling")
        plan = plan_tables(cfg.cardinalities, cfg.embedding_dims, comm.size, cfg.dist_strategy,
                           cfg.column_slice_threshold, cfg.row_slice_threshold, cfg.data_parallel_threshold)
        from parallel_embedding.optimizers import slot_names
        from run.runtime import tiered_plan
        on_gpu = bool(tf.config.list_physical_devices("GPU"))
        plan = tiered_plan(plan, cfg, len(slot_names(cfg.optimizer)), on_gpu)
        self.model_config = model_config(cfg)
        self.model = RankingModel(self.model_config, seed=cfg.seed, compute_dtype=compute_dtype, plan=plan,
                                  collectives=comm, data_parallel_input=cfg.data_parallel_input,
                                  zeros_initializer=cfg.embedding_zeros_initializer,
                                  store_path=cfg.embedding_store_path, cache_policy=cfg.embedding_cache_policy)
        emb = self.model.embeddings
        self.view = RankInput(comm.rank, comm.size, tuple(emb.input_rows(f) for f in range(cfg.num_categorical)))
        schedule = LearningRateSchedule(cfg.learning_rate, cfg.warmup_steps, cfg.decay_start_step, cfg.decay_steps)
        self.trainer = Trainer(self.model, cfg.optimizer, schedule, cfg.beta1, cfg.beta2, xla=cfg.xla,
                               loss_scaling=compute_dtype == tf.float16, static_loss_scale=cfg.loss_scale,
                               train_tables=cfg.embedding_trainable, run_eagerly=cfg.run_eagerly)
        self.log.print(plan.format(slots=len(emb.optimizer.slot_names)))
        if cfg.cpu_offloading_threshold_gb is not None:
            from run.runtime import offloading_line
            self.log.print(offloading_line(cfg.cpu_offloading_threshold_gb, plan.bytes_on(comm.rank), comm.rank,
                                           on_gpu))
        params = sum(t.rows * t.dim for t in plan.tables) + sum(
            int(v.shape.num_elements()) for v in self.model.dense_variables)
        self.log.print(f"model: {cfg.interaction} interaction, {cfg.num_categorical} tables, "
                       f"{params:,} parameters, compute dtype {compute_dtype.name}, xla {cfg.xla}, "
                       f"{comm.size} rank{'s' if comm.size > 1 else ''}")
        self.log.record("params", **dataclasses.asdict(cfg), parameters=params, world_size=comm.size)
        if cfg.mode == "train":
            from dataloading.batches import steps_per_epoch
            self.steps_per_epoch = steps_per_epoch(self.rows["train"], cfg.batch_size, comm.size,
                                                   cfg.train_last_partial_batch)
            self.total = self.steps_per_epoch * cfg.epochs   # training batches of this data
            if cfg.max_steps > 0:
                self.total = min(self.total, cfg.max_steps)
            self.data_definition = position.definition(cfg, self.rows["train"])
        self.start_step = 0   # the trainer's (global) step at the start
        self.data_start = 0   # the first training batch of this data
        self.saved = None   # (step, path) of this run's newest checkpoint
        # The runs that trained this model, each from the step it started at (deployment/delta.py)
        self.lineage = [{"run": comm.broadcast_object(uuid.uuid4().hex if comm.rank == 0 else None, "run_id"),
                         "from_step": 0}]
        self.best_auc = checkpoint.best_auc(cfg.save_checkpoint_path) if cfg.keep_best_checkpoint else None
        if cfg.restore_checkpoint_path:
            self._restore()
        self.trainer.broadcast_replicated()

    def _restore(self):
        """Loads --restore_checkpoint_path: everything to evaluate or resume, or what
        --restore_mode asks for; sets where training starts and the schedule's origin."""
        cfg = self.cfg
        mode = cfg.restore_mode if cfg.mode == "train" else "resume"
        manifest = checkpoint.read_manifest(cfg.restore_checkpoint_path)
        ckpt, saved = manifest["path"], manifest["state"]
        if cfg.mode == "train" and mode == "resume":
            self.data_start = position.resume_step(saved.get("data"), self.data_definition, self.steps_per_epoch, ckpt)
            if self.data_start >= self.total:
                raise ConfigError(f"--restore_mode=resume: {ckpt} has trained {self.data_start} of the "
                                  f"{self.total} steps this run asks for (--epochs={cfg.epochs}, --max_steps="
                                  f"{cfg.max_steps}): nothing left to train; raise --epochs or --max_steps, or train "
                                  "on the data again with --restore_mode=continue")
        weights_only = mode == "weights"
        # weights only: a fresh optimizer, of any kind
        signature = self.model_config.signature(optimizer=None if weights_only else cfg.optimizer)
        checkpoint.restore(ckpt, self.trainer.checkpoint_entries(weights_only), signature,
                           self.trainer.checkpoint_names(weights_only), extra_ok=weights_only,
                           optional=self.trainer.optional_names(), verify=not cfg.skip_checkpoint_checksums)
        self.start_step = int(self.trainer.step.numpy())
        if not weights_only:   # the same model, trained on by this run
            self.lineage = saved.get("lineage", [{"run": "", "from_step": 0}]) + [
                dict(self.lineage[-1], from_step=self.start_step)]
        restart = mode == "continue" and cfg.restore_lr_schedule == "restart"
        self.trainer.schedule_origin.assign(self.start_step if restart else saved.get("schedule_origin", 0))
        what = "" if cfg.mode != "train" else {
            "resume": f"; resuming at batch {self.data_start} of this data",
            "continue": f"; continuing on this run's data with the optimizer state, learning-rate schedule "
                        f"{'restarted' if restart else 'continued'}",
            "weights": "; its weights only, with a fresh optimizer from step 0"}[mode]
        unverified = "--skip_checkpoint_checksums" if cfg.skip_checkpoint_checksums else \
            "written without checksums" if not checkpoint.checksummed(manifest) else ""
        self.log.print(f"restored {ckpt} at step {manifest['step']} (written at {manifest['world_size']} "
                       f"rank(s){f'; not verified: {unverified}' if unverified else ''}){what}")

    def _eval_data(self):
        from dataloading.batches import eval_batches, prefetched
        d = self.dataset
        return prefetched(eval_batches(d, self.view, rows=self.rows["eval"], batch_size=self.cfg.valid_batch_size), d,
                          synchronous=self.cfg.tfdata_debug)

    def evaluate(self, step: int) -> dict:
        from nn.evaluator import evaluate, format_metrics
        self.trainer.check_finite()
        t0 = time.perf_counter()
        batches = self.model.embeddings.staged(self._eval_data(), training=False)
        metrics = evaluate(self.trainer.predict, batches, self.comm, oracle=self.dataset.has_oracle,
                           auc_thresholds=self.cfg.auc_thresholds)
        metrics["seconds"] = time.perf_counter() - t0
        keys = ("auc", "logloss", "oracle_auc") if self.dataset.has_oracle else ("auc", "logloss")
        keys += ("auc_thresholded",) if self.cfg.auc_thresholds else ()
        self.log.print(f"eval at step {step}: {format_metrics(metrics, keys)} | {metrics['samples']:,} samples "
                       f"in {metrics['seconds']:.1f} s")
        self.log.record("eval", step, **metrics)
        return metrics

    def save(self, step: int, data_step: int):
        """Checkpoints global step `step`, having trained the first `data_step` batches of this data."""
        self.trainer.check_finite()
        state = {"data": position.state(self.data_definition, data_step, self.steps_per_epoch),
                 "schedule_origin": int(self.trainer.schedule_origin.numpy()), "lineage": self.lineage}
        path = checkpoint.save(self.cfg.save_checkpoint_path, self.trainer.checkpoint_entries(), step,
                               self.model_config.signature(self.cfg.optimizer), self.comm, state,
                               keep=self.cfg.keep_checkpoints)
        self.saved = (step, path)
        self.log.print(f"saved checkpoint {path}")

    def keep_if_best(self, step: int, data_step: int, auc: float):
        """--keep_best_checkpoint: a model whose evaluation AUC beats the one ROOT/best records is
        checkpointed (unless it just was) and ROOT/best names it."""
        if not self.cfg.keep_best_checkpoint or not auc > self.best_auc:
            return
        if self.saved is None or self.saved[0] != step:
            self.save(step, data_step)
        if self.comm.rank == 0:
            checkpoint.mark_best(self.cfg.save_checkpoint_path, self.saved[1], auc, self.cfg.keep_checkpoints)
        self.best_auc = auc
        self.log.print(f"best checkpoint: {self.saved[1]} (auc {auc:.5f})")

    def train(self) -> dict:
        from dataloading.batches import prefetched, train_batches
        from run.runtime import StepProfiler
        cfg, d = self.cfg, self.dataset
        steps_per_epoch, total = self.steps_per_epoch, self.total
        offset = self.start_step - self.data_start   # global step = this data's step + offset
        evals = eval_steps(steps_per_epoch, cfg.evals_per_epoch, total) if self.evaluating else set()
        profiler = StepProfiler(cfg, self.comm.rank, self.start_step, total + offset)   # global steps
        batches = train_batches(d, self.view, rows=self.rows["train"], batch_size=cfg.batch_size, seed=cfg.seed,
                                start_step=self.data_start, end_step=total, shuffle=cfg.shuffle_batch_order,
                                last_partial=cfg.train_last_partial_batch)
        batches = self.model.embeddings.staged(prefetched(batches, d, synchronous=cfg.tfdata_debug), training=True)
        self.log.print(f"training steps {self.start_step}..{total + offset} ({steps_per_epoch} per epoch, "
                       f"batch {cfg.batch_size})")
        step, losses = self.data_start, []
        t_start = t_last = time.perf_counter()
        timed_from, paused = None, 0.0   # step timing: after the first step (it traces), less evaluations and saves
        for numerical, categorical, labels, _, _ in batches:
            profiler.before_step(step + offset)
            losses.append(self.trainer.train_step(numerical, categorical, labels))
            step += 1
            profiler.after_step(step + offset)
            if timed_from is None:
                float(losses[-1])
                timed_from = time.perf_counter()
            if step % cfg.print_freq == 0 or step == total:
                self.trainer.check_finite()   # here, and before every save and evaluation
                loss = float(sum(float(x) for x in losses) / len(losses))
                now = time.perf_counter()
                lr = float(self.trainer.learning_rate(step + offset - 1))
                self.log.progress(step + offset, total + offset, loss, (now - t_last) / len(losses), cfg.batch_size, lr,
                                  self.model.embeddings.store_stats())
                losses, t_last = [], now
            if cfg.checkpoint_every_n_steps and step % cfg.checkpoint_every_n_steps == 0 and step != total:
                t0 = time.perf_counter()
                self.save(step + offset, step)
                paused += time.perf_counter() - t0
            if step in evals and step != total:
                metrics = self.evaluate(step + offset)
                self.keep_if_best(step + offset, step, metrics["auc"])
                t_last += metrics["seconds"]
                paused += metrics["seconds"]
        t_end = time.perf_counter()
        train_seconds = t_end - t_start
        timed_steps = step - self.data_start - 1
        step_seconds = (t_end - timed_from - paused) / timed_steps if timed_steps > 0 else None
        if cfg.save_checkpoint_path:   # before the final evaluation: nothing trained is lost if it fails
            self.save(step + offset, step)
        metrics = self.evaluate(step + offset) if self.evaluating else {}
        if metrics:
            self.keep_if_best(step + offset, step, metrics["auc"])
        train_seconds += metrics.get("seconds", 0.0)
        result = dict(metrics, steps=step + offset, train_seconds=train_seconds,
                      samples_per_s=(step - self.data_start) * cfg.batch_size / max(train_seconds, 1e-9))
        # The reference's DLLogger keys (null when fewer than 2 steps ran): training steps alone, the last evaluation.
        result.update(throughput=cfg.batch_size / step_seconds if step_seconds else None,
                      mean_step_time_ms=1000 * step_seconds if step_seconds else None,
                      validation_loss=metrics.get("logloss"))
        self.log.print(f"done: {step + offset} steps, {result['samples_per_s']:,.0f} samples/s overall "
                       f"(with evaluation)")
        self.log.record("final", step + offset, **result)
        return result

    def inference(self) -> list:
        from dataloading.batches import ids_tensor, rank_batch
        from nn.evaluator import measure_latency
        results = []
        self.log.print("batch_size | samples/s | mean ms | p50 ms | p90 ms | p99 ms")
        for size in self.cfg.inference_batch_sizes:
            batch = rank_batch(self.dataset, "eval", 0, size, self.view, end=self.rows["eval"])
            element = (batch["numerical"], tuple(ids_tensor(c) for c in batch["categorical"]))
            for numerical, categorical in self.model.embeddings.staged([element], training=False):
                r = measure_latency(self.trainer.predict, dict(batch, numerical=numerical, categorical=categorical),
                                    self.cfg.inference_steps, size)
            self.log.print(f"{size} | {r['samples_per_s']:,.0f} | {r['mean_ms']:.3f} | {r['p50_ms']:.3f} | "
                           f"{r['p90_ms']:.3f} | {r['p99_ms']:.3f}")
            self.log.record("inference", int(self.trainer.step.numpy()), **r)
            results.append(r)
        return results


def run(cfg: RunConfig, comm=None):
    """Executes `cfg.mode` on this rank of `comm` (default: one process); returns its results
    (final metrics, or inference figures)."""
    from parallel_embedding.collectives import SingleProcess
    r = Run(cfg, comm or SingleProcess())
    try:
        if cfg.mode == "train":
            return r.train()
        if cfg.mode == "eval":
            return r.evaluate(r.start_step)
        return r.inference()
    finally:
        r.model.embeddings.close()
        r.log.close()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from parallel_embedding.collectives import make_collectives
    from run.runtime import configure_tensorflow
    F = run_flags.FLAGS
    try:   # before the collectives: their first op starts TensorFlow, and they pick a GPU
        configure_tensorflow(F.cpu, F.inter_op_parallelism, F.intra_op_parallelism, F.tfdata_debug)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    comm = make_collectives()
    try:
        cfg = run_flags.config_from_flags(comm.size)
        run(cfg, comm)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (NonFiniteError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:   # a lost rank: one line, not a traceback per collective
        failure = comm.failure(e)
        if failure is None:
            raise
        print(f"error: {failure}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
