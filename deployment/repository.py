"""Writes a Triton model repository for a checkpoint.

    OUT/<name>/config.pbtxt, OUT/<name>/1/model.savedmodel/            monolithic
    OUT/<name>_sparse/..., OUT/<name>_dense/...                         the ensemble's parts
    OUT/<name>_ensemble/config.pbtxt, OUT/<name>_ensemble/1/            sparse -> dense
    OUT/export.json         checkpoint, step, signature, serving layout, tables in host memory

Each model is `tensorflow_savedmodel` with dynamic batching. The repository is written under a
temporary name next to OUT and renamed into place; an existing OUT is replaced only when asked,
after the new one is complete.
"""
import dataclasses
import json
import os
import shutil
from typing import Dict, List, Sequence

from deployment.layout import CATEGORICAL, EMBEDDINGS, LOGITS, NUMERICAL, PREDICTIONS, ServingLayout
from nn.checkpoint import read_manifest
from nn.model_config import ModelConfig
from utils.files import move_into_place

FORMS = ("monolithic", "ensemble")
EXPORT_INFO = "export.json"


class ExportError(ValueError):
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
            PREDICTIONS: _tensor(PREDICTIONS, "TYPE_FP32", [1]),
            LOGITS: _tensor(LOGITS, "TYPE_FP32", [1])}


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


def _write(path: str, text: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def write_repository(checkpoint_path: str, out: str, name: str = None, settings: Settings = Settings(),
                     host_table_mb: float = 4096.0, forms: Sequence[str] = FORMS, overwrite: bool = False) -> dict:
    """Exports the checkpoint at `checkpoint_path` into the model repository `out` under model
    name `name` (default dlrm, or dcnv2 for a cross-interaction model); returns its export.json
    content. Tables above `host_table_mb` MiB are served from host memory."""
    for form in forms:
        if form not in FORMS:
            raise ExportError(f"--forms: unknown form {form!r} (choose from {', '.join(FORMS)})")
    if os.path.exists(out) and not overwrite:
        raise ExportError(f"{out} already exists; pass --overwrite to replace it")
    manifest = read_manifest(checkpoint_path)
    signature = manifest["signature"]
    model = ModelConfig.from_signature(signature)
    name = name or ("dcnv2" if model.interaction == "cross" else "dlrm")
    layout = ServingLayout.of(model)
    from deployment.export import load_model, save, serving_modules   # TensorFlow: after the checks
    modules = serving_modules(load_model(manifest), layout, int(host_table_mb * 2 ** 20))
    lookup = modules["sparse"].lookup
    host_tables = [t for t, host in zip(lookup.tables, lookup.on_host) if host]
    tmp = f"{out.rstrip('/')}.tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    parts = {}
    if "monolithic" in forms:
        parts[name] = ("monolithic", [NUMERICAL, CATEGORICAL], [PREDICTIONS, LOGITS])
    if "ensemble" in forms:
        parts[f"{name}_sparse"] = ("sparse", [CATEGORICAL], [EMBEDDINGS])
        parts[f"{name}_dense"] = ("dense", [NUMERICAL, EMBEDDINGS], [PREDICTIONS, LOGITS])
        os.makedirs(os.path.join(tmp, f"{name}_ensemble", "1"))
        _write(os.path.join(tmp, f"{name}_ensemble", "config.pbtxt"),
               ensemble_config(f"{name}_ensemble", f"{name}_sparse", f"{name}_dense", layout, settings))
    for model_name, (part, inputs, outputs) in parts.items():
        save(modules[part], os.path.join(tmp, model_name, "1", "model.savedmodel"),
             host_tables if part != "dense" else ())
        _write(os.path.join(tmp, model_name, "config.pbtxt"), model_config(model_name, inputs, outputs, layout, settings))
    info = {"name": name, "forms": list(forms), "checkpoint": manifest["path"], "step": manifest["step"],
            "written_at_ranks": manifest["world_size"], "signature": signature, "layout": dataclasses.asdict(layout),
            "models": sorted(parts), "host_tables": [f for f, host in enumerate(lookup.on_host) if host],
            "settings": dataclasses.asdict(settings)}
    _write(os.path.join(tmp, EXPORT_INFO), json.dumps(info, indent=1))
    move_into_place(tmp, out, f"{out.rstrip('/')}.old-export")
    return info


def read_export_info(repository: str) -> dict:
    path = os.path.join(repository, EXPORT_INFO)
    if not os.path.isfile(path):
        raise ExportError(f"{repository}: not a model repository written by deployment/deploy.py (no {EXPORT_INFO})")
    with open(path) as f:
        return json.load(f)
