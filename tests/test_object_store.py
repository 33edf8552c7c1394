"""The job against object storage: a real S3 API (moto's server, on 127.0.0.1, stopped by pid, logging the
requests it answers), reached by Spark through S3A (hadoop-aws, which `kfed-spark` adds for s3a:// paths), by
pyarrow for the report files, and by delta-rs and DuckDB through their storage options. Every command is a
process of its own, as a user starts it; the labels are compared row for row with the same run on a local
folder."""

import json
from pathlib import Path

import pyarrow.compute as pc
import pytest
import yaml
from deltalake import DeltaTable

from helpers import (
    MIXTURE,
    N_ROWS,
    duckdb_published,
    run_cli_process,
)
from kfed_spark.bench.object_store import request_counts

pytestmark = pytest.mark.integration  # the S3 server and every command are processes of their own


def published_rows(out: str, name: str, storage_options: dict | None, columns: list[str], order: list[str]):
    table = duckdb_published(out, name, storage_options).select(columns)
    return table.sort_by([(column, "ascending") for column in order])


def test_a_run_on_the_bucket_writes_what_the_same_run_on_a_local_folder_writes(
    spark, published_run, mixture_path, s3, tmp_path
):
    """Input and output in the bucket: a first run, a daily run and a re-run of the first run id, each a
    `kfed-spark run` process; the published labels, centers and counts of `first` equal those of the same
    run on a local folder (published_run), row for row, and the report files are in the bucket."""
    config, local_out = published_run
    out = s3.url("runs-out")
    on_bucket = s3.config(config, s3.upload(Path(mixture_path), "mixture"), out, tmp_path / "bucket.yaml")
    for run_id in ("first", "second", "first"):
        before = s3.requests_so_far()
        ran = run_cli_process("run", "--config", str(on_bucket), "--set", f"run_id={run_id}", cwd=tmp_path)
        requests = request_counts(s3.log.read_text().splitlines()[before:], "runs-out")
        assert requests[("mixture", "LIST")] <= 4  # the input is listed when it is read, not for every stage
        assert all(requests[(f"{table} log", "PUT")] for table in ("labels", "centers", "local_centers", "runs"))
        assert ran.returncode == 0, ran.stderr[-3000:]
        # without Delta's multi-driver log store for S3, each run says once that overlapping runs are unsafe
        (warned,) = [line for line in ran.stderr.splitlines() if "log store" in line]
        assert " WARNING " in warned and "spark.delta.logStore.s3a.impl=io.delta.storage.S3DynamoDBLogStore" in warned

    options = s3.storage_options
    label_columns = ["run_id", "row_id", "device_id", "cluster_id", "local_cluster_id"]
    bucket_labels = published_rows(out, "labels", options, label_columns, ["run_id", "row_id"])
    local_labels = published_rows(str(local_out), "labels", None, label_columns, ["run_id", "row_id"])
    first = pc.equal(bucket_labels.column("run_id"), "first")
    assert bucket_labels.filter(first).equals(local_labels) and len(local_labels) == N_ROWS
    assert bucket_labels.num_rows == 2 * N_ROWS  # first (its re-run) and second
    center_columns = ["run_id", "cluster_id", "center", "n_points", "n_devices"]
    bucket_centers = published_rows(out, "centers", options, center_columns, ["run_id", "cluster_id"])
    local_centers = published_rows(str(local_out), "centers", None, center_columns, ["run_id", "cluster_id"])
    assert bucket_centers.filter(pc.equal(bucket_centers.column("run_id"), "first")).equals(local_centers)

    counts = ["n_input", "n_labelled", "n_quarantined", "n_devices", "k", "cost"]
    bucket_runs = duckdb_published(out, "runs", options).to_pylist()
    (local_run,) = duckdb_published(str(local_out), "runs").to_pylist()
    attempts = {row["run_id"]: [] for row in bucket_runs}
    for row in bucket_runs:
        attempts[row["run_id"]].append(row)
    assert sorted((row["publish_seq"], row["status"]) for row in attempts["first"]) == [
        (1, "superseded"),
        (2, "succeeded"),
    ]
    (published_first,) = [row for row in attempts["first"] if row["status"] == "succeeded"]
    assert {c: published_first[c] for c in counts} == {c: local_run[c] for c in counts}

    reports = s3.keys("runs-out/reports/first/")
    assert f"runs-out/reports/first/{published_first['attempt_id']}/report.json" in reports


