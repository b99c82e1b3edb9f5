"""The project as a package: no module imports back into a circle or up a floor (module-level and
function-local imports alike; the floors of docs/architecture.md), and `pip install -e .`
(pyproject.toml, what make setup runs) makes every module importable and the scripts runnable
from any directory."""
import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def project_modules(root):
    """{dotted name: file} of the top-level .py files under `root` and of every module in its
    packages (folders with an __init__.py, recursively)."""
    modules = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.endswith(".py"):
            modules[name[:-3]] = path
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            for folder, dirs, files in os.walk(path):
                if not os.path.isfile(os.path.join(folder, "__init__.py")):
                    dirs[:] = []
                    continue
                package = os.path.relpath(folder, root).replace(os.sep, ".")
                for f in files:
                    if f.endswith(".py"):
                        modules[package if f == "__init__.py" else f"{package}.{f[:-3]}"] = os.path.join(folder, f)
    return modules


def import_graph(modules):
    """{module: set of the project modules it imports}, from every import statement in its file
    (module-level, in functions, in branches)."""
    graph = {}
    for name, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + [base] if base else parts)
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)   # `from package import module`
        imported = set()
        for target in targets:
            while target and target not in modules:   # a name in a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                imported.add(target)
        graph[name] = imported
    return graph


