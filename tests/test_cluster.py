"""A real Spark standalone cluster on loopback: a master and two one-core workers whose `python3` has no
numpy, and no PYSPARK_PYTHON, sharing no folder: input and tables are in an S3 bucket (moto's server on
127.0.0.1). The deployment page's cluster commands, read out of docs/deployment.md, must build and ship the
job's Python environment and S3A's jars, and label every row as a local-mode run does.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import MIXTURE, N_ROWS, ROOT, bare_environment, docs_page, duckdb_published
from kfed_spark.runtime.packaging import delta_package
from kfed_spark.spark.session import hadoop_version

pytestmark = pytest.mark.integration  # processes of their own: spark-submit, servers, the CLI


CLUSTER_SECTION = "## On a cluster with spark-submit"


def docs_cluster_commands() -> list[str]:
    """The commands of the first bash block of the deployment page's cluster section, continuation lines
    joined."""
    text = docs_page("deployment.md")
    section = text[text.index(CLUSTER_SECTION) :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_readme_cluster_commands_label_as_local_mode_does(published_run, tmp_path, standalone_master, mixture_path, s3):
    package, submit = docs_cluster_commands()
    assert package.startswith("kfed-spark package") and submit.startswith("spark-submit --master spark://HOST:7077")
    # the page names the jars matching the installed versions: Delta's, and S3A's at pyspark's Hadoop version
    assert f"--packages {delta_package()},org.apache.hadoop:hadoop-aws:{hadoop_version()} " in submit

    applications_before = len(standalone_master.applications())
    work = tmp_path / "clone"  # the commands' relative paths, as in a clone
    work.mkdir()
    for folder in ("jobs", "conf"):
        (work / folder).symlink_to(ROOT / folder)
    spark_conf = work / "spark-conf"  # small executors and the tests' sizes, without touching the commands
    spark_conf.mkdir()
    (spark_conf / "spark-defaults.conf").write_text(
        "spark.executor.memory 512m\nspark.executor.cores 1\nspark.ui.enabled false\n"
        "spark.sql.shuffle.partitions 4\nspark.databricks.delta.snapshotPartitions 2\n"
        + "".join(f"spark.hadoop.{key} {value}\n" for key, value in s3.s3a_settings().items())  # as an admin keeps them
    )
    # The submitting machine: kfed-spark installed and on PATH, as after the README's install command.
    env = {
        **bare_environment(tmp_path / "bare"),
        "SPARK_CONF_DIR": str(spark_conf),
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
    }
    source, out = s3.upload(Path(mixture_path), "cluster-in"), s3.url("cluster-out")  # no disk is shared
    overrides = (
        f" --set input.path={source} --set input.format=parquet --set output.path={out}"
        f" --set k={MIXTURE['k']} --set k_per_device={MIXTURE['k_per_device']} --set seed=11"
        " --set run_id=first --set local_partitions=4 --set output.database=null"
    )
    for command in (package, submit.replace("spark://HOST:7077", standalone_master.url) + overrides):
        result = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert len(standalone_master.applications()) == applications_before + 1  # it ran on the workers
    columns = ["row_id", "cluster_id", "local_cluster_id"]
    local_mode = duckdb_published(published_run[1], "labels").select(columns).sort_by("row_id")  # the same run
    on_cluster = duckdb_published(out, "labels", s3.storage_options).select(columns).sort_by("row_id")
    assert on_cluster.equals(local_mode) and on_cluster.num_rows == N_ROWS
