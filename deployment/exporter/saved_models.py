"""A checkpoint (written at any number of ranks) -> SavedModels that serve it.

The dense part (model_file.KerasDense: the Keras model's part after its embeddings; for a built-in
model the example model file it trained, model_file.builtin_dense) reads only the dense weights;
the tables (`Lookup`) are read whole from the checkpoint, only for the SavedModels that hold
them (never the optimizer state). Three SavedModels (tensor names:
deployment/repository_format.py):
    monolithic   numerical_features, categorical_features -> predictions, logits ([B, 1]; [B, H] of H heads)
    sparse       categorical_features -> embeddings (the lookups; tables larger than a threshold
                 are placed in host memory, their gathers run on the CPU)
    dense        numerical_features, embeddings -> predictions, logits
The monolithic model is the sparse and dense modules in one graph, so the three agree by
construction; every one checks its ids (an out-of-range id fails the request, naming the
feature) and computes in float32, whatever precision trained the model.
"""
import contextlib
import functools
from typing import Iterable, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from deployment.exporter.model_file import builtin_dense
from deployment.exporter.model_layout import ExportedModel, built_in_export
from deployment.repository_format import CATEGORICAL, EMBEDDINGS, LOGITS, NUMERICAL, PAD, PREDICTIONS
from parallel_embedding.ids import check_ids, combine, flatten_ids
from ranking.sequences import recent_ids
from storage import checkpoint

HOST = "/device:CPU:0"


class Lookup(tf.Module):
    """categorical_features [B, W] int64 -> embeddings [B, sum of the lookups' widths] float32: per
    lookup l of `model` (model_layout.ExportedModel) its feature's ids in its table, combined by its
    combiner, or a sequence's rows unpooled (repository_format).

    `tables`: [rows_t, D_t] float32 per table, taken one at a time (a generator keeps one in
    memory beside the variables). Tables of more than `host_bytes` bytes are created on, and
    gathered from, host memory.
    """

    def __init__(self, tables: Iterable[np.ndarray], model: ExportedModel, host_bytes: int):
        super().__init__(name="sparse")
        self.layout, self._lookups, self._computed_from = model.layout, list(model.lookups), model.computed_from
        # The id computation called, its weights kept (a Keras model kept as it is would be saved
        # with a signature of its own, which its ragged inputs do not trace)
        self._computed_ids = _Call(model.computed_ids)
        self.computed_weights = [w.value for w in model.computed_ids.weights] if model.computed_ids else []
        self.on_host, self.tables = [], []
        for t, table in enumerate(tables):
            self.on_host.append(table.nbytes > host_bytes)
            with tf.device(HOST) if self.on_host[-1] else contextlib.nullcontext():
                self.tables.append(tf.Variable(table, trainable=False, name=f"table_{t}"))

    def __call__(self, categorical: tf.Tensor) -> tf.Tensor:
        computed = self._computed(categorical)
        parts = []   # per lookup: (the ids it gathers [n], its rows [n, D] -> its block of embeddings)
        for lookup in self._lookups:
            ids = self._given(categorical, lookup.feature, lookup.sequence is not None) if lookup.computed is None \
                else _normalized(computed[lookup.computed], lookup)
            if lookup.sequence is not None:
                kept, _ = recent_ids(ids, lookup.sequence)
                parts.append((kept.values, functools.partial(_unpooled, kept=kept, given=ids.row_lengths(),
                                                             length=lookup.sequence)))
                continue
            x = flatten_ids(ids, lookup.combiner)
            parts.append((x.ids, functools.partial(combine, flat=x)))
        features = [x.feature if x.computed is None else x.name for x in self._lookups]
        rows_of = [int(self.tables[x.table].shape[0]) for x in self._lookups]
        rows = []
        with tf.control_dependencies(check_ids(features, [ids for ids, _ in parts], rows_of)):
            for lookup, (ids, block) in zip(self._lookups, parts):
                with tf.device(HOST) if self.on_host[lookup.table] else contextlib.nullcontext():
                    rows.append(block(tf.gather(self.tables[lookup.table], ids)))
        return tf.concat(rows, axis=1)

    def _given(self, categorical: tf.Tensor, feature: int, ragged: bool = False):
        """Feature `feature`'s ids as the model takes them: one-hot [B], multi-hot (or `ragged`)
        ragged [B, None], without the padding."""
        start, end = self.layout.columns[feature]
        ids = categorical[:, start:end]
        return ids[:, 0] if self.layout.max_hotness[feature] is None and not ragged else \
            tf.ragged.boolean_mask(ids, ids != PAD)

    def _computed(self, categorical: tf.Tensor) -> list:
        """The ids the model computes (ExportedModel.computed_ids' outputs), from the requests' features."""
        if self._computed_ids.call is None:
            return []
        out = self._computed_ids.call([self._given(categorical, f) for f in self._computed_from], training=False)
        return list(out) if isinstance(out, (list, tuple)) else [out]


class _Call:
    """A callable that TensorFlow's saving does not track."""

    def __init__(self, call):
        self.call = call


