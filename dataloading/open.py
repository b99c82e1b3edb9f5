"""Opens the dataset a run names (synthetic, split-binary or split-TFRecord files)."""
import os

from utils.errors import ConfigError


def open_dataset(cfg):
    """The dataset of `cfg` (anything with the fields read here, flat: the run's, from
    run.assembly.dataset_request, or deployment/client.py's) and its rows per split ("train" only
    when training, "eval"; "validation": training on files whose feature spec has the mapping
    `cfg.validation_mapping`, when that is given). An empty eval mapping is an error unless training
    (which then trains without evaluation)."""
    if cfg.dataset_type == "synthetic":
        from dataloading.synthetic import SyntheticDataset
        dataset = SyntheticDataset(cfg.cardinalities, cfg.num_numerical, cfg.synthetic_alpha, cfg.seed,
                                   cfg.max_hotness, cfg.synthetic_labels, cfg.synthetic_history_length)
        return dataset, {"train": cfg.synthetic_rows, "eval": cfg.synthetic_eval_rows}
    from dataloading.feature_spec import FeatureSpec
    from dataloading.split_binary import SplitBinaryDataset
    mappings = {"train": cfg.train_mapping, "eval": cfg.eval_mapping} if cfg.mode == "train" else {"eval": cfg.eval_mapping}
    tfrecords = cfg.dataset_type == "split_tfrecords"
    spec = FeatureSpec.from_yaml(cfg.feature_spec_path, chunk_type=None if tfrecords else "split_binary")
    if cfg.mode == "train" and cfg.validation_mapping and (
            os.path.isdir(spec.path(cfg.validation_mapping)) if tfrecords else cfg.validation_mapping in spec.source):
        mappings["validation"] = cfg.validation_mapping
    if tfrecords:
        from dataloading.split_tfrecords import open_split_tfrecords
        dataset = open_split_tfrecords(cfg.feature_spec_path, mappings)
    else:   # split_binary, or the reference's name for it, tf_raw
        dataset = SplitBinaryDataset(spec, mappings)
    rows = {split: dataset.rows(split) for split in mappings}
    if cfg.mode != "train" and not rows["eval"]:
        raise ConfigError(f"--eval_mapping={cfg.eval_mapping}: the mapping has no rows; nothing to "
                          f"{'evaluate' if cfg.mode == 'eval' else 'time'}")
    if cfg.mode == "train" and rows["train"] < cfg.batch_size:
        raise ConfigError(f"--batch_size ({cfg.batch_size}) is larger than the {rows['train']} rows of the "
                          f"{cfg.train_mapping!r} mapping")
    return dataset, rows
