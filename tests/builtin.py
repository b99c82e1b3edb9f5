"""The built-in DLRM / DCNv2 as a run builds and trains it (run/assembly.py): the model file of
`builtin_model_file` (examples/dlrm.py or dcnv2.py) handed the tables of `model_tables` on a plan,
a run.user_model.UserModel, trained by its run.user_model.UserTrainer (one process)."""
import contextlib
import dataclasses
from typing import Optional, Sequence
from unittest import mock

import run.user_model
from nn.model import builtin_model_file, model_tables
from parallel_embedding.collectives import SingleProcess
from parallel_embedding.optimizers import slot_names
from run.assembly import model_config
from run.runtime import embedding_plan
from run.user_model import UserModel, UserTrainer
from tests.configs import tiny_config


def builtin_trainer(plan=None, max_hotness: Optional[Sequence[Optional[int]]] = None,
                    multi_hot_combiner: Optional[str] = None, compute_dtype=None, store_path: Optional[str] = None,
                    cache_policy: Optional[str] = None, **flags) -> UserTrainer:
    """The run's trainer of the built-in model of `tiny_config(**flags)` on one process, its tables
    on `plan` (default: the flags', run.runtime.embedding_plan), in files under `store_path`, cached
    by `cache_policy` (default: the flags'; the flags' own require a budget). `max_hotness` (per
    feature; None: one-hot) and `multi_hot_combiner` give the data a multi-hot shape the
    synthetic flags cannot (a feature of hotness 1, the combiner of a feature spec's data);
    `compute_dtype`: the dtype --amp computes in (tf.float16: posing as a GPU)."""
    cfg = tiny_config(**flags)
    if max_hotness is not None:
        shape = dataclasses.replace(cfg.data.shape, max_hotness=list(max_hotness))
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, shape=shape),
                                  model=dataclasses.replace(cfg.model, multi_hot_combiner=multi_hot_combiner))
    comm = SingleProcess()
    plan = plan or embedding_plan(cfg, comm.size, len(slot_names(cfg.training.optimizer)), on_gpu=False)
    storage = cfg.storage
    tables = model_tables(model_config(cfg), plan, comm, seed=cfg.seed,
                          data_parallel_input=cfg.parallelism.data_parallel_input,
                          zeros_initializer=cfg.model.embedding_zeros_initializer,
                          store_path=store_path or storage.embedding_store_path,
                          cache_policy=cache_policy or storage.embedding_cache_policy)
    path, hparams = builtin_model_file(model_config(cfg))
    posed = mock.patch.object(run.user_model, "compute_dtype", lambda _: compute_dtype) if compute_dtype \
        else contextlib.nullcontext()
    with posed:
        model = UserModel(cfg, comm, path, hparams, tables)
    return UserTrainer(model, run_eagerly=cfg.runtime.run_eagerly)


def variables_by_name(trainer: UserTrainer) -> dict:
    """Every variable of the trainer's checkpoint by its tensor's name (one process: each whole)."""
    return {e.name: e.variable for e in trainer.checkpoint_entries()}
