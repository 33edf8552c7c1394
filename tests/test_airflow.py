"""The Airflow DAG, for real: DagBag parsing, and dag.test() submitting the job, with the package and the
packed environment `kfed-spark package` built, to the standalone cluster whose workers' python3 has no numpy.

Airflow runs in its own virtual environment (the `airflow` extra of pyproject.toml), built here on
first use and kept under ~/.cache/kfed-spark; the tests in tests/airflow run inside it.
"""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from helpers import MIXTURE, ROOT, tool_python
from kfed_spark.runtime.packaging import build, delta_package

pytestmark = pytest.mark.integration  # processes of their own: spark-submit, servers, the CLI


def airflow_python() -> Path:
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["airflow"]
    return tool_python("airflow", [*requirements, "pytest>=8"])


def test_airflow_dag_parses_runs_and_checks(tmp_path, mixture_path, standalone_master):
    from pyspark.find_spark_home import _find_spark_home

    python = airflow_python()
    build(tmp_path / "dist")
    config = tmp_path / "kfed.yaml"
    # One executor per application (spark.cores.max): the DAG's two jobs still run on the cluster, unpacking
    # the packed environment, and test_cluster.py keeps two executors per application; a second executor here
    # would only unpack the environment once more.
    config.write_text(
        f'input: {{path: "{mixture_path}"}}\noutput: {{path: unused}}\n'
        f"k: {MIXTURE['k']}\nk_per_device: {MIXTURE['k_per_device']}\nseed: 1\n"
        "spark: {conf: {spark.sql.shuffle.partitions: '2', spark.databricks.delta.snapshotPartitions: '2', "
        "spark.ui.enabled: 'false', spark.executor.memory: 512m, spark.cores.max: '1'}}\n"
    )
    host, port = standalone_master.url.rsplit(":", 1)
    env = {
        **{key: value for key, value in os.environ.items() if not key.startswith(("PYSPARK", "VIRTUAL_ENV"))},
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "jobs"),
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": host, "port": int(port)}),
        "KFED_CONFIG": str(config),
        "KFED_OUTPUT": str(tmp_path / "out"),
        "KFED_STREAM_INPUT": mixture_path,
        "KFED_DIST": str(tmp_path / "dist"),
        "KFED_DELTA_PACKAGE": delta_package(),
        "KFED_DRIVER_PYTHON": sys.executable,  # client mode: the driver runs where Airflow runs spark-submit
        "PATH": f"{_find_spark_home()}/bin:/usr/bin:/bin",
        "SPARK_HOME": _find_spark_home(),
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    migrate = subprocess.run([str(python), "-m", "airflow", "db", "migrate"], env=env, capture_output=True, text=True)
    assert migrate.returncode == 0, migrate.stderr[-3000:]
    result = subprocess.run(
        [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--confcutdir",
            str(ROOT / "tests" / "airflow"),
            str(ROOT / "tests" / "airflow"),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert "4 passed" in result.stdout