def _normalized(ids, lookup) -> tf.Tensor:
    """Computed ids as the embedding layer takes them (ranking HybridEmbedding): one-hot [B],
    multi-hot ragged [B, None] (a dense one's every entry an id), a sequence ragged [B, None] (a
    dense one's ids < 0 padding); int64."""
    if lookup.sequence is not None:
        return ids if isinstance(ids, tf.RaggedTensor) else tf.ragged.boolean_mask(ids, ids >= 0)
    if lookup.multi_hot:
        return tf.cast(ids if isinstance(ids, tf.RaggedTensor) else tf.RaggedTensor.from_tensor(ids), tf.int64)
    return tf.reshape(tf.cast(ids, tf.int64), [-1])


def _unpooled(gathered: tf.Tensor, kept: tf.RaggedTensor, given: tf.Tensor, length: int) -> tf.Tensor:
    """A sequence lookup's block of embeddings: the rows [n, D] of its kept ids (ragged `kept`
    [B, None], at most `length` L a sample) -> [B, L D + 1]: each sample's rows, zeros after them,
    then `given`, the number of ids its request gave (repository_format)."""
    dim = gathered.shape[1]
    padded = tf.RaggedTensor.from_row_splits(gathered, kept.row_splits).to_tensor(shape=[None, length, dim])
    return tf.concat([tf.reshape(padded, [-1, length * dim]), tf.cast(given, tf.float32)[:, None]], axis=1)


def _outputs(logits: tf.Tensor, values: Sequence[int] = ()) -> dict:
    """logits [B] (one output) or [B, H] (heads) -> predictions and logits [B, 1] or [B, H]: each
    column's prediction the sigmoid of its logit, but the output itself for the columns `values`."""
    logits = logits[:, None] if logits.shape.rank == 1 else logits
    predictions = [logits[:, h:h + 1] if h in values else tf.sigmoid(logits[:, h:h + 1])
                   for h in range(logits.shape[1])]
    return {PREDICTIONS: predictions[0] if len(predictions) == 1 else tf.concat(predictions, axis=1), LOGITS: logits}


class _Serving(tf.Module):
    """A SavedModel's root: `serve`, its serving signature, over the given parts."""

    def __init__(self, name: str, serve, specs: Sequence[tf.TensorSpec], **parts):
        super().__init__(name=name)
        for key, part in parts.items():
            setattr(self, key, part)
        self.serve = tf.function(serve, input_signature=list(specs), autograph=False)


def serving_modules(manifest: dict, host_bytes: int, with_tables: bool = True, verify: bool = True,
                    model: Optional[ExportedModel] = None) -> dict:
    """The root module of each SavedModel of the checkpoint whose manifest (storage.checkpoint.
    read_manifest) is given: "dense", and with `with_tables` "monolithic" and "sparse" (they hold
    every table, read whole; tables above `host_bytes` bytes in host memory). `verify`: check the
    checksums of the pieces read; `model`: its model (default: a built-in model's, from the
    manifest)."""
    model = model or built_in_export(manifest)
    layout = model.layout
    dense = builtin_dense(manifest, verify) if model.dense is None else model.dense(verify)
    numerical = tf.TensorSpec([None, layout.num_numerical], tf.float32, name=NUMERICAL)
    categorical = tf.TensorSpec([None, layout.categorical_width], tf.int64, name=CATEGORICAL)
    embeddings = tf.TensorSpec([None, sum(layout.embedding_dims)], tf.float32, name=EMBEDDINGS)

    def dense_part(numerical_features, embeddings):
        return _outputs(dense(numerical_features, embeddings), model.layout.values or ())

    modules = {"dense": _Serving("dense", dense_part, [numerical, embeddings], dense=dense)}
    if not with_tables:
        return modules
    tables = (checkpoint.read_tensor(manifest["path"], t.tensor, verify) for t in model.tables)
    lookup = Lookup(tables, model, host_bytes)

    def monolithic(numerical_features, categorical_features):
        return _outputs(dense(numerical_features, lookup(categorical_features)), model.layout.values or ())

    def sparse(categorical_features):
        return {EMBEDDINGS: lookup(categorical_features)}

    return dict(modules, monolithic=_Serving("monolithic", monolithic, [numerical, categorical], lookup=lookup,
                                             dense=dense),
                sparse=_Serving("sparse", sparse, [categorical], lookup=lookup))


def save(module: _Serving, directory: str, host_variables: Sequence[tf.Variable] = ()):
    """Writes `module` as a SavedModel; only the variables in `host_variables` keep a device
    (host memory), every other one goes wherever the server places it."""
    policy = tf.saved_model.experimental.VariablePolicy.SAVE_VARIABLE_DEVICES
    tf.saved_model.save(module, directory, signatures={"serving_default": module.serve.get_concrete_function()},
                        options=tf.saved_model.SaveOptions(experimental_variable_policy=policy))
    _keep_devices_of(directory, {v.name for v in host_variables})


def _keep_devices_of(directory: str, host_names: set):
    """Clears the saved device of every variable not named in `host_names` (saving records the
    exporting machine's device of each variable, or none at all)."""
    path = f"{directory}/saved_model.pb"
    proto = saved_model_pb2.SavedModel()
    with open(path, "rb") as f:
        proto.ParseFromString(f.read())
    graph = proto.meta_graphs[0]
    for node in graph.object_graph_def.nodes:
        if node.HasField("variable") and f"{node.variable.name}:0" not in host_names:
            node.variable.device = ""
    for node in graph.graph_def.node:
        if node.op == "VarHandleOp" and f"{node.attr['shared_name'].s.decode()}:0" not in host_names:
            node.device = ""
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
