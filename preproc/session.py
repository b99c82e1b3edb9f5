"""The SparkSession: local[*] unless a master is given (--master or spark-submit's)."""
import os
import shutil
import sys
from typing import Dict, Optional

from utils.errors import ConfigError


def spark_session(master: Optional[str] = None, conf: Optional[Dict[str, str]] = None):
    """A SparkSession; in local mode the Python workers run this interpreter, the UI is off."""
    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        raise ConfigError("Spark needs Java (17): no `java` on PATH and JAVA_HOME is not set "
                          "(apt-get install openjdk-17-jre-headless)")
    from pyspark import SparkConf
    from pyspark.sql import SparkSession

    spark_conf = SparkConf()
    if master or not spark_conf.contains("spark.master"):
        spark_conf.setMaster(master or "local[*]")
    if spark_conf.get("spark.master").startswith("local"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        spark_conf.setIfMissing("spark.ui.enabled", "false")
    spark_conf.setIfMissing("spark.ui.showConsoleProgress", "false")
    spark_conf.setIfMissing("spark.app.name", "criteo-preprocessing")
    for key, value in (conf or {}).items():
        spark_conf.set(key, value)
    spark = SparkSession.builder.config(conf=spark_conf).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
