"""Bad input, faults and re-runs: every row accounted for, every error clear, no partial runs."""

import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import functions as F

from helpers import MIXTURE, ROOT, fitted_labels, labels_of, published, run_cli, runs_of, write_empty_config
from kfed_spark.cli import main
from kfed_spark.faults import FAULT_ENV
from kfed_spark.metrics import adjusted_rand_index
from kfed_spark.session import delta_package

N_ROWS = MIXTURE["devices"] * MIXTURE["points_per_device"]


def sorted_labels(spark, out, run_id="first"):
    return labels_of(spark, out, run_id).select("row_id", "cluster_id", "local_cluster_id").orderBy("row_id").collect()


def dirty_input(spark, path):
    rows = [
        (1, "a", [0.0, 0.0]),
        (2, "a", [9.0, 9.0]),
        (3, "b", [0.1, 0.0]),
        (4, "b", [9.0, 9.1]),
        (5, None, [1.0, 1.0]),
        (6, "a", [float("nan"), 0.0]),
        (7, "b", [1.0, None]),
    ]
    spark.createDataFrame(rows, "row_id long, device_id string, features array<double>").write.parquet(str(path))


@pytest.mark.spark
def test_on_bad_rows_fail_names_reasons_and_counts_and_publishes_nothing(spark, tmp_path, capsys):
    dirty_input(spark, tmp_path / "dirty")
    args = ["run", "--config", str(write_empty_config(tmp_path))]
    for item in [
        f"input.path={tmp_path / 'dirty'}",
        f"output.path={tmp_path / 'out'}",
        "k=2",
        "k_per_device=2",
        "on_bad_rows=fail",
    ]:
        args += ["--set", item]
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == (
        "kfed-spark: error: 3 bad input rows (non_finite_value: 2, null_device: 1) and on_bad_rows is 'fail'; "
        "nothing of this run was published"
    )
    assert published(spark, tmp_path / "out", "labels").count() == 0
    assert [(r.status, r.rows_removed) for r in runs_of(spark, tmp_path / "out")] == [("failed", True)]


@pytest.mark.spark
def test_null_values_inside_features_are_quarantined(spark, tmp_path):
    dirty_input(spark, tmp_path / "dirty")
    assert (
        main(
            [
                "run",
                "--config",
                str(write_empty_config(tmp_path)),
                "--set",
                f"input.path={tmp_path / 'dirty'}",
                "--set",
                f"output.path={tmp_path / 'out'}",
                "--set",
                "k=2",
                "--set",
                "run_id=r",
            ]
        )
        == 0
    )
    quarantine = published(spark, tmp_path / "out", "quarantine").toPandas()
    assert dict(zip(quarantine.row_id, quarantine.reason)) == {
        5: "null_device",
        6: "non_finite_value",
        7: "non_finite_value",
    }


