"""A training script written for NVIDIA distributed-embeddings (`dmp`), with its import changed to
`from ranking import dist_model_parallel as dmp`, and its reference: the same Keras model with
plain Keras Embedding layers in one process.

Run under `horovodrun -np N` (tests/test_ranking_dmp.py): for SGD, Adagrad and Adam, every rank
trains the dmp model on its b = B / N samples of each global batch while the reference trains
on the whole batch B (same initial weights, same Keras optimizer); checks the global loss (the
mean of the ranks' losses) at every step, then the dense weights and the whole tables
(`get_weights`); then Adagrad with tables shared by inputs (`input_table_map`); then
model-parallel input (`dp_input=False`, each rank feeding the global batch's ids of the inputs
`strategy.input_ids_list` gives it): SGD over the row-sliced, column-sliced and replicated
tables, and Adagrad with shared tables placed whole (memory_balanced, none replicated: each
rank given only its own tables' inputs); tables drawn by Keras initializers; keras-rs' front door
refused at N > 1. Prints RESULT with the worst difference and, per run, the tables'
kinds and this rank's inputs; exits non-zero on a mismatch.

argv[1] "xla": the dmp model's step in a tf.function under TensorFlow's auto-clustering
(`tf.config.optimizer.set_jit(True)`, how NVIDIA's scripts turn on XLA; the CPU also needs
TF_XLA_FLAGS=--tf_xla_cpu_global_jit, which the test sets)."""
import json
import sys

import keras
import numpy as np
import tensorflow as tf

from ranking import dist_model_parallel as dmp, keras_rs
from ranking.config import FeatureConfig, TableConfig
from ranking.embedding import WeightTables
from utils.errors import ConfigError

TABLES = [(40, 8), (60, 4), (20, 6)]   # (rows, width): at 2 ranks row-sliced, column-sliced, replicated
PLAN = dict(row_slice_threshold=300, column_slice_threshold=200, data_parallel_threshold=150)
B, STEPS, TOLERANCE = 32, 4, 1e-5
SHARED = [0, 1, 2, 0, 1, 2]   # input -> table: every table read by two inputs
# Whole tables only (distributed-embeddings' table-wise placement), none replicated.
WHOLE = dict(strategy="memory_balanced", row_slice_threshold=None, column_slice_threshold=None,
             data_parallel_threshold=None)
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.5), "adagrad": lambda: keras.optimizers.Adagrad(0.2),
              "adam": lambda: keras.optimizers.Adam(0.05)}


class Model(keras.Model):
    """distributed-embeddings' pattern: Keras Embedding layers, wrapped by dmp.DistributedEmbedding
    when `distributed`; concat with a bottom layer's output; two Dense layers to a logit [b, 1]."""

    def __init__(self, distributed: bool, input_table_map=None, **plan):
        super().__init__()
        self.embeddings = [keras.layers.Embedding(rows, dim, name=f"embedding_{t}")
                           for t, (rows, dim) in enumerate(TABLES)]
        self.input_table_map = input_table_map or list(range(len(TABLES)))
        self.distributed = dmp.DistributedEmbedding(self.embeddings, input_table_map=input_table_map,
                                                    **plan) if distributed else None
        self.bottom = keras.layers.Dense(4, activation="relu", name="bottom")
        self.top = keras.layers.Dense(16, activation="relu", name="top")
        self.logit = keras.layers.Dense(1, name="logit")

    def call(self, inputs):
        numerical, ids = inputs
        if self.distributed is not None:
            rows = self.distributed(ids)
        else:
            rows = [self.embeddings[t](i) for t, i in zip(self.input_table_map, ids)]
        return self.logit(self.top(tf.concat([self.bottom(numerical)] + rows, axis=1)))


def batches(steps=STEPS, input_table_map=None):
    """`steps` global batches: ((numerical [B, 3], ids [B] per input), labels [B, 1])."""
    rng = np.random.default_rng(5)
    out = []
    for _ in range(steps):
        ids = [tf.constant(rng.integers(0, TABLES[t][0], B), tf.int32)
               for t in (input_table_map or range(len(TABLES)))]
        out.append(((tf.constant(rng.normal(size=(B, 3)), tf.float32), ids),
                    tf.constant(rng.integers(0, 2, (B, 1)), tf.float32)))
    return out


def pair(input_table_map=None, rank=0, size=1, **plan):
    """(the dmp model, the reference), built on one batch, with the reference's weights in both."""
    keras.utils.set_random_seed(3)
    ref, dist = Model(False, input_table_map), Model(True, input_table_map, **plan)
    x, labels = batches(1, input_table_map)[0]
    ref(x)
    dist(fed(dist, x, labels, rank, size)[0])
    dist.distributed.set_weights([e.embeddings.numpy() for e in ref.embeddings])
    for name in ("bottom", "top", "logit"):
        getattr(dist, name).set_weights(getattr(ref, name).get_weights())
    return dist, ref


