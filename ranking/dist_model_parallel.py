"""NVIDIA distributed-embeddings' front door: a model and training loop written for
`distributed_embeddings.python.layers.dist_model_parallel` run with only the import changed.

    from ranking import dist_model_parallel as dmp     # was: from distributed_embeddings... import ...
    tables = dmp.DistributedEmbedding([keras.layers.Embedding(1000, 16), keras.layers.Embedding(50, 8)])
    rows = tables([ids_0, ids_1])                      # ids [b] -> [b, D_t]; list in, list out
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(x, training=True))      # the mean over this rank's b samples
    tape = dmp.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))    # any Keras optimizer
    if first_batch:
        dmp.broadcast_variables(model.variables, root_rank=0)

Shapes: `b` this rank's samples, `B = N b` over the N ranks of `default_collectives()` (Horovod's under
horovodrun or mpirun, else one process), table t [rows_t, D_t]. With `dp_input=False` each rank
feeds the global batch's ids of the inputs `strategy.input_ids_list[rank]` names instead.

The tables are `ranking.HybridEmbedding`'s (one `plan_tables` call over the ranks), exposed as
Keras weights: `model.trainable_variables` holds this rank's table shards and replicated tables
beside the dense weights, and the user's Keras optimizer updates them. A table's gradient is a
tf.IndexedSlices of the rows looked up (the reverse all-to-all brings each shard the rows of the
global batch); `DistributedGradientTape` divides it by N (each rank's loss is its local mean) and
averages every other gradient over the ranks (one grouped allreduce), so N ranks take the step
one process takes on the global batch. `broadcast_variables` skips the table shards (each rank
owns its own).
"""
import functools
from typing import List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from parallel_embedding.collectives import make_collectives
from parallel_embedding.ids import num_samples
from ranking.config import COMBINERS, FeatureConfig, TableConfig
from ranking.embedding import WeightTables
from utils.errors import ConfigError


@functools.lru_cache(maxsize=None)
def default_collectives():
    """This process's collectives, made once (`make_collectives`: Horovod's when launched by
    horovodrun or mpirun, which initialises Horovod and picks this rank's GPU, so call it, or make
    the first DistributedEmbedding, before any TensorFlow op, as `hvd.init()` in such a script)."""
    return make_collectives()


def _table_kind(variable) -> Optional[str]:
    """"shard" (model-parallel: this rank's part of a table), "replicated" (a whole table on every
    rank), or None for any other variable."""
    return getattr(variable, "embedding_table", None)


