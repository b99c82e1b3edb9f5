"""A tiny dlrm.py run (4 steps, the tests' size) in a fresh interpreter against the same run forked
from a tests/support/warm_python.py server, alternated: wall seconds of each, and the fresh runs' CPU
seconds (a forked run's CPU is its server's child's, not this process's).

    .venv/bin/python benchmarks/warm_start.py [--pairs 3]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.support import warm_python  # noqa: E402

RUN = ["dlrm.py", "--dataset_type=synthetic", "--synthetic_cardinalities=20,50,7,30", "--synthetic_num_numerical=3",
       "--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--batch_size=64",
       "--valid_batch_size=256", "--synthetic_rows=256", "--synthetic_eval_rows=256", "--print_freq=1"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    with tempfile.TemporaryDirectory() as directory:
        servers = warm_python.start_servers(1, directory)
        try:
            subprocess.run([*warm_python.PYTHON, "-c", "pass"], check=True)   # waits for the server's imports
            for _ in range(args.pairs):
                for name, command in (("fresh", [sys.executable]), ("warm", warm_python.PYTHON)):
                    start, before = time.monotonic(), os.times()
                    subprocess.run([*command, *RUN], cwd=ROOT, check=True, capture_output=True)
                    after = os.times()
                    cpu = after.children_user + after.children_system - before.children_user - before.children_system
                    print(json.dumps({"run": name, "wall_s": round(time.monotonic() - start, 2),
                                      "cpu_s": round(cpu, 2) if name == "fresh" else None}), flush=True)
        finally:
            for server in servers:
                server.kill()
                server.wait()


if __name__ == "__main__":
    main()
