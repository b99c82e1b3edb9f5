"""The position of a run in its training data, as a checkpoint records it.

Training batch `k` of epoch `e` is fixed by the data and the settings that order it (see
dataloading/batches.py), so (epoch, offset in batches) names a place in the stream only together
with that definition: the dataset's identity (dataset type, the synthetic flags or the feature
spec's path, the training mapping and its rows), the batch size, the seed, and the shuffle and
partial-batch flags. A checkpoint stores both (`state(...)`); resuming checks that this run's
definition is the same, setting by setting, and starts at the stored batch.
"""
import os

from utils.errors import ConfigError


def definition(cfg, train_rows: int) -> dict:
    """What defines the order of the training batches of `cfg` (a run.config.RunConfig) over
    `train_rows` samples, as flag name -> value (JSON-serialisable)."""
    data, training = cfg.data, cfg.training
    if data.dataset_type == "synthetic":
        named = {"dataset_type": "synthetic", "synthetic_cardinalities": data.cardinalities,
                 "synthetic_num_numerical": data.num_numerical, "synthetic_alpha": data.synthetic_alpha}
    else:
        named = {"dataset_type": data.dataset_type, "feature_spec": os.path.realpath(data.feature_spec_path),
                 "train_mapping": data.train_mapping}
    return dict(named, train_rows=int(train_rows), batch_size=training.batch_size, seed=cfg.seed,
                shuffle_batch_order=training.shuffle_batch_order,
                train_last_partial_batch=training.train_last_partial_batch)


def state(data_definition: dict, step: int, steps_per_epoch: int) -> dict:
    """The checkpoint record of having trained the first `step` batches of this data."""
    epoch, offset = divmod(int(step), steps_per_epoch)
    return {"definition": data_definition, "epoch": epoch, "offset": offset}


def resume_step(saved: dict, data_definition: dict, steps_per_epoch: int, where: str) -> int:
    """The index of the next training batch after the position `saved` (a `state(...)`, None for
    a checkpoint without one), which must have been reached with `data_definition`; else a
    ConfigError naming the first setting that differs. `where`: the checkpoint, for messages."""
    hint = "to train on other data or settings from this model use --restore_mode=continue"
    if not saved:
        raise ConfigError(f"--restore_mode=resume: {where} records no data position; {hint}")
    for key, value in data_definition.items():
        if saved["definition"].get(key) != value:
            raise ConfigError(f"--restore_mode=resume: {where} was trained with {key}={saved['definition'].get(key)}, "
                              f"this run has {key}={value}; resuming needs the same data and order ({hint})")
    return saved["epoch"] * steps_per_epoch + saved["offset"]
