# Two images (docs/launchers.md#the-container), built with BuildKit (Docker 23+, DOCKER_BUILDKIT=1
# on Docker 20.10):
#   docker build -t dlrm-tf2 .                    the GPU image (the last stage), on BASE: TensorFlow's
#                                                 own image at the version requirements.txt pins
#   docker build --target cpu -t dlrm-tf2:cpu .   the CPU image, on CPU_BASE (Debian 12)
# Both run the same set-up as a local one (tools/setup_env.sh --system: the pinned requirements,
# Horovod with Gloo, and NCCL in the GPU image, the project's op libraries), then install the
# project editable. A TLS-intercepting proxy's CA bundle, where pip needs one, is passed as the
# build secret ca-certificates: --secret id=ca-certificates,src=/etc/ssl/certs/ca-certificates.crt
#   docker run --gpus all --ipc=host dlrm-tf2 horovodrun -np 8 -H localhost:8 python3 dlrm.py ...
#   docker run dlrm-tf2:cpu horovodrun -np 2 -H localhost:2 python3 dlrm.py ...
ARG BASE=tensorflow/tensorflow:2.21.0-gpu
ARG CPU_BASE=debian:bookworm

FROM ${CPU_BASE} AS cpu
SHELL ["/bin/bash", "-e", "-u", "-o", "pipefail", "-c"]
ARG DEBIAN_FRONTEND=noninteractive
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_BREAK_SYSTEM_PACKAGES=1
WORKDIR /workspace/dlrm
COPY requirements.txt ./
COPY tools/ tools/
COPY tensorflow-dot-based-interact/ tensorflow-dot-based-interact/
COPY tensorflow-id-map/ tensorflow-id-map/
# Debian's python3, its pip and the CA certificates; tools/setup_env.sh installs the rest it needs.
# hadolint ignore=DL3008
RUN --mount=type=secret,id=ca-certificates \
    apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip ca-certificates \
    && if [ -s /run/secrets/ca-certificates ]; then export PIP_CERT=/run/secrets/ca-certificates; fi \
    && DLRM_WHEEL_CACHE=/tmp/wheels PYTHON=/usr/bin/python3 bash tools/setup_env.sh --system \
    && horovodrun --check-build | tee /tmp/check-build.txt \
    && grep -q '\[X\] TensorFlow' /tmp/check-build.txt && grep -q '\[X\] Gloo' /tmp/check-build.txt \
    && rm -rf /tmp/wheels /tmp/check-build.txt /var/lib/apt/lists/*
COPY . .
# The project, editable, as tools/setup_env.sh installs it in a virtual environment (pyproject.toml).
RUN python3 -m pip install --no-deps --no-build-isolation -e .
CMD ["bash", "-c", "echo 'usage: docker run IMAGE horovodrun -np RANKS -H localhost:RANKS python3 dlrm.py|dcnv2.py [flags]   (flags: python3 dlrm.py --helpfull; more in docs/launchers.md)'"]

# The GPU image: Horovod built with NCCL and Gloo for TensorFlow (and MPI, were there an MPI
# compiler in the base image: TensorFlow's ships none).
FROM ${BASE} AS gpu
SHELL ["/bin/bash", "-e", "-u", "-o", "pipefail", "-c"]
ARG DEBIAN_FRONTEND=noninteractive
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_BREAK_SYSTEM_PACKAGES=1

# Horovod's build tools: the system cmake (a pip cmake 4.x breaks Horovod's bundled Gloo), a C++
# compiler, the Python headers and venv module of the image's python3 (tools/setup_env.sh makes
# the serving stub's environment with it), the CUDA compiler and runtime headers of the image's
# CUDA version, and NCCL from
# NVIDIA's CUDA repository (which the base image is set up with): NCCL_VERSION if given, else the
# image's own NCCL if it has one, else the newest build for the image's CUDA major version and a
# minor version no newer than the image's.
# Ubuntu's cmake and g++ are left unpinned: they follow the base image's release.
ARG NCCL_VERSION=
# hadolint ignore=DL3008
RUN cuda=${CUDA_VERSION:-$(readlink -f /usr/local/cuda)}; cuda=${cuda##*cuda-}; \
    major=${cuda%%.*}; minor=${cuda#*.}; minor=${minor%%.*}; \
    case $major.$minor in *[!0-9.]*|.*|*.) echo "error: cannot tell the base image's CUDA version ($cuda)" >&2; exit 1 ;; esac; \
    py=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
    apt-get update; \
    installed=$(dpkg-query -W -f '${Version}' libnccl2 2>/dev/null || true); \
    nccl=${NCCL_VERSION:-${installed:-$(apt-cache madison libnccl-dev | awk -F'|' -v maj="$major" -v min="$minor" \
      '{ v = $2; gsub(/ /, "", v); n = split(v, c, /\+cuda|\./) } v ~ /\+cuda[0-9]+\.[0-9]+$/ && c[n - 1] == maj && c[n] <= min { print v; exit }')}}; \
    [ -n "$nccl" ] || { echo "error: no libnccl-dev for CUDA $major.$minor in the apt sources: pass --build-arg NCCL_VERSION=..." >&2; exit 1; }; \
    apt-get install -y --no-install-recommends cmake g++ make "python$py-dev" "python$py-venv" \
      "cuda-nvcc-$major-$minor" "cuda-cudart-dev-$major-$minor" "libnccl2=$nccl" "libnccl-dev=$nccl"; \
    rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/dlrm
COPY requirements.txt ./
COPY tools/ tools/
COPY tensorflow-dot-based-interact/ tensorflow-dot-based-interact/
COPY tensorflow-id-map/ tensorflow-id-map/
# The GPU generations the CUDA code (Horovod's and the interaction op's) is compiled for: machine
# code for each (Volta to Hopper), and PTX of the last, which newer GPUs' drivers compile
# (the op's setup.py CUDA_CAPABILITIES; a CUDA 13 nvcc leaves Volta out).
ARG CUDA_CC_LIST=70,75,80,86,89,90
# The driver's stub libcuda stands in for the driver during the build only. The build fails if
# Horovod lacks NCCL or the interaction op its GPU kernels.
RUN --mount=type=secret,id=ca-certificates \
    if [ -s /run/secrets/ca-certificates ]; then export PIP_CERT=/run/secrets/ca-certificates; fi \
    && ldconfig /usr/local/cuda/lib64/stubs \
    && PATH="/usr/local/cuda/bin:$PATH" HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_BUILD_CUDA_CC_LIST="$CUDA_CC_LIST" \
       DOT_INTERACT_CUDA_ARCHS="$CUDA_CC_LIST" DLRM_WHEEL_CACHE=/tmp/wheels PYTHON="$(command -v python3)" \
       bash tools/setup_env.sh --system \
    && horovodrun --check-build | tee /tmp/check-build.txt \
    && grep -q '\[X\] TensorFlow' /tmp/check-build.txt && grep -q '\[X\] NCCL' /tmp/check-build.txt \
    && python3 -c 'import dot_based_interact as d; from tensorflow.python.framework import kernels; d.load(); \
                   assert any(k.device_type == "GPU" for k in kernels.get_registered_kernels_for_op("DotBasedInteract").kernel)' \
    && python3 -c 'import id_map; id_map.load()' \
    && rm -rf /tmp/wheels /tmp/check-build.txt \
    && ldconfig

COPY . .
# The project, editable, as tools/setup_env.sh installs it in a virtual environment (pyproject.toml).
RUN python3 -m pip install --no-deps --no-build-isolation -e .

CMD ["bash", "-c", "echo 'usage: docker run --gpus all --ipc=host IMAGE horovodrun -np GPUS -H localhost:GPUS python3 dlrm.py|dcnv2.py [flags]   (flags: python3 dlrm.py --helpfull; more in docs/launchers.md)'"]
