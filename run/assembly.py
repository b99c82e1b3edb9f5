"""The assembly of one run on this rank: the parts `cfg` describes (log, dataset, plan, model,
trainer), and what a restore puts into them."""
import types
from typing import Optional

import tensorflow as tf

from dataloading import position
from dataloading.batches import RankInput, steps_per_epoch
from dataloading.open import open_dataset
from nn.interaction import DOT_KERNELS, interaction_op
from nn.model import builtin_model_file, model_tables
from nn.model_config import ModelConfig, table_configs
from parallel_embedding.optimizers import slot_names
from parallel_embedding.planner import Plan
from run.config import RunConfig
import run.runtime
from run.runtime import embedding_plan, offloading_line
from run.run_model import RunModel, RunTrainer
from storage import checkpoint
from utils.errors import ConfigError
from utils.logger import RunLogger

# Why a dataset's cardinalities differ from a checkpoint's: its vocabularies were built afresh.
VOCABULARY_HINT = ("the data's vocabularies differ from the checkpoint's: preprocess new data with "
                   "--vocab_from=<the earlier dataset> (docs/continuous_training.md, "
                   "'The same ids every day')")


def model_config(cfg: RunConfig) -> ModelConfig:
    """The model `cfg` describes."""
    data, model = cfg.data, cfg.model
    tables = table_configs(cardinalities=data.cardinalities, dims=model.embedding_dims, max_hotness=data.max_hotness,
                           multi_hot_combiner=model.multi_hot_combiner)
    return ModelConfig(tables=tables, num_numerical=data.num_numerical, bottom_mlp_dims=tuple(model.bottom_mlp_dims),
                       top_mlp_dims=tuple(model.top_mlp_dims), interaction=model.interaction,
                       num_cross_layers=model.num_cross_layers,
                       cross_layer_projection_dim=model.cross_layer_projection_dim)


def builtin_model(cfg: RunConfig, comm, plan: Plan) -> RunModel:
    """The flags' DLRM / DCNv2 on rank `comm.rank`: the ranking.Model of nn.model.builtin_model_file
    (the flags' shapes), handed its tables placed and tiered by `plan` (nn.model.model_tables)."""
    config = model_config(cfg)
    tables = model_tables(config, plan, comm, seed=cfg.seed, data_parallel_input=cfg.parallelism.data_parallel_input,
                          zeros_initializer=cfg.model.embedding_zeros_initializer,
                          store_path=cfg.storage.embedding_store_path, cache_policy=cfg.storage.embedding_cache_policy)
    if cfg.model.interaction != "cross":   # the op's error (and fallback warning) name the flags
        interaction_op(DOT_KERNELS[cfg.model.interaction])
    path, hparams = builtin_model_file(config)
    return RunModel(cfg, comm, path, hparams, tables)


def dataset_request(cfg: RunConfig) -> types.SimpleNamespace:
    """What dataloading.open.open_dataset reads, flat (as deployment/client.py gives it too); the
    "validation" mapping is asked for with --keep_best_checkpoint (it chooses the best on it)."""
    data = cfg.data
    validation = "validation" if cfg.checkpoints.keep_best_checkpoint and \
        "validation" not in (data.train_mapping, data.eval_mapping) else ""
    return types.SimpleNamespace(mode=cfg.mode, seed=cfg.seed, batch_size=cfg.training.batch_size,
                                 validation_mapping=validation, **{
        name: getattr(data, name) for name in ("dataset_type", "cardinalities", "num_numerical", "max_hotness",
                                               "synthetic_alpha", "synthetic_labels", "synthetic_history_length",
                                               "synthetic_rows", "synthetic_eval_rows", "train_mapping", "eval_mapping",
                                               "feature_spec_path")})


