"""Writes tests/durations.json, each test file's seconds in a run of the suite (its tests' setup,
call and teardown summed), from that run's JUnit XML; tests/conftest.py starts the longest files
first.

    .venv/bin/python tools/test_durations.py test-results/junit.xml   # .ci/run's, or make test's with --junitxml
"""
import collections
import json
import os
import sys
import xml.etree.ElementTree as ET

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "durations.json")


def file_seconds(junit: str) -> dict:
    """tests/<file>.py -> seconds, from the JUnit XML at `junit` (classnames tests.<file>[.<class>])."""
    seconds = collections.Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        if len(parts) >= 2 and parts[0] == "tests":
            seconds[f"tests/{parts[1]}.py"] += float(case.get("time") or 0)
    return {name: round(s) for name, s in sorted(seconds.items())}


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isfile(sys.argv[1]):
        sys.exit(f"usage: {sys.argv[0]} JUNIT_XML")
    with open(OUT, "w") as f:
        json.dump(file_seconds(sys.argv[1]), f, indent=0, sort_keys=True)
        f.write("\n")
    print(f"wrote {OUT}")
