#!/usr/bin/env bash
# Creates the project's virtual environment: pinned requirements, then Horovod 0.28.1 (Gloo,
# TensorFlow) built from its sdist. The built wheel is cached outside the checkout, keyed by
# the TensorFlow version, so later set-ups (and fresh clones) skip the ~5 minute build.
#   usage: tools/setup_env.sh [VENV_DIR]
set -euo pipefail
VENV=${1:-.venv}
HOROVOD_VERSION=0.28.1
PYTHON=${PYTHON:-/usr/bin/python3}   # Debian's Python ships a shared libpython (serving needs it)
CACHE=${DLRM_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dlrm-tf2/wheels}

[ -x "$PYTHON" ] || PYTHON=$(command -v python3)
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV" || { apt-get update -qq && apt-get install -y -qq python3-venv python3-dev && "$PYTHON" -m venv "$VENV"; }
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install -r requirements.txt

TF_VERSION=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("tensorflow"))')
WHEEL_DIR="$CACHE/horovod-$HOROVOD_VERSION-tf$TF_VERSION"
if ! "$VENV/bin/python" -c "import horovod.tensorflow" 2>/dev/null; then
  if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    echo "building Horovod $HOROVOD_VERSION against TensorFlow $TF_VERSION (about 5 minutes, once)"
    # Horovod's build needs the system cmake: a pip cmake 4.x breaks its bundled Gloo.
    CMAKE=$(PATH=/usr/bin:/bin command -v cmake) || { apt-get update -qq && apt-get install -y -qq cmake; CMAKE=/usr/bin/cmake; }
    "$VENV/bin/python" -m pip uninstall -y -q cmake 2>/dev/null || true
    BUILD=$(mktemp -d)
    trap 'rm -rf "$BUILD"' EXIT
    $PIP download --no-deps --no-binary :all: -d "$BUILD" "horovod==$HOROVOD_VERSION"
    tar -xzf "$BUILD"/horovod-$HOROVOD_VERSION.tar.gz -C "$BUILD"
    SRC="$BUILD/horovod-$HOROVOD_VERSION"
    # TF 2.21's wheel lacks headers xla_mpi_ops.cc needs; its XLA ops only matter on GPU.
    sed -i '/xla_mpi_ops\.cc/d' "$SRC/horovod/tensorflow/CMakeLists.txt"
    mkdir -p "$WHEEL_DIR"
    PATH="$(dirname "$CMAKE"):$VENV/bin:$PATH" \
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CMAKE="$CMAKE" \
    MAKEFLAGS="-j$(nproc)" \
      $PIP wheel --no-build-isolation --no-deps -w "$BUILD/wheel" "$SRC"
    cp "$BUILD"/wheel/horovod-*.whl "$WHEEL_DIR"/
  fi
  $PIP install --no-deps "$WHEEL_DIR"/horovod-*.whl
fi
"$VENV/bin/python" -c "import tensorflow as tf, horovod.tensorflow as hvd; print('environment ready: tensorflow', tf.__version__, '/ horovod', hvd.__version__ if hasattr(hvd, '__version__') else '$HOROVOD_VERSION')"
