"""A checkpoint (written at any number of ranks) -> SavedModels that serve it.

`load_model` rebuilds the trained model in one process from the checkpoint alone (its manifest
holds the model's signature) and reads its tables and dense weights, not the optimizer state.
Three SavedModels are built from it (tensor names: deployment/layout.py):
    monolithic   numerical_features, categorical_features -> predictions, logits
    sparse       categorical_features -> embeddings (the lookup; tables larger than a threshold
                 are placed in host memory, their gathers run on the CPU)
    dense        numerical_features, embeddings -> predictions, logits
The monolithic model is the sparse and dense modules in one graph, so the three agree by
construction; every one checks its ids (an out-of-range id fails the request, naming the
feature) and computes in float32, whatever precision trained the model.
"""
import contextlib
from typing import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from deployment.layout import CATEGORICAL, EMBEDDINGS, LOGITS, NUMERICAL, PAD, PREDICTIONS, ServingLayout
from nn import checkpoint
from nn.model_config import ModelConfig
from parallel_embedding.layer import check_ids, combine, flatten_ids

HOST = "/device:CPU:0"


def load_model(manifest: dict):
    """A RankingModel in one process with the trained weights of the checkpoint whose manifest
    (nn.checkpoint.read_manifest) is given."""
    from nn.model import RankingModel
    s = manifest["signature"]
    model = RankingModel(ModelConfig.from_signature(s))
    checkpoint.restore(manifest["path"], model.checkpoint_entries(), s, model.checkpoint_names(), extra_ok=True)
    return model


class Lookup(tf.Module):
    """categorical_features [B, W] int64 -> embeddings [B, sum D_f] float32.

    Tables of more than `host_bytes` bytes are created on, and gathered from, host memory.
    """

    def __init__(self, tables: Sequence[tf.Tensor], layout: ServingLayout, combiners: Sequence[str], host_bytes: int):
        super().__init__(name="sparse")
        self.layout, self.combiners = layout, list(combiners)
        self.on_host = [int(np.prod(t.shape)) * t.dtype.size > host_bytes for t in tables]
        self.tables = []
        for f, (table, host) in enumerate(zip(tables, self.on_host)):
            with tf.device(HOST) if host else contextlib.nullcontext():
                self.tables.append(tf.Variable(table, trainable=False, name=f"table_{f}"))

    def __call__(self, categorical: tf.Tensor) -> tf.Tensor:
        flat = []
        for f, (start, end) in enumerate(self.layout.columns):
            ids = categorical[:, start:end]
            ids = ids[:, 0] if self.layout.max_hotness[f] is None else tf.ragged.boolean_mask(ids, ids != PAD)
            flat.append(flatten_ids(ids, self.combiners[f]))
        features = range(len(flat))
        rows = []
        with tf.control_dependencies(check_ids(features, [x.ids for x in flat], self.layout.cardinalities)):
            for table, x, host in zip(self.tables, flat, self.on_host):
                with tf.device(HOST) if host else contextlib.nullcontext():
                    rows.append(combine(tf.gather(table, x.ids), x))
        return tf.concat(rows, axis=1)


class Dense(tf.Module):
    """numerical_features [B, n], embeddings [B, sum D_f] -> logits [B] (the model's dense part)."""

    def __init__(self, model):
        super().__init__(name="dense")
        self.bottom_mlp, self.interaction, self.top_mlp = model.bottom_mlp, model.interaction, model.top_mlp
        self._dims = list(model.embeddings.dims)
        self._forward = model.predict_from_embeddings   # uses only the three parts above

    def __call__(self, numerical: tf.Tensor, embeddings: tf.Tensor) -> tf.Tensor:
        return self._forward(numerical, tf.split(embeddings, self._dims, axis=1))


def _outputs(logits: tf.Tensor) -> dict:
    return {PREDICTIONS: tf.sigmoid(logits)[:, None], LOGITS: logits[:, None]}


class _Serving(tf.Module):
    """A SavedModel's root: `serve`, its serving signature, over the given parts."""

    def __init__(self, name: str, serve, specs: Sequence[tf.TensorSpec], **parts):
        super().__init__(name=name)
        for key, part in parts.items():
            setattr(self, key, part)
        self.serve = tf.function(serve, input_signature=list(specs))


def serving_modules(model, layout: ServingLayout, host_bytes: int) -> dict:
    """{"monolithic", "sparse", "dense"} -> the root module of each SavedModel of a one-process model."""
    lookup = Lookup(model.embeddings.whole_tables(), layout, model.embeddings.combiners, host_bytes)
    dense = Dense(model)
    numerical = tf.TensorSpec([None, layout.num_numerical], tf.float32, name=NUMERICAL)
    categorical = tf.TensorSpec([None, layout.categorical_width], tf.int64, name=CATEGORICAL)
    embeddings = tf.TensorSpec([None, sum(layout.embedding_dims)], tf.float32, name=EMBEDDINGS)

    def monolithic(numerical_features, categorical_features):
        return _outputs(dense(numerical_features, lookup(categorical_features)))

    def sparse(categorical_features):
        return {EMBEDDINGS: lookup(categorical_features)}

    def dense_part(numerical_features, embeddings):
        return _outputs(dense(numerical_features, embeddings))

    return {"monolithic": _Serving("monolithic", monolithic, [numerical, categorical], lookup=lookup, dense=dense),
            "sparse": _Serving("sparse", sparse, [categorical], lookup=lookup),
            "dense": _Serving("dense", dense_part, [numerical, embeddings], dense=dense)}


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
