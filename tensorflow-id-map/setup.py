"""pip-installable TensorFlow op library: the id -> row map of dynamic embedding tables (IdMap*
ops, src/id_map.h) for the TensorFlow in the installing environment.

    pip install --no-build-isolation ./tensorflow-id-map

Compiles src/ with the flags of that TensorFlow (tf.sysconfig, C++17; CXX names the compiler).
CPU kernels only. Importing this file only defines; pip runs it as __main__.
"""
import os
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "src")
LIBRARY = "_id_map_ops.so"


def compile_library(target):
    """Builds the op library at `target`."""
    import tensorflow as tf
    print(f"building {LIBRARY} (CPU kernels) for TensorFlow {tf.__version__}")
    subprocess.run([os.environ.get("CXX", "g++"), "-O3", "-fPIC", "-std=c++17", "-shared", "-I", SRC,
                    os.path.join(SRC, "id_map_ops.cc"), "-o", target]
                   + tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags(), check=True)


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        out = os.path.join(self.build_lib, "id_map")
        os.makedirs(out, exist_ok=True)
        compile_library(os.path.join(out, LIBRARY))


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


if __name__ == "__main__":
    setup(name="id-map", version="1.0.0", packages=["id_map"],
          cmdclass={"build_py": BuildWithLibrary}, distclass=BinaryDistribution, python_requires=">=3.9")
