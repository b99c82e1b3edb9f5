"""A model file's checkpoint (main.py --model=FILE) as the exporter serves it: FILE's model
rebuilt on one process from the checkpoint's signature (its features, hyper-parameters, and the
labels of a model with heads), its HybridEmbedding layers' tables and lookups read off the built
layers, whose tables are built of one row each (Features' `one_row_tables`: the exporter streams
the checkpoint's rows, so that the model needs no memory for its tables), and the dense part
(ranking FunctionalModel.dense_part) with the checkpoint's Keras weights, giving a column per head
(in the labels' order) and predicting a value for a head FILE's compile_args trains with mean
squared error. Shapes: B requests, n numericals, lookups of widths D_l, H heads. A sequence
feature (a history of length L) is a lookup of width L D_l + 1 (repository_format). Ids computed
in the model (a cross of two features hashed, a slice of a history) are computed in the serving
graph by the model's own layers (ExportedModel.computed_ids) from the requests' categorical
features, before their lookups. A dynamic table (--dynamic_tables) is rebuilt static and
exported as its checkpoint holds it: its live rows and their ids (model_layout.with_dynamic_tables).
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
from ranking import CategoricalFeature, Features, HybridEmbedding, SequenceMask
from ranking.features import NUMERICAL, compile_args, load_model_file
from ranking.model import FunctionalModel, ids_part
from storage import checkpoint
from utils.errors import ConfigError


class KerasDense(tf.Module):
    """numerical_features [B, n], embeddings [B, sum of the lookups' widths] -> logits [B] float32,
    or [B, H] for `heads` (a column per head, in their order): a model file's dense part (a
    keras.Model taking first its inputs `given`, each None for the numericals or the index of the
    sequence lookup whose ids it is, then one [B, D_l] per lookup, [B, L, D_l] for a sequence of
    `sequences`' L; giving one output, or one per head in the order of their names). A sequence's
    ids reach it as zeros, as many as its request gave (the count ending its block of embeddings,
    repository_format): what a SequenceMask, the one layer allowed to read them, needs."""

    def __init__(self, dense_part: keras.Model, widths, sequences, given, heads: Optional[List[str]] = None):
        super().__init__(name="dense")
        self.model, self._widths, self._sequences, self._given = dense_part, list(widths), list(sequences), list(given)
        self._columns = None if heads is None else [sorted(heads).index(h) for h in heads]

    def __call__(self, numerical: tf.Tensor, embeddings: tf.Tensor) -> tf.Tensor:
        blocks = tf.split(embeddings, self._widths, axis=1)
        rows = [b if length is None else tf.reshape(b[:, :-1], [-1, length, (width - 1) // length])
                for b, width, length in zip(blocks, self._widths, self._sequences)]
        first = [numerical if l is None else _given_ids(blocks[l][:, -1]) for l in self._given]
        out = self.model(first + rows, training=False)
        if self._columns is None:
            return tf.reshape(tf.cast(out, tf.float32), [-1])
        return tf.stack([tf.reshape(tf.cast(out[i], tf.float32), [-1]) for i in self._columns], axis=1)


def _given_ids(counts: tf.Tensor) -> tf.RaggedTensor:
    """Ragged [B, None] int64 zeros, `counts` [B] (floats) a row."""
    lengths = tf.cast(counts, tf.int64)
    return tf.RaggedTensor.from_row_lengths(tf.zeros([tf.reduce_sum(lengths)], tf.int64), lengths)


def model_file_export(manifest: dict, model_file) -> ExportedModel:
    """The ExportedModel of a model file's checkpoint (manifest) built by `model_file` (the file the
    signature names, checked by repository.exported_model); RepositoryError, one line, for a
    model that does not build as the checkpoint has it."""
    signature, where = manifest["signature"], manifest["path"]
    names = signature.get("features") or [f"cat_{i}" for i in range(len(signature["cardinalities"]))]
    features = Features([CategoricalFeature(n, c, h) for n, c, h in
                         zip(names, signature["cardinalities"], signature["max_hotness"])], signature["num_numerical"],
                        labels=signature.get("labels", ["label"]), one_row_tables=True)
    heads = signature.get("labels")   # a model with heads: one per label, named as it (run/run_model.py)
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
    tables, lookups, widths, sources, computed = [], [], [], [], []
    for layer in layers:   # the order dense_part takes their outputs in; tables numbered across layers
        first = len(tables)
        tables += [Table(layer.embedding.table_name(t), c.vocabulary_size, c.embedding_dim)
                   for t, c in enumerate(layer.tables)]
        more, more_widths, more_sources = _lookups(model, layer, features, model_file, first, computed)
        lookups, widths, sources = lookups + more, widths + more_widths, sources + more_sources
    read = [n for n in features.names if n in model._inputs_struct]
    computed_ids = _computed_ids(model, read, computed, lookups, model_file) if computed else None
    for t in tables:
        saved = tuple(manifest["tensors"].get(t.tensor, {}).get("shape", ()))
        dynamic = f"{t.tensor}/{DYNAMIC_IDS}" in manifest["tensors"]   # its rows: the live ones saved
        if saved != (saved[0] if dynamic and saved else t.rows, t.dim):
            raise RepositoryError(f"--model={model_file}: table {t.tensor} is {saved or 'missing'} in {where}, the "
                                  f"model builds it {(t.rows, t.dim)}")
    dense_part = model.dense_part()
    given = _given(model, dense_part, lookups, sources, model_file)
    layout = ServingLayout(signature["cardinalities"], signature["max_hotness"], widths, signature["num_numerical"],
                           [x.feature for x in lookups], heads,
                           [h for h, score in enumerate(scores) if score == "rmse"] or None)

    def dense(verify: bool) -> KerasDense:
        return _restored_dense(model, dense_part, manifest, verify, widths, [x.sequence for x in lookups], given,
                               heads)

    return ExportedModel(layout, tables, lookups, os.path.splitext(signature["model"])[0], dense, computed_ids,
                         tuple(features.names.index(n) for n in read) if computed else ())


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
    widths = config.embedding_dims
    return _restored_dense(model, model.dense_part(), manifest, verify, widths, [None] * len(widths), [None])


def _restored_dense(model, dense_part: keras.Model, manifest: dict, verify: bool, widths, sequences, given,
                    heads: Optional[List[str]] = None) -> KerasDense:
    """KerasDense of the functional `model`'s `dense_part`, its Keras weights read from the
    checkpoint (manifest) by path; `verify`: their checksums checked."""
    named = {w.path: w.value for w in model.weights}
    checkpoint.restore(manifest["path"], checkpoint.replicated_entries(named), {}, set(named), extra_ok=True,
                       verify=verify)
    return KerasDense(dense_part, widths, sequences, given, heads)


def _given(model, dense_part: keras.Model, lookups: List[Lookup], sources: List[int], model_file: str) -> list:
    """`dense_part`'s inputs before the lookups' rows (the model's own), as KerasDense takes them:
    None for the numericals, or the index of the sequence lookup whose ids (`sources`: per lookup,
    the id of the tensor it reads) a SequenceMask reads; RepositoryError, one line, for any other."""
    names = {id(t): name for name, t in model._inputs_struct.items()}
    given = []
    for t in (t for t in dense_part.inputs if id(t) in names):
        if names[id(t)] == NUMERICAL:
            given.append(None)
            continue
        seq = [l for l, (x, source) in enumerate(zip(lookups, sources)) if x.sequence is not None and source == id(t)]
        others = [l.name for l in model.readers(t, exclude=(HybridEmbedding, SequenceMask))]
        if not seq or others:
            raise RepositoryError(f"--model={model_file}: input {names[id(t)]!r} is read by layer "
                                  f"{(others or [l.name for l in model.readers(t, exclude=HybridEmbedding)])[0]!r} "
                                  f"beside the embeddings; the export serves a feature's ids to the model only "
                                  f"through its lookups, and a sequence's through a SequenceMask too")
        given.append(seq[0])
    return given


def _computed_ids(model, read: List[str], computed: list, lookups: List[Lookup], model_file: str) -> keras.Model:
    """The part of `model` computing the KerasTensors `computed` from its categorical inputs `read`
    (a list, in the features' order: ranking.model.ids_part); RepositoryError, one line, naming the
    first lookup whose ids need anything else (the numericals) or an embedding lookup."""
    first = next(x.name for x in lookups if x.computed is not None)
    try:
        return ids_part(model, computed, [model._inputs_struct[n] for n in read],
                        why=f"--model={model_file}: feature {first!r}: ")
    except ValueError:
        raise RepositoryError(f"--model={model_file}: feature {first!r}: its ids are computed from more than the "
                              f"categorical inputs (the numericals?); the export computes them from the requests' "
                              f"categorical_features") from None
    except ConfigError as e:
        raise RepositoryError(str(e)) from None


def _lookups(model, layer: HybridEmbedding, features: Features, model_file: str, first_table: int,
             computed: list):
    """Per output of `layer` in the order the dense part takes them (keras.tree.flatten's: the
    features' order, or by name for a dict): its Lookup (the dataset feature whose input feeds it,
    or the index in `computed` of the tensor of ids the model computes for it, appended to it if
    new; the table numbered from `first_table`; a sequence's L), width, and the id of the tensor
    it reads."""
    if not isinstance(model, FunctionalModel) or not isinstance(model._inputs_struct, dict):
        raise RepositoryError(f"--model={model_file}: export needs a functional model with a dict of inputs")
    input_feature = {id(t): features.names.index(name) for name, t in model._inputs_struct.items() if name != NUMERICAL}
    sources = layer.call_inputs()   # the ids the layer was called with, in feature order
    order = range(len(layer.features))
    if isinstance(layer.output, dict):   # the dense part takes a dict's outputs by name
        order = sorted(order, key=lambda i: layer.features[i].name)
    lookups, widths, read = [], [], []
    for i in order:
        f, table = layer.features[i], layer.tables[layer.table_of[i]]
        sequence = f.ids_per_sample if f.sequence else None
        if id(sources[i]) in input_feature:
            lookups.append(Lookup(input_feature[id(sources[i])], first_table + layer.table_of[i], table.combiner,
                                  sequence, name=f.name))
        else:
            if not any(t is sources[i] for t in computed):
                computed.append(sources[i])
            index = next(k for k, t in enumerate(computed) if t is sources[i])
            lookups.append(Lookup(None, first_table + layer.table_of[i], table.combiner, sequence, index,
                                  f.multi_hot, f.name))
        widths.append(lookups[-1].width(table.embedding_dim))
        read.append(id(sources[i]))
    return lookups, widths, read
