"""The launchers: slurm_multinode.sh (dry runs under a faked SLURM allocation, and its errors),
the linters on it, tools/setup_env.sh and the Dockerfile, and the pins those files share."""
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM = os.path.join(ROOT, "slurm_multinode.sh")
SETUP = os.path.join(ROOT, "tools", "setup_env.sh")
DOCKERFILE = os.path.join(ROOT, "Dockerfile")
FRESH_DEBIAN = os.path.join(ROOT, "benchmarks", "fresh_debian.sh")


def read(path):
    with open(path) as f:
        return f.read()


def linter(name):
    """The linter requirements.txt installs beside this Python, else one on PATH, else skip."""
    path = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (requirements.txt pins it; run make setup)")
    return path


@pytest.mark.parametrize("script", [SLURM, SETUP, FRESH_DEBIAN], ids=os.path.basename)
def test_shellcheck_clean(script):
    out = subprocess.run([linter("shellcheck"), script], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_clean():
    out = subprocess.run([linter("hadolint"), "--no-color", DOCKERFILE], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# --- the versions the Dockerfile, the set-up script and requirements.txt share

def test_docker_base_images_are_the_pinned_tensorflow_and_debian():
    """The GPU image (the last stage: what a plain `docker build` makes) is on TensorFlow's own
    image at the pinned version, the CPU one (`--target cpu`) on Debian 12, whose Python is the
    set-up's 3.11; both bases are build arguments."""
    pin = re.search(r"^tensorflow==(\S+)", read(os.path.join(ROOT, "requirements.txt")), re.M).group(1)
    docker = read(DOCKERFILE)
    assert re.findall(r"^FROM\s+(.+)$", docker, re.M) == ["${CPU_BASE} AS cpu", "${BASE} AS gpu"]
    assert re.findall(r"^ARG (BASE|CPU_BASE)=(\S+)$", docker, re.M) == [
        ("BASE", f"tensorflow/tensorflow:{pin}-gpu"), ("CPU_BASE", "debian:bookworm")]


def test_docker_builds_the_set_up_scripts_horovod():
    version = re.search(r"^HOROVOD_VERSION=(\S+)", read(SETUP), re.M).group(1)
    docker = read(DOCKERFILE)
    # Horovod comes from tools/setup_env.sh (its version, patches and requirements.txt) ...
    assert re.search(r"^COPY requirements\.txt ", docker, re.M) and re.search(r"^COPY tools/ tools/", docker, re.M)
    assert re.search(r"HOROVOD_GPU_OPERATIONS=NCCL .*bash tools/setup_env\.sh --system", docker, re.S)
    # ... and any Horovod version the Dockerfile names is that one.
    for named in re.findall(r"horovod[=\-v ]+(\d+\.\d+\.\d+)", docker, re.I):
        assert named == version


def test_setup_and_docker_install_the_project_editable():
    """The venv (tools/setup_env.sh) and the image (which copies the sources in after its
    --system set-up) both install the project editable (pyproject.toml)."""
    assert re.search(r'^if \[ "\$\{1:-\}" != --system \]; then \$PIP install --no-deps -e \.; fi$', read(SETUP), re.M)
    installs = re.findall(r"^COPY \. \.\nRUN python3 -m pip install --no-deps --no-build-isolation -e \.$",
                          uncommented(read(DOCKERFILE)), re.M)
    assert len(installs) == 2   # each image


# --- the Docker build: what its RUN steps use, the GPU code it compiles

def tracked_paths():
    """The repository's tracked files and their folders, relative to ROOT."""
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    files = out.stdout.split()
    return set(files) | {f[:i] for f in files for i, c in enumerate(f) if c == "/"}


def uncommented(text):
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def paths_used(text, tracked, seen):
    """The tracked paths `text` (a RUN step or a script it runs) names (a folder as ./DIR or DIR/),
    and those the scripts it names name in turn; `seen` collects the scripts already read."""
    used = set()
    for token in re.findall(r"[\w./-]+", uncommented(text)):
        path = token[2:] if token.startswith("./") else token
        path = path.rstrip("/")
        if os.path.isdir(os.path.join(ROOT, path)) and "/" not in token:
            continue   # a bare word ("run" in a sentence): a folder is named as ./DIR or DIR/
        if path in tracked and path not in seen:
            used.add(path)
            if path.endswith((".sh", ".py")):
                seen.add(path)
                used |= paths_used(read(os.path.join(ROOT, path)), tracked, seen)
    return used


def uncopied_paths(dockerfile):
    """[(RUN step number, path)] for each tracked path a RUN step uses that no earlier COPY of its
    stage put at the same place (relative to WORKDIR)."""
    tracked = tracked_paths()
    copies, missing = [], []
    steps = re.findall(r"^(FROM|COPY|RUN)\s+(.*)$", re.sub(r"\\\n", " ", uncommented(dockerfile)), re.M)
    for number, (keyword, args) in enumerate(steps):
        if keyword == "FROM":
            copies = []
            continue
        if keyword == "COPY":
            *sources, dest = [a for a in args.split() if not a.startswith("--")]
            for src in sources:
                placed = dest + os.path.basename(src.rstrip("/")) if dest.endswith("/") and os.path.isfile(
                    os.path.join(ROOT, src)) else dest
                copies.append((os.path.normpath(src), os.path.normpath(placed)))
            continue
        for path in sorted(paths_used(args, tracked, set())):
            if not any(src == placed and (src == "." or path == src or path.startswith(src + "/"))
                       for src, placed in copies):
                missing.append((number, path))
    return missing


def test_docker_run_steps_use_only_copied_paths():
    """Every repository path a RUN step uses (also through the scripts it runs) came in by an
    earlier COPY of its stage; the check finds the op's sources when their COPYs are left out."""
    docker = read(DOCKERFILE)
    assert uncopied_paths(docker) == []
    without = re.sub(r"^COPY tensorflow-dot-based-interact/ .*$", "", docker, flags=re.M)
    assert [path for _, path in uncopied_paths(without)] == ["tensorflow-dot-based-interact"] * 2   # each stage


def op_setup():
    """tensorflow-dot-based-interact/setup.py as a module (importing it runs no build)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("op_setup", os.path.join(ROOT, "tensorflow-dot-based-interact",
                                                                            "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docker_builds_horovod_and_the_op_for_the_ops_gpu_list():
    docker = read(DOCKERFILE)
    assert re.findall(r"^ARG CUDA_CC_LIST=(\S+)$", docker, re.M) == [op_setup().CUDA_CAPABILITIES]
    build = re.sub(r"\\\n", " ", docker)
    assert re.search(r'HOROVOD_BUILD_CUDA_CC_LIST="\$CUDA_CC_LIST" .*DOT_INTERACT_CUDA_ARCHS="\$CUDA_CC_LIST" .*'
                     r"tools/setup_env\.sh --system .*get_registered_kernels_for_op\(\"DotBasedInteract\"\)", build)


def test_op_build_has_machine_code_for_each_gpu_and_ptx_for_the_newest():
    """nvcc's own plan (--dryrun) for setup.py's flags: machine code for every listed compute
    capability this nvcc supports, PTX for the highest of them."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    setup = op_setup()
    supported = {int(c) for c in re.findall(r"sm_(\d+)", subprocess.run([nvcc, "--list-gpu-code"], capture_output=True,
                                                                         text=True).stdout)}
    listed = {int(c) for c in setup.CUDA_CAPABILITIES.split(",")}
    dry = subprocess.run([nvcc, "--dryrun", "-c", os.path.join(setup.SRC, "dot_based_interact.cu"), "-o", os.devnull,
                          *setup.gencode_flags(nvcc, setup.CUDA_CAPABILITIES)], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    images = re.findall(r"--image3=kind=(elf|ptx),sm=(\d+)", dry.stderr)
    assert sorted(int(sm) for kind, sm in images if kind == "elf") == sorted(listed & supported)
    assert [int(sm) for kind, sm in images if kind == "ptx"] == [max(listed & supported)]


# --- slurm_multinode.sh under a faked allocation

def executable(path, text):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


@pytest.fixture
def fake(tmp_path):
    """A bin folder with a fake scontrol (n[1-2] -> n1, n2; a,b -> a, b), first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "scontrol",
               '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 1\n'
               'case $3 in "n[1-2]") printf "n1\\nn2\\n" ;; *) echo "$3" | tr , "\\n" ;; esac\n')
    return bin_dir


def run_slurm(fake, args, cwd=None, **env):
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "HOROVOD", "OMP_", "TF_NUM_")) and k not in ("VENV", "LAUNCHER", "DRY_RUN")}
    base["PATH"] = f"{fake}:/usr/bin:/bin"
    return subprocess.run(["bash", SLURM, *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd or fake.parent, env=dict(base, **env))


def launched(out):
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("launching: ")]
    assert len(lines) == 1, out.stdout
    return lines[0][len("launching: "):]


def no_gpu(fake):
    executable(fake / "nvidia-smi", "#!/bin/sh\necho 'No devices were found'\nexit 6\n")


def test_two_nodes_of_two_gpus(fake):
    out = run_slurm(fake, ["--dry-run", "python", "dlrm.py", "--batch_size=64"],
                    SLURM_JOB_NODELIST="n[1-2]", SLURM_GPUS_ON_NODE="2")
    assert launched(out) == "horovodrun -np 4 -H n1:2,n2:2 --gloo python dlrm.py --batch_size=64"
    assert "2 node(s) x 2 rank(s) (one per GPU) = 4 ranks" in out.stdout


@pytest.mark.parametrize("spec", ["4", "a100:4", "gpu:a100:4(IDX:0-3)"])
def test_gpus_from_gpus_per_node(fake, spec):
    out = run_slurm(fake, ["python", "dcnv2.py"], SLURM_JOB_NODELIST="n[1-2]", SLURM_GPUS_PER_NODE=spec, DRY_RUN="1")
    assert launched(out) == "horovodrun -np 8 -H n1:4,n2:4 --gloo python dcnv2.py"


def test_gpus_from_nvidia_smi(fake):
    executable(fake / "nvidia-smi", '#!/bin/sh\n[ "$1" = -L ] && for i in 0 1 2; do echo "GPU $i: H100 (UUID: x)"; done\n')
    out = run_slurm(fake, ["--dry-run", "python", "dlrm.py"], SLURM_JOB_NODELIST="a,b,c")
    assert launched(out) == "horovodrun -np 9 -H a:3,b:3,c:3 --gloo python dlrm.py"


def test_cpu_only_one_rank_per_socket(fake):
    no_gpu(fake)
    # 2 sockets of 4 cores, 2 hardware threads each.
    cores = "".join(f"{c},{c // 4}\n{c},{c // 4}\n" for c in range(8))
    executable(fake / "lscpu",
               '#!/bin/sh\necho "# The following is the parsable format"\n'
               'case $1 in -p=SOCKET) printf "0\\n0\\n1\\n1\\n" ;; -p=CORE,SOCKET) printf "%s" "' + cores + '" ;; esac\n')
    out = run_slurm(fake, ["--dry-run", "python", "dlrm.py"], SLURM_JOB_NODELIST="n[1-2]")
    assert launched(out) == "horovodrun -np 4 -H n1:2,n2:2 --gloo python dlrm.py"
    assert "(one per CPU socket) = 4 ranks, 4 threads each" in out.stdout


def test_ranks_per_node_override_mpi_and_extra_args(fake):
    out = run_slurm(fake, ["--dry-run", "python", "dlrm.py", "--log_path=a b.json"],
                    SLURM_JOB_NODELIST="n[1-2]", SLURM_GPUS_ON_NODE="8", RANKS_PER_NODE="1",
                    LAUNCHER="mpi", HOROVODRUN_ARGS="--network-interface ib0")
    # Arguments print shell-quoted where they need it, so the line can be pasted back.
    assert launched(out) == r"horovodrun -np 2 -H n1:1,n2:1 --mpi --network-interface ib0 python dlrm.py --log_path=a\ b.json"


def test_launches_the_venvs_horovodrun_with_the_arguments_and_timeouts(fake, tmp_path):
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    executable(venv_bin / "horovodrun",
               '#!/bin/sh\necho "horovodrun got: $*"\necho "gloo timeout $HOROVOD_GLOO_TIMEOUT_SECONDS"\n'
               'echo "python: $(command -v python)"\n')
    executable(venv_bin / "python", "#!/bin/sh\n")
    out = run_slurm(fake, ["python", "dlrm.py", "two words"], VENV=str(tmp_path / "venv"),
                    SLURM_JOB_NODELIST="n[1-2]", SLURM_GPUS_ON_NODE="1")
    assert out.returncode == 0, out.stderr
    assert "horovodrun got: -np 2 -H n1:1,n2:1 --gloo python dlrm.py two words" in out.stdout
    assert "gloo timeout 300" in out.stdout
    assert f"python: {venv_bin}/python" in out.stdout   # the command's `python` is the venv's


def test_submit_directorys_venv_is_found(fake, tmp_path):
    if shutil.which("horovodrun", path="/usr/bin:/bin"):
        pytest.skip("a system horovodrun is on the PATH, and it comes before the submit directory's .venv")
    venv_bin = tmp_path / "submit" / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    executable(venv_bin / "horovodrun", '#!/bin/sh\necho "venv horovodrun: $*"\n')
    out = run_slurm(fake, ["python", "dlrm.py"], SLURM_JOB_NODELIST="n1", SLURM_GPUS_ON_NODE="1",
                    SLURM_SUBMIT_DIR=str(tmp_path / "submit"))
    assert "venv horovodrun: -np 1 -H n1:1 --gloo python dlrm.py" in out.stdout, out.stderr


def one_line_error(out, starts):
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: " + starts), out.stderr


def test_error_outside_slurm(fake):
    one_line_error(run_slurm(fake, ["python", "dlrm.py"]), "not inside a SLURM allocation")


def test_error_without_command(fake):
    one_line_error(run_slurm(fake, [], SLURM_JOB_NODELIST="n1"), "no command given")
    one_line_error(run_slurm(fake, ["--dry-run"], SLURM_JOB_NODELIST="n1"), "no command given")


def test_error_on_unknown_launcher(fake):
    one_line_error(run_slurm(fake, ["python", "dlrm.py"], SLURM_JOB_NODELIST="n1", LAUNCHER="ssh"), "LAUNCHER=ssh")


def test_help(fake):
    out = run_slurm(fake, ["--help"])
    assert out.returncode == 0 and "usage: sbatch" in out.stdout
    assert not [line for line in out.stdout.splitlines() if line.startswith(("#", "set "))], out.stdout


# --- tools/setup_env.sh on a bare Debian: Debian's packages it needs, with faked dpkg-query/apt-get

DEBIAN_PYTHON = "/usr/bin/python3"


@pytest.fixture
def debian(tmp_path):
    """Runs tools/setup_env.sh with a fake dpkg-query (packages in $INSTALLED installed, in $REMOVED
    removed with their configuration kept), apt-get (logs its arguments; `install` exits $APT_RC)
    and id (-u prints $FAKE_UID) first on PATH; pip reaches no index. Returns (result, apt-get log)."""
    if not os.path.isfile(DEBIAN_PYTHON):
        pytest.skip(f"no {DEBIAN_PYTHON}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    executable(bin_dir / "dpkg-query",
               '#!/bin/sh\nfor p in $INSTALLED; do [ "$p" = "$4" ] && echo "install ok installed" && exit 0; done\n'
               'for p in $REMOVED; do [ "$p" = "$4" ] && echo "deinstall ok config-files" && exit 0; done\n'
               'echo "dpkg-query: no packages found matching $4" >&2; exit 1\n')
    executable(bin_dir / "apt-get", f'#!/bin/sh\necho "$*" >> {log}\n[ "$1" != install ] || exit "$APT_RC"\n')
    executable(bin_dir / "id", '#!/bin/sh\necho "$FAKE_UID"\n')

    def run(arg, uid, installed, removed=()):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "HOROVOD"))}
        env.update(PATH=f"{bin_dir}:/usr/bin:/bin", PYTHON=DEBIAN_PYTHON, FAKE_UID=str(uid), APT_RC="100",
                   INSTALLED=" ".join(installed), REMOVED=" ".join(removed), PIP_CONFIG_FILE=os.devnull,
                   PIP_NO_INDEX="1", DLRM_WHEEL_CACHE=str(tmp_path / "wheels"))
        out = subprocess.run(["bash", SETUP, arg], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
        return out, log.read_text().splitlines() if log.exists() else []
    return run


def debian_packages():
    py = os.path.basename(os.path.realpath(DEBIAN_PYTHON))   # python3.11
    return ["g++", "make", "cmake", "openjdk-17-jre-headless", py, f"{py}-dev", f"{py}-venv", "redis-server",
            "slurmctld", "slurmd", "slurm-client", "munge", "openssh-server", "iproute2"]


@pytest.mark.parametrize("arg", ["/dev/null/venv", "--system"])
def test_setup_installs_the_missing_debian_packages_as_root(debian, arg):
    packages = debian_packages()
    slurm = packages[-6:]   # absent either way: the image (--system) does not take them
    missing = [packages[0], packages[3], packages[5], packages[6]] + (slurm if arg != "--system" else [])
    out, apt = debian(arg, 0, [p for p in packages if p not in missing and p not in slurm], removed=[packages[6]])
    # apt-get's failure (APT_RC) stops the set-up there.
    assert out.returncode == 100, out.stderr
    assert apt == ["update -qq", "install -y -qq --no-install-recommends " + " ".join(missing)]
    assert f"installing Debian packages: {' '.join(missing)}" in out.stdout


def test_setup_names_the_apt_command_to_others(debian):
    packages = debian_packages()
    out, apt = debian("/dev/null/venv", 1000, [p for p in packages if p not in ("cmake", packages[4])])
    missing = f"cmake {packages[4]}"
    one_line_error(out, f"missing Debian packages {missing}: run as root: apt-get install -y {missing}")
    assert apt == []


def test_setup_installs_nothing_when_all_are_there(debian):
    out, apt = debian("/dev/null/venv", 0, debian_packages())
    assert apt == []
    # It went on to make the virtual environment (which /dev/null/venv cannot be).
    assert out.returncode != 0 and "/dev/null/venv" in out.stderr and "installing" not in out.stdout


def test_a_signal_goes_to_this_nodes_ranks_not_horovodrun_and_the_job_requeues(fake, tmp_path):
    """SLURM's SIGTERM (#SBATCH --signal=B:TERM@...) reaches the script: it passes it to the ranks
    (processes with HOROVOD_RANK) alone, waits for them, requeues with REQUEUE=1 and exits 143;
    RESUME_FROM adds --restore_checkpoint_path once a checkpoint is there."""
    assert re.search(r"^#SBATCH --signal=B:TERM@\d+$", read(SLURM), re.M)
    marks = tmp_path / "marks"
    marks.mkdir()
    executable(fake / "scontrol",
               '#!/bin/sh\nif [ "$1" = requeue ]; then echo "$2" > "$MARKS/requeued"; exit 0; fi\n'
               '[ "$1 $2" = "show hostnames" ] && echo "$3"\n')
    # The launcher: records its arguments and any signal sent to it; its one rank records its signal and
    # exits 143 as a preempted rank does.
    executable(fake / "horovodrun", '#!/bin/bash\necho "$@" > "$MARKS/args"\n'
               "trap 'touch \"$MARKS/launcher_signalled\"' TERM\n"
               f"HOROVOD_RANK=0 {sys.executable} -c '\n"
               "import os, signal, sys, time\n"
               "def stop(s, f):\n"
               "    open(os.environ[\"MARKS\"] + \"/rank_signal\", \"w\").write(str(s)); sys.exit(143)\n"
               "signal.signal(signal.SIGTERM, stop)\n"
               "open(os.environ[\"MARKS\"] + \"/ready\", \"w\").close()\n"
               "while True: time.sleep(0.05)' &\n"
               'while ! wait; do :; done\nexit 1\n')
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text("ckpt-5\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HOROVOD"))}
    env.update(PATH=f"{fake}:/usr/bin:/bin", MARKS=str(marks), SLURM_JOB_NODELIST="n1", SLURM_GPUS_ON_NODE="1",
               SLURM_JOB_ID="77", HOROVODRUN=str(fake / "horovodrun"), REQUEUE="1", RESUME_FROM=str(ckpt))
    p = subprocess.Popen(["bash", SLURM, "python", "dlrm.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if (marks / "ready").exists():
                break
            assert p.poll() is None, p.communicate()
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err
    assert (marks / "rank_signal").read_text() == str(int(signal.SIGTERM))
    assert not (marks / "launcher_signalled").exists()
    assert (marks / "requeued").read_text().strip() == "77"
    assert (marks / "args").read_text().split()[-1] == f"--restore_checkpoint_path={ckpt}"
    assert "SIGTERM received: passed to this node's ranks" in err
