"""All Delta reads and writes of an output location (kfed_spark.store.delta): the checks before any work, old
locations, the catalog and relative paths."""

import json
import shutil
from datetime import datetime, timezone

import pytest
from deltalake import DeltaTable

from helpers import MIXTURE, assert_commented, labels_of, published, refused, run_cli, runs_of
from kfed_spark.config import OutputConfig
from kfed_spark.params import DEFAULTS
from kfed_spark.store.delta import rows_frame
from kfed_spark.store.ledger import Ledger
from kfed_spark.store.output import OutputTables
from kfed_spark.store.tables import RUNS_SCHEMA, TABLES, RunRecord

pytestmark = pytest.mark.spark


def test_output_holding_another_schema_is_refused_before_any_work(spark, config, tmp_path, capsys):
    spark.createDataFrame([(1, "x")], "a long, run_id string").write.format("delta").save(
        str(tmp_path / "other" / "labels")
    )
    assert run_cli(config, f"output.path={tmp_path / 'other'}") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kfed-spark: error: output table {tmp_path / 'other' / 'labels'} holds another schema")
    assert "only in the table: ['a']" in err


def test_a_runs_table_of_the_previous_version_is_refused_before_any_work(spark, config, tmp_path, capsys):
    """runs.k_per_device was an integer and had no seeding column before per-device k."""
    spark.createDataFrame([("old", 2)], "run_id string, k_per_device int").write.format("delta").save(
        str(tmp_path / "old" / "runs")
    )
    assert run_cli(config, f"output.path={tmp_path / 'old'}") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kfed-spark: error: output table {tmp_path / 'old' / 'runs'} holds another schema")
    assert not (tmp_path / "old" / "labels").exists()


