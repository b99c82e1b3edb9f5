"""Writes a Triton model repository for a checkpoint.

    OUT/<name>/config.pbtxt, OUT/<name>/1/model.savedmodel/            monolithic
    OUT/<name>_sparse/..., OUT/<name>_dense/...                         the ensemble's parts
    OUT/<name>_ensemble/config.pbtxt, OUT/<name>_ensemble/1/            sparse -> dense
    OUT/<name>_dense/..., OUT/<name>_tables/                            tables: the dense model and one
                                                                        .npy file per table (table_files.py)
    OUT/export.json         checkpoint, step, signature, serving layout, tables in host memory, table files,
                            and every other file's size and CRC-32 (repository_format.FILES)

Each model is `tensorflow_savedmodel` with dynamic batching. The monolithic and ensemble forms hold
every table in memory while exporting, and in their SavedModels: they are refused for tables
above a limit (default a fraction of this machine's memory), which the tables form, streamed from
the checkpoint, does not have. The repository is written under a temporary name next to OUT
(hidden, `.<OUT>.tmp-export`: a server polling OUT's folder for updates never takes it; removed on
error) and renamed into place; an existing OUT is replaced only when asked, after the new one is
complete. A full device: one line naming OUT and the bytes needed, the temporary copy removed.
"""
import dataclasses
import json
import os
import shutil
from typing import Dict, List, Optional, Sequence

import numpy as np

from deployment.exporter.deltas import base_signature, base_version, checkpoint_version, descends_from, write_delta
from deployment.exporter.model_layout import (DYNAMIC_IDS, ExportedModel, Table, built_in_export, gather_rows,
                                              is_model_file, read_blocks, read_whole, same_model, with_dynamic_tables)
from deployment.exporter.table_files import write_tables
from deployment.repository_format import (CATEGORICAL, EMBEDDINGS, EXPORT_INFO, FILES, LOGITS, NUMERICAL,
                                          PREDICTIONS, RepositoryError, ServingLayout, file_entries, live_ids)
from parallel_embedding import UPDATED_AT
from storage.checkpoint import read_manifest
from utils import preemption
from utils.files import move_into_place, no_space

FORMS = ("monolithic", "ensemble", "tables")
IN_MEMORY_FORMS = ("monolithic", "ensemble")   # every table in memory (and in a SavedModel)
MEMORY_FRACTION = 0.25   # of physical memory: the default limit of tables exported in memory


