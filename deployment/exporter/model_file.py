"""A model file's checkpoint (main.py --model=FILE) as the exporter serves it: FILE's model
rebuilt on one process from the checkpoint's signature (its features, hyper-parameters, and the
labels of a model with heads), its HybridEmbedding layers' tables and lookups read off the built
layers, whose tables are built of one row each (Features' `one_row_tables`: the exporter streams
the checkpoint's rows, so that the model needs no memory for its tables), and the dense part
(ranking FunctionalModel.dense_part) with the checkpoint's Keras weights, giving a column per head
(in the labels' order) and predicting a value for a head FILE's compile_args trains with mean
squared error. Shapes: B requests, n numericals, L lookups of widths D_l, H heads. A dynamic
table (--dynamic_tables) is rebuilt static and exported as its checkpoint holds it: its live
rows and their ids (model_layout.with_dynamic_tables).
A built-in model's checkpoint (dlrm.py, dcnv2.py) has its dense part built the same way
(`builtin_dense`), from the example model file those train (nn.model.builtin_model_file)."""
import dataclasses
import os
from typing import List, Optional

import keras
import tensorflow as tf

from deployment.exporter.model_layout import DYNAMIC_IDS, ExportedModel, Lookup, Table
from deployment.repository_format import RepositoryError, ServingLayout
from nn.model import builtin_model_file
from nn.model_config import ModelConfig
from ranking import CategoricalFeature, Features, HybridEmbedding
from ranking.features import NUMERICAL, compile_args, load_model_file
from ranking.model import FunctionalModel
from storage import checkpoint
from utils.errors import ConfigError


class KerasDense(tf.Module):
    """numerical_features [B, n], embeddings [B, sum D_l] -> logits [B] float32, or [B, H] for
    `heads` (a column per head, in their order): a model file's dense part (a keras.Model taking
    the numericals, if the model does, then one [B, D_l] per lookup; giving one output, or one per
    head in the order of their names)."""

    def __init__(self, dense_part: keras.Model, widths, takes_numerical: bool, heads: Optional[List[str]] = None):
        super().__init__(name="dense")
        self.model, self._widths, self._takes_numerical = dense_part, list(widths), takes_numerical
        self._columns = None if heads is None else [sorted(heads).index(h) for h in heads]

    def __call__(self, numerical: tf.Tensor, embeddings: tf.Tensor) -> tf.Tensor:
        rows = tf.split(embeddings, self._widths, axis=1)
        out = self.model(([numerical] if self._takes_numerical else []) + rows, training=False)
        if self._columns is None:
            return tf.reshape(tf.cast(out, tf.float32), [-1])
        return tf.stack([tf.reshape(tf.cast(out[i], tf.float32), [-1]) for i in self._columns], axis=1)


def model_file_export(manifest: dict, model_file) -> ExportedModel:
    """The ExportedModel of a model file's checkpoint (manifest) built by `model_file` (the file the
    signature names, checked by repository.exported_model); RepositoryError, one line, for a
    model that does not build as the checkpoint has it."""
    signature, where = manifest["signature"], manifest["path"]
    names = signature.get("features") or [f"cat_{i}" for i in range(len(signature["cardinalities"]))]
    features = Features([CategoricalFeature(n, c, h) for n, c, h in
                         zip(names, signature["cardinalities"], signature["max_hotness"])], signature["num_numerical"],
                        labels=signature.get("labels", ["label"]), one_row_tables=True)
    heads = signature.get("labels")   # a model with heads: one per label, named as it (run/user_model.py)
    try:
        build, chosen = load_model_file(model_file)
        model = build(features, dict(signature["hparams"]))
        outputs = getattr(model, "_outputs_struct", None)
        built = sorted(outputs) if isinstance(outputs, dict) else None
        if isinstance(model, FunctionalModel) and built != (None if heads is None else sorted(heads)):
            raise ConfigError(f"the model gives {'heads ' + ', '.join(built) if built else 'one output'}, the "
                              f"checkpoint's {'heads ' + ', '.join(heads) if heads else 'one output'}")
        _, scores = compile_args(chosen, features, signature["hparams"], heads)
    except ConfigError as e:
        raise RepositoryError(f"--model={model_file}: {e}") from None
    layers = [l for l in model._flatten_layers() if isinstance(l, HybridEmbedding)]
    tables, lookups, widths = [], [], []
    for layer in layers:   # the order dense_part takes their outputs in; tables numbered across layers
        first = len(tables)
        tables += [Table(layer.embedding.table_name(t), c.vocabulary_size, c.embedding_dim)
                   for t, c in enumerate(layer.tables)]
        more, more_widths = _lookups(model, layer, features, model_file, first)
        lookups, widths = lookups + more, widths + more_widths
    for t in tables:
        saved = tuple(manifest["tensors"].get(t.tensor, {}).get("shape", ()))
        dynamic = f"{t.tensor}/{DYNAMIC_IDS}" in manifest["tensors"]   # its rows: the live ones saved
        if saved != (saved[0] if dynamic and saved else t.rows, t.dim):
            raise RepositoryError(f"--model={model_file}: table {t.tensor} is {saved or 'missing'} in {where}, the "
                                  f"model builds it {(t.rows, t.dim)}")
    inputs = model._inputs_struct
    layout = ServingLayout(signature["cardinalities"], signature["max_hotness"], widths, signature["num_numerical"],
                           [x.feature for x in lookups], heads,
                           [h for h, score in enumerate(scores) if score == "rmse"] or None)

    def dense(verify: bool) -> KerasDense:
        return _restored_dense(model, manifest, verify, widths, NUMERICAL in inputs, heads)

    return ExportedModel(layout, tables, lookups, os.path.splitext(signature["model"])[0], dense)


