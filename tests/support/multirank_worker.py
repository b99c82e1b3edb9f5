"""Run under `horovodrun -np N`: hybrid-parallel training against one process with the whole batch.

For every case (a JSON list in argv[1]) each rank builds the run's model and trainer (the built-in
DLRM / DCNv2 as run/assembly.py builds them: examples/dlrm.py or dcnv2.py handed its tables, in a
run.run_model.RunModel trained by its RunTrainer) on N ranks with the case's plan options and,
beside it, the single-process one (same seed: the same initial weights at any world size). Both
train the same global batches; each rank checks its logits, the global loss and, at the end, every
one of its variables (table shards, optimizer slots, dense weights) against the matching region of
the single-process model's. Exits non-zero on a mismatch.
"""
import json
import sys

import numpy as np
import tensorflow as tf

from dataloading.batches import RankInput, rank_batch
from dataloading.synthetic import SyntheticDataset
from parallel_embedding.collectives import SingleProcess, make_collectives
from parallel_embedding.planner import plan_tables
from run.run_model import RunTrainer
from tests.support.builtin import builtin_trainer
from tests.support.multi_hot import multi_hot_ids

TOLERANCE = 1e-5


def build(case, comm, plan) -> RunTrainer:
    """The run's trainer of the case's model on the ranks of `comm`, its tables on `plan` (None:
    the flags', every table whole): the flags of the case (tables, hotness, interaction, optimizer,
    learning rate, input layout; seed 3), its tables' combiners the case's (per table, which the
    flags cannot give)."""
    cards, dims = case["cardinalities"], case["dims"]
    hotness = case.get("hotness") or [1] * len(cards)
    flags = dict(synthetic_cardinalities=cards, embedding_dim=dims, synthetic_num_numerical=3,
                 bottom_mlp_dims=[16, dims[0]], top_mlp_dims=[16, 1], interaction=case["interaction"],
                 optimizer=case["optimizer"], learning_rate=case.get("lr", 0.05), warmup_steps=0, decay_steps=0,
                 seed=3, batch_size=case.get("batch_size", 48))
    if case["interaction"] == "cross":
        flags.update(num_cross_layers=2, cross_layer_projection_dim=4)
    if max(hotness) > 1:
        flags.update(synthetic_dataset_hotness=hotness)
    if comm.size > 1:
        flags.update(data_parallel_input=case.get("data_parallel_input", False))
    return builtin_trainer(plan, comm, combiners=case.get("combiners"), **flags)


def tensors(batch, case, scopes, global_start, local_start):
    """A batch's tensors; features of hotness > 1 get multi-hot ids of the same samples (`scopes[f]`
    "global": the B samples from global_start, "local": the b from local_start)."""
    categorical = [tf.constant(c) for c in batch["categorical"]]
    for f, h in enumerate(case.get("hotness", [])):
        if h > 1:
            first = global_start if scopes[f] == "global" else local_start
            categorical[f] = multi_hot_ids(case["cardinalities"][f], h, f, first, len(batch["categorical"][f]))
    return tf.constant(batch["numerical"]), categorical, tf.constant(batch["labels"])


def check_close(what, got, want):
    err = float(np.max(np.abs(got - want))) if np.size(want) else 0.0
    if not err <= TOLERANCE:
        raise AssertionError(f"{what}: max abs difference {err:.3g} > {TOLERANCE}")
    return err


def run_case(case, comm):
    cards, dims = case["cardinalities"], case["dims"]
    plan = plan_tables(cards, dims, comm.size, case.get("strategy", "memory_balanced"),
                       case.get("column_slice_threshold"), case.get("row_slice_threshold"),
                       case.get("data_parallel_threshold"))
    kinds = sorted({t.kind for t in plan.tables})
    if "expect_kinds" in case and kinds != sorted(case["expect_kinds"]):
        raise AssertionError(f"plan kinds {kinds}, expected {case['expect_kinds']}")
    dist = build(case, comm, plan)
    dist.broadcast_replicated()
    ref = build(case, SingleProcess(), None)
    emb = dist.model.embeddings
    view = RankInput(comm.rank, comm.size, tuple(emb.input_rows(f) for f in range(len(cards))))
    data = SyntheticDataset(cards, 3, alpha=1.05, seed=7)
    batch_size, worst = case.get("batch_size", 48), 0.0
    b = batch_size // comm.size
    for step in range(case.get("steps", 4)):
        start = step * batch_size
        mine = tensors(rank_batch(data, "train", start, batch_size, view), case, view.scopes, start,
                       start + comm.rank * b)
        whole = tensors(data.batch("train", start, batch_size), case, ["local"] * len(cards), start, start)
        logits = dist.predict(*mine[:2]).numpy()
        ref_logits = ref.predict(*whole[:2]).numpy()[comm.rank * b:(comm.rank + 1) * b]
        worst = max(worst, check_close(f"step {step} logits", logits, ref_logits))
        loss, ref_loss = float(dist.train_step(*mine)), float(ref.train_step(*whole))
        worst = max(worst, check_close(f"step {step} loss", np.float32(loss), np.float32(ref_loss)))
    reference = {e.name: e.variable.numpy() for e in ref.checkpoint_entries()}
    for e in dist.checkpoint_entries():
        value = e.variable.numpy()
        if value.ndim < 2:
            worst = max(worst, check_close(e.name, value, reference[e.name]))
            continue
        (r0, r1), (c0, c1) = e.region
        worst = max(worst, check_close(f"{e.name} rows {r0}:{r1} cols {c0}:{c1}", value[:r1 - r0],
                                       reference[e.name][r0:r1, c0:c1]))
    return {"case": case["name"], "rank": comm.rank, "kinds": kinds, "max_error": worst}


def main():
    comm = make_collectives()
    for case in json.loads(sys.argv[1]):
        result = run_case(case, comm)
        results = comm.allgather_object(result, f"result_{case['name']}")
        if comm.rank == 0:
            print("RESULT", json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