def find_cycle(graph):
    """One circle of imports as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if state.get(other) == "open":
                return stack[stack.index(other):] + [other]
            if other not in state:
                cycle = visit(other)
                if cycle:
                    return cycle
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_no_module_imports_back_into_a_circle():
    graph = import_graph(project_modules(ROOT))
    assert {"main", "utils.errors", "dataloading.feature_spec", "tests.test_package"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "an import circle: " + " -> ".join(cycle)


def test_the_circle_check_sees_function_local_and_relative_imports(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import f\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    if True:\n        from . import a\n")
    (tmp_path / "top.py").write_text("import pkg.a\n")
    graph = import_graph(project_modules(str(tmp_path)))
    assert graph == {"top": {"pkg.a"}, "pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg", "pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    pass\n")
    assert find_cycle(import_graph(project_modules(str(tmp_path)))) is None


def floor_rules(doc):
    """{module or package (dotted): (floor, the modules it may import only, or None)} from the
    floors table of `doc` (the markdown table under "## Floors": floor | modules | imports only;
    its `names`: `pkg/`, `pkg/module.py`, `module`)."""
    with open(doc) as f:
        section = f.read().split("\n## Floors\n", 1)[1].split("\n## ", 1)[0]

    def names(cell):
        return [re.sub(r"\.py$", "", name.rstrip("/")).replace("/", ".") for name in re.findall(r"`([^`]+)`", cell)]

    rules = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            for name in names(cells[1]):
                rules[name] = (int(cells[0]), names(cells[2]) or None)
    return rules


def _entry(module, rules):
    """The most specific entry of `rules` that holds `module` (None: none)."""
    parts = module.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in rules), None)


def floor_breaks(graph, modules, rules, root):
    """Every import that goes up a floor, or outside what its module may import only, as
    'a.py -> b (floor x -> y)'; and every module that has no floor. A package whose __init__.py
    imports nothing of the project runs nothing of a floor when imported: it counts as no import."""
    breaks = []
    for name in sorted(graph):
        entry = _entry(name, rules)
        if entry is None:
            breaks.append(f"{os.path.relpath(modules[name], root)}: no floor (docs/architecture.md, ## Floors)")
            continue
        floor, only = rules[entry]
        for target in sorted(graph[name]):
            other = _entry(target, rules)
            if other is None or (modules[target].endswith("__init__.py") and not graph[target]):
                continue   # reported as a module of its own; a package that imports nothing (`from pkg import m`)
            where = f"{os.path.relpath(modules[name], root)} -> {target} (floor {floor} -> {rules[other][0]}"
            if rules[other][0] > floor:
                breaks.append(where + ")")
            elif only is not None and other != entry and _entry(target, dict.fromkeys(only)) is None:
                breaks.append(where + f"; {entry} imports only {', '.join(only)})")
    return breaks


def test_no_module_imports_a_module_of_a_higher_floor():
    rules = floor_rules(os.path.join(ROOT, "docs", "architecture.md"))
    assert rules["utils"][0] == 1 and rules["run"][0] == 6 and rules["main"][0] == 7
    assert rules["deployment.serving"] == (5, ["utils", "storage.row_cache", "deployment.repository_format"])
    modules = project_modules(ROOT)
    breaks = floor_breaks(import_graph(modules), modules, rules, ROOT)
    assert not breaks, "imports that break the floors:\n" + "\n".join(breaks)


def test_the_floor_check_sees_function_local_imports_and_the_imports_only_rule(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(
        "# A\n\n## Floors\n\n| floor | modules | imports only |\n| --- | --- | --- |\n"
        "| 1 | `low/` | |\n| 2 | `high.py` | |\n| 2 | `low/format.py` | |\n"
        "| 2 | `server/` (nothing of high) | `low/format.py` |\n\n## Next\n\n| 9 | `high.py` | |\n")
    rules = floor_rules(str(tmp_path / "docs" / "architecture.md"))
    assert rules == {"low": (1, None), "high": (2, None), "low.format": (2, None),
                     "server": (2, ["low.format"])}
    for package in ("low", "server"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "low" / "a.py").write_text("def f():\n    if True:\n        import high\n")
    (tmp_path / "low" / "format.py").write_text("import low.a\n")
    (tmp_path / "high.py").write_text("from low import a, format\n")
    (tmp_path / "server" / "s.py").write_text("from low import format\nfrom . import t\nimport low.a\n")
    (tmp_path / "server" / "t.py").write_text("")
    (tmp_path / "other.py").write_text("")
    modules = project_modules(str(tmp_path))
    assert floor_breaks(import_graph(modules), modules, rules, str(tmp_path)) == [
        os.path.join("low", "a.py") + " -> high (floor 1 -> 2)",
        "other.py: no floor (docs/architecture.md, ## Floors)",
        os.path.join("server", "s.py") + " -> low.a (floor 2 -> 1; server imports only low.format)"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The python of a fresh virtual environment that sees this one's packages (a .pth file) and
    has this checkout installed as tools/setup_env.sh installs it (editable, offline here)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "base.pth"), "w") as f:
        f.write("".join(p + "\n" for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")))
    out = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                          "-e", ROOT], capture_output=True, text=True, timeout=300,
                         env=dict(without_pythonpath(), PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert out.returncode == 0, out.stdout + out.stderr
    return python


def without_pythonpath():
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_installed_every_module_imports_from_this_checkout(installed, tmp_path):
    """Found where they are, without being run (the tests are not part of the package)."""
    modules = {name: path for name, path in project_modules(ROOT).items() if name.split(".")[0] != "tests"}
    code = ("import importlib.util, sys\n"
            "for name in sys.argv[1:]:\n"
            "    try:\n"
            "        print(name, importlib.util.find_spec(name).origin)\n"
            "    except (ImportError, AttributeError):\n"
            "        print(name, 'not found')\n")
    out = subprocess.run([installed, "-c", code, *modules], cwd=tmp_path, capture_output=True, text=True,
                         env=without_pythonpath())
    assert out.returncode == 0, out.stderr
    assert dict(line.split(" ", 1) for line in out.stdout.splitlines()) == modules


@pytest.mark.parametrize("script", [["dlrm.py", "--helpshort"], ["deployment/deploy.py", "--helpshort"],
                                    ["dataloading/transcode.py", "--help"], ["-m", "preproc.criteo", "--help"]],
                         ids=lambda s: s[-2])
def test_installed_scripts_run_from_another_directory(installed, tmp_path, script):
    args = [os.path.join(ROOT, script[0]) if script[0].endswith(".py") else script[0], *script[1:]]
    out = subprocess.run([installed, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=without_pythonpath())
    assert out.returncode in (0, 1) and "Traceback" not in out.stderr, out.stderr   # absl's help exits 1
    assert ("usage: " in out.stdout) or ("--helpfull" in out.stdout), out.stdout
