"""Preprocessing on a Spark standalone cluster over two hosts (tests/support/netns_hosts.py): a master on
hosta and a worker on each host, one core apiece; `preproc.criteo` and `preproc.raw` (user
histories included) run with `--master spark://hosta:7077` on hosta, their tasks on both
workers' executors, and write the bytes the same arguments write on the suite's local[2]
session."""
import os
import subprocess
import sys
import time

import pytest

from preproc import criteo, generate, raw
from preproc.pipeline import run
from tests.support.horovod_run import ROOT
from tests.support.netns_hosts import Hosts, missing
from tests.test_preproc import read_tree
from tests.test_preproc_history import events_log, write_events, write_spec

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

MASTER = "spark://hosta:7077"
ENV = dict(os.environ, PYTHONPATH=ROOT, PYSPARK_PYTHON=sys.executable)


def spark_class():
    import pyspark
    return os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")


class SparkCluster:
    """A standalone master on hosts' first host, a worker (1 core, 1 GB) on each."""

    def __init__(self, hosts: Hosts, root: str):
        self.hosts, self.root, self.processes = hosts, root, []
        self.start(hosts.names[0], "master", "org.apache.spark.deploy.master.Master", "--host", hosts.names[0],
                   "--port", "7077", "--webui-port", "8080")
        for name in hosts.names:
            self.start(name, f"worker-{name}", "org.apache.spark.deploy.worker.Worker", "--host", name,
                       "--cores", "1", "--memory", "1g", "--webui-port", "8081",
                       "--work-dir", os.path.join(root, f"work-{name}"), MASTER)
        deadline = time.monotonic() + 90
        while self.log("master").count("Registering worker") < len(hosts.names):
            assert time.monotonic() < deadline, f"the workers did not register in 90 s: {root}/*.log"
            time.sleep(0.2)

    def start(self, host, name, main, *args):
        with open(os.path.join(self.root, f"{name}.log"), "w") as log:
            self.processes.append(self.hosts.popen(host, spark_class(), main, *args, stdout=log,
                                                   stderr=subprocess.STDOUT, env=ENV))

    def log(self, name):
        with open(os.path.join(self.root, f"{name}.log")) as f:
            return f.read()

    def tasks_by_host(self):
        """How many tasks each worker's executors ran (their logs' "Running task" lines)."""
        counts = {}
        for name in self.hosts.names:
            work = os.path.join(self.root, f"work-{name}")
            counts[name] = sum(open(os.path.join(folder, "stderr")).read().count("Running task")
                               for folder, _, files in os.walk(work) if "stderr" in files)
        return counts

    def close(self):
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    hosts = Hosts(str(tmp_path_factory.mktemp("hosts")))
    try:
        c = SparkCluster(hosts, str(tmp_path_factory.mktemp("spark")))
        yield c
        c.close()
    finally:
        hosts.close()


def on_the_cluster(cluster, module, argv):
    """`python -m preproc.MODULE --master spark://hosta:7077 ARGV`, run on hosta."""
    out = cluster.hosts.run("hosta", sys.executable, "-m", f"preproc.{module}", "--master", MASTER,
                            "--conf", "spark.sql.shuffle.partitions=4", *argv, cwd=ROOT, env=ENV, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


def locally(spark_local, module, argv):
    """The same job on the suite's local Spark session."""
    job = {"criteo": criteo, "raw": raw}[module]
    args = job.parser().parse_args(argv)
    spark_local.conf.set("spark.sql.shuffle.partitions", "4")
    run(spark_local, job.options(args), log=lambda m: None)


@pytest.mark.slow
def test_criteo_on_a_standalone_cluster_writes_what_local_mode_writes(cluster, spark_local, tmp_path):
    day = tmp_path / "day.tsv"
    generate.write(generate.generate(8000, seed=5, bad_fraction=0.002), str(day))
    args = ["--input", str(day), "--frequency_threshold=3", "--shuffle", "--split_mb=1", "--part_rows=2000"]
    before = cluster.tasks_by_host()
    on_the_cluster(cluster, "criteo", args + ["--output", str(tmp_path / "cluster")])
    after = cluster.tasks_by_host()
    assert all(after[h] > before[h] for h in after), (before, after)   # both hosts' executors worked
    locally(spark_local, "criteo", args + ["--output", str(tmp_path / "local")])
    cluster_files, local_files = read_tree(tmp_path / "cluster"), read_tree(tmp_path / "local")
    assert sorted(cluster_files) == sorted(local_files) and "feature_spec.yaml" in local_files
    assert cluster_files == local_files


@pytest.mark.slow
def test_raw_histories_on_a_standalone_cluster_are_what_local_mode_builds(cluster, spark_local, tmp_path):
    write_events(tmp_path, events_log(6000, seed=2, users=40))
    args = ["--spec", write_spec(tmp_path), "--shuffle", "--split_mb=1", "--part_rows=1500"]
    on_the_cluster(cluster, "raw", args + ["--output", str(tmp_path / "cluster")])
    locally(spark_local, "raw", args + ["--output", str(tmp_path / "local")])
    cluster_files, local_files = read_tree(tmp_path / "cluster"), read_tree(tmp_path / "local")
    assert any(f.startswith("train/history.part") for f in local_files)
    assert cluster_files == local_files