def test_an_output_path_that_is_a_file_or_cannot_be_written_is_refused_before_any_work(spark, config, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    assert run_cli(config, f"output.path={tmp_path / 'file'}") == 2
    assert refused(capsys) == f"kfed-spark: error: output.path {tmp_path / 'file'} is a file, not a folder"
    assert run_cli(config, "output.path=/proc/kfed-output") == 2  # no one, not even root, creates folders there
    assert refused(capsys).startswith("kfed-spark: error: cannot write under output.path /proc/kfed-output: ")


def test_a_damaged_table_is_refused_before_anything_is_written(spark, config_after_first_run, tmp_path, capsys):
    config, out = config_after_first_run, tmp_path / "out"
    (out / "labels" / "_delta_log" / "00000000000000000000.json").unlink()  # its .crc stays
    logs = {path: path.stat().st_mtime for path in out.glob("*/_delta_log/*.json")}
    assert run_cli(config, "run_id=second") == 2
    assert refused(capsys) == (
        f"kfed-spark: error: output table {out / 'labels'} is damaged: its Delta log lacks version(s) 0; restore "
        "the log or use another output.path (nothing was written)"
    )
    assert {path: path.stat().st_mtime for path in out.glob("*/_delta_log/*.json")} == logs


def test_relative_output_path_is_taken_from_the_working_directory(spark, config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_cli(config, "output.path=relative-out") == 0
    assert (
        labels_of(spark, tmp_path / "relative-out", "first").count()
        == MIXTURE["devices"] * MIXTURE["points_per_device"]
    )


def test_catalog_table_in_and_registered_tables_out(spark, config, tmp_path, mixture_path):
    spark.sql("CREATE DATABASE IF NOT EXISTS kfed_source")
    spark.read.parquet(mixture_path).write.format("delta").saveAsTable("kfed_source.devices")
    assert (
        run_cli(
            config,
            "input.path=null",
            "input.table=kfed_source.devices",
            "output.database=kfed_test",
            f"output.path={tmp_path / 'catalogued'}",
        )
        == 0
    )
    sizes = spark.sql(
        "SELECT cluster_id, count(*) AS n FROM kfed_test.labels WHERE run_id = 'first' GROUP BY cluster_id"
    ).collect()
    assert sum(r.n for r in sizes) == MIXTURE["devices"] * MIXTURE["points_per_device"]
    assert spark.sql("SELECT n_labelled FROM kfed_test.runs").first().n_labelled == sum(r.n for r in sizes)
    assert spark.table("kfed_test.centers").count() == MIXTURE["k"]


def test_an_output_location_of_the_previous_version_gains_the_new_table_and_columns(
    spark, config_after_first_run, tmp_path
):
    """Written before device_clusters existed and before runs had local_restarts and robust_min_size."""
    config, out = config_after_first_run, tmp_path / "out"
    runs_path = str(out / "runs")
    older = spark.read.format("delta").load(runs_path).drop("local_restarts", "robust_min_size")
    older.write.format("delta").mode("overwrite").option("overwriteSchema", "true").partitionBy(
        "run_id", "attempt_id"
    ).save(runs_path)
    shutil.rmtree(out / "device_clusters")
    assert run_cli(config, "run_id=second") == 0
    rows = {r.run_id: r for r in runs_of(spark, out)}
    assert (rows["first"].local_restarts, rows["first"].robust_min_size) == (None, None)
    assert rows["second"].local_restarts == DEFAULTS.local_restarts
    assert rows["second"].robust_min_size == DEFAULTS.robust_min_size
    assert_commented(spark, out / "runs", "runs")  # the added columns too
    assert published(spark, out, "device_clusters").filter("run_id = 'second'").count() > 0


def test_every_table_and_column_carries_a_comment(spark, published_run):
    """DESCRIBE shows what a column means, DESCRIBE DETAIL what the table holds."""
    _, out = published_run
    for name in TABLES:
        assert_commented(spark, out / name, name)
    labels = {row.col_name: row.comment for row in spark.sql(f"DESCRIBE delta.`{out / 'labels'}`").collect()}
    assert (labels["cluster_id"], labels["features"]) == ("the global cluster of the row", "as in the input table")


def test_every_column_of_every_table_is_nullable_at_every_depth(published_run):
    """The tables' schemas as their Delta logs hold them (read by delta-rs, not Spark): nullable columns,
    array elements and struct fields, as Delta stores a table created from a query; a NOT NULL nested in
    an array is one Delta refuses to create."""

    def not_nullable(data_type: dict, where: str) -> list[str]:
        if data_type.get("type") == "struct":
            return [
                found
                for f in data_type["fields"]
                for found in ([] if f["nullable"] else [f"{where}{f['name']}"])
                + (not_nullable(f["type"], f"{where}{f['name']}.") if isinstance(f["type"], dict) else [])
            ]
        if data_type.get("type") == "array":
            element = data_type["elementType"]
            return ([] if data_type["containsNull"] else [f"{where}[]"]) + (
                not_nullable(element, f"{where}[].") if isinstance(element, dict) else []
            )
        return []

    _, out = published_run
    found = {name: not_nullable(json.loads(DeltaTable(str(out / name)).schema().to_json()), "") for name in TABLES}
    assert found == {name: [] for name in TABLES}


def test_a_runs_row_reaches_spark_whole_and_without_a_python_task(spark, published_run):
    """delta.rows_frame, as the runs rows reach Spark where Spark writes them: a record as read back from the
    runs table (its datetimes naive, as Spark returns them), with a k sweep's structs added, makes a frame that
    holds it whole, built on the driver: a frame from a Python list would be an RDD whose every pass starts
    Python tasks."""
    (row,) = runs_of(spark, published_run[1])
    record = RunRecord.of(row.asDict()).changed(k_sweep=[(2, 1.0, 2.0, 0.5, None, 0.25)], k_range=[2, 3])
    frame = rows_frame(spark, [record.values()], RUNS_SCHEMA)
    assert frame.schema == RUNS_SCHEMA
    assert RunRecord.of(frame.first().asDict()) == record
    plan = frame._jdf.queryExecution().executedPlan().toString()
    assert "LocalTableScan" in plan and "ExistingRDD" not in plan, plan


def begun_attempts(spark, config, run_ids, schemas):
    """A location's tables (schemas by name) and its ledger, with an attempt of each run id begun:
    run id -> (attempt, row)."""
    from kfed_spark.config import load_config
    from kfed_spark.runs.job import attempt_row
    from kfed_spark.store.ledger import Ledger, new_attempt_id

    cfg = load_config(config)
    tables = OutputTables(spark, cfg.output)
    tables.prepare(schemas)
    ledger = Ledger(tables)
    started = datetime.now(timezone.utc)
    return (
        tables,
        ledger,
        {run_id: ledger.begin(attempt_row(cfg, run_id, new_attempt_id(started), None, started)) for run_id in run_ids},
    )


def test_a_named_published_run_is_found_from_its_run_ids_rows_alone(spark, config):
    """published_run with a run id (assign --model-run, describe --run, KFedModel.from_run) reads that run
    id's partitions of runs alone, as the publish does: another run id's rows are never opened, so that a
    location's thousandth run is found as soon as its first. An unreadable file of another run shows it."""
    from pathlib import Path

    from pyspark.sql.types import StructType

    from kfed_spark.store.models import published_run
    from kfed_spark.store.tables import ATTEMPT_FIELDS, CENTERS_FIELDS

    schemas = {"runs": RUNS_SCHEMA, "centers": StructType(CENTERS_FIELDS + ATTEMPT_FIELDS)}
    tables, ledger, begun = begun_attempts(spark, config, ("day1", "day2"), schemas)
    for attempt, row in begun.values():
        ledger.publish(attempt, row)
    other = list((Path(tables.root) / "runs").glob("run_id=day1/**/*.parquet"))
    assert other
    for data in other:
        data.unlink()
    assert published_run(tables, "day2").run_id == "day2"


def test_a_publish_reads_back_its_run_ids_rows_alone(spark, config):
    """`runs` keeps a row per attempt the location ever ran, in a partition of its own: a publish reads back
    its run id's partitions alone, so that it takes as long on a location's thousandth run as on its first."""
    _, ledger, begun = begun_attempts(spark, config, ("day1", "day2"), {"runs": RUNS_SCHEMA})
    read_back = ledger.publish(*begun["day2"])
    assert [(row.run_id, row.attempt_id, row.status) for row in read_back] == [
        ("day2", begun["day2"][0].attempt_id, "succeeded")
    ]
    assert sorted((row.run_id, row.status) for row in ledger.rows()) == [("day1", "running"), ("day2", "succeeded")]


def test_the_few_row_tables_read_without_spark_are_what_spark_reads(spark, config, published_run):
    """TableStore.read_few reads runs and an attempt's model with delta-rs on a local path (a fresh JVM's first
    Delta read costs seconds): the same rows, values and Arrow types as Spark's collect() and toArrow(), down to
    a runs row's map, its k sweep's structs and its naive datetimes."""
    from pyspark.sql import functions as F

    from kfed_spark.spark.columns import LOCAL_CENTER_COLUMNS

    _, ledger, begun = begun_attempts(spark, config, ("day1",), {"runs": RUNS_SCHEMA})
    _, row = begun["day1"]
    ledger.write(row.changed(k_sweep=[(2, 1.0, 2.0, 0.5, None, 0.25)], k_range=[2, 3], timings={"validate": 1.5}))
    assert ledger.tables.local_path("runs") is not None  # delta-rs reads it
    by_spark = [RunRecord.of(r.asDict()) for r in ledger.tables.read("runs").collect()]
    assert ledger.rows() == by_spark
    assert ledger.rows("day1", row.attempt_id) == by_spark
    assert ledger.rows("day2") == []

    tables = OutputTables(spark, OutputConfig(path=str(published_run[1])))
    (published,) = Ledger(tables).rows()
    models = {"centers": (["cluster_id", "center"], ["cluster_id"]), "local_centers": (LOCAL_CENTER_COLUMNS, [])}
    for name, (columns, order) in models.items():
        order = [(column, "ascending") for column in order or ["device_id", "local_cluster_id"]]
        attempt = (F.col("run_id") == published.run_id) & (F.col("attempt_id") == published.attempt_id)
        expected = tables.read(name).filter(attempt).select(*columns).toArrow()
        read = tables.read_few(name, columns, published.run_id, published.attempt_id)
        assert read.num_rows == expected.num_rows > 0
        assert read.schema == expected.schema
        assert read.sort_by(order).equals(expected.sort_by(order))


def test_runs_rows_written_without_spark_keep_deltas_publish_fence_with_spark_writers(spark, config):
    """TableStore.write_few commits a runs row with delta-rs on a local path (a fresh JVM's first Delta commit costs
    seconds), keeping Delta's idempotent-write rule that makes a publish first-come-first-served: a fence that
    Spark committed skips delta-rs's write of it, and the other way round, also once delta-rs has checkpointed the
    log. The rows, and each commit's userMetadata, read in Spark as Spark's own writes do; a table whose protocol
    someone raised past the one kfed-spark creates is written by Spark."""
    from pyspark.sql import functions as F

    from kfed_spark.store.delta import attempt_filter, rows_table

    tables, ledger, begun = begun_attempts(spark, config, ("day1",), {"runs": RUNS_SCHEMA})
    attempt, row = begun["day1"]
    assert tables.local_path("runs") is not None  # delta-rs writes it
    fence = f"kfed-spark-publish:{row.run_id}"

    def by_spark(changed, number):
        frame = spark.createDataFrame(rows_table([changed.values()], RUNS_SCHEMA), RUNS_SCHEMA)
        options = {"replaceWhere": attempt_filter(row.run_id, row.attempt_id), "txnAppId": fence}
        tables._write(frame, "runs", "overwrite", "by Spark", txnVersion=str(number), **options)

    def status():
        (read,) = [RunRecord.of(r.asDict()) for r in tables.read("runs").collect()]
        return read.status, read.error

    by_spark(row.changed(error="Spark 1"), 1)
    ledger.write(row.changed(error="delta-rs 1"), fence=1)
    assert status() == ("running", "Spark 1")
    ledger.write(row.changed(error="delta-rs 2"), fence=2)
    assert status() == ("running", "delta-rs 2")
    by_spark(row.changed(error="Spark 2"), 2)
    assert status() == ("running", "delta-rs 2")

    DeltaTable(tables.path("runs")).create_checkpoint()
    by_spark(row.changed(error="Spark 2"), 2)
    ledger.write(row.changed(error="delta-rs 2"), fence=2)
    assert status() == ("running", "delta-rs 2")
    ledger.write(row.changed(status="succeeded", error=None), fence=3)
    assert status() == ("succeeded", None)
    assert ledger.rows() == [RunRecord.of(r.asDict()) for r in tables.read("runs").collect()]
    history = spark.sql(f"DESCRIBE HISTORY {tables.source('runs')}").orderBy("version").collect()
    note = f"kfed-spark run day1 attempt {attempt.attempt_id}"
    # created, begun, Spark's fence 1, delta-rs's fence 2, delta-rs's fence 3: no commit for a skipped write
    assert [commit.userMetadata for commit in history] == [None, note, "by Spark", note, note]
    assert [commit.engineInfo.startswith("Apache-Spark") for commit in history] == [True, False, True, False, False]

    # A table someone gave features beyond the plain protocol kfed-spark creates is left to Spark.
    spark.sql(f"ALTER TABLE {tables.source('runs')} SET TBLPROPERTIES ('delta.enableDeletionVectors' = true)")
    ledger.write(row.changed(status="succeeded", error="by Spark"))
    assert status() == ("succeeded", "by Spark")
    last = spark.sql(f"DESCRIBE HISTORY {tables.source('runs')}").orderBy(F.desc("version")).first()
    assert last.engineInfo.startswith("Apache-Spark") and last.userMetadata == note


def test_the_runs_log_written_without_spark_is_checkpointed_where_spark_would(spark, config):
    """A Spark read replays every commit since the table's last checkpoint; delta-rs's own default is one
    checkpoint per 100 commits, so write_arrow makes one every delta.checkpointInterval commits, Spark's 10."""
    from pathlib import Path

    tables, ledger, begun = begun_attempts(spark, config, ("day1",), {"runs": RUNS_SCHEMA})
    _, row = begun["day1"]
    log = Path(tables.path("runs")) / "_delta_log"
    for n in range(12):
        ledger.write(row.changed(pid=n))
    assert sorted(p.name for p in log.glob("*.checkpoint.parquet")) == ["00000000000000000010.checkpoint.parquet"]
    assert ledger.rows() == [RunRecord.of(r.asDict()) for r in tables.read("runs").collect()]
    assert ledger.rows()[0].pid == 11