class DistributedEmbedding(WeightTables):
    """distributed-embeddings' `DistributedEmbedding`: Embedding layers -> one hybrid-parallel layer.

    `embeddings`: T layers with `input_dim` (rows) and `output_dim` (D), e.g. keras.layers.Embedding,
    and optionally `combiner` ("sum" or "mean", as distributed-embeddings' Embedding). Called on a
    list of ids, one per input (input i looks up table `input_table_map[i]`, default i): a layer
    without combiner takes [b] ids -> [b, D] ([b, 1] -> [b, 1, D], as Keras' Embedding); with a
    combiner, a ragged [b, None] or a dense [b, k] -> [b, D]. Every rank feeds its own b samples.

    strategy, column_slice_threshold, row_slice_threshold, data_parallel_threshold: the planner's
    (parallel_embedding/planner.py; the same rules and names). `dp_input=False` (model-parallel
    input, as distributed-embeddings'): rank r is called on the global batch's ids ([B], B = N b)
    of the inputs `strategy.input_ids_list[r]` names, in that order (those whose table has a
    shard on r, or is replicated), and gives every input's rows of its own b samples, the rows
    [r b, (r + 1) b) of the global batch ([b, D]; [b, 1, D] for an input it was given as [B, 1]).
    `gpu_embedding_size` (offloading tables to host memory) is refused. Tables start from the
    project's initializer with `seed` (the same values at any N), not the layers' initializers:
    `set_weights` sets them. `collectives`: default `default_collectives()`.
    """

    def __init__(self, embeddings: Sequence[keras.layers.Layer], strategy: str = "basic",
                 column_slice_threshold: Optional[int] = None, row_slice_threshold: Optional[int] = None,
                 dp_input: bool = True, input_table_map: Optional[Sequence[int]] = None,
                 data_parallel_threshold: Optional[int] = None, gpu_embedding_size: Optional[int] = None,
                 *, collectives=None, seed=(0, 1000), name: str = "distributed_embedding", **kwargs):
        comm = collectives or default_collectives()
        if gpu_embedding_size is not None:
            raise ConfigError(f"DistributedEmbedding: gpu_embedding_size={gpu_embedding_size}: offloading tables to "
                              f"host memory is not supported here (every table stays in device memory)")
        tables = [self._table_config(layer, t) for t, layer in enumerate(embeddings)]
        combined = [getattr(layer, "combiner", None) is not None for layer in embeddings]
        if not tables:
            raise ConfigError("DistributedEmbedding: no embedding layers given")
        table_map = list(range(len(tables)) if input_table_map is None else input_table_map)
        bad = [t for t in table_map if not isinstance(t, int) or not 0 <= t < len(tables)]
        unused = sorted(set(range(len(tables))) - set(table_map))
        if bad or unused:
            raise ConfigError(f"DistributedEmbedding: input_table_map {table_map} must name every one of the "
                              f"{len(tables)} tables by its index, got " + (f"{bad[0]!r}" if bad else
                                                                            f"no input for table {unused[0]}"))
        features = [FeatureConfig(f"input_{i}", tables[t], (None, 2) if combined[t] else (None,),
                                  (None, tables[t].embedding_dim)) for i, t in enumerate(table_map)]
        super().__init__(features, collectives=comm, seed=seed, strategy=strategy,
                         column_slice_threshold=column_slice_threshold, row_slice_threshold=row_slice_threshold,
                         data_parallel_threshold=data_parallel_threshold, data_parallel_input=dp_input, name=name,
                         **kwargs)
        # Table t of `embeddings` is the embedding's table `self._table_index[t]` (order of first use).
        self._table_index = [self.table_of[table_map.index(t)] for t in range(len(tables))]
        plan = self.embedding.plan
        held = [set(plan.features_on(r)) | set(plan.replicated) for r in range(comm.size)]
        self.strategy = Strategy([[i for i, t in enumerate(self.table_of) if t in held[r]] for r in range(comm.size)])

    @staticmethod
    def _table_config(layer, t: int) -> TableConfig:
        rows, dim = getattr(layer, "input_dim", None), getattr(layer, "output_dim", None)
        if not isinstance(rows, int) or not isinstance(dim, int):
            raise ConfigError(f"DistributedEmbedding: embedding {t} ({type(layer).__name__}) has no integer "
                              f"input_dim and output_dim")
        for option in ("mask_zero", "embeddings_regularizer", "embeddings_constraint", "activity_regularizer"):
            if getattr(layer, option, None):
                raise ConfigError(f"DistributedEmbedding: embedding {t} ({layer.name!r}) sets {option}, "
                                  f"which is not supported here")
        combiner = getattr(layer, "combiner", None)
        if combiner not in (None,) + COMBINERS:
            raise ConfigError(f"DistributedEmbedding: embedding {t} ({layer.name!r}): combiner must be None, "
                              f"{' or '.join(COMBINERS)}, got {combiner!r}")
        return TableConfig(name=f"table_{t}", vocabulary_size=rows, embedding_dim=dim, combiner=combiner or "sum")

    def call(self, inputs, training=None):
        inputs = list(inputs)
        if not self.model_parallel_input:
            out = super().call(inputs, training)
            return [tf.expand_dims(o, 1) if self._keras_shaped(f, x) else o
                    for f, x, o in zip(self.features, inputs, out)]
        mine = self.strategy.input_ids_list[self.collectives.rank]
        if len(inputs) != len(mine):
            raise ConfigError(f"layer {self.name!r}: dp_input=False: rank {self.collectives.rank} takes the ids of "
                              f"inputs {mine} (strategy.input_ids_list[{self.collectives.rank}]), got {len(inputs)} "
                              f"inputs")
        given = dict(zip(mine, inputs))
        whole = num_samples(inputs[0])   # B: the global batch
        size, rank = self.collectives.size, self.collectives.rank
        tf.debugging.assert_equal(whole % size, 0, message=f"layer {self.name!r}: dp_input=False: the global "
                                  f"batch is not a multiple of the {size} ranks")
        b = whole // size
        # Every input's ids, normalized: the given ones' global batch, the others' never read (zeros).
        placeholder = tf.zeros([whole], tf.int64)
        ids, _ = self._normalized([given.get(i, placeholder if not f.multi_hot else
                                             tf.RaggedTensor.from_tensor(placeholder[:, None]))
                                   for i, f in enumerate(self.features)])
        own = [x[rank * b:(rank + 1) * b] for x in ids]   # this rank's samples
        replicated = set(self.embedding.plan.replicated)
        table_ids = [l if t in replicated else g for t, (g, l) in
                     enumerate(zip(self._table_ids(ids), self._table_ids(own)))]
        with self.given_table_ids(table_ids):
            out = super().call(own, training)
        return [tf.expand_dims(o, 1) if i in given and self._keras_shaped(f, given[i]) else o
                for i, (f, o) in enumerate(zip(self.features, out))]

    def compute_output_spec(self, inputs, training=None):
        inputs = list(inputs)
        given = dict(zip(self.strategy.input_ids_list[self.collectives.rank], inputs)) if self.model_parallel_input \
            else dict(enumerate(inputs))
        return [keras.KerasTensor((None, 1, d) if i in given and self._keras_shaped(f, given[i]) else (None, d),
                                  "float32")
                for i, (f, d) in enumerate(zip(self.features, (f.table.embedding_dim for f in self.features)))]

    @staticmethod
    def _keras_shaped(feature: FeatureConfig, ids) -> bool:
        """A table without combiner given [b, 1] ids: Keras' Embedding gives [b, 1, D]."""
        return not feature.multi_hot and not isinstance(ids, tf.RaggedTensor) and len(ids.shape) == 2

    def get_weights(self, all_ranks: bool = False) -> List[np.ndarray]:
        """The T whole tables ([rows_t, D_t] float32, in `embeddings` order) at any world size, on
        every rank (one allreduce of the tables; `all_ranks`, distributed-embeddings' choice of
        rank 0 only or every rank, is accepted: every rank gets them either way)."""
        whole = self.whole_tables()
        return [whole[i] for i in self._table_index]

    def set_weights(self, weights: Sequence) -> None:
        """Sets the T whole tables (arrays [rows_t, D_t], or paths of .npy files, in `embeddings`
        order); each rank takes the rows and columns of its shards."""
        if len(weights) != len(self._table_index):
            raise ConfigError(f"layer {self.name!r}: set_weights got {len(weights)} tables, expected "
                              f"{len(self._table_index)}")
        whole = [None] * len(self.tables)
        for t, (w, i) in enumerate(zip(weights, self._table_index)):
            w = np.load(w, mmap_mode="r") if isinstance(w, str) else np.asarray(w)
            shape = (self.tables[i].vocabulary_size, self.tables[i].embedding_dim)
            if w.shape != shape:
                raise ConfigError(f"layer {self.name!r}: set_weights: table {t} has shape {w.shape}, expected {shape}")
            whole[i] = w
        self.set_whole_tables(whole)


