"""The run's checkpoint policy: when training saves (every --checkpoint_every_n_steps, at the end,
and a model that beats the best evaluation AUC with --keep_best_checkpoint), how many are kept
(--keep_checkpoints), the state written with a save (data position, schedule origin, lineage), and
the save when a signal stops training (utils.preemption)."""
import uuid
from typing import Optional

from dataloading import position
from run.assembly import Assembly
from storage import checkpoint
from utils import preemption


class CheckpointPolicy:
    """Saves the checkpoints of `parts` (a run.assembly.Assembly) into --save_checkpoint_path.

    lineage: the runs that trained this model, each from the step it started at
    (deployment/exporter/deltas.py reads it): [{"run": run id, "from_step": global step}, ...], this run
    last. saved: (global step, path) of this run's newest checkpoint, or None."""

    def __init__(self, parts: Assembly):
        self.parts = parts
        self.settings = parts.cfg.checkpoints
        comm = parts.comm
        self.lineage = [{"run": comm.broadcast_object(uuid.uuid4().hex if comm.rank == 0 else None, "run_id"),
                         "from_step": 0}]
        self.saved = None
        self.best = checkpoint.best_value(self.settings.save_checkpoint_path, self.settings.keep_best_metric) \
            if self.settings.keep_best_checkpoint else None

    def restored(self, saved: Optional[dict], start_step: int):
        """After a restore (run.assembly.Assembly.restore, `saved` its state; None: weights only):
        this run goes on with the restored model's lineage from `start_step`."""
        if saved is not None:
            self.lineage = saved.get("lineage", [{"run": "", "from_step": 0}]) + [
                dict(self.lineage[-1], from_step=start_step)]

    def due(self, data_step: int, total: int) -> bool:
        """Whether --checkpoint_every_n_steps saves after batch `data_step` of `total` (the last
        batch's save is the end of training's)."""
        every = self.settings.checkpoint_every_n_steps
        return bool(every) and data_step % every == 0 and data_step != total

    def at_end(self, step: int, data_step: int):
        """The end of training's save (with --save_checkpoint_path), before the final evaluation:
        nothing trained is lost if that fails. A signal received since the last step boundary
        then stops the run (utils.preemption.Interrupted) before that evaluation."""
        if self.settings.save_checkpoint_path:
            self.save(step, data_step)
        saved = f"saved checkpoint {self.saved[1]}" if self.saved else "nothing saved (no --save_checkpoint_path)"
        preemption.undefer(f"after training's last step {step}: {saved}; the final evaluation skipped",
                           self.parts.comm.rank == 0)

    def save(self, step: int, data_step: int, announce: bool = True):
        """Checkpoints global step `step`, having trained the first `data_step` batches of this data;
        `announce`: print a line naming it."""
        parts, root = self.parts, self.settings.save_checkpoint_path
        parts.trainer.check_finite()
        state = {"data": position.state(parts.data_definition, data_step, parts.steps_per_epoch),
                 "schedule_origin": int(parts.trainer.schedule_origin.numpy()), "lineage": self.lineage}
        # save's temporary folder: removed if a signal must end the process first
        with preemption.saving(checkpoint.temporary_path(root, step)):
            path = checkpoint.save(root, parts.trainer.checkpoint_entries(), step,
                                   parts.model_config.signature(parts.cfg.training.optimizer), parts.comm, state,
                                   keep=self.settings.keep_checkpoints)
        self.saved = (step, path)
        if announce:
            parts.log.print(f"saved checkpoint {path}")

    def preempted(self, signum: int, step: int, data_step: int):
        """Training stops on signal `signum` after global step `step` (every rank calls this at
        the same step): checkpoints it (with --save_checkpoint_path, unless just saved) and raises
        utils.preemption.Interrupted, whose one line (rank 0's) names the signal, step and checkpoint."""
        root, rank0 = self.settings.save_checkpoint_path, self.parts.comm.rank == 0
        if not root:
            preemption.stop(signum, f"after step {step}: nothing saved (no --save_checkpoint_path)", rank0)
        if self.saved is None or self.saved[0] != step:
            self.save(step, data_step, announce=False)
        preemption.stop(signum, f"after step {step}: saved checkpoint {self.saved[1]} (resume: the same command "
                                f"with --restore_checkpoint_path={root})", rank0)

    def keep_if_best(self, step: int, data_step: int, metrics: dict, split: str = "eval"):
        """--keep_best_checkpoint: a model whose --keep_best_metric in `metrics` (its evaluation on
        `split`: the evaluation rows, or "validation") beats the one ROOT/best records (a higher
        AUC, a lower logloss) is checkpointed (unless it just was) and ROOT/best names it."""
        if not self.settings.keep_best_checkpoint:
            return
        metric = self.settings.keep_best_metric
        value = metrics[metric]
        if self.best is not None and not (value > self.best if metric == "auc" else value < self.best):
            return
        if self.saved is None or self.saved[0] != step:
            self.save(step, data_step)
        checkpoint.mark_best(self.settings.save_checkpoint_path, self.saved[1], value, self.parts.comm,
                             self.settings.keep_checkpoints, metric)
        self.best = value
        on = "" if split == "eval" else f"{split} "
        self.parts.log.print(f"best checkpoint: {self.saved[1]} ({on}{metric} {value:.5f})")
