"""Building the SparkSession with Delta Lake, for local runs and under spark-submit alike."""

from __future__ import annotations

import os
import sys
from importlib.metadata import version

from pyspark.sql import SparkSession

from kfed_spark.config import SparkConfig

DELTA_SQL_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}
DELTA_JARS_ENV = "KFED_DELTA_JARS"
"""Comma-separated local Delta jars, for machines that cannot resolve packages from Maven."""


def build_session(spark_cfg: SparkConfig) -> SparkSession:
    """A SparkSession with the Delta extensions.

    Delta's jars come, in this order, from KFED_DELTA_JARS, from jars the configuration already
    names (spark.jars / spark.jars.packages, as on a cluster), or from Maven through
    delta-spark's configure_spark_with_delta_pip, which picks the jar matching the installed
    pyspark. Under spark-submit the JVM is already up, so --packages or --jars decide instead.
    """
    builder = SparkSession.builder.appName(spark_cfg.app_name)
    if spark_cfg.master:
        builder = builder.master(spark_cfg.master)
    if is_local(spark_cfg) and "PYSPARK_PYTHON" not in os.environ:
        # Workers would take `python3` from PATH, which is not this environment's when the CLI was
        # started by its absolute path (cron, systemd, a BashOperator) without activating it. PySpark
        # reads the workers' interpreter from this variable when it creates the SparkContext.
        os.environ["PYSPARK_PYTHON"] = spark_cfg.conf.get("spark.pyspark.python", sys.executable)
    for key, value in {**DELTA_SQL_CONF, **spark_cfg.conf}.items():
        builder = builder.config(key, str(value).lower() if isinstance(value, bool) else str(value))
    local_jars = os.environ.get(DELTA_JARS_ENV)
    if local_jars:
        builder = builder.config("spark.jars", local_jars)
    elif not {"spark.jars", "spark.jars.packages"} & set(spark_cfg.conf):
        from delta import configure_spark_with_delta_pip

        builder = configure_spark_with_delta_pip(builder)
    return builder.getOrCreate()


def is_local(spark_cfg: SparkConfig) -> bool:
    """Spark will run in this process's own local JVM: a local master, or none at all outside
    spark-submit (which starts Python with PYSPARK_GATEWAY_PORT) and Spark Connect (SPARK_REMOTE);
    PySpark then defaults to local[*]."""
    master = spark_cfg.master or os.environ.get("MASTER")
    if master:
        return master.startswith("local")
    return not {"PYSPARK_GATEWAY_PORT", "SPARK_REMOTE"} & set(os.environ)


def delta_package() -> str:
    """The Maven coordinate of the Delta jar matching the installed pyspark and delta-spark,
    for `spark-submit --packages` (the same rule configure_spark_with_delta_pip follows)."""
    spark_minor = ".".join(version("pyspark").split(".")[:2])
    return f"io.delta:delta-spark_{spark_minor}_2.13:{version('delta-spark')}"
