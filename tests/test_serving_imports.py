"""The server imports nothing of training: deployment/serving/ (every import, function-local ones
too) and deployment/serve.py (imported as it starts) load no module of nn, parallel_embedding,
dataloading, storage.checkpoint or the exporter; deployment/repository_format.py, which the
exporter and the server share, imports only utils/."""
import os
import subprocess
import sys

from tests.test_package import ROOT, import_graph, project_modules

TRAINING = ("nn", "parallel_embedding", "dataloading", "storage.checkpoint", "deployment.exporter")


def of_training(modules):
    return sorted(m for m in modules if any(m == t or m.startswith(t + ".") for t in TRAINING))


def reachable(graph, start):
    """The project modules that the modules `start` import, directly or not."""
    seen, todo = set(), list(start)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def loaded(modules):
    """Every module in sys.modules of a fresh python (in this checkout) once it imported `modules`."""
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint(*sys.modules)"
    out = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_serving_imports_nothing_of_training():
    graph = import_graph(project_modules(ROOT))
    serving = [m for m in graph if m.startswith("deployment.serving")]
    assert {"deployment.serving.live", "deployment.serving.native", "deployment.serving.monolithic",
            "deployment.serving.metrics", "deployment.serving.tiers", "deployment.serving.tiers.cache",
            "deployment.serving.tiers.config", "deployment.serving.tiers.lookup", "deployment.serving.tiers.redis_tier",
            "deployment.serving.tiers.store"} <= set(serving)
    assert of_training(reachable(graph, serving)) == []
    assert of_training(loaded(serving + ["deployment.serve"])) == []


def test_the_repository_format_imports_only_utils():
    graph = import_graph(project_modules(ROOT))
    assert {m.split(".")[0] for m in reachable(graph, ["deployment.repository_format"]) - {
        "deployment.repository_format"}} <= {"utils"}


def test_the_checks_see_training_modules():
    graph = import_graph(project_modules(ROOT))
    assert "nn.model_config" in of_training(reachable(graph, ["deployment.exporter.repository"]))
    assert "deployment.exporter.repository" in of_training(loaded(["deployment.exporter.repository"]))
