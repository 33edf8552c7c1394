"""Bad input, faults and re-runs: every row accounted for, every error clear, no partial runs."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import functions as F

from helpers import (
    MIXTURE,
    dirty_input,
    labels_of,
    published,
    refused,
    run_cli,
    runs_of,
    spark_submit_job,
    write_empty_config,
)
from kfed_spark.cli import main
from kfed_spark.core.metrics import adjusted_rand_index
from kfed_spark.runtime.fault_injection import FAULT_ENV


def sorted_labels(spark, out, run_id="first"):
    return labels_of(spark, out, run_id).select("row_id", "cluster_id", "local_cluster_id").orderBy("row_id").collect()


@pytest.mark.spark
def test_on_bad_rows_fail_names_reasons_and_counts_and_publishes_nothing(spark, tmp_path, capsys):
    dirty_input(spark, tmp_path / "dirty")
    settings = [
        f"input.path={tmp_path / 'dirty'}",
        f"output.path={tmp_path / 'out'}",
        "k=2",
        "k_per_device=2",
        "min_center_points=1",  # devices of two good rows: each shares its rows themselves
        "on_bad_rows=fail",
    ]
    assert run_cli(write_empty_config(tmp_path), *settings) == 2
    assert capsys.readouterr().err.strip() == (
        "kfed-spark: error: 3 bad input rows (non_finite_value: 2, null_device: 1) and on_bad_rows is 'fail'; "
        "nothing of this run was published"
    )
    assert published(spark, tmp_path / "out", "labels").count() == 0
    assert [(r.status, r.rows_removed) for r in runs_of(spark, tmp_path / "out")] == [("failed", True)]


@pytest.mark.spark
def test_empty_input_is_a_clear_error(spark, tmp_path, capsys):
    spark.createDataFrame([], "device_id long, features array<double>").write.parquet(str(tmp_path / "empty"))
    assert (
        run_cli(
            str(write_empty_config(tmp_path)),
            f"input.path={tmp_path / 'empty'}",
            f"output.path={tmp_path / 'out'}",
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == "kfed-spark: error: the input has no rows"


@pytest.mark.spark
def test_a_failure_after_the_labels_commit_publishes_nothing(
    spark, config_after_first_run, tmp_path, capsys, monkeypatch
):
    config, out = config_after_first_run, tmp_path / "out"
    before = sorted_labels(spark, out)
    monkeypatch.setenv(FAULT_ENV, "fail:labels")
    assert run_cli(config, "run_id=second") == 2
    assert capsys.readouterr().err.strip().endswith("kfed-spark: error: injected failure at labels")
    for name in ("labels", "centers", "local_centers", "quarantine", "device_clusters"):
        assert published(spark, out, name).filter(F.col("run_id") == "second").count() == 0, name
        assert spark.read.format("delta").load(str(out / name)).filter(F.col("run_id") == "second").count() == 0
    # A failed re-run of an existing run id leaves that run's published rows as they were.
    assert run_cli(config, "seed=12") == 2
    assert sorted_labels(spark, out) == before
    assert [(r.run_id, r.status, r.error) for r in runs_of(spark, out)] == [
        ("first", "succeeded", None),
        ("second", "failed", "injected failure at labels"),
        ("first", "failed", "injected failure at labels"),
    ]


@pytest.mark.integration  # spark-submit
def test_spark_submit_job_with_retried_local_tasks_writes_the_cli_s_labels(spark, published_run, tmp_path):
    """jobs/kfed_job.py under spark-submit, every local-step task failing once and retried by Spark
    (local[2,4]), writes the labels and local clusters that `kfed-spark run` writes undisturbed."""
    config, out = published_run
    result = spark_submit_job(config, tmp_path / "retried", "local[2,4]", {FAULT_ENV: "fail_first_attempt"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "injected failure in the first attempt of local-step task" in result.stderr
    assert sorted_labels(spark, tmp_path / "retried") == sorted_labels(spark, out)


@pytest.mark.spark
def test_dropping_a_fifth_of_the_devices_keeps_the_clusters(spark, config, tmp_path, mixture_path):
    table = pq.read_table(mixture_path)
    devices = np.unique(table.column("device_id").to_numpy())
    kept = np.random.default_rng(1).choice(devices, size=int(0.8 * len(devices)), replace=False)
    pq.write_table(
        table.filter(pa.compute.is_in(table.column("device_id"), pa.array(kept))), tmp_path / "remaining.parquet"
    )
    assert run_cli(config, f"input.path={tmp_path / 'remaining.parquet'}") == 0
    cells = labels_of(spark, tmp_path / "out", "first").groupBy("true_cluster", "cluster_id").count().toPandas()
    assert cells["count"].sum() == len(kept) * MIXTURE["points_per_device"]
    assert adjusted_rand_index(cells.true_cluster, cells.cluster_id, cells["count"]) >= 0.95


@pytest.mark.spark
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["input.truth_col=nope"], "input has no truth column 'nope' (input.truth_col); columns: "),
        (["k_per_device=no_such_table"], "cannot read table no_such_table: "),
    ],
)
def test_columns_and_tables_the_config_names_are_checked_before_any_work(
    spark, config, tmp_path, capsys, overrides, message
):
    assert run_cli(config, *overrides) == 2
    assert refused(capsys).startswith(f"kfed-spark: error: {message}")
    assert not (tmp_path / "out").exists()


@pytest.mark.spark
@pytest.mark.parametrize(
    "devices, message",
    [
        (
            [1.0, float("nan"), 2.0, float("nan")],
            "device column 'device_id' is NaN in 2 rows; device ids must be strings or whole numbers",
        ),
        ([None, None, None, None], "the device column 'device_id' is null in every row"),
    ],
)
def test_nan_or_all_null_device_ids_are_refused_before_any_work(spark, tmp_path, capsys, devices, message):
    rows = [(d, [float(i), 0.0]) for i, d in enumerate(devices)]
    spark.createDataFrame(rows, "device_id double, features array<double>").write.parquet(str(tmp_path / "in"))
    args = [
        "run",
        "--config",
        str(write_empty_config(tmp_path)),
        "--set",
        f"input.path={tmp_path / 'in'}",
        "--set",
        f"output.path={tmp_path / 'out'}",
        "--set",
        "k=2",
    ]
    assert main(args) == 2
    assert refused(capsys) == f"kfed-spark: error: {message}"
    assert not (tmp_path / "out").exists()
