"""The table files of an export (--forms=tables): every embedding table of a checkpoint as one
.npy file, streamed from the checkpoint's pieces (never a whole table in memory), and tables.json
saying what they hold, for a parameter server (or any process) that does the lookups in front of
the dense SavedModel (file names and format: deployment/repository_format.py). No TensorFlow.

    <dir>/table_<t>.npy   table t [rows_t, D_t] float32, .npy format 1.0, row-major: an id is a
                          row number
    <dir>/table_<t>.ids.npy   a dynamic table's: [rows_t, 2] int64, row r's (raw id, LIVE); its
                          rows are the checkpoint's live rows (an id is looked up by value), of
                          all its hash shards in shard order
    <dir>/tables.json     written last (atomically): checkpoint, step, per table its file and
                          shape, per lookup (a feature's ids in a table, a slice of embeddings)
                          its feature, table, hotness, combiner and columns (a sequence: its L),
                          and the dense model's name and inputs. The built-in models (lookup f =
                          feature f = table f) have no `lookups`: table f's entry holds lookup f's
                          keys (repository_format.table_lookups reads either).
"""
import os
from typing import Dict, Tuple

import numpy as np

from deployment.exporter.model_layout import DYNAMIC_IDS, ExportedModel, Table, read_blocks, read_whole
from deployment.repository_format import (EMBEDDINGS, IDS_DTYPE, LIVE, NUMERICAL, PAD, TABLE_DTYPE, TABLES_FORMAT,
                                          TABLES_INFO, TABLES_VERSION)
from utils.errors import CheckpointError
from utils.files import Checksummed, write_json


def write_tables(manifest: dict, model: ExportedModel, directory: str, dense_model: str,
                 verify: bool = True) -> Tuple[dict, Dict[str, int]]:
    """Writes the table files of the checkpoint whose manifest (storage.checkpoint.read_manifest)
    and model are given into the new directory `directory`, then tables.json; returns its content
    and {table file: its CRC-32, computed as it was written}. `dense_model`: the name of the
    SavedModel that takes the lookups' rows (as `embeddings`); `verify`: check the checksums of
    the checkpoint's pieces."""
    layout = model.layout
    os.makedirs(directory)
    tables, lookups, offset, checksums = [], [], 0, {}
    for t, table in enumerate(model.tables):
        file = f"table_{t}.npy"
        checksums[file] = _write_npy(os.path.join(directory, file), manifest, table, verify)
        tables.append({"table": t, "file": file, "rows": table.rows, "dim": table.dim, "dtype": TABLE_DTYPE.name})
        if table.dynamic:
            ids_file = f"table_{t}.ids.npy"
            checksums[ids_file] = _write_ids(os.path.join(directory, ids_file), manifest, table, verify)
            tables[-1].update(dynamic=True, ids_file=ids_file)
    for lookup, dim in zip(model.lookups, layout.embedding_dims):
        lookups.append({"feature": lookup.feature, "table": lookup.table,
                        "max_hotness": layout.max_hotness[lookup.feature], "combiner": lookup.combiner,
                        "categorical_columns": list(layout.columns[lookup.feature]),
                        "embedding_columns": [offset, offset + dim],
                        **({} if lookup.sequence is None else {"sequence": lookup.sequence})})
        offset += dim
    if model.per_feature:   # table f's entry is lookup f's
        tables = [{"feature": t.pop("table"), **t, **{k: v for k, v in x.items() if k not in ("feature", "table")}}
                  for t, x in zip(tables, lookups)]
    info = {"format": TABLES_FORMAT, "version": TABLES_VERSION, "checkpoint": manifest["path"],
            "step": manifest["step"], "pad_id": PAD, "tables": tables,
            **({} if model.per_feature else {"lookups": lookups}),
            "dense_model": {"name": dense_model, "inputs": {NUMERICAL: [layout.num_numerical], EMBEDDINGS: [offset]}}}
    write_json(os.path.join(directory, TABLES_INFO), info)
    return info, checksums


def _write_ids(path: str, manifest: dict, table: Table, verify: bool) -> int:
    """Writes a dynamic table's ids file (its checkpoint's `<tensor>/ids` [L, 1] int64, of its hash
    shards concatenated in shard order as its rows, each row LIVE: [L, 2]); returns its CRC-32."""
    ids = read_whole(manifest, table, DYNAMIC_IDS, verify).astype(IDS_DTYPE)
    if len(np.unique(ids)) != len(ids):
        raise CheckpointError(f"{manifest['path']}: table {table.tensor}'s ids "
                              f"({', '.join(table.tensors(DYNAMIC_IDS))}) hold an id twice")
    with open(path, "wb") as f:
        checksummed = Checksummed(f)
        np.save(checksummed, np.concatenate([ids.reshape(-1, 1), np.full((len(ids), 1), LIVE, IDS_DTYPE)], axis=1))
        f.flush()
        os.fsync(f.fileno())
    return checksummed.crc


def _write_npy(path: str, manifest: dict, table: Table, verify: bool) -> int:
    """Writes the table's rows [rows, dim] (its tensor, or its hash shards' concatenated) as a float32
    .npy file (the bytes np.save writes), a block of rows at a time; returns the file's CRC-32."""
    shape = (table.rows, table.dim)
    saved = [tuple(manifest["tensors"].get(name, {}).get("shape", ())) for name in table.tensors()]
    if any(len(s) != 2 or s[1] != table.dim for s in saved) or sum(s[0] for s in saved) != table.rows:
        raise CheckpointError(f"{manifest['path']}: tensor {table.tensor} has shape "
                              f"{saved[0] if len(saved) == 1 else saved}, its signature says {shape}")
    with open(path, "wb") as f:
        checksummed = Checksummed(f)
        np.lib.format.write_array_header_1_0(checksummed, {"descr": np.lib.format.dtype_to_descr(TABLE_DTYPE),
                                                           "fortran_order": False, "shape": shape})
        for _, block in read_blocks(manifest, table, "", TABLE_DTYPE, verify):
            checksummed.write(block.data)
        f.flush()
        os.fsync(f.fileno())
    return checksummed.crc

