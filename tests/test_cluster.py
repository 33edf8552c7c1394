"""A real Spark standalone cluster on loopback: a master and two one-core workers.

The job is submitted the way the README tells cluster users (the package zipped and shipped with
--py-files, Delta through --packages) and must label every row as a local-mode run does. Local mode
shares one process between driver and executors; a cluster does not.
"""

import os
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from kfed_spark.session import delta_package

from test_job import ROOT, labels_of, run_cli


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spark_home() -> Path:
    from pyspark.find_spark_home import _find_spark_home

    return Path(_find_spark_home())


@pytest.fixture(scope="module")
def standalone_master(tmp_path_factory):
    """Start the master and two workers from pyspark's own spark-class; stop them by pid afterwards."""
    logs = tmp_path_factory.mktemp("standalone")
    port = free_port()
    url = f"spark://127.0.0.1:{port}"
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    spark_class = str(spark_home() / "bin" / "spark-class")
    commands = [
        [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
         "--webui-port", str(free_port())],
    ] + [
        [spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "1",
         "--memory", "1g", "--webui-port", str(free_port()), "--work-dir", str(logs / f"work{i}"), url]
        for i in range(2)
    ]
    processes = []
    try:
        for i, command in enumerate(commands):
            log = open(logs / f"process{i}.log", "w")
            processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
            if i == 0:
                wait_for(logs / "process0.log", "Starting Spark master", 1)
        wait_for(logs / "process0.log", "Registering worker", 2)
        yield url
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def wait_for(log: Path, text: str, times: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and log.read_text(errors="replace").count(text) >= times:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{log} did not show {text!r} {times} time(s) in {timeout} s:\n{log.read_text()[-3000:]}")


def test_standalone_cluster_labels_equal_local_mode(spark, config, tmp_path, standalone_master):
    assert run_cli(config) == 0
    package = tmp_path / "kfed_spark.zip"
    with zipfile.ZipFile(package, "w") as archive:  # what `python -m zipfile -c kfed_spark.zip kfed_spark/` makes
        for source in sorted((ROOT / "kfed_spark").glob("*.py")):
            archive.write(source, f"kfed_spark/{source.name}")
    result = subprocess.run(
        [str(spark_home() / "bin" / "spark-submit"), "--master", standalone_master,
         "--packages", delta_package(), "--py-files", str(package),
         "--conf", "spark.executor.memory=512m", "--conf", "spark.executor.cores=1",
         "--conf", "spark.sql.shuffle.partitions=4", "--conf", "spark.databricks.delta.snapshotPartitions=2",
         "--conf", "spark.ui.enabled=false",
         str(ROOT / "jobs" / "kfed_job.py"), "--config", str(config), "--set", f"output.path={tmp_path / 'cluster'}"],
        capture_output=True, text=True, check=False, timeout=900,
        env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "app-" in result.stderr  # it ran as an application of the standalone master, not in local mode
    expected = labels_of(spark, tmp_path / "out", "first").select("row_id", "cluster_id").orderBy("row_id").collect()
    got = labels_of(spark, tmp_path / "cluster", "first").select("row_id", "cluster_id").orderBy("row_id").collect()
    assert got == expected