def run_ok(*args: str, cwd: Path) -> str:
    ran = run_cli_process(*args, cwd=cwd)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran.stdout


def with_catalog(config: str, catalog: Path, warehouse: str) -> str:
    """The config with output.database, its views kept in a Hive metastore (embedded Derby, as the catalog
    page sets it up) whose warehouse is in the bucket."""
    cfg = yaml.safe_load(Path(config).read_text())
    cfg["output"]["database"] = "kfed"
    cfg["spark"]["conf"].update(
        {
            "spark.sql.catalogImplementation": "hive",
            "spark.sql.warehouse.dir": warehouse,
            "spark.hadoop.javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={catalog};create=true",
        }
    )
    target = catalog.parent / "catalog.yaml"
    target.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(target)


def test_every_command_works_on_the_bucket(spark, config, mixture_path, s3, tmp_path):
    """k: auto, choose-k, report, sql (and output.database's views), assign, a stream with its checkpoint in
    the bucket, forget and maintain --vacuum, each a process of its own on a config whose input and output
    are in the bucket."""
    out = s3.url("commands-out")
    on_bucket = str(s3.config(config, s3.upload(Path(mixture_path), "commands-in"), out, tmp_path / "bucket.yaml"))
    cataloged = with_catalog(on_bucket, tmp_path / "metastore_db", s3.url("commands-warehouse"))
    run_ok("run", "--config", cataloged, "--set", "k=auto", "--set", "k_range=[8, 16]", cwd=tmp_path)
    (chosen,) = duckdb_published(out, "runs", s3.storage_options).to_pylist()
    assert chosen["k"] == MIXTURE["k"] and chosen["k_sweep"]

    swept = json.loads(
        run_ok("choose-k", "--config", on_bucket, "--k", "10:14", "--run", "first", "--json", cwd=tmp_path)
    )
    assert swept["recommended_k"] == MIXTURE["k"]
    report = f"commands-out/reports/first/{chosen['attempt_id']}"
    assert {f"{report}/{name}" for name in ("report.json", "k_sweep.json", "k_sweep.html")} <= set(s3.keys(report))
    assert json.loads(run_ok("report", "--config", on_bucket, "--json", "first", cwd=tmp_path))["run_id"] == "first"
    counted = run_ok("sql", "--config", on_bucket, "SELECT count(*) AS n FROM labels", cwd=tmp_path)
    assert counted.split()[-1] == str(N_ROWS)
    in_catalog = run_ok("sql", "--config", cataloged, "SELECT count(*) AS n FROM kfed.latest_labels", cwd=tmp_path)
    assert in_catalog.split()[-1] == str(N_ROWS)
    assert s3.keys("commands-warehouse/kfed.db")  # the database's folder is in the bucket too

    run_ok("assign", "--config", on_bucket, "--model-run", "first", "--set", "run_id=assigned", cwd=tmp_path)
    run_ok("stream", "--config", on_bucket, "--model-run", "first", "--available-now", cwd=tmp_path)
    assert s3.keys("commands-out/_checkpoints/stream/")  # the stream's checkpoint is in the bucket
    streamed = DeltaTable(f"{out}/stream_labels", storage_options=s3.storage_options).to_pyarrow_table()
    assigned = duckdb_published(out, "labels", s3.storage_options)
    assigned = assigned.filter(pc.equal(assigned.column("run_id"), "assigned"))
    assert streamed.num_rows == assigned.num_rows == N_ROWS
    by_row = dict(zip(assigned.column("row_id").to_pylist(), assigned.column("cluster_id").to_pylist()))
    assert dict(zip(streamed.column("row_id").to_pylist(), streamed.column("cluster_id").to_pylist())) == by_row

    device = str(assigned.column("device_id")[0])
    run_ok("forget", "--config", on_bucket, "--device", device, "--run", "first", cwd=tmp_path)
    labels = duckdb_published(out, "labels", s3.storage_options)
    first = labels.filter(pc.equal(labels.column("run_id"), "first"))
    assert 0 < first.num_rows < N_ROWS and device not in set(map(str, first.column("device_id").to_pylist()))
    run_ok("maintain", "--config", on_bucket, "--vacuum", cwd=tmp_path)
    statuses = {
        row["status"]
        for row in DeltaTable(f"{out}/runs", storage_options=s3.storage_options).to_pyarrow_table().to_pylist()
    }
    assert statuses == {"succeeded", "superseded"}
