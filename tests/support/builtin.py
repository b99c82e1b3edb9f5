"""The built-in DLRM / DCNv2 as a run builds it (run/assembly.py), the tests' one builder of it:
the run's configuration of tiny_config's flags and a test's own (`builtin_config`), the tables of
nn.model.model_tables on a plan (`builtin_tables`), handed to the model file of
nn.model.builtin_model_file (examples/dlrm.py or dcnv2.py): its bare ranking.Model
(`builtin_model`), or a run.run_model.RunModel trained by its run.run_model.RunTrainer
(`builtin_trainer`)."""
import contextlib
import dataclasses
from typing import Optional, Sequence
from unittest import mock

import run.run_model
from nn.model import builtin_model_file, model_tables
from nn.model_config import ModelConfig
from parallel_embedding.collectives import SingleProcess
from parallel_embedding.optimizers import slot_names
from ranking.features import load_model_file
from run.assembly import model_config
from run.config import RunConfig, build_config
from run.runtime import embedding_plan
from run.run_model import RunModel, RunTrainer, dataset_features
from tests.support.configs import TINY


def builtin_config(model: Optional[ModelConfig] = None, max_hotness: Optional[Sequence[Optional[int]]] = None,
                   multi_hot_combiner: Optional[str] = None, world_size: int = 1, **flags) -> RunConfig:
    """The configuration of tiny_config's flags (tests/support/configs.py) with `flags` (set on the command
    line), validated at `world_size` ranks. `model`: the flags of that ModelConfig's shapes under
    `flags`, its multi-hot combiner included (model_config gives `model` back). `max_hotness` (per
    feature; None: one-hot) and `multi_hot_combiner` give the data a multi-hot shape the synthetic
    flags cannot (a feature of hotness 1, the combiner of a feature spec's data)."""
    if model is not None:
        s = model.signature()
        shapes = dict(synthetic_cardinalities=s["cardinalities"], synthetic_num_numerical=s["num_numerical"],
                      embedding_dim=s["embedding_dim"], bottom_mlp_dims=s["bottom_mlp_dims"],
                      top_mlp_dims=s["top_mlp_dims"], interaction=s["interaction"])
        if s["multi_hot_combiner"]:
            shapes.update(synthetic_dataset_hotness=[h or 1 for h in s["max_hotness"]])
        if s["interaction"] == "cross":
            shapes.update(num_cross_layers=s["num_cross_layers"],
                          cross_layer_projection_dim=s["cross_layer_projection_dim"])
        flags, multi_hot_combiner = dict(shapes, **flags), s["multi_hot_combiner"]
    cfg = build_config(dict(TINY, **flags), present=set(flags), world_size=world_size)
    if max_hotness is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(
            cfg.data, shape=dataclasses.replace(cfg.data.shape, max_hotness=list(max_hotness))))
    if multi_hot_combiner is not None:   # --multi_hot_combiner: not of synthetic data
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, multi_hot_combiner=multi_hot_combiner))
    assert model is None or model_config(cfg) == model
    return cfg


def builtin_tables(cfg: RunConfig, plan=None, comm=None, combiners: Optional[Sequence[str]] = None,
                   store_path: Optional[str] = None, cache_policy: Optional[str] = None):
    """The tables (nn.model.model_tables' DistributedEmbedding) of `cfg`'s model with its seed,
    input layout and initializer, on the ranks of `comm` (default: one process), placed by `plan`
    (default: the flags', run.runtime.embedding_plan, not on a GPU), in files under `store_path`,
    cached by `cache_policy` (default: the flags'; the flags' own require a budget), combined by
    `combiners` (per table, which the flags cannot give; default: the flags')."""
    comm = comm or SingleProcess()
    config = model_config(cfg)
    if combiners:
        config = dataclasses.replace(config, tables=tuple(dataclasses.replace(t, combiner=k)
                                                          for t, k in zip(config.tables, combiners)))
    plan = plan or embedding_plan(cfg, comm.size, len(slot_names(cfg.training.optimizer)), on_gpu=False)
    storage = cfg.storage
    return model_tables(config, plan, comm, seed=cfg.seed, data_parallel_input=cfg.parallelism.data_parallel_input,
                        zeros_initializer=cfg.model.embedding_zeros_initializer,
                        store_path=store_path or storage.embedding_store_path,
                        cache_policy=cache_policy or storage.embedding_cache_policy)


def builtin_model(cfg: RunConfig, plan=None, comm=None):
    """The bare ranking.Model of `cfg`'s model file handed builtin_tables(cfg, plan, comm), not
    compiled: its caller compiles it (ranks run as threads, together: a RunModel compiles, and so
    broadcasts, as it is built)."""
    tables = builtin_tables(cfg, plan, comm)
    path, hparams = builtin_model_file(model_config(cfg))
    build, _ = load_model_file(path)
    return build(dataset_features(cfg, tables.comm, tables), hparams)


def builtin_trainer(plan=None, comm=None, combiners: Optional[Sequence[str]] = None, compute_dtype=None,
                    store_path: Optional[str] = None, cache_policy: Optional[str] = None, **config) -> RunTrainer:
    """The run's trainer of the built-in model of builtin_config(**config) on the ranks of `comm`
    (default: one process), its tables builtin_tables(cfg, plan, comm, combiners, store_path,
    cache_policy); `compute_dtype`: the dtype --amp computes in (tf.float16: posing as a GPU)."""
    comm = comm or SingleProcess()
    cfg = builtin_config(world_size=comm.size, **config)
    tables = builtin_tables(cfg, plan, comm, combiners, store_path, cache_policy)
    path, hparams = builtin_model_file(model_config(cfg))
    posed = mock.patch.object(run.run_model, "compute_dtype", lambda _: compute_dtype) if compute_dtype \
        else contextlib.nullcontext()
    with posed:
        model = RunModel(cfg, comm, path, hparams, tables)
    return RunTrainer(model, run_eagerly=cfg.runtime.run_eagerly)


def variables_by_name(trainer: RunTrainer) -> dict:
    """Every variable of the trainer's checkpoint by its tensor's name (one process: each whole)."""
    return {e.name: e.variable for e in trainer.checkpoint_entries()}
