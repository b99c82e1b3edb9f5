#!/usr/bin/env bash
# Creates the project's virtual environment: pinned requirements, then Horovod 0.28.1 (Gloo,
# TensorFlow; MPI too where an MPI compiler is found; NCCL with HOROVOD_GPU_OPERATIONS=NCCL)
# built from its sdist, the interaction op, the id map op, and the project itself (editable, pyproject.toml). The built wheel is cached outside the checkout, keyed by the TensorFlow
# version and the build's options, so later set-ups (and fresh clones) skip the ~5 minute build.
#   usage: tools/setup_env.sh [VENV_DIR]   a virtual environment (default .venv)
#          tools/setup_env.sh --system     $PYTHON's own site-packages (the Docker image, which
#                                          installs the project once it has copied it in)
set -euo pipefail
HOROVOD_VERSION=0.28.1
PYTHON=${PYTHON:-/usr/bin/python3}   # Debian's Python ships a shared libpython (serving needs it)
CACHE=${DLRM_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dlrm-tf2/wheels}

# The build's options; each one other than the plain CPU build (Gloo) names its wheel's cache:
# MPI where an MPI compiler is found, NCCL when asked for (HOROVOD_GPU_OPERATIONS=NCCL).
FLAVOUR='' WITH_MPI='' WITHOUT_MPI=1
if command -v mpicc >/dev/null; then WITH_MPI=1 WITHOUT_MPI='' FLAVOUR=-mpi; fi
case ${HOROVOD_GPU_OPERATIONS:-} in
  "") ;;
  NCCL) FLAVOUR=$FLAVOUR-nccl ;;
  *) echo "error: HOROVOD_GPU_OPERATIONS=$HOROVOD_GPU_OPERATIONS: only NCCL (or unset, for CPU) is supported" >&2; exit 2 ;;
esac

[ -x "$PYTHON" ] || PYTHON=$(command -v python3 || echo /usr/bin/python3)
MODE=${1:-}

