"""The job against object storage: a real S3 API (moto's server, on 127.0.0.1, stopped by pid), reached by
Spark through S3A (hadoop-aws, which `kfed-spark` adds for s3a:// paths), by pyarrow for the report files,
and by delta-rs and DuckDB through their storage options. Every command is a process of its own, as a
user starts it; the labels are compared row for row with the same run on a local folder."""

import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
import pytest

from helpers import (
    N_ROWS,
    duckdb_published,
    free_port,
    run_cli_process,
    servers,
    wait_for_port,
)

pytestmark = pytest.mark.integration  # the S3 server and every command are processes of their own

BUCKET = "kfed"
KEYS = {"access.key": "loopback", "secret.key": "loopback-secret"}


@dataclass(frozen=True)
class LoopbackS3:
    """An S3 API on 127.0.0.1 with one bucket, and the settings each client needs to reach it."""

    endpoint: str

    def url(self, key: str) -> str:
        return f"s3a://{BUCKET}/{key}"

    def cli_settings(self) -> list[str]:
        """`--set` arguments with S3A's settings for the bucket, as a user's config holds them."""
        settings = {"endpoint": self.endpoint, "path.style.access": "true", "endpoint.region": "us-east-1", **KEYS}
        return [
            arg for key, value in settings.items() for arg in ("--set", f"spark.conf.spark.hadoop.fs.s3a.{key}={value}")
        ]

    @property
    def storage_options(self) -> dict[str, str]:
        """delta-rs's options for the same bucket."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": KEYS["access.key"],
            "AWS_SECRET_ACCESS_KEY": KEYS["secret.key"],
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=KEYS["access.key"],
            aws_secret_access_key=KEYS["secret.key"],
            region_name="us-east-1",
        )

    def keys(self, prefix: str) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def upload(self, folder: Path, prefix: str) -> str:
        """Every file under folder to the bucket under prefix; the prefix's s3a:// URL."""
        client = self.client()
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(folder)}")
        return self.url(prefix)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    logs = tmp_path_factory.mktemp("moto")
    port = free_port()
    command = [sys.executable, "-m", "moto.server", "--host", "127.0.0.1", "--port", str(port)]
    with servers(logs) as start:
        wait_for_port(port, start(command, {"PATH": "/usr/bin:/bin"}))
        store = LoopbackS3(f"http://127.0.0.1:{port}")
        store.client().create_bucket(Bucket=BUCKET)
        yield store


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
    source = s3.upload(Path(mixture_path), "mixture")
    out = s3.url("runs-out")
    on_bucket = [*s3.cli_settings(), "--set", f"input.path={source}", "--set", f"output.path={out}"]
    for run_id in ("first", "second", "first"):
        ran = run_cli_process("run", "--config", str(config), *on_bucket, "--set", f"run_id={run_id}", cwd=tmp_path)
        assert ran.returncode == 0, ran.stderr[-3000:]

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
