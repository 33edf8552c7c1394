"""The job and the estimator over Spark Connect, against a real Spark Connect server on loopback.

The server is pyspark's own SparkConnectServer with Delta's package and extensions, started with
spark-submit and stopped by pid. The clients are processes of their own (a Python process holds either a
classic or a Connect session, not both); what they write must equal a classic-session run.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TEST_SPARK_CONF

from helpers import (
    MIXTURE,
    by_row,
    free_port,
    labels_of,
    mixture_estimator,
    report_folder,
    run_cli_process,
    servers,
    spark_home,
    wait_for_port,
)
from kfed_spark.runtime.packaging import delta_package

pytestmark = pytest.mark.integration  # processes of their own: spark-submit, servers, the CLI


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory):
    logs = tmp_path_factory.mktemp("connect")
    port = free_port()
    conf = {
        **TEST_SPARK_CONF,
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.sql.warehouse.dir": str(logs / "warehouse"),
    }
    command = [
        str(spark_home() / "bin" / "spark-submit"),
        "--master",
        "local[2]",
        "--packages",
        delta_package(),
        "--class",
        "org.apache.spark.sql.connect.service.SparkConnectServer",
        "--name",
        "kfed-connect-test",
        *[arg for key, value in conf.items() for arg in ("--conf", f"{key}={value}")],
    ]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    with servers(logs) as start:
        wait_for_port(port, start(command, env))
        yield f"sc://127.0.0.1:{port}"


def cli(*args: str, remote: str | None = None, cwd: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYSPARK")}
    if remote:
        env["SPARK_REMOTE"] = remote
    return run_cli_process(*args, env=env, cwd=cwd)


def test_cli_over_connect_writes_what_a_classic_session_writes(spark, published_run, tmp_path, connect_url):
    config, classic = published_run
    out = tmp_path / "connect"
    # spark.remote in the config; the config's own master and Spark settings do not get in the way.
    result = cli(
        "run",
        "--config",
        str(config),
        "--set",
        f"output.path={out}",
        "--set",
        "spark.master=local[2]",
        "--set",
        f"spark.remote={connect_url}",
        "--json",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["n_labelled"] == MIXTURE["devices"] * MIXTURE["points_per_device"]
    expected = labels_of(spark, classic, "first").select("row_id", "cluster_id").orderBy("row_id").collect()
    assert labels_of(spark, out, "first").select("row_id", "cluster_id").orderBy("row_id").collect() == expected
    assert (report_folder(out, "first") / "report.html").is_file()

    # SPARK_REMOTE in the environment, for assign, sql and report.
    result = cli(
        "assign",
        "--model-run",
        "first",
        "--config",
        str(config),
        "--set",
        f"output.path={out}",
        "--set",
        "run_id=again",
        "--quiet",
        remote=connect_url,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assigned = labels_of(spark, out, "again").select("row_id", "cluster_id").orderBy("row_id").collect()
    assert assigned == expected  # the same rows, labelled by the run's own model
    result = cli(
        "sql",
        "SELECT run_id, count(*) AS n FROM labels GROUP BY run_id ORDER BY run_id",
        "--output",
        str(out),
        remote=connect_url,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["run_id", "n", "again", "6000", "first", "6000"]
    result = cli("report", "first", "--output", str(out), remote=connect_url, cwd=tmp_path)
    assert result.returncode == 0 and "silhouette" in result.stdout, result.stderr[-3000:]

    # stream: foreachBatch runs in the server's Python; the summary is read back from the tables.
    result = cli(
        "stream",
        "--available-now",
        "--model-run",
        "first",
        "--config",
        str(config),
        "--set",
        f"output.path={out}",
        "--json",
        "--quiet",
        remote=connect_url,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert (summary["batches"], summary["n_labelled"], summary["n_quarantined"]) == (1, 6000, 0)
    streamed = spark.read.format("delta").load(str(out / "stream_labels"))
    assert streamed.select("row_id", "cluster_id").orderBy("row_id").collect() == expected

    # Failures are one line, last: a missing input (found when Connect first analyses the plan: the same
    # user error, exit 2, as in a classic session), and a server that is not there (exit 1).
    result = cli(
        "run",
        "--config",
        str(config),
        "--set",
        f"output.path={out}",
        "--set",
        "input.path=/nonexistent",
        "--quiet",
        remote=connect_url,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("kfed-spark: error: cannot read parquet input /nonexistent: [PATH_NOT_FOUND]")
    )
    nobody = f"sc://127.0.0.1:{free_port()}"
    result = cli("run", "--config", str(config), "--quiet", remote=nobody, cwd=tmp_path)
    assert (result.returncode, result.stderr.strip().splitlines()[-1]) == (
        1,
        f"kfed-spark: error: cannot reach the Spark Connect server at {nobody}: Connection refused",
    )


ESTIMATOR_OVER_CONNECT = """
import json, sys
from pyspark.sql import SparkSession
from kfed_spark.estimator import KFed, KFedModel

url, data, folder, k, k_per_device = sys.argv[1:]
spark = SparkSession.builder.remote(url).getOrCreate()
rows = spark.read.parquet(data)
model = KFed(k=int(k), kPerDevice=int(k_per_device), seed=11).fit(rows)
for _ in range(2):  # the second save overwrites the first
    model.write().overwrite().save(folder + "/model")
KFed(k=int(k)).write().overwrite().save(folder + "/estimator")
loaded = KFedModel.load(folder + "/model")
assert KFed.load(folder + "/estimator").getK() == int(k)
predictions = loaded.transform(rows).select("row_id", "prediction").orderBy("row_id").toPandas()
print(json.dumps(predictions["prediction"].tolist()))
"""


def test_estimator_over_connect_fits_transforms_saves_and_loads(spark, tmp_path, mixture_path, connect_url):
    expected = by_row(
        mixture_estimator().fit(spark.read.parquet(mixture_path)).transform(spark.read.parquet(mixture_path)),
        "prediction",
    )["prediction"].tolist()
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYSPARK")}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(ESTIMATOR_OVER_CONNECT),
            connect_url,
            mixture_path,
            str(tmp_path),
            str(MIXTURE["k"]),
            str(MIXTURE["k_per_device"]),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout) == expected


SESSION_SIZES_OVER_CONNECT = """
import json, sys
from kfed_spark.config import SparkConfig
from kfed_spark.spark.session import build_session

session = build_session(SparkConfig(remote=sys.argv[1], conf=json.loads(sys.argv[2])))
keys = ("spark.sql.shuffle.partitions", "spark.databricks.delta.snapshotPartitions")
print(json.dumps([session.conf.get(key) for key in keys]))
"""


def test_a_run_on_a_local_mode_server_sizes_its_session_partitions_to_the_servers_cores(connect_url):
    """The server runs Spark in local[2] with 2 shuffle partitions: a run's session there takes a local run's
    partition counts for 2 cores (3 shuffle partitions a core, a Delta snapshot partition a core); a config
    that sets one keeps it."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYSPARK")}

    def sizes(conf: dict) -> list[str]:
        client = [sys.executable, "-c", SESSION_SIZES_OVER_CONNECT, connect_url, json.dumps(conf)]
        result = subprocess.run(client, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.splitlines()[-1])

    assert sizes({}) == ["6", "2"]
    assert sizes({"spark.sql.shuffle.partitions": "5"}) == ["5", "2"]
