import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The scripts and workers the tests start import this checkout, as the tests do (pytest.ini's
# pythonpath), whether the environment has the project installed (make setup) or not, or another
# checkout of it.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                         os.environ.get("PYTHONPATH")]))

# tests/fake_gpus.py fakes GPUs in the process that imports it: never in pytest's (--doctest-modules).
collect_ignore = ["fake_gpus.py"]