class ExportError(RepositoryError):
    """A repository that cannot be written as asked; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """The serving settings written into every config.pbtxt."""
    max_batch_size: int = 65536
    instance_kind: str = "gpu"            # gpu or cpu: where Triton runs each model's instances
    instances: int = 1
    max_queue_delay_us: int = 100


def _tensor(name: str, dtype: str, dims: Sequence[int]) -> str:
    return f'  {{ name: "{name}" data_type: {dtype} dims: [ {", ".join(map(str, dims))} ] }}'


def _tensors(kind: str, tensors: List[str]) -> str:
    return f"{kind} [\n" + ",\n".join(tensors) + "\n]\n"


def _io(layout: ServingLayout) -> Dict[str, str]:
    return {NUMERICAL: _tensor(NUMERICAL, "TYPE_FP32", [layout.num_numerical]),
            CATEGORICAL: _tensor(CATEGORICAL, "TYPE_INT64", [layout.categorical_width]),
            EMBEDDINGS: _tensor(EMBEDDINGS, "TYPE_FP32", [sum(layout.embedding_dims)]),
            PREDICTIONS: _tensor(PREDICTIONS, "TYPE_FP32", [layout.outputs]),
            LOGITS: _tensor(LOGITS, "TYPE_FP32", [layout.outputs])}


def model_config(name: str, inputs: List[str], outputs: List[str], layout: ServingLayout, s: Settings) -> str:
    """config.pbtxt of a SavedModel taking `inputs` and giving `outputs` (tensor names)."""
    io = _io(layout)
    return (f'name: "{name}"\nplatform: "tensorflow_savedmodel"\nmax_batch_size: {s.max_batch_size}\n'
            + _tensors("input", [io[i] for i in inputs]) + _tensors("output", [io[o] for o in outputs])
            + f"instance_group [ {{ count: {s.instances} kind: KIND_{s.instance_kind.upper()} }} ]\n"
            + f"dynamic_batching {{ max_queue_delay_microseconds: {s.max_queue_delay_us} }}\n")


def ensemble_config(name: str, sparse: str, dense: str, layout: ServingLayout, s: Settings) -> str:
    """config.pbtxt of the ensemble: requests as the monolithic model's, sparse then dense."""
    io = _io(layout)

    def maps(kind, names):
        return " ".join(f'{kind} {{ key: "{n}" value: "{n}" }}' for n in names)

    steps = [f'  {{ model_name: "{sparse}" model_version: -1 {maps("input_map", [CATEGORICAL])} '
             f'{maps("output_map", [EMBEDDINGS])} }}',
             f'  {{ model_name: "{dense}" model_version: -1 {maps("input_map", [NUMERICAL, EMBEDDINGS])} '
             f'{maps("output_map", [PREDICTIONS, LOGITS])} }}']
    return (f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: {s.max_batch_size}\n'
            + _tensors("input", [io[NUMERICAL], io[CATEGORICAL]]) + _tensors("output", [io[PREDICTIONS], io[LOGITS]])
            + "ensemble_scheduling {\n step [\n" + ",\n".join(steps) + "\n ]\n}\n")


