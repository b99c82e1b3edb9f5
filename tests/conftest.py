import os

import pytest

# TensorFlow's C++ logs off in the tests and what they start (make's default of 2 prints its
# errors, e.g. a failed cuInit, among the lines the tests read); a test that wants them sets its own.
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
# Horovod's background thread negotiates every HOROVOD_CYCLE_TIME ms (default 1): a tiny test run
# mostly waits between its steps, and at 1 ms its ranks' negotiations take about a third of the
# run's CPU from the two cores that the other test worker shares; results do not depend on it.
os.environ.setdefault("HOROVOD_CYCLE_TIME", "5")
# The scripts and workers the tests start import this checkout, as the tests do (pytest.ini's
# pythonpath), whether the environment has the project installed (make setup) or not, or another
# checkout of it.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                         os.environ.get("PYTHONPATH")]))

# tests/support/fake_gpus.py fakes GPUs in the process that imports it: never in pytest's (--doctest-modules).
collect_ignore = ["support/fake_gpus.py"]

# Subprocesses started as `[*tests.support.warm_python.PYTHON, ...]` are forked by servers that imported
# TensorFlow once, one per rank slot (tests/support/warm_python.py); started before collection, so that the
# environments the test modules copy at import name them.
_WARM = {}


def _controller(config) -> bool:
    """Whether this pytest process hands the tests to xdist workers (make test) instead of running them."""
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


def pytest_configure(config):
    config.addinivalue_line("markers", f"slow: the test may take over {SLOW_S} s (others fail the run when they do)")
    if _controller(config):
        return
    import tempfile
    from tests.support import warm_python
    _WARM["directory"] = tempfile.mkdtemp(prefix="warm-python-")
    _WARM["servers"] = warm_python.start_servers(3, _WARM["directory"])


def pytest_unconfigure(config):
    import shutil
    for server in _WARM.pop("servers", []):
        server.kill()
        server.wait()
    if "directory" in _WARM:
        shutil.rmtree(_WARM.pop("directory"), ignore_errors=True)


# A test not marked slow that takes over SLOW_S seconds (its setup, call and teardown) fails the
# run, named in the summary; `make test` prints the slowest tests. Under xdist the controller
# judges, from its workers' reports.
SLOW_S = 60
_durations, _over = {}, []


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown" and _durations[report.nodeid] > SLOW_S and "slow" not in report.keywords:
        _over.append((report.nodeid, _durations[report.nodeid]))


def pytest_terminal_summary(terminalreporter):
    for nodeid, seconds in _over:
        terminalreporter.write_line(f"error: {nodeid} took {seconds:.0f} s, over {SLOW_S} s, and is not marked slow")


def pytest_sessionfinish(session, exitstatus):
    if _over and exitstatus == 0 and not hasattr(session.config, "workerinput"):
        session.exitstatus = 1


def pytest_collection_modifyitems(session, config, items):
    """The test files longest first, each file's tests in their order, so that no worker ends the
    run alone on a long file: by their seconds in a recorded run (tests/durations.json, written by
    tools/test_durations.py from a run's JUnit XML), a file not recorded there by an estimate
    (ESTIMATE_S per slow test, 2 s per other)."""
    import json
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")) as f:
        recorded = json.load(f)
    files = {}
    for item in items:
        files.setdefault(item.path, []).append(item)

    def seconds(path) -> float:
        name = os.path.relpath(path, config.rootpath)
        tests = files[path]
        slow = sum("slow" in i.keywords for i in tests)
        return recorded.get(name, ESTIMATE_S * slow + 2 * (len(tests) - slow))
    items[:] = [i for path in sorted(files, key=lambda p: -seconds(p)) for i in files[path]]


ESTIMATE_S = 30   # a slow test's seconds, for a file tests/durations.json does not hold yet


@pytest.fixture(scope="session")
def spark_local():
    """One local Spark session (2 cores, no UI) for every module of a pytest process; a module's
    `spark` fixture sets its shuffle partitions."""
    from preproc.session import spark_session
    session = spark_session("local[2]", {"spark.ui.enabled": "false"})
    yield session
    session.stop()


@pytest.fixture(scope="session")
def live_exports(tmp_path_factory):
    """tests/support/live_exports.py's exports, built once per test process: {step: repository}."""
    from tests.support import live_exports
    return live_exports.build(tmp_path_factory.mktemp("live"))