class Strategy:
    """distributed-embeddings' placement record, as its scripts read it: `input_ids_list[r]`, the
    inputs (by index, sorted) whose ids rank r takes under model-parallel input (dp_input=False):
    those whose table has a shard on r, or is replicated."""

    def __init__(self, input_ids_list: List[List[int]]):
        self.input_ids_list = input_ids_list


class DistributedGradientTape:
    """Wraps a tf.GradientTape (distributed-embeddings' and Horovod's `DistributedGradientTape`).

    `gradient(target, sources)`: the tape's gradients of `target` (this rank's loss, the mean over
    its b samples), then over the N ranks of `collectives` (default `default_collectives()`): a table's
    IndexedSlices divided by N; every other gradient averaged (one grouped allreduce; an
    IndexedSlices one made dense first). Other attributes are the tape's."""

    def __init__(self, tape: tf.GradientTape, collectives=None):
        self._tape = tape
        self._comm = collectives or default_collectives()

    def gradient(self, target, sources, output_gradients=None):
        flat = tf.nest.flatten(sources)
        grads = list(self._tape.gradient(target, flat, output_gradients=output_gradients))
        n = self._comm.size
        if n > 1:
            dense = [i for i, (s, g) in enumerate(zip(flat, grads)) if g is not None and _table_kind(s) is None]
            reduced = self._comm.allreduce_sum([tf.convert_to_tensor(grads[i]) for i in dense], "dmp_gradients")
            for i, g in zip(dense, reduced):
                grads[i] = g / n
            for i, (s, g) in enumerate(zip(flat, grads)):
                if g is not None and _table_kind(s) is not None:
                    grads[i] = tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
        return tf.nest.pack_sequence_as(sources, grads)

    def __getattr__(self, name):
        return getattr(self._tape, name)


def broadcast_variables(variables, root_rank: int = 0, collectives=None) -> None:
    """Sets every rank's `variables` (Keras or tf.Variables) to rank 0's, except the table shards
    (each rank's own); over `collectives` (default `default_collectives()`)."""
    if root_rank != 0:
        raise ConfigError(f"broadcast_variables: root_rank={root_rank}: only rank 0 broadcasts here")
    comm = collectives or default_collectives()
    comm.broadcast_variables([v.value if isinstance(v, keras.Variable) else v
                              for v in variables if _table_kind(v) != "shard"])
