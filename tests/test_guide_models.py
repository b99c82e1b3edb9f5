"""docs/models.md runs as it reads. The page marks its code blocks by their info strings:

    ```python file=NAME   a model file: written to NAME in a scratch directory
    ```python run         a script: executed in a fresh namespace (the page's scripts in one process,
                          in order, from the scratch directory)
    ```bash run           commands: run in order in one bash (set -euo pipefail): the guide's (before
                          "# Reference") in one shell, the reference's in another, after the scripts
    ```text               right after a `run` block: lines that block prints

The scratch directory stands for the repository root: it links main.py, deployment/ and examples/
of this checkout, and its .venv/bin/python and .venv/bin/horovodrun start the tests' warm
interpreter (tests/support/warm_python.py). The server the guide starts listens on free ports
instead of 8000-8002 (its flags, and the clients' URLs, rewritten).

Checked: every code block of the page is marked; each model file is trained by a command of the
page; every block runs without error (a failing script's traceback names the page's line); each
line of a `text` block is a line its block printed, numbers and run ids aside; and what the guide
says of its runs: two ranks print the losses and AUC of one process, the 2-rank checkpoint
evaluates to that AUC, the served model scores that AUC through the server, and the running
server applies the second day's delta (its answers then come from step 24 instead of 16)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from deployment.client import free_ports
from tests.support.horovod_run import ROOT
from tests.support.warm_python import PYTHON, executable

PAGE = os.path.join(ROOT, "docs", "models.md")
LINKED = ("main.py", "deployment", "examples")   # what the page's commands name of the checkout
MARKER = "@@@ block "                              # printed before each block's output
REFERENCE = "# Reference"                          # the heading after the guide's steps

# The scripts of the page, each in a fresh namespace, its code at its lines of the page (tracebacks
# name docs/models.md and the page's line).
RUN_SCRIPTS = """
import json, sys
for block in json.load(open(sys.argv[1])):
    print("\\n%s" + str(block["index"]), flush=True)
    code = compile("\\n" * block["line"] + block["text"], "docs/models.md", "exec")
    exec(code, {"__name__": "__main__"})
    sys.stdout.flush()
""" % MARKER

# curl for a machine without it: POST -d's body to the URL, print the answer.
CURL = """#!%s
import sys, urllib.request
args = sys.argv[1:]
url = next(a for a in args if a.startswith("localhost"))
body = args[args.index("-d") + 1].encode()
print(urllib.request.urlopen(urllib.request.Request("http://" + url, data=body)).read().decode())
"""


def page_blocks(path: str = PAGE) -> list:
    """The page's fenced code blocks (fences at the start of a line): per block its index, `info`
    (the words after the fence), `kind` (file, run, output or plain), `lang`, `name` (a file
    block's), `line` (the 0-based line of its first line of code), `text` and `part` ("guide" before
    the reference's heading, else "reference")."""
    out, block, part = [], None, "guide"
    with open(path) as f:
        lines = f.read().split("\n")
    for n, line in enumerate(lines):
        if block is None:
            if line.strip() == REFERENCE:
                part = "reference"
            if line.startswith("```"):
                words = line[3:].split()
                block = dict(index=len(out), info=words, lang=words[0] if words else "", line=n + 1, lines=[],
                             part=part)
        elif line == "```":
            block["text"] = "\n".join(block.pop("lines")) + "\n"
            words = block["info"][1:]
            block["name"] = next((w[5:] for w in words if w.startswith("file=")), None)
            block["kind"] = "file" if block["name"] else "run" if words == ["run"] else "plain"
            if block["lang"] == "text" and not words and out and out[-1]["kind"] == "run":
                block["kind"] = "output"
            out.append(block)
            block = None
        else:
            block["lines"].append(line)
    assert block is None, f"docs/models.md: the code block at line {block['line']} is not closed"
    return out


def normalized(line: str) -> str:
    """A printed line without what differs between runs: numbers (with their sign), run ids, runs
    of spaces."""
    line = re.sub(r"run [0-9a-f]{8}\b", "run #", line)
    line = re.sub(r"-?\d+(?:[.,:]\d+)*(?:e[-+]?\d+)?", "#", line)
    return " ".join(line.split())


def assert_shown(blocks: list, outputs: dict):
    """Every line of each `text` block after a run block of `outputs` (by index) is a line that
    run block printed, numbers aside."""
    for i, block in enumerate(blocks):
        if block["kind"] != "output" or blocks[i - 1]["index"] not in outputs:
            continue
        printed = {normalized(line) for line in outputs[blocks[i - 1]["index"]].splitlines()}
        for line in block["text"].splitlines():
            if line.strip():
                assert normalized(line) in printed, (
                    f"docs/models.md line {block['line'] + 1}: the page shows {line!r}, which the block at line "
                    f"{blocks[i - 1]['line']} did not print; it printed:\n{outputs[blocks[i - 1]['index']]}")


def split_output(text: str) -> dict:
    """{block index: its output} of a run whose blocks printed MARKER + index before theirs."""
    out, index = {}, None
    for line in text.splitlines(keepends=True):
        if line.startswith(MARKER):
            index = int(line[len(MARKER):])
            out[index] = ""
        elif index is not None:
            out[index] += line
    return out


def marked(kind: str, lang: str, part: str = None) -> list:
    return [b for b in BLOCKS if b["kind"] == kind and b["lang"] == lang and part in (None, b["part"])]


BLOCKS = page_blocks()


def test_the_page_marks_every_code_block_and_trains_each_model_file():
    plain = [b["line"] for b in BLOCKS if b["kind"] == "plain"]
    assert not plain, f"docs/models.md: unmarked code blocks at lines {plain} (mark them file=NAME, run, or " \
                      f"text after a run block)"
    commands = "".join(b["text"] for b in marked("run", "bash"))
    for block in BLOCKS:
        if block["kind"] == "file":
            assert f"--model={block['name']}" in commands, f"no command of the page trains {block['name']}"
    guide = "".join(b["text"] for b in marked("run", "bash", "guide"))
    for step in ("main.py --model=", "horovodrun -np 2", "--mode=eval", "deployment/deploy.py", "deployment/serve.py",
                 "--restore_mode=continue", "--delta_from="):
        assert step in guide, f"the guide's commands lack {step!r}"
    assert len(marked("run", "python")) >= 5


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """The directory the page's commands run in (the module docstring), its model files written."""
    path = tmp_path_factory.mktemp("guide")
    for name in LINKED:
        os.symlink(os.path.join(ROOT, name), path / name)
    (path / ".venv" / "bin").mkdir(parents=True)
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    for name, command in (("python", executable()), ("horovodrun", f"{' '.join(PYTHON)} {horovodrun}")):
        (path / ".venv" / "bin" / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        (path / ".venv" / "bin" / name).chmod(0o755)
    (path / "bin").mkdir()
    if not shutil.which("curl"):
        (path / "bin" / "curl").write_text(CURL % sys.executable)
        (path / "bin" / "curl").chmod(0o755)
    for block in BLOCKS:
        if block["kind"] == "file":
            (path / block["name"]).write_text(block["text"])
    return path


def run_shell(scratch, blocks, timeout=400) -> dict:
    """`blocks`' commands in one bash in `scratch`, serve.py on free ports: {block index: output}.
    Whatever the commands left running (a server) is stopped after."""
    http, grpc, metrics = free_ports(3)
    script = ["set -euo pipefail"]
    for block in blocks:
        text = block["text"]
        if "deployment/serve.py" in text:
            text = text.replace("deployment/serve.py ",
                                f"deployment/serve.py --http_port={http} --grpc_port={grpc} --metrics_port={metrics} ")
        text = text.replace("deployment/evaluate_accuracy.py ",
                            f"deployment/evaluate_accuracy.py --url=localhost:{http} ")
        text = text.replace("localhost:8000", f"localhost:{http}")
        script += [f"printf '\\n{MARKER}{block['index']}\\n'", text]   # after a last line without its newline (curl's)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3",
               PATH=os.pathsep.join([str(scratch / "bin"), os.environ["PATH"]]))
    process = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=scratch, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)   # the commands' session: a server left running
        except ProcessLookupError:
            pass
        process.wait()
    assert process.returncode == 0, f"the page's commands failed (exit {process.returncode}):\n{output[-6000:]}"
    return split_output(output)


