"""The table files of an export (--forms=tables): every embedding table of a checkpoint as one
.npy file, streamed from the checkpoint's pieces (never a whole table in memory), and tables.json
saying what they hold, for a parameter server (or any process) that does the lookups in front of
the dense SavedModel (file names and format: deployment/repository_format.py). No TensorFlow.

    <dir>/table_<f>.npy   feature f's table [rows_f, D_f] float32, .npy format 1.0, row-major:
                          an id is a row number
    <dir>/tables.json     written last (atomically): checkpoint, step, per table its file, shape,
                          hotness and combiner, and the dense model's name and inputs
"""
import os
from typing import Dict, Tuple

import numpy as np

from deployment.exporter.model_layout import serving_layout, table_tensor
from deployment.repository_format import (EMBEDDINGS, NUMERICAL, PAD, TABLE_DTYPE, TABLES_FORMAT, TABLES_INFO,
                                          TABLES_VERSION)
from nn.model_config import ModelConfig
from storage import checkpoint
from utils.errors import CheckpointError
from utils.files import Checksummed, write_json


def tables_bytes(model: ModelConfig) -> int:
    """The bytes of a model's tables as served (float32)."""
    return sum(t.cardinality * t.dim for t in model.tables) * TABLE_DTYPE.itemsize


def write_tables(manifest: dict, directory: str, dense_model: str, verify: bool = True) -> Tuple[dict, Dict[str, int]]:
    """Writes the table files of the checkpoint whose manifest (storage.checkpoint.read_manifest) is
    given into the new directory `directory`, then tables.json; returns its content and {table
    file: its CRC-32, computed as it was written}. `dense_model`: the name of the SavedModel that
    takes the tables' rows (as `embeddings`); `verify`: check the checksums of the checkpoint's pieces."""
    model = ModelConfig.from_signature(manifest["signature"])
    layout = serving_layout(model)
    os.makedirs(directory)
    tables, offset, checksums = [], 0, {}
    for f, (table, columns) in enumerate(zip(model.tables, layout.columns)):
        file = f"table_{f}.npy"
        checksums[file] = _write_npy(os.path.join(directory, file), manifest, table_tensor(f),
                                     (table.cardinality, table.dim), verify)
        tables.append({"feature": f, "file": file, "rows": table.cardinality, "dim": table.dim,
                       "dtype": TABLE_DTYPE.name, "max_hotness": table.max_hotness, "combiner": table.combiner,
                       "categorical_columns": list(columns), "embedding_columns": [offset, offset + table.dim]})
        offset += table.dim
    info = {"format": TABLES_FORMAT, "version": TABLES_VERSION, "checkpoint": manifest["path"],
            "step": manifest["step"], "pad_id": PAD, "tables": tables,
            "dense_model": {"name": dense_model, "inputs": {NUMERICAL: [layout.num_numerical], EMBEDDINGS: [offset]}}}
    write_json(os.path.join(directory, TABLES_INFO), info)
    return info, checksums


def _write_npy(path: str, manifest: dict, name: str, shape: Tuple[int, int], verify: bool) -> int:
    """Writes tensor `name` [rows, cols] of a checkpoint as a float32 .npy file (the bytes np.save
    writes), a block of rows at a time; returns the file's CRC-32."""
    saved = tuple(manifest["tensors"].get(name, {}).get("shape", ()))
    if saved != shape:
        raise CheckpointError(f"{manifest['path']}: tensor {name} has shape {saved}, its signature says {shape}")
    with open(path, "wb") as f:
        checksummed = Checksummed(f)
        np.lib.format.write_array_header_1_0(checksummed, {"descr": np.lib.format.dtype_to_descr(TABLE_DTYPE),
                                                           "fortran_order": False, "shape": shape})
        for _, block in checkpoint.read_blocks(manifest, name, TABLE_DTYPE, verify):
            checksummed.write(block.data)
        f.flush()
        os.fsync(f.fileno())
    return checksummed.crc