# Debian's packages that the set-up, `make demo` and `make test` need and a bare Debian lacks: a
# C++ compiler, make and the system cmake (Horovod's build, the interaction op), Java 17 (Spark),
# redis-server (the shared tier of serving lookups, deployment/serving/tiers/redis_tier.py, and its tests),
# for Debian's own Python, the interpreter, its headers and its venv module (split off it), and,
# outside --system (the image), SLURM and munge, which the tests start as a real cluster (tests/support/slurm_cluster.py),
# and sshd and iproute2, for the tests' hosts in network namespaces (tests/support/netns_hosts.py).
system_packages() {
  local py=python3
  if [ -x "$PYTHON" ]; then py=$("$PYTHON" -c 'import sys; print("python%d.%d" % sys.version_info[:2])'); fi
  echo g++ make cmake openjdk-17-jre-headless
  case $(readlink -f "$PYTHON") in /usr/bin/*) echo "$py" "$py-dev" "$py-venv" ;; esac
  echo redis-server
  [ "$MODE" = --system ] || echo slurmctld slurmd slurm-client munge openssh-server iproute2
}

# The ones dpkg does not list as installed, one a line (none on a system without dpkg).
missing_system_packages() {
  command -v dpkg-query >/dev/null || return 0
  local package
  for package in $(system_packages); do
    [ "$(dpkg-query -W -f '${Status}' "$package" 2>/dev/null)" = "install ok installed" ] || echo "$package"
  done
}

# Installs the missing ones with apt-get as root; anyone else gets the command to run.
install_system_packages() {
  local missing
  mapfile -t missing < <(missing_system_packages)
  [ ${#missing[@]} -gt 0 ] || return 0
  if [ "$(id -u)" != 0 ]; then
    echo "error: missing Debian packages ${missing[*]}: run as root: apt-get install -y ${missing[*]}" >&2
    exit 2
  fi
  echo "installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

install_system_packages
if [ "${1:-}" = --system ]; then
  PY=$PYTHON
else
  VENV=${1:-.venv}
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  PY=$VENV/bin/python
fi
PIP="$PY -m pip --disable-pip-version-check -q"
$PIP install -r requirements.txt

TF_VERSION=$("$PY" -c 'import importlib.metadata as m; print(m.version("tensorflow"))')
WHEEL_DIR="$CACHE/horovod-$HOROVOD_VERSION-tf$TF_VERSION$FLAVOUR"
if ! "$PY" -c "import horovod.tensorflow" 2>/dev/null; then
  if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    echo "building Horovod $HOROVOD_VERSION${FLAVOUR:+ ($FLAVOUR)} against TensorFlow $TF_VERSION (about 5 minutes, once)"
    # Horovod's build needs the system cmake: a pip cmake 4.x breaks its bundled Gloo.
    CMAKE=$(PATH=/usr/bin:/bin command -v cmake) || { echo "error: Horovod's build needs the system cmake (in /usr/bin): install it" >&2; exit 2; }
    "$PY" -m pip uninstall -y -q cmake 2>/dev/null || true
    BUILD=$(mktemp -d)
    trap 'rm -rf "$BUILD"' EXIT
    $PIP download --no-deps --no-binary :all: -d "$BUILD" "horovod==$HOROVOD_VERSION"
    tar -xzf "$BUILD"/horovod-$HOROVOD_VERSION.tar.gz -C "$BUILD"
    SRC="$BUILD/horovod-$HOROVOD_VERSION"
    # TF 2.21's wheel lacks headers xla_mpi_ops.cc needs; its XLA ops only matter on GPU.
    sed -i '/xla_mpi_ops\.cc/d' "$SRC/horovod/tensorflow/CMakeLists.txt"
    if [ -n "${HOROVOD_GPU_OPERATIONS:-}" ]; then
      # TF 2.21 no longer exports stream_executor::gpu::AsGpuStreamValue, which Horovod's GPU
      # ops declare and call (the op library would not load): read the CUDA stream off the
      # Stream itself instead.
      sed -i -e 's|^GpuStreamHandle AsGpuStreamValue(Stream\* stream);|inline &|' \
        -e '0,/^#endif \/\/ HAVE_GPU$/s||namespace stream_executor { namespace gpu {\ninline GpuStreamHandle AsGpuStreamValue(Stream* stream) {\n  return static_cast<GpuStreamHandle>(stream->platform_specific_handle().stream);\n} } }\n&|' \
        "$SRC/horovod/tensorflow/mpi_ops.cc"
      grep -q 'platform_specific_handle' "$SRC/horovod/tensorflow/mpi_ops.cc" || { echo "error: could not patch Horovod's mpi_ops.cc for TensorFlow $TF_VERSION" >&2; exit 1; }
    fi
    mkdir -p "$WHEEL_DIR"
    PATH="$(dirname "$CMAKE"):$(dirname "$PY"):$PATH" \
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=$WITH_MPI HOROVOD_WITHOUT_MPI=$WITHOUT_MPI \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CMAKE="$CMAKE" \
    MAKEFLAGS="-j$(nproc)" \
      $PIP wheel --no-build-isolation --no-deps -w "$BUILD/wheel" "$SRC"
    cp "$BUILD"/wheel/horovod-*.whl "$WHEEL_DIR"/
  fi
  $PIP install --no-deps "$WHEEL_DIR"/horovod-*.whl
fi
# Serving: pytriton and tritonclient without their numpy<2 / protobuf<7 pins (see requirements.txt),
# and the small environment of Triton's Python-backend stub, which needs numpy 1.x: with numpy 2
# it silently garbles every tensor (deployment/serve.py points pytriton at it).
$PIP install --no-deps nvidia-pytriton==0.7.0 tritonclient==2.73.0
STUB_ENV=$(dirname "$(dirname "$PY")")/triton-stub
if [ "${1:-}" = --system ]; then STUB_ENV=/opt/triton-stub; fi
if ! "$STUB_ENV/bin/python" -c "import numpy, zmq" 2>/dev/null; then
  "$PYTHON" -m venv "$STUB_ENV"
  "$STUB_ENV/bin/python" -m pip --disable-pip-version-check -q install numpy==1.26.4 pyzmq==27.3.0
fi
# The dot-interaction op library (tensorflow-dot-based-interact/), compiled against this TensorFlow.
$PIP install --no-build-isolation --no-deps --force-reinstall ./tensorflow-dot-based-interact
# The id map op library of dynamic tables (tensorflow-id-map/), compiled against this TensorFlow.
$PIP install --no-build-isolation --no-deps --force-reinstall ./tensorflow-id-map
# The project, editable: every module importable and every script runnable from any directory.
if [ "${1:-}" != --system ]; then $PIP install --no-deps -e .; fi
"$PY" -c "import tensorflow as tf, horovod.tensorflow as hvd; print('environment ready: tensorflow', tf.__version__, '/ horovod', hvd.__version__ if hasattr(hvd, '__version__') else '$HOROVOD_VERSION')"