@pytest.mark.spark
def test_empty_input_is_a_clear_error(spark, tmp_path, capsys):
    spark.createDataFrame([], "device_id long, features array<double>").write.parquet(str(tmp_path / "empty"))
    assert (
        main(
            [
                "run",
                "--config",
                str(write_empty_config(tmp_path)),
                "--set",
                f"input.path={tmp_path / 'empty'}",
                "--set",
                f"output.path={tmp_path / 'out'}",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == "kfed-spark: error: the input has no rows"


@pytest.mark.spark
def test_output_holding_another_schema_is_refused_before_any_work(spark, config, tmp_path, capsys):
    spark.createDataFrame([(1, "x")], "a long, run_id string").write.format("delta").save(
        str(tmp_path / "other" / "labels")
    )
    assert run_cli(config, f"output.path={tmp_path / 'other'}") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kfed-spark: error: output table {tmp_path / 'other' / 'labels'} holds another schema")
    assert "only in the table: ['a']" in err


@pytest.mark.spark
def test_a_runs_table_of_the_previous_version_is_refused_before_any_work(spark, config, tmp_path, capsys):
    """runs.k_per_device was an integer and had no seeding column before per-device k."""
    spark.createDataFrame([("old", 2)], "run_id string, k_per_device int").write.format("delta").save(
        str(tmp_path / "old" / "runs")
    )
    assert run_cli(config, f"output.path={tmp_path / 'old'}") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kfed-spark: error: output table {tmp_path / 'old' / 'runs'} holds another schema")
    assert not (tmp_path / "old" / "labels").exists()


@pytest.mark.spark
def test_partitioning_and_row_order_do_not_change_labels(spark, tmp_path, mixture_path):
    """Through the fit layer (no table written): other files, other row order, other local-step partitions."""
    table = pq.read_table(mixture_path)
    shuffled = table.take(np.random.default_rng(0).permutation(table.num_rows))
    (tmp_path / "shuffled").mkdir()
    for i, part in enumerate(np.array_split(np.arange(table.num_rows), 5)):
        pq.write_table(shuffled.take(part), tmp_path / "shuffled" / f"part-{i}.parquet")
    settings = dict(k=MIXTURE["k"], k_per_device=MIXTURE["k_per_device"], seed=11)

    def labels(path, **more):
        rows = fitted_labels(spark.read.parquet(str(path)), **settings, **more)[1]
        return rows.set_index("row_id")[["cluster_id", "local_cluster_id"]].sort_index()

    expected = labels(mixture_path)
    assert labels(tmp_path / "shuffled", local_partitions=5).equals(expected)
    assert labels(mixture_path, local_partitions=1).equals(expected)  # all devices in one partition


@pytest.mark.spark
def test_a_failure_after_the_labels_commit_publishes_nothing(spark, config, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert run_cli(config) == 0
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
def test_a_retried_local_step_gives_the_same_labels(spark, config, tmp_path):
    """Every local-step task fails once; Spark retries it (local[2,4]); labels equal an undisturbed run."""
    import os

    from pyspark.find_spark_home import _find_spark_home

    assert run_cli(config) == 0
    submit = [
        str(_find_spark_home() + "/bin/spark-submit"),
        "--master",
        "local[2,4]",
        "--packages",
        delta_package(),
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        "spark.databricks.delta.snapshotPartitions=2",
        "--conf",
        "spark.sql.shuffle.partitions=2",
        str(ROOT / "jobs" / "kfed_job.py"),
        "--config",
        str(config),
        "--set",
        f"output.path={tmp_path / 'retried'}",
    ]
    env = {**os.environ, FAULT_ENV: "fail_first_attempt"}
    result = subprocess.run(submit, capture_output=True, text=True, check=False, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "injected failure in the first attempt of local-step task" in result.stderr
    assert sorted_labels(spark, tmp_path / "retried") == sorted_labels(spark, tmp_path / "out")


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


def refused(capsys) -> str:
    """The last stderr line of a refused run."""
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.spark
def test_an_output_path_that_is_a_file_or_cannot_be_written_is_refused_before_any_work(spark, config, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    assert run_cli(config, f"output.path={tmp_path / 'file'}") == 2
    assert refused(capsys) == f"kfed-spark: error: output.path {tmp_path / 'file'} is a file, not a folder"
    assert run_cli(config, "output.path=/proc/kfed-output") == 2  # no one, not even root, creates folders there
    assert refused(capsys).startswith("kfed-spark: error: cannot write under output.path /proc/kfed-output: ")


@pytest.mark.spark
def test_a_damaged_table_is_refused_before_anything_is_written(spark, config, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_cli(config) == 0
    (out / "labels" / "_delta_log" / "00000000000000000000.json").unlink()  # its .crc stays
    logs = {path: path.stat().st_mtime for path in out.glob("*/_delta_log/*.json")}
    assert run_cli(config, "run_id=second") == 2
    assert refused(capsys) == (
        f"kfed-spark: error: output table {out / 'labels'} is damaged: its Delta log lacks version(s) 0; restore "
        "the log or use another output.path (nothing was written)"
    )
    assert {path: path.stat().st_mtime for path in out.glob("*/_delta_log/*.json")} == logs


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


@pytest.mark.spark
def test_assign_cannot_name_its_own_run_as_the_model(spark, published_run, capsys):
    config, out = published_run
    assert main(["assign", "--model-run", "first", "--config", str(config)]) == 2
    assert refused(capsys) == (
        "kfed-spark: error: run 'first' cannot take its own model: give the new run another run_id"
    )
    assert [r.status for r in runs_of(spark, out)] == ["succeeded"]