def builtin_dense(manifest: dict, verify: bool = True) -> KerasDense:
    """The dense part of a built-in model's checkpoint (manifest; its signature a ModelConfig's):
    the example model the run trains for it (nn.model.builtin_model_file; its dot interaction in
    TensorFlow's ops, which serve without the op library), built with one-row tables (Features'
    `one_row_tables`: the dense part reads none, the checkpoint's tables are streamed by the
    exporter), with the checkpoint's Keras weights: numerical_features [B, n], embeddings
    [B, sum D_f] -> logits [B]."""
    config = ModelConfig.from_signature(manifest["signature"])
    path, hparams = builtin_model_file(config if config.interaction == "cross" else
                                       dataclasses.replace(config, interaction="dot_tensorflow"))
    features = Features([CategoricalFeature(f"cat_{f}", t.cardinality, t.max_hotness)
                         for f, t in enumerate(config.tables)], config.num_numerical, one_row_tables=True)
    model = load_model_file(path)[0](features, hparams)
    return _restored_dense(model, manifest, verify, config.embedding_dims, True)


def _restored_dense(model, manifest: dict, verify: bool, widths, takes_numerical: bool,
                    heads: Optional[List[str]] = None) -> KerasDense:
    """KerasDense of the functional `model`'s dense part, its Keras weights read from the
    checkpoint (manifest) by path; `verify`: their checksums checked."""
    named = {w.path: w.value for w in model.weights}
    checkpoint.restore(manifest["path"], checkpoint.replicated_entries(named), {}, set(named), extra_ok=True,
                       verify=verify)
    return KerasDense(model.dense_part(), widths, takes_numerical, heads)


def _lookups(model, layer: HybridEmbedding, features: Features, model_file: str, first_table: int):
    """Per output of `layer` in the order the dense part takes them (keras.tree.flatten's: the
    features' order, or by name for a dict): its Lookup (the dataset feature whose input feeds it,
    the table numbered from `first_table`) and width."""
    if not isinstance(model, FunctionalModel) or not isinstance(model._inputs_struct, dict):
        raise RepositoryError(f"--model={model_file}: export needs a functional model with a dict of inputs")
    input_feature = {id(t): features.names.index(name) for name, t in model._inputs_struct.items() if name != NUMERICAL}
    sources = layer.call_inputs()   # the ids the layer was called with, in feature order
    order = range(len(layer.features))
    if isinstance(layer.output, dict):   # the dense part takes a dict's outputs by name
        order = sorted(order, key=lambda i: layer.features[i].name)
    lookups, widths = [], []
    for i in order:
        f, table = layer.features[i], layer.tables[layer.table_of[i]]
        if f.sequence:
            raise RepositoryError(f"--model={model_file}: feature {f.name!r} of layer {layer.name!r} is a sequence "
                                  f"(output_shape {tuple(f.output_shape)}): sequence features train and checkpoint, "
                                  f"but are not yet exported for serving (docs/sequences.md)")
        if id(sources[i]) not in input_feature:
            raise RepositoryError(f"--model={model_file}: feature {f.name!r} of layer {layer.name!r} is not fed one "
                                  "of the model's inputs as it is (the export looks up the requests' ids)")
        lookups.append(Lookup(input_feature[id(sources[i])], first_table + layer.table_of[i], table.combiner))
        widths.append(table.embedding_dim)
    return lookups, widths
