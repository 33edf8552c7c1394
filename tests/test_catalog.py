"""A persistent catalog, as the docs' catalog page sets it up: a run's `output.database` views kept in a Hive metastore
(embedded Derby), read afterwards by a `spark-sql` process, by the Spark Thrift Server over JDBC with
`beeline`, and from Python's DB-API with PyHive; each answer equal to `kfed-spark sql`'s."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import docs_page, free_port, run_cli_process, servers, spark_home, wait_for_port
from kfed_spark.cli import main
from kfed_spark.runtime.packaging import delta_package

pytestmark = pytest.mark.integration  # processes of their own: the CLI, spark-sql, the Thrift server, beeline

QUERY = "SELECT cluster_id, count(*) AS n FROM {database}latest_labels GROUP BY cluster_id ORDER BY cluster_id"


def docs_catalog(catalog, out) -> tuple[dict, str]:
    """The catalog page's run settings (YAML) and readers' properties file, its example folders replaced."""
    section = docs_page("catalog.md")
    section = section.replace("/data/kfed-catalog", str(catalog)).replace("/data/kfed-output", str(out))
    run_settings = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    properties = re.search(r"```properties\n(.*?)```", section, re.S).group(1)
    return yaml.safe_load(run_settings), properties


def reader_environment() -> dict[str, str]:
    return {
        **{key: value for key, value in os.environ.items() if not key.startswith("PYSPARK")},
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }


def test_views_persist_for_spark_sql_the_thrift_server_beeline_and_db_api(spark, config, tmp_path, capsys):
    out, catalog = tmp_path / "out", tmp_path / "catalog"
    settings, properties = docs_catalog(catalog, out)
    reader_conf = dict(line.split(" ", 1) for line in properties.strip().splitlines())
    run_conf = settings["spark"]["conf"]
    assert {key: reader_conf[key] for key in run_conf} == run_conf  # readers open the run's metastore
    assert reader_conf["spark.jars.packages"] == delta_package()  # the Delta the package installs
    properties_file = tmp_path / "kfed-catalog.conf"
    small = {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2"}
    properties_file.write_text(properties + "".join(f"{key} {value}\n" for key, value in small.items()))

    cfg = yaml.safe_load(config.read_text())
    cfg["output"] = settings["output"]
    cfg.setdefault("spark", {}).setdefault("conf", {}).update(run_conf)
    catalog_config = tmp_path / "catalog.yaml"
    catalog_config.write_text(yaml.safe_dump(cfg))
    ran = run_cli_process("run", "--config", str(catalog_config), cwd=tmp_path)  # its Spark ends with it
    assert ran.returncode == 0, ran.stderr[-3000:]

    assert main(["sql", QUERY.format(database=""), "--output", str(out)]) == 0
    expected = capsys.readouterr().out.split()
    assert expected[:2] == ["cluster_id", "n"] and len(expected) == 2 + 2 * cfg["k"]
    rows = expected[2:]

    bin_folder = spark_home() / "bin"
    query = QUERY.format(database=f"{settings['output']['database']}.")
    spark_sql = subprocess.run(
        [str(bin_folder / "spark-sql"), "--properties-file", str(properties_file), "-e", query],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=reader_environment(),
        timeout=600,
    )
    assert spark_sql.returncode == 0, spark_sql.stderr[-3000:]
    assert spark_sql.stdout.split() == rows

    # As the catalog page: Delta's two jars on the driver's class path too, from Ivy's folder (delta-io/delta#1332),
    # which is under Java's user.home: the home folder /etc/passwd names, whatever HOME says.
    ivy = Path(spark.sparkContext._jvm.java.lang.System.getProperty("user.home")) / ".ivy2.5.2" / "jars"
    delta_jars = [*ivy.glob("io.delta_delta-spark_*.jar"), *ivy.glob("io.delta_delta-storage-*.jar")]
    assert len(delta_jars) == 2, sorted(ivy.glob("io.delta_*"))
    port = free_port()
    thrift_server = [
        str(bin_folder / "spark-submit"),
        "--properties-file",
        str(properties_file),
        "--driver-class-path",
        ":".join(map(str, delta_jars)),
        "--master",
        "local[2]",
        "--class",
        "org.apache.spark.sql.hive.thriftserver.HiveThriftServer2",
        "spark-internal",
        "--hiveconf",
        "hive.server2.thrift.bind.host=127.0.0.1",
        "--hiveconf",
        f"hive.server2.thrift.port={port}",
    ]
    with servers(tmp_path) as start:  # stopped by pid on the way out
        wait_for_port(port, start(thrift_server, reader_environment()))
        beeline = subprocess.run(  # as the catalog page runs it: one statement with -e
            [
                str(bin_folder / "beeline"),
                "-u",
                f"jdbc:hive2://127.0.0.1:{port}",
                "-n",
                "kfed",
                "--silent=true",
                "--outputformat=tsv2",
                "-e",
                query,
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={key: value for key, value in reader_environment().items() if key != "TERM"},  # as cron, CI
            timeout=600,
        )
        assert beeline.returncode == 0, (beeline.stdout + beeline.stderr)[-3000:]
        # With no terminal, beeline's console writes its prompt ("null") around the answer, even on the
        # header's line: the answer is the header and the rows of two whole numbers after it.
        lines = beeline.stdout.splitlines()
        header = next((i for i, line in enumerate(lines) if line.endswith("cluster_id\tn")), None)
        assert header is not None, beeline.stdout[-3000:]
        answer = [line for line in lines[header + 1 :] if re.fullmatch(r"\d+\t\d+", line)]
        assert "\n".join(answer).split() == rows, beeline.stdout[-3000:]

        from pyhive import hive

        with hive.connect("127.0.0.1", port=port, username="kfed") as connection:
            cursor = connection.cursor()
            cursor.execute(query)
            assert [str(value) for row in cursor.fetchall() for value in row] == rows