class Assembly:
    """The parts of one run of `cfg` on rank `comm.rank` of `comm.size` (a
    parallel_embedding.collectives object):

    log: RunLogger (rank 0 writes); dataset, rows: the dataset and its rows per split ("train",
    "eval", and "validation" with --keep_best_checkpoint where the data has that mapping);
    evaluating: whether there are evaluation rows; best_split: the split whose AUC
    --keep_best_checkpoint chooses by ("validation" where it has rows, else "eval");
    model_config (its `signature`), model (run.run_model.RunModel: its `embeddings`), trainer
    (run.run_model.RunTrainer: step, predict and checkpoint interface): a model file's (--model;
    RunModel as model_config too) or the built-in model's (ModelConfig; the ranking.Model of
    `builtin_model`, handed its tables on the plan of run.runtime.embedding_plan); heads: a
    model file's heads, one per label of the data in its order (None: one output); head_metrics: per
    output the figure evaluating it ("auc" or "rmse": nn.evaluator.evaluate's scores; None: the
    built-in model's, AUC); view (RankInput: this rank's share of a batch).
    Training only: steps_per_epoch, total (the training batches of this data the run trains up to),
    data_definition (dataloading.position). start_step (the trainer's global step at the start) and
    data_start (the first training batch of this data) are 0 until `restore`."""

    def __init__(self, cfg: RunConfig, comm):
        self.cfg, self.comm = cfg, comm
        self.log = RunLogger(cfg.runtime.log_path, enabled=comm.rank == 0)
        run_model = RunModel(cfg, comm) if cfg.model.model else None   # built and checked before any data is read
        self.dataset, self.rows = open_dataset(dataset_request(cfg))
        if cfg.checkpoints.keep_best_checkpoint and not self.rows["eval"]:
            raise ConfigError(f"--keep_best_checkpoint needs an evaluation; --eval_mapping={cfg.data.eval_mapping} "
                              "has no rows")
        if cfg.data.validate_dataset:
            self.dataset.validate()
            self.log.print(f"validated every value of {cfg.data.feature_spec_path} "
                           f"({', '.join(f'{s} {n:,} rows' for s, n in self.rows.items())})")
        self.evaluating = self.rows["eval"] > 0   # only a training run gets this far without eval rows
        self.best_split = "validation" if self.rows.get("validation") else "eval"
        if not self.evaluating:
            self.log.print(f"the {cfg.data.eval_mapping!r} mapping (--eval_mapping) has no rows: training without "
                           "evaluation")
        self.heads = run_model.heads if run_model else None
        self.head_metrics = run_model.head_metrics if run_model else None
        if run_model is None:
            params = self._builtin_model(cfg, comm)
        else:
            self.model = self.model_config = run_model
            self.trainer = RunTrainer(run_model, run_eagerly=cfg.runtime.run_eagerly)
            params = run_model.parameters
            for layer in run_model.embeddings.layers:
                if layer.storage:   # which tables the budget puts on disk
                    emb = layer.embedding
                    self.log.print(f"layer {layer.name!r}, tables " + ", ".join(
                        f"{t} {c.name}" for t, c in enumerate(layer.tables)) + ":\n" +
                        emb.plan.format(slots=len(emb.optimizer.slot_names)))
            if cfg.storage.cpu_offloading_threshold_gb is not None:
                self.log.print(offloading_line(cfg.storage.cpu_offloading_threshold_gb,
                                               run_model.table_bytes(comm.rank), comm.rank,
                                               bool(tf.config.list_physical_devices("GPU"))))
            self.log.print(f"model: {cfg.model.model}, {len(run_model.features)} categorical features, "
                           f"{params:,} parameters, compute dtype {run_model.compute_dtype.name}, "
                           f"xla {cfg.runtime.xla}, {comm.size} rank{'s' if comm.size > 1 else ''}")
        hosts = comm.ranks_by_host()
        if comm.size > 1:
            self.log.print("ranks by host: " + "; ".join(f"{h} {', '.join(map(str, r))}" for h, r in hosts.items()))
        emb = self.model.embeddings
        self.view = RankInput(comm.rank, comm.size, tuple(emb.input_rows(f) for f in range(cfg.data.num_categorical)))
        self.log.record("params", **cfg.used(comm.size), parameters=params, world_size=comm.size,
                        hosts=hosts)
        training = cfg.training
        if cfg.mode == "train":
            self.steps_per_epoch = steps_per_epoch(self.rows["train"], training.batch_size, comm.size,
                                                   training.train_last_partial_batch)
            self.total = self.steps_per_epoch * training.epochs   # training batches of this data
            if training.max_steps > 0:
                self.total = min(self.total, training.max_steps)
            self.data_definition = position.definition(cfg, self.rows["train"])
        self.start_step = 0
        self.data_start = 0

    def _builtin_model(self, cfg: RunConfig, comm) -> int:
        """Builds the flags' DLRM / DCNv2 (model_config, model, trainer: `builtin_model` on the
        run's one planner call) and prints its plan; returns its parameters."""
        runtime, training = cfg.runtime, cfg.training
        compute_dtype = run.runtime.compute_dtype(cfg)
        on_gpu = bool(tf.config.list_physical_devices("GPU"))
        plan = embedding_plan(cfg, comm.size, len(slot_names(training.optimizer)), on_gpu)
        self.model_config = model_config(cfg)
        self.model = builtin_model(cfg, comm, plan)
        self.trainer = RunTrainer(self.model, run_eagerly=runtime.run_eagerly)
        self.log.print(plan.format(slots=len(slot_names(training.optimizer))))
        if cfg.storage.cpu_offloading_threshold_gb is not None:
            self.log.print(offloading_line(cfg.storage.cpu_offloading_threshold_gb, plan.bytes_on(comm.rank),
                                           comm.rank, on_gpu))
        params = sum(t.rows * t.dim for t in plan.tables) + sum(
            int(v.shape.num_elements()) for v in self.model.dense_variables)
        self.log.print(f"model: {cfg.model.interaction} interaction, {cfg.data.num_categorical} tables, "
                       f"{params:,} parameters, compute dtype {compute_dtype.name}, xla {runtime.xla}, "
                       f"{comm.size} rank{'s' if comm.size > 1 else ''}")
        return params

    def restore(self) -> Optional[dict]:
        """Loads --restore_checkpoint_path: everything to resume, what --restore_mode asks for, or
        to evaluate (or infer) the weights and their step (whatever optimizer trained them); sets
        start_step, data_start (resume) and the schedule's origin. Returns the state the checkpoint
        was saved with (run.checkpoint_policy), None for --restore_mode=weights (a fresh optimizer:
        the restored model's lineage does not go on)."""
        cfg, ck = self.cfg, self.cfg.checkpoints
        mode = ck.restore_mode if cfg.mode == "train" else "resume"
        manifest = checkpoint.read_manifest(ck.restore_checkpoint_path)
        path, saved = manifest["path"], manifest["state"]
        if cfg.mode == "train" and mode == "resume":
            self.data_start = position.resume_step(saved.get("data"), self.data_definition, self.steps_per_epoch, path)
            if self.data_start >= self.total:
                raise ConfigError(f"--restore_mode=resume: {path} has trained {self.data_start} of the "
                                  f"{self.total} steps this run asks for (--epochs={cfg.training.epochs}, "
                                  f"--max_steps={cfg.training.max_steps}): nothing left to train; raise --epochs or "
                                  "--max_steps, or train on the data again with --restore_mode=continue")
        # weights only: a fresh optimizer, of any kind; evaluation and inference need only the weights
        weights_only = mode == "weights" or cfg.mode != "train"
        signature = self.model_config.signature(optimizer=None if weights_only else cfg.training.optimizer)
        # a table static in one, dynamic in the other: refused; a dynamic table in other hash shards: re-hashed
        with self.model.keras_model.restoring_tables(manifest["tensors"]):
            checkpoint.restore(path, self.trainer.checkpoint_entries(weights_only), signature,
                               self.trainer.checkpoint_names(weights_only), extra_ok=weights_only,
                               optional=self.trainer.optional_names(), verify=not ck.skip_checkpoint_checksums,
                               hints={} if cfg.data.dataset_type == "synthetic" else {"cardinalities": VOCABULARY_HINT})
        if cfg.mode != "train":   # the step the weights were saved at, which the evaluation reports
            self.trainer.step.assign(manifest["step"])
        self.start_step = int(self.trainer.step.numpy())
        restart = mode == "continue" and ck.restore_lr_schedule == "restart"
        self.trainer.schedule_origin.assign(self.start_step if restart else saved.get("schedule_origin", 0))
        what = "" if cfg.mode != "train" else {
            "resume": f"; resuming at batch {self.data_start} of this data",
            "continue": f"; continuing on this run's data with the optimizer state, learning-rate schedule "
                        f"{'restarted' if restart else 'continued'}",
            "weights": "; its weights only, with a fresh optimizer from step 0"}[mode]
        unverified = "; not verified: --skip_checkpoint_checksums" if ck.skip_checkpoint_checksums else ""
        self.log.print(f"restored {path} at step {manifest['step']} (written at {manifest['world_size']} "
                       f"rank(s){unverified}){what}")
        return None if mode == "weights" else saved
