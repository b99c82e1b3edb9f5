"""The run's loop: train (with its evaluations and checkpoints), evaluate, or time inference, on
the parts run.assembly assembles, saving by run.checkpoint_policy."""
import time
from typing import Optional

import tensorflow as tf

from dataloading.batches import eval_batches, ids_tensor, prefetched, rank_batch, train_batches
from nn import evaluator   # its functions read when called (tests replace them)
from parallel_embedding.collectives import SingleProcess
from run.assembly import Assembly
from run.checkpoint_policy import CheckpointPolicy
from run.config import RunConfig
from run.runtime import StepProfiler
from utils import preemption


def eval_steps(steps_per_epoch: int, evals_per_epoch: int, total_steps: int):
    """Global steps (1-based counts) after which to evaluate: evenly spaced in each epoch."""
    if not evals_per_epoch:
        return set()
    steps = set()
    for epoch_start in range(0, total_steps, steps_per_epoch):
        for k in range(1, evals_per_epoch + 1):
            steps.add(epoch_start + max(1, k * steps_per_epoch // evals_per_epoch))
    return {s for s in steps if s <= total_steps}


def mean_losses(losses: list) -> dict:
    """The mean over steps of the trainer's step losses ([] each; a model with heads: a dict of
    "loss" and "<head>_loss"): {"loss": float} (and "<head>_loss" each)."""
    steps = [x if isinstance(x, dict) else {"loss": x} for x in losses]
    return {k: float(sum(float(s[k]) for s in steps) / len(steps)) for k in steps[0]}


class Run(Assembly):
    """One run of `cfg` on this rank of `comm` (default: one process): its assembled parts
    (run.assembly.Assembly's attributes), restored from --restore_checkpoint_path, its checkpoint
    policy (`checkpoints`), and the loops `train`, `evaluate`, `inference`."""

    def __init__(self, cfg: RunConfig, comm=None):
        super().__init__(cfg, comm or SingleProcess())
        self.checkpoints = CheckpointPolicy(self)
        if cfg.checkpoints.restore_checkpoint_path:
            self.checkpoints.restored(self.restore(), self.start_step)
        self.trainer.broadcast_replicated()

    def _eval_data(self, split: str = "eval"):
        d, evaluation = self.dataset, self.cfg.evaluation
        return prefetched(eval_batches(d, self.view, rows=self.rows[split], batch_size=evaluation.valid_batch_size,
                                       split=split), d, synchronous=self.cfg.runtime.tfdata_debug)

    def evaluate(self, step: int, split: str = "eval", data_step: Optional[int] = None) -> dict:
        """Evaluates the model (after global step `step`) on the rows of `split` (default the
        evaluation rows; "validation"); returns its metrics, printed and logged as that split's.
        A signal stops it at the next batch on every rank (utils.preemption.deferred); within
        training (after batch `data_step` of this data) the run then checkpoints and stops."""
        self.trainer.check_finite()
        t0 = time.perf_counter()
        batches = self.model.embeddings.staged(self._eval_data(split), training=False)
        thresholds = self.cfg.evaluation.auc_thresholds
        with preemption.deferred():
            metrics = evaluator.evaluate(self.trainer.predict, batches, self.comm, oracle=self.dataset.has_oracle,
                                         auc_thresholds=thresholds, heads=self.heads, scores=self.head_metrics,
                                         more=self.model.metric_figures,
                                         stopped=lambda k: preemption.requested(self.comm, k) is not None)
            if metrics is None and data_step is not None:   # outside training's steps: raised as the block ends
                self.checkpoints.preempted(preemption.received(), step, data_step)
        metrics["seconds"] = time.perf_counter() - t0
        keys = evaluator.printed_metrics(self.dataset.has_oracle, bool(thresholds), self.heads, self.head_metrics,
                                         self.model.metric_names)
        self.log.print(f"{split} at step {step}: {evaluator.format_metrics(metrics, keys)} | "
                       f"{metrics['samples']:,} samples in {metrics['seconds']:.1f} s")
        self.log.record(split, step, **metrics)
        return metrics

    def _keep_if_best(self, step: int, data_step: int, metrics: dict) -> float:
        """--keep_best_checkpoint after the evaluation of `metrics` (global step `step`, batch
        `data_step` of this data): chooses by --keep_best_metric on `best_split` (the validation
        rows, evaluated here, where the data has them; a model with heads: its first head's);
        returns the seconds that validation took."""
        if not self.cfg.checkpoints.keep_best_checkpoint:
            return 0.0
        chosen_on = self.evaluate(step, "validation", data_step) if self.best_split == "validation" else metrics
        self.checkpoints.keep_if_best(step, data_step, chosen_on, self.best_split)
        return chosen_on["seconds"] if chosen_on is not metrics else 0.0

    def train(self) -> dict:
        """Trains from the start (or the restored position) to `total`, evaluating --evals_per_epoch
        times an epoch and at the end, checkpointing by the policy; returns the final metrics."""
        cfg, d, training = self.cfg, self.dataset, self.cfg.training
        steps_per_epoch, total = self.steps_per_epoch, self.total
        offset = self.start_step - self.data_start   # global step = this data's step + offset
        evals = eval_steps(steps_per_epoch, cfg.evaluation.evals_per_epoch, total) if self.evaluating else set()
        profiler = StepProfiler(cfg, self.comm.rank, self.start_step, total + offset)   # global steps
        batches = train_batches(d, self.view, rows=self.rows["train"], batch_size=training.batch_size, seed=cfg.seed,
                                start_step=self.data_start, end_step=total, shuffle=training.shuffle_batch_order,
                                last_partial=training.train_last_partial_batch)
        batches = self.model.embeddings.staged(prefetched(batches, d, synchronous=cfg.runtime.tfdata_debug),
                                               training=True)
        self.log.print(f"training steps {self.start_step}..{total + offset} ({steps_per_epoch} per epoch, "
                       f"batch {training.batch_size})")
        step, losses = self.data_start, []
        t_start = t_last = time.perf_counter()
        timed_from, paused = None, 0.0   # step timing: after the first step (it traces), less evaluations and saves
        preemption.defer()   # SIGTERM/SIGINT: finish the step, checkpoint, stop (utils.preemption)
        for numerical, categorical, labels, _, _ in batches:
            profiler.before_step(step + offset)
            losses.append(self.trainer.train_step(numerical, categorical, labels))
            step += 1
            profiler.after_step(step + offset)
            if timed_from is None:
                float(tf.nest.flatten(losses[-1])[0])
                timed_from = time.perf_counter()
            if step % cfg.runtime.print_freq == 0 or step == total:
                self.trainer.check_finite()   # here, and before every save and evaluation
                means = mean_losses(losses)
                now = time.perf_counter()
                lr = float(self.trainer.learning_rate(step + offset - 1))
                self.log.progress(step + offset, total + offset, means.pop("loss"), (now - t_last) / len(losses),
                                  training.batch_size, lr, self.model.embeddings.store_stats(), heads=means)
                losses, t_last = [], now
            if self.checkpoints.due(step, total):
                t0 = time.perf_counter()
                self.checkpoints.save(step + offset, step)
                paused += time.perf_counter() - t0
            if step in evals and step != total:
                metrics = self.evaluate(step + offset, data_step=step)
                seconds = metrics["seconds"] + self._keep_if_best(step + offset, step, metrics)
                t_last += seconds
                paused += seconds
            signum = preemption.requested(self.comm, step) if step != total else None
            if signum is not None:
                self.checkpoints.preempted(signum, step + offset, step)
        t_end = time.perf_counter()
        train_seconds = t_end - t_start
        timed_steps = step - self.data_start - 1
        step_seconds = (t_end - timed_from - paused) / timed_steps if timed_steps > 0 else None
        self.checkpoints.at_end(step + offset, step)
        metrics = self.evaluate(step + offset) if self.evaluating else {}
        if metrics:
            train_seconds += self._keep_if_best(step + offset, step, metrics)
        train_seconds += metrics.get("seconds", 0.0)
        result = dict(metrics, steps=step + offset, train_seconds=train_seconds,
                      samples_per_s=(step - self.data_start) * training.batch_size / max(train_seconds, 1e-9))
        # The reference's DLLogger keys (null when fewer than 2 steps ran): training steps alone, the last evaluation.
        result.update(throughput=training.batch_size / step_seconds if step_seconds else None,
                      mean_step_time_ms=1000 * step_seconds if step_seconds else None,
                      validation_loss=metrics.get("logloss"))
        self.log.print(f"done: {step + offset} steps, {result['samples_per_s']:,.0f} samples/s overall "
                       f"(with evaluation)")
        self.log.record("final", step + offset, **result)
        return result

    def inference(self) -> list:
        """Times predictions at each --inference_batch_sizes; returns one figures dict per size."""
        results = []
        self.log.print("batch_size | samples/s | mean ms | p50 ms | p90 ms | p99 ms")
        for size in self.cfg.evaluation.inference_batch_sizes:
            batch = rank_batch(self.dataset, "eval", 0, size, self.view, end=self.rows["eval"])
            element = (batch["numerical"], tuple(ids_tensor(c) for c in batch["categorical"]))
            for numerical, categorical in self.model.embeddings.staged([element], training=False):
                r = evaluator.measure_latency(self.trainer.predict,
                                              dict(batch, numerical=numerical, categorical=categorical),
                                              self.cfg.evaluation.inference_steps, size)
            self.log.print(f"{size} | {r['samples_per_s']:,.0f} | {r['mean_ms']:.3f} | {r['p50_ms']:.3f} | "
                           f"{r['p90_ms']:.3f} | {r['p99_ms']:.3f}")
            self.log.record("inference", int(self.trainer.step.numpy()), **r)
            results.append(r)
        return results


def run(cfg: RunConfig, comm=None):
    """Executes `cfg.mode` on this rank of `comm` (default: one process); returns its results
    (final metrics, or inference figures)."""
    r = Run(cfg, comm)
    try:
        if cfg.mode == "train":
            return r.train()
        if cfg.mode == "eval":
            return r.evaluate(r.start_step)
        return r.inference()
    finally:
        r.model.embeddings.close()
        r.log.close()
