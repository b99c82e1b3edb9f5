"""pip-installable TensorFlow op library: DotBasedInteract / DotBasedInteractGrad (DLRM's dot
interaction) for the TensorFlow in the installing environment.

    pip install --no-build-isolation ./tensorflow-dot-based-interact

Compiles src/ with the flags of that TensorFlow (tf.sysconfig, C++17). The CUDA kernels are
added when TensorFlow is a CUDA build and nvcc is on PATH (DOT_INTERACT_CUDA=0 leaves them out),
for the compute capabilities DOT_INTERACT_CUDA_ARCHS lists (default CUDA_CAPABILITIES): machine
code for each one nvcc can build, and PTX of the highest, which the driver compiles for newer
GPUs. The two compilers run at once. Importing this file only defines; pip runs it as __main__.
"""
import os
import re
import shutil
import subprocess
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "src")
LIBRARY = "_dot_based_interact_ops.so"
# Volta, Turing, Ampere (A100, A10/RTX 30), Ada, Hopper; the Dockerfile builds Horovod for the same.
CUDA_CAPABILITIES = "70,75,80,86,89,90"


def cuda_root(nvcc):
    """The CUDA toolkit behind `nvcc` (which may be a wrapper script), from its own dry run."""
    dry = subprocess.run([nvcc, "--dryrun", "-c", os.path.join(SRC, "dot_based_interact.cu"), "-o", os.devnull],
                         capture_output=True, text=True).stderr
    return os.path.normpath(re.search(r"^#\$ TOP=(.*)$", dry, re.M).group(1).strip())


def gencode_flags(nvcc, capabilities):
    """nvcc's -gencode flags for the comma-separated `capabilities`: machine code (SASS) for each
    one this nvcc can build (a note names those it cannot: CUDA 13 has no Volta), PTX of the
    highest one too."""
    supported = set(re.findall(r"sm_(\d+)", subprocess.run([nvcc, "--list-gpu-code"], capture_output=True,
                                                             text=True).stdout))
    wanted = sorted({int(c) for c in capabilities.split(",")})
    ccs = [c for c in wanted if str(c) in supported]
    if not ccs:
        raise RuntimeError(f"{nvcc} builds none of the compute capabilities {capabilities} (DOT_INTERACT_CUDA_ARCHS)")
    if len(ccs) < len(wanted):
        print(f"note: {nvcc} cannot build for sm_{', sm_'.join(str(c) for c in wanted if c not in ccs)}: left out")
    return ([f"-gencode=arch=compute_{c},code=sm_{c}" for c in ccs[:-1]] +
            [f"-gencode=arch=compute_{ccs[-1]},code=[sm_{ccs[-1]},compute_{ccs[-1]}]"])


def compile_library(target):
    """Builds the op library at `target`."""
    import tensorflow as tf
    nvcc = shutil.which("nvcc")
    cuda = (nvcc is not None and tf.sysconfig.get_build_info().get("is_cuda_build", False)
            and os.environ.get("DOT_INTERACT_CUDA", "1") != "0")
    cxx = [os.environ.get("CXX", "g++"), "-O3", "-fPIC", "-std=c++17", "-I", SRC] + tf.sysconfig.get_compile_flags()
    link = tf.sysconfig.get_link_flags()
    with tempfile.TemporaryDirectory() as tmp:
        objects = [os.path.join(tmp, "ops.o")]
        jobs = []
        if cuda:
            root = cuda_root(nvcc)
            objects.append(os.path.join(tmp, "cuda.o"))
            archs = gencode_flags(nvcc, os.environ.get("DOT_INTERACT_CUDA_ARCHS", CUDA_CAPABILITIES))
            jobs.append([nvcc, "-O3", "-std=c++17", "--threads=0", "-Xcompiler", "-fPIC", "-c",
                         os.path.join(SRC, "dot_based_interact.cu"), "-o", objects[1]] + archs)
            cxx += ["-DGOOGLE_CUDA=1", "-I", os.path.join(root, "include")]
            link += ["-L", os.path.join(root, "lib64"), "-lcudart_static", "-ldl", "-lrt", "-lpthread"]
        jobs.append(cxx + ["-c", os.path.join(SRC, "dot_based_interact_ops.cc"), "-o", objects[0]])
        print(f"building {LIBRARY} ({'CPU and CUDA' if cuda else 'CPU'} kernels) for TensorFlow {tf.__version__}")
        for proc in [subprocess.Popen(job) for job in jobs]:
            if proc.wait():
                raise RuntimeError(f"compiling {LIBRARY} failed: {' '.join(proc.args)}")
        subprocess.run([os.environ.get("CXX", "g++"), "-shared", "-o", target] + objects + link, check=True)


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        out = os.path.join(self.build_lib, "dot_based_interact")
        os.makedirs(out, exist_ok=True)
        compile_library(os.path.join(out, LIBRARY))


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


if __name__ == "__main__":
    setup(name="dot-based-interact", version="1.0.0", packages=["dot_based_interact"],
          cmdclass={"build_py": BuildWithLibrary}, distclass=BinaryDistribution, python_requires=">=3.9")
