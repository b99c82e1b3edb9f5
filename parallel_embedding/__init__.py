"""Model-parallel embedding tables: placement planner, collectives, the layer that executes a plan,
and the sparse optimizers that update its rows.

The package owns the tables' state (variables, optimizer slots, their placement and names): the
rest of the project uses only `DistributedEmbedding`'s interface below, so a new kind of table
storage is a change inside this package. Shapes: F features, `B` global batch, `b` local batch,
table f [rows_f, D_f]; `emb = DistributedEmbedding(plan_tables(...), collectives, seed, ...)`.

Lookup and gradient hand-off (the train step):
    looked_up = emb.lookup(ids, training)          F id tensors ([B], [b] or ragged; emb.input_rows(f))
    features = emb.exchange(looked_up, b)          -> F x [b, D_f]; emb(ids, b) does both
                                                   (a table read by m inputs, inputs_per_table:
                                                   their ids concatenated, rows [m b, D_f])
    grads = emb.gradients(looked_up, feature_grads)     F x [b, D_f] -> IndexedSlices, one per variable
Optimizer update of the rows:
    emb.set_optimizer("sgd" | "adagrad" | "adam", step, beta1, beta2, compiled, scope)   once; step:
                                                   the global step counter (int64 variable);
                                                   emb.optimizer.slot_names
    emb.apply_gradients(grads, lr, multi_hot)      only the rows in grads (and their slots) change;
                                                   their updated_at becomes step + 1
Checkpoint entries (storage.checkpoint saves every rank's pieces, restores at any world size):
    emb.checkpoint_entries(weights_only)   this rank's pieces of tensors "embedding/table_<f>"
                                           [rows_f, D_f] and "embedding/table_<f>/<slot>", of
                                           "embedding/table_<f>/updated_at" [rows_f, 1] int32 (the
                                           step that last updated each row, 0: never) and of
                                           "<scope>/iterations" [] (default
                                           "table_optimizer/iterations")
    emb.checkpoint_names(weights_only)     every such tensor name, on any rank
    with emb.restoring(manifest["tensors"]):    around storage.checkpoint.restore: refuses a table
                                           static in one, dynamic in the other; takes a dynamic
                                           table saved in another number of hash shards (re-hashed)
    emb.variables_by_name()                this rank's variables and slots, by variable name
Tables on disk (a plan with tiers, plan_tables(..., tiers=planner.TierOptions(...)); tiered.py):
    batches = emb.staged(batches, training)    elements (numerical, ids, ...) with the ids of tables
                                               on disk as cache rows, staged one element ahead (a
                                               dynamic table on disk: its raw ids kept, its live
                                               rows read ahead; its map decides in the step)
    emb.store_stats()                      hit rate, rows and MB read/written, staging time and wait
    emb.close()                            removes the store's files

Modules: planner.py (`plan_tables`, with `TierOptions` the tiers too: pure Python), collectives.py
(the one seam to Horovod), layer.py (`DistributedEmbedding`: its tables, lookups, optimizer and
tiers; exchange.py its all-to-alls forward and backward, table_state.py its checkpoint entries and
restores, ids.py one feature's flat ids and their combiners), choices.py (the optimizers' and
combiners' names), routing.py (`Router`: a dynamic table
in hash shards at N ranks, each shard's owner receiving and returning only its own ids' rows;
`hash_shards`), tiered.py (`DiskTier`: the disk tier, its caches storage/row_cache.py's),
optimizers.py (SGD, Adagrad, Adam: lazy sparse row updates, and the dense form, which the trainer
uses for the MLPs), dynamic_table.py (`DynamicTable`: raw 64-bit ids, admission and eviction over
the id map op; one per hash shard of the layer's tables of kind "dynamic", planner rule 2: their
ids any int64, `emb.dynamic_stats()` their counts).
"""
UPDATED_AT = "updated_at"   # tensor `<table>/updated_at` [rows, 1] int32: the step that last updated each row