def figures(line: str) -> dict:
    """{name: value} of the `| name value` pairs of a progress or evaluation line."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"(\w+) (-?[\d.]+)(?= \||$| samples)", line)}


def lines_with(text: str, start: str) -> list:
    """The lines of `text` starting with `start`, without horovodrun's `[r]<stdout>:` prefix."""
    lines = [line.split("<stdout>:", 1)[-1] for line in text.splitlines()]
    return [line for line in lines if line.startswith(start)]


@pytest.mark.slow   # six runs and a server: about 15 s on a quiet 2-core machine, more than 60 s under load
def test_the_guide_trains_on_one_and_two_ranks_evaluates_exports_serves_and_updates_the_server(scratch):
    blocks = marked("run", "bash", "guide")
    out = run_shell(scratch, blocks)
    assert_shown(BLOCKS, out)
    train, two, evaluated, exported, served, continued = (out[b["index"]] for b in blocks)
    # two ranks: the one process' losses and AUC, and its checkpoint evaluates to that AUC
    assert "1 rank" in train and "2 ranks" in two
    steps = lines_with(train, "step ")
    assert steps and [figures(s)["loss"] for s in steps] == [figures(s)["loss"] for s in lines_with(two, "step ")]
    auc = figures(lines_with(train, "eval at step")[0])["auc"]
    assert figures(lines_with(two, "eval at step")[0])["auc"] == auc
    assert "written at 2 rank(s)" in evaluated and figures(lines_with(evaluated, "eval at step")[0])["auc"] == auc
    # served: the evaluation split through the server scores that AUC; an answer from step 16, then 24
    assert "SavedModels" in exported
    assert figures(lines_with(served, "served my_model over http")[0])["auc"] == auc
    answers = [json.loads(line) for line in (served + continued).splitlines() if line.startswith('{"model_name"')]
    versions = [next(o["data"][0] for o in a["outputs"] if o["name"] == "model_version") for a in answers]
    assert versions == [16, 24], answers
    assert "applied update runs/my_model/updates/day2 (delta" in continued


@pytest.fixture(scope="module")
def scripts(scratch):
    """The page's Python scripts run in one process in `scratch`: {block index: output}."""
    listed = scratch / "scripts.json"
    listed.write_text(json.dumps([{k: b[k] for k in ("index", "line", "text")} for b in marked("run", "python")]))
    result = subprocess.run([*PYTHON, "-c", RUN_SCRIPTS, str(listed)], cwd=scratch, capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3"))
    assert result.returncode == 0, f"a script of the page failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return split_output(result.stdout)


def test_the_reference_scripts_run_and_print_what_the_page_shows(scripts):
    assert sorted(scripts) == [b["index"] for b in marked("run", "python")]
    assert_shown(BLOCKS, scripts)


def test_the_reference_commands_evaluate_and_export_the_scripts_checkpoint(scratch, scripts):
    blocks = marked("run", "bash", "reference")
    out = run_shell(scratch, blocks)
    assert_shown(BLOCKS, out)
    assert any("restored runs/deepfm/ckpt/ckpt-10" in text for text in out.values())