def _write_text(path: str, text: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def exported_model(manifest: dict, model_file: Optional[str] = None) -> ExportedModel:
    """The model of the checkpoint whose manifest (storage.checkpoint.read_manifest) is given; a
    model file's needs `model_file`, the file its signature names (ExportError, one line, before
    TensorFlow is imported, otherwise), and a built-in model's none. Its dynamic tables (model_layout.
    with_dynamic_tables) are marked so, one in hash shards read as one table."""
    signature, where = manifest["signature"], manifest["path"]
    if not signature:
        raise ExportError(f"{where}: saved without its model file (ranking.Model.save_checkpoint without model_file "
                          f"and features): nothing to rebuild the model from; save it with them to export it")
    if is_model_file(signature):
        if model_file is None:
            raise ExportError(f"{where}: a checkpoint of model file {signature['model']}: pass it as --model=FILE")
        if os.path.basename(model_file) != signature["model"]:
            raise ExportError(f"--model={model_file}: {where} was written by model file {signature['model']}")
        if not os.path.isfile(model_file):
            raise ExportError(f"--model={model_file}: not a file")
        from deployment.exporter.model_file import model_file_export   # TensorFlow, Keras: after the checks
        return with_dynamic_tables(model_file_export(manifest, model_file), manifest)
    if model_file is not None:
        raise ExportError(f"--model={model_file}: {where} is a built-in model's checkpoint (dlrm.py or "
                          "dcnv2.py), not a model file's: drop --model")
    return with_dynamic_tables(built_in_export(manifest), manifest)


def default_tables_limit() -> int:
    """Bytes: MEMORY_FRACTION of this machine's physical memory."""
    return int(MEMORY_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 2 ** 30:.3g} GiB"


def choose_forms(forms: Optional[Sequence[str]], table_bytes: int, limit: int,
                 dynamic: Sequence[str] = (), computed: Sequence[str] = ()) -> List[str]:
    """The forms to write: `forms`, checked, or by default monolithic and ensemble when the tables
    (`table_bytes`) fit in `limit` bytes and none is dynamic (`dynamic`: their tensors), else
    tables. The in-memory forms (a SavedModel's table indexed by row number) cannot take a dynamic
    table's raw ids: refused, naming the table. The tables form looks up the requests' ids as
    they are, not ids the model computes (`computed`: those features' names): refused, naming
    the feature."""
    if forms is None:
        forms = list(IN_MEMORY_FORMS) if table_bytes <= limit and not dynamic else ["tables"]
        if not computed or forms != ["tables"]:
            return forms
    for form in forms:
        if form not in FORMS:
            raise ExportError(f"--forms: unknown form {form!r} (choose from {', '.join(FORMS)})")
    if "tables" in forms and computed:
        raise ExportError(f"feature {computed[0]!r}'s ids are computed in the model, and the tables "
                          f"form looks up the requests' ids as they are: use --forms=monolithic,ensemble (the id "
                          f"computation in their SavedModels)" + (f"; table {dynamic[0]} is dynamic, which only the "
                                                                  "tables form serves" if dynamic else ""))
    in_memory = [f for f in forms if f in IN_MEMORY_FORMS]
    if in_memory and dynamic:
        raise ExportError(f"--forms={','.join(in_memory)}: table {dynamic[0]} is dynamic (raw 64-bit ids), which "
                          "only the tables form serves: use --forms=tables")
    if in_memory and table_bytes > limit:
        raise ExportError(f"the tables take {gib(table_bytes)}, more than --max_tables_in_memory_gb ({gib(limit)}), "
                          f"and --forms={','.join(in_memory)} holds every table in memory: use --forms=tables "
                          "(the dense SavedModel and one .npy file per table)")
    return list(dict.fromkeys(forms))


def write_repository(checkpoint_path: str, out: str, name: str = None, settings: Settings = Settings(),
                     host_table_mb: float = 4096.0, forms: Optional[Sequence[str]] = None, overwrite: bool = False,
                     max_tables_bytes: Optional[int] = None, verify: bool = True,
                     model_file: Optional[str] = None) -> dict:
    """Exports the checkpoint at `checkpoint_path` into the model repository `out` under model
    name `name` (default dlrm, or dcnv2 for a cross-interaction model, or a model file's name
    without .py); returns its export.json content. Tables above `host_table_mb` MiB are served
    from host memory. `forms`: see choose_forms; `max_tables_bytes`: its limit (default
    default_tables_limit()). `verify`: check the checksums of the checkpoint's pieces
    (storage.checkpoint). `model_file`: the model file of a checkpoint written by main.py
    --model=FILE (exported_model)."""
    _check_output(out, overwrite)
    manifest = read_manifest(checkpoint_path)
    model = exported_model(manifest, model_file)
    table_bytes = model.table_bytes
    forms = choose_forms(forms, table_bytes, default_tables_limit() if max_tables_bytes is None else max_tables_bytes,
                         model.dynamic_tables, model.computed)
    name = name or model.name
    return _written_whole(out, lambda tmp: _write_content(manifest, model, tmp, name, settings, host_table_mb, forms,
                                                          verify), table_bytes * len(forms))


def _check_output(out: str, overwrite: bool):
    if os.path.exists(out) and not overwrite:
        raise ExportError(f"{out} already exists; pass --overwrite to replace it")


def _written_whole(out: str, write, need: int):
    """`write(tmp)`'s result, having written `out` under a temporary name next to it and renamed
    it into place (removed on error). `need`: about the bytes it writes, for the line saying that
    the device is full (ExportError)."""
    parent, base = os.path.split(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)   # as `mkdir -p`: an output under folders yet to be made
    except OSError as e:
        raise ExportError(f"{out}: cannot create its folder {parent}: {e.strerror}") from None
    tmp, old = (os.path.join(parent, f".{base}.{kind}-export") for kind in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    free = shutil.disk_usage(parent).free
    try:
        info = write(tmp)
        preemption.check()
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not no_space(e):
            raise
        needed = f"about {need:,} bytes, {free:,} were free" if need > free else f"more than the {free:,} bytes free"
        raise ExportError(f"{out}: no space left on device: it needs {needed} in {parent} (the partial copy removed; "
                          f"{'the existing one unchanged' if os.path.exists(out) else 'nothing written'})") from None
    move_into_place(tmp, out, old)
    return info


def write_delta_repository(checkpoint_path: str, out: str, base_path: str, name: Optional[str] = None,
                           overwrite: bool = False, verify: bool = True, model_file: Optional[str] = None) -> dict:
    """Writes into `out` the delta (deployment/repository_format.py) that turns the version exported at
    `base_path` (a model repository or a delta) into the checkpoint at `checkpoint_path`: the rows
    each table updated since the base's step (a dynamic table's: its ids new to the base or updated
    since, and its live ids) and the whole dense model; returns its delta.json content. The
    checkpoint must descend from the base (same model, trained on from it). `verify`: check the
    checksums of the checkpoint's pieces read; `model_file`: as write_repository's."""
    _check_output(out, overwrite)
    manifest = read_manifest(checkpoint_path)
    model = exported_model(manifest, model_file)
    if model.computed:
        raise ExportError(f"--delta_from: feature {model.computed[0]!r}'s ids are computed in the model, and a delta "
                          f"updates the tables form, which looks up the requests' ids as they are: export it in full "
                          f"(--forms=monolithic,ensemble)")
    base = base_version(base_path)
    if not same_model(base_signature(base_path), manifest["signature"]):
        raise ExportError(f"{base_path}: another model than {manifest['path']}'s (its signature differs)")
    new = checkpoint_version(manifest)
    if not descends_from(manifest, base):
        raise ExportError(f"{manifest['path']} ({new}) was not trained on from {base_path} ({base}): "
                          "export it in full instead")
    if any(n not in manifest["tensors"] for t in model.tables for n in t.tensors(UPDATED_AT)):
        raise ExportError(f"{manifest['path']}: written without the rows' updated_at (an older checkpoint): "
                          "export it in full instead")

    updated_ids = [np.concatenate([np.zeros(0, np.int64)] + [
        start + np.flatnonzero(block[:, 0] > base.step)
        for start, block in read_blocks(manifest, table, UPDATED_AT, verify=verify)]) for table in model.tables]
    # Dynamic tables: the checkpoint rows (ascending; a table in hash shards: its shards' concatenated)
    # of the ids new to the base or updated since, in ascending id order (`order`), and every live id
    dynamic = {t: _dynamic_update(manifest, table, live_ids(base_path, t), updated_ids[t], verify)
               for t, table in enumerate(model.tables) if table.dynamic}
    need = sum(ids.size * (8 + 4 * table.dim) for ids, table in zip(updated_ids, model.tables))   # ids and rows
    need += sum(8 * d[3].size for d in dynamic.values())

    def tables():
        for t, (table, ids) in enumerate(zip(model.tables, updated_ids)):
            if t in dynamic:
                rows, order, raw = dynamic[t][:3]
                yield t, table.rows, raw, gather_rows(manifest, table, rows, np.float32, verify)[order]
            else:
                yield t, table.rows, ids, gather_rows(manifest, table, ids, np.float32, verify)

    def write_dense(path):
        from deployment.exporter.saved_models import save, serving_modules   # TensorFlow: after the checks
        save(serving_modules(manifest, 0, with_tables=False, verify=verify, model=model)["dense"], path)

    return _written_whole(out, lambda tmp: write_delta(tmp, name or model.name, base, new, manifest["signature"],
                                                       tables(), write_dense, model.per_feature,
                                                       {t: d[3:] for t, d in dynamic.items()}), need)


def _dynamic_update(manifest: dict, table: Table, base_live: np.ndarray, updated: np.ndarray, verify: bool):
    """A dynamic table's part of a delta: (checkpoint rows [n] ascending, `order` [n] putting them in
    ascending id order, those ids [n], every live id [L] ascending, the count of the base's ids
    evicted), for the ids new to the base (`base_live`: its live ids, ascending) or updated since
    (`updated`: their checkpoint rows)."""
    ids = read_whole(manifest, table, DYNAMIC_IDS, verify)[:, 0].astype(np.int64)
    new = ~np.isin(ids, base_live, assume_unique=True)
    new[updated] = True
    rows = np.flatnonzero(new)
    order = np.argsort(ids[rows], kind="stable")
    live = np.sort(ids)
    return rows, order, ids[rows][order], live, int((~np.isin(base_live, live, assume_unique=True)).sum())


def _write_content(manifest: dict, model: ExportedModel, tmp: str, name: str, settings: Settings,
                   host_table_mb: float, forms: Sequence[str], verify: bool) -> dict:
    """Writes the repository's content into the new directory `tmp`; returns its export.json content."""
    from deployment.exporter.saved_models import save, serving_modules   # TensorFlow: after the checks
    layout = model.layout
    in_memory = any(f in IN_MEMORY_FORMS for f in forms)
    modules = serving_modules(manifest, int(host_table_mb * 2 ** 20), in_memory, verify, model)
    lookup = modules["sparse"].lookup if in_memory else None
    host_tables = [t for t, host in zip(lookup.tables, lookup.on_host) if host] if lookup else []
    parts = {}
    os.makedirs(tmp)
    if "monolithic" in forms:
        parts[name] = ("monolithic", [NUMERICAL, CATEGORICAL], [PREDICTIONS, LOGITS])
    if "ensemble" in forms:
        parts[f"{name}_sparse"] = ("sparse", [CATEGORICAL], [EMBEDDINGS])
        os.makedirs(os.path.join(tmp, f"{name}_ensemble", "1"))
        _write_text(os.path.join(tmp, f"{name}_ensemble", "config.pbtxt"),
                    ensemble_config(f"{name}_ensemble", f"{name}_sparse", f"{name}_dense", layout, settings))
    if "ensemble" in forms or "tables" in forms:
        parts[f"{name}_dense"] = ("dense", [NUMERICAL, EMBEDDINGS], [PREDICTIONS, LOGITS])
    for model_name, (part, inputs, outputs) in parts.items():
        save(modules[part], os.path.join(tmp, model_name, "1", "model.savedmodel"),
             host_tables if part != "dense" else ())
        _write_text(os.path.join(tmp, model_name, "config.pbtxt"),
                    model_config(model_name, inputs, outputs, layout, settings))
    table_files, written = None, {}
    if "tables" in forms:
        directory = f"{name}_tables"
        files, checksums = write_tables(manifest, model, os.path.join(tmp, directory), f"{name}_dense", verify)
        written = {f"{directory}/{file}": crc for file, crc in checksums.items()}
        table_files = {"directory": directory, "tables": len(files["tables"]), "bytes": sum(
            os.path.getsize(os.path.join(tmp, directory, t["file"])) for t in files["tables"]),
            **({"dynamic": model.dynamic_tables} if model.dynamic_tables else {})}
    info = {"name": name, "forms": list(forms), "checkpoint": manifest["path"], "step": manifest["step"],
            "version": checkpoint_version(manifest).to_json(),
            "written_at_ranks": manifest["world_size"], "signature": manifest["signature"],
            "layout": _layout_json(layout), "models": sorted(parts),
            "ensemble": f"{name}_ensemble" if "ensemble" in forms else None,
            "host_tables": [f for f, host in enumerate(lookup.on_host) if host] if lookup else [],
            "table_files": table_files, "settings": dataclasses.asdict(settings),
            FILES: file_entries(tmp, EXPORT_INFO, written)}   # the SavedModels (TensorFlow's writer) read back
    _write_text(os.path.join(tmp, EXPORT_INFO), json.dumps(info, indent=1))
    return info


def _layout_json(layout: ServingLayout) -> dict:
    """export.json's "layout": without `lookup_features` for the built-in models (one lookup per
    feature), without `heads` for a model of one output, without `values` for one of logits alone."""
    out = dataclasses.asdict(layout)
    for optional in ("lookup_features", "heads", "values"):
        if out[optional] is None:
            del out[optional]
    return out
