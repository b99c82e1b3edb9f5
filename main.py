"""Train, evaluate or benchmark a DLRM / DCNv2 model (DLRM defaults; see dlrm.py, dcnv2.py).

    python main.py --mode=train --batch_size=4096 --embedding_dim=16 ...
"""
import dataclasses
import os
import sys
import time

from absl import app

from dataloading.open import open_dataset
from nn import checkpoint
from utils import flags as run_flags
from utils.config import ConfigError, RunConfig

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def model_signature(cfg: RunConfig) -> dict:
    """The settings a checkpoint must share with the run that reads it, named as the flags."""
    return {"cardinalities": cfg.cardinalities, "num_numerical": cfg.num_numerical, "max_hotness": cfg.max_hotness,
            "multi_hot_combiner": (cfg.multi_hot_combiner or "sum") if any(cfg.max_hotness) else None,
            "embedding_dim": cfg.embedding_dims, "bottom_mlp_dims": cfg.bottom_mlp_dims,
            "top_mlp_dims": cfg.top_mlp_dims,
            "interaction": "dot" if cfg.interaction == "dot_custom" else cfg.interaction,   # same model
            "num_cross_layers": cfg.num_cross_layers if cfg.interaction == "cross" else None,
            "cross_layer_projection_dim": cfg.cross_layer_projection_dim if cfg.interaction == "cross" else None,
            "optimizer": cfg.optimizer}


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
        if cfg.validate_dataset:
            self.dataset.validate()
            self.log.print(f"validated every value of {cfg.feature_spec_path} "
                           f"({', '.join(f'{s} {n:,} rows' for s, n in self.rows.items())})")
        compute_dtype = amp_dtype() if cfg.amp else tf.float32
        plan = plan_tables(cfg.cardinalities, cfg.embedding_dims, comm.size, cfg.dist_strategy,
                           cfg.column_slice_threshold, cfg.row_slice_threshold, cfg.data_parallel_threshold)
        self.model = RankingModel(cfg.cardinalities, cfg.embedding_dims, cfg.num_numerical, cfg.bottom_mlp_dims,
                                  cfg.top_mlp_dims, cfg.interaction, cfg.num_cross_layers,
                                  cfg.cross_layer_projection_dim, seed=cfg.seed, compute_dtype=compute_dtype,
                                  plan=plan, collectives=comm, data_parallel_input=cfg.data_parallel_input,
                                  combiners=cfg.combiners)
        emb = self.model.embeddings
        self.view = RankInput(comm.rank, comm.size, tuple(emb.input_rows(f) for f in range(cfg.num_categorical)))
        schedule = LearningRateSchedule(cfg.learning_rate, cfg.warmup_steps, cfg.decay_start_step, cfg.decay_steps)
        self.trainer = Trainer(self.model, cfg.optimizer, schedule, cfg.beta1, cfg.beta2, xla=cfg.xla,
                               loss_scaling=compute_dtype == tf.float16)
        self.log.print(plan.format(slots=len(self.trainer.table_optimizer.slot_names)))
        params = sum(t.rows * t.dim for t in plan.tables) + sum(
            int(v.shape.num_elements()) for v in self.model.dense_variables)
        self.log.print(f"model: {cfg.interaction} interaction, {cfg.num_categorical} tables, "
                       f"{params:,} parameters, compute dtype {compute_dtype.name}, xla {cfg.xla}, "
                       f"{comm.size} rank{'s' if comm.size > 1 else ''}")
        self.log.record("params", **dataclasses.asdict(cfg), parameters=params, world_size=comm.size)
        self.start_step = 0
        if cfg.restore_checkpoint_path:
            manifest = checkpoint.restore(cfg.restore_checkpoint_path, self.trainer.checkpoint_entries(),
                                          model_signature(cfg), self.trainer.checkpoint_names())
            self.start_step = int(self.trainer.step.numpy())
            self.log.print(f"restored {manifest['path']} at step {self.start_step} "
                           f"(written at {manifest['world_size']} rank(s))")
        self.trainer.broadcast_replicated()

    def _eval_data(self):
        from dataloading.batches import eval_batches, prefetched
        d = self.dataset
        return prefetched(eval_batches(d, self.rows["eval"], self.cfg.valid_batch_size, self.view), d)

    def evaluate(self, step: int) -> dict:
        from nn.evaluator import evaluate, format_metrics
        self.trainer.check_finite()
        t0 = time.perf_counter()
        metrics = evaluate(self.trainer.predict, self._eval_data(), self.comm)
        if not self.dataset.has_oracle:   # files carry no ground truth
            metrics = {k: v for k, v in metrics.items() if not k.startswith("oracle_")}
        metrics["seconds"] = time.perf_counter() - t0
        keys = ("auc", "logloss", "oracle_auc") if self.dataset.has_oracle else ("auc", "logloss")
        self.log.print(f"eval at step {step}: {format_metrics(metrics, keys)} | {metrics['samples']:,} samples "
                       f"in {metrics['seconds']:.1f} s")
        self.log.record("eval", step, **metrics)
        return metrics

    def save(self, step: int):
        self.trainer.check_finite()
        path = checkpoint.save(self.cfg.save_checkpoint_path, self.trainer.checkpoint_entries(), step,
                               model_signature(self.cfg), self.comm)
        self.log.print(f"saved checkpoint {path}")

    def train(self) -> dict:
        from dataloading.batches import prefetched, steps_per_epoch as epoch_steps, train_batches
        cfg, d = self.cfg, self.dataset
        steps_per_epoch = epoch_steps(self.rows["train"], cfg.batch_size, self.comm.size, cfg.train_last_partial_batch)
        total = steps_per_epoch * cfg.epochs
        if cfg.max_steps > 0:
            total = min(total, cfg.max_steps)
        evals = eval_steps(steps_per_epoch, cfg.evals_per_epoch, total)
        batches = prefetched(train_batches(d, self.rows["train"], cfg.batch_size, cfg.seed, self.start_step, total,
                                           self.view, cfg.shuffle_batch_order, cfg.train_last_partial_batch), d)
        self.log.print(f"training steps {self.start_step}..{total} ({steps_per_epoch} per epoch, "
                       f"batch {cfg.batch_size})")
        step, losses, metrics = self.start_step, [], None
        t_start = t_last = time.perf_counter()
        for numerical, categorical, labels, _, _ in batches:
            losses.append(self.trainer.train_step(numerical, categorical, labels))
            step += 1
            if step % cfg.print_freq == 0 or step == total:
                self.trainer.check_finite()   # here, and before every save and evaluation
                loss = float(sum(float(x) for x in losses) / len(losses))
                now = time.perf_counter()
                lr = float(self.trainer.schedule(step - 1))
                self.log.progress(step, total, loss, (now - t_last) / len(losses), cfg.batch_size, lr)
                losses, t_last = [], now
            if cfg.checkpoint_every_n_steps and step % cfg.checkpoint_every_n_steps == 0 and step != total:
                self.save(step)
            if step in evals or step == total:
                metrics = self.evaluate(step)
                t_last += metrics["seconds"]
        train_seconds = time.perf_counter() - t_start
        if metrics is None:   # resumed at the end: nothing trained, still report the model
            metrics = self.evaluate(step)
        if cfg.save_checkpoint_path:
            self.save(step)
        result = dict(metrics, steps=step, train_seconds=train_seconds,
                      samples_per_s=(step - self.start_step) * cfg.batch_size / max(train_seconds, 1e-9))
        self.log.print(f"done: {step} steps, {result['samples_per_s']:,.0f} samples/s overall (with evaluation)")
        self.log.record("final", step, **result)
        return result

    def inference(self) -> list:
        from dataloading.batches import rank_batch
        from nn.evaluator import measure_latency
        results = []
        self.log.print("batch_size | samples/s | mean ms | p50 ms | p90 ms | p99 ms")
        for size in self.cfg.inference_batch_sizes:
            r = measure_latency(self.trainer.predict, rank_batch(self.dataset, "eval", 0, size, self.view,
                                                                        end=self.rows["eval"]),
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
        r.log.close()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from nn.trainer import NonFiniteError
    from parallel_embedding.collectives import make_collectives
    comm = make_collectives()
    try:
        cfg = run_flags.config_from_flags(comm.size)
        run(cfg, comm)
    except (ConfigError, checkpoint.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteError as e:
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