def train_step(model, optimizer, x, labels, first_batch: bool, distributed: bool):
    """distributed-embeddings' loop (the dmp lines only when `distributed`); this rank's loss."""
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = keras.losses.BinaryCrossentropy(from_logits=True)(labels, logits)
    if distributed:
        tape = dmp.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    if distributed and first_batch:
        dmp.broadcast_variables(model.variables, root_rank=0)
    return loss


def fed(dist, x, labels, rank, size):
    """What rank `rank` of `size` feeds the dmp model of global batch (x, labels): its b samples
    of the numericals and labels, and of every input's ids (dp_input) or, under model-parallel
    input, the global batch's ids of the inputs its strategy.input_ids_list names."""
    b = B // size
    (numerical, ids) = x
    if dist.distributed.model_parallel_input:
        ids = [ids[i] for i in dist.distributed.strategy.input_ids_list[rank]]
    else:
        ids = [i[rank * b:(rank + 1) * b] for i in ids]
    return (numerical[rank * b:(rank + 1) * b], ids), labels[rank * b:(rank + 1) * b]


UNSEEDED = "he_uniform"


def drawn(initializer, comm) -> WeightTables:
    """TABLES drawn by a Keras initializer, placed by PLAN over the ranks of `comm`."""
    return WeightTables([FeatureConfig(f"f{t}", TableConfig(f"t{t}", rows, dim, initializer=initializer), (None,),
                                       (None, dim)) for t, (rows, dim) in enumerate(TABLES)],
                        collectives=comm, name="drawn", **PLAN)


def main():
    comm = dmp.default_collectives()
    worst = 0.0

    def check(what, got, want):
        nonlocal worst
        err = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
        if not err <= TOLERANCE:
            raise AssertionError(f"rank {comm.rank}: {what}: max abs difference {err:.3g} > {TOLERANCE}")
        worst = max(worst, err)

    xla = sys.argv[1:] == ["xla"]
    if xla:
        tf.config.optimizer.set_jit(True)
    runs = [(name, None, {}) for name in OPTIMIZERS] + [("adagrad", SHARED, {})]
    if not xla:   # model-parallel input: over the row-, column-sliced and replicated tables; over whole tables
        runs += [("sgd", None, {"dp_input": False}), ("adagrad", SHARED, {"dp_input": False, **WHOLE})]
    placed = {}   # per run: its tables' kinds, the inputs this rank takes under model-parallel input
    for name, table_map, options in runs:
        dist, ref = pair(table_map, comm.rank, comm.size, **{**PLAN, **options})
        dist_opt, ref_opt = OPTIMIZERS[name](), OPTIMIZERS[name]()
        step_fn = tf.function(train_step) if xla else train_step   # a graph: auto-clustering compiles parts of it
        name += " shared" * bool(table_map) + " model-parallel input" * ("dp_input" in options) + \
            " whole tables" * ("strategy" in options)
        placed[name] = {"kinds": sorted({t.kind for t in dist.distributed.embedding.plan.tables}),
                        "inputs": dist.distributed.strategy.input_ids_list[comm.rank]}
        for step, (x, labels) in enumerate(batches(STEPS, table_map)):
            loss = step_fn(dist, dist_opt, *fed(dist, x, labels, comm.rank, comm.size), step == 0, True)
            loss = comm.allreduce_sum([loss], f"loss_{name}_{step}")[0] / comm.size
            check(f"{name} step {step} loss", loss, train_step(ref, ref_opt, x, labels, step == 0, False))
        for layer in ("bottom", "top", "logit"):
            for got, want in zip(getattr(dist, layer).get_weights(), getattr(ref, layer).get_weights()):
                check(f"{name} {layer} weights", got, want)
        for t, (got, e) in enumerate(zip(dist.distributed.get_weights(), ref.embeddings)):
            check(f"{name} table {t}", got, e.embeddings.numpy())
    result = {"rank": comm.rank, "max_error": worst, "runs": placed}
    if dist.distributed.model_parallel_input:   # the last run's: every input given
        try:
            dist(batches(1, SHARED)[0][0])
        except ConfigError as e:
            result["wrong_inputs"] = str(e)
    # Keras initializers: a seeded one draws the tables as it does alone; an unseeded one the same
    # tables at any N (its checksum compared across rank counts by the test).
    seeded = keras.initializers.RandomNormal(stddev=0.3, seed=9)
    for t, (whole, shape) in enumerate(zip(drawn(seeded, comm).whole_tables(), TABLES)):
        check(f"table {t} drawn by a seeded initializer", whole, seeded(shape, "float32"))
    result["unseeded"] = [w.tolist() for w in drawn(UNSEEDED, comm).whole_tables()]
    try:   # keras-rs' front door takes one process only
        keras_rs.layers.DistributedEmbedding({"a": keras_rs.layers.FeatureConfig(
            "a", keras_rs.layers.TableConfig("t", 10, 4), (None,), (None, 4))})
        result["keras_rs"] = None
    except ConfigError as e:
        result["keras_rs"] = str(e)
    results = comm.allgather_object(result, "dmp_result")
    if comm.rank == 0:
        print("RESULT", json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
