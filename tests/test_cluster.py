"""A real Spark standalone cluster on loopback: a master and two one-core workers whose `python3` has no
numpy, and no PYSPARK_PYTHON. The deployment page's cluster commands, read out of docs/deployment.md, must
build and ship the job's Python environment, and label every row as a local-mode run does.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import MIXTURE, ROOT, bare_environment, docs_page, labels_of
from kfed_spark.runtime.packaging import delta_package

pytestmark = pytest.mark.integration  # processes of their own: spark-submit, servers, the CLI


CLUSTER_SECTION = "## On a cluster with spark-submit"


def docs_cluster_commands() -> list[str]:
    """The commands of the first bash block of the deployment page's cluster section, continuation lines
    joined."""
    text = docs_page("deployment.md")
    section = text[text.index(CLUSTER_SECTION) :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_readme_cluster_commands_label_as_local_mode_does(
    spark, published_run, tmp_path, standalone_master, mixture_path
):
    package, submit = docs_cluster_commands()
    assert package.startswith("kfed-spark package") and submit.startswith("spark-submit --master spark://HOST:7077")
    assert f"--packages {delta_package()}" in submit  # the page names the jar matching the installed versions

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
    )
    # The submitting machine: kfed-spark installed and on PATH, as after the README's install command.
    env = {
        **bare_environment(tmp_path / "bare"),
        "SPARK_CONF_DIR": str(spark_conf),
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
    }
    overrides = (
        f" --set input.path={mixture_path} --set input.format=parquet --set output.path={tmp_path / 'cluster'}"
        f" --set k={MIXTURE['k']} --set k_per_device={MIXTURE['k_per_device']} --set seed=11"
        " --set run_id=first --set local_partitions=4 --set output.database=null"
    )
    for command in (package, submit.replace("spark://HOST:7077", standalone_master.url) + overrides):
        result = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"{command}\n{result.stderr[-4000:]}"
    assert len(standalone_master.applications()) == applications_before + 1  # it ran on the workers
    local_mode = labels_of(spark, published_run[1], "first")  # the same run in local mode
    expected = local_mode.select("row_id", "cluster_id").orderBy("row_id").collect()
    got = labels_of(spark, tmp_path / "cluster", "first").select("row_id", "cluster_id").orderBy("row_id").collect()
    assert got == expected
