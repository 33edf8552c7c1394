"""Streaming: `kfed-spark stream` labels rows as they arrive, exactly once, and KFedModel.transform is a lazy
plan that streams."""

import signal
import subprocess
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from pyspark.ml.functions import array_to_vector
from pyspark.sql import functions as F

from helpers import (
    MIXTURE,
    assert_commented,
    by_row,
    clean_environment,
    cli_process,
    labels_of,
    mixture_estimator,
    run_cli,
    run_cli_process,
)
from kfed_spark.cli import main
from kfed_spark.config import load_config
from kfed_spark.core.metrics import adjusted_rand_index
from kfed_spark.estimator import KFedModel
from kfed_spark.runs.streaming import start
from kfed_spark.runtime.fault_injection import FAULT_ENV
from kfed_spark.runtime.stopping import STREAM_STOPPED
from kfed_spark.store.models import stored_model
from kfed_spark.store.output import OutputTables
from kfed_spark.store.tables import STREAM_TABLES

MIXTURE_DDL = "row_id bigint, device_id bigint, features array<double>, true_cluster int"
SEEN_DEVICES = 45
"""The model is fitted to devices 0..44; 45..59 arrive later, unseen."""


def mixture_parts(mixture_path):
    table = pq.read_table(mixture_path)
    seen = pc.less(table.column("device_id"), SEEN_DEVICES)
    return table.filter(seen), table.filter(pc.invert(seen))


def bad_rows():
    """One row of each reason a row of a stream is quarantined, with the mixture's columns."""
    return pa.table(
        {
            "row_id": pa.array([-1, -2, -3, -4], pa.int64()),
            "device_id": pa.array([None, 3, 3, 50], pa.int64()),
            "features": pa.array([[0.0] * 8, [1.0, 2.0], [float("nan")] * 8, None], pa.list_(pa.float64())),
            "true_cluster": pa.array([0, 0, 0, 0], pa.int32()),
        }
    )


def stream_rows(spark, out, name):
    return spark.read.format("delta").load(str(out / name))


@pytest.mark.spark
def test_three_batches_arriving_while_the_stream_runs_are_each_labelled_or_quarantined_once(
    spark, config, tmp_path, mixture_path
):
    seen, unseen = mixture_parts(mixture_path)
    pq.write_table(seen, tmp_path / "seen.parquet")
    assert run_cli(config, f"input.path={tmp_path / 'seen.parquet'}") == 0
    source = tmp_path / "arriving"
    source.mkdir()
    cfg = load_config(config, [f"input.path={source}", f"input.schema={MIXTURE_DDL}", "stream.trigger_seconds=0.5"])
    out = tmp_path / "out"
    stream = start(spark, cfg, stored_model(OutputTables(spark, cfg.output)), available_now=False)
    try:
        known_rows = seen.take(np.arange(0, seen.num_rows, 2))  # half of each known device's rows
        for i, part in enumerate([known_rows, unseen, bad_rows()]):
            pq.write_table(part, source / f"part-{i}.parquet")
            stream.query.processAllAvailable()
    finally:
        stream.query.stop()
    result = stream.result()
    assert (result.batches, result.n_labelled, result.n_quarantined, result.n_new_devices) == (
        3,
        known_rows.num_rows + unseen.num_rows,
        4,
        MIXTURE["devices"] - SEEN_DEVICES,
    )

    labelled = stream_rows(spark, out, "stream_labels").toPandas()
    quarantined = stream_rows(spark, out, "stream_quarantine").toPandas()
    every_row = np.concatenate([known_rows["row_id"], unseen["row_id"], bad_rows()["row_id"]])
    assert sorted(np.concatenate([labelled.row_id, quarantined.row_id])) == sorted(every_row)  # each row once
    assert dict(zip(quarantined.row_id, quarantined.reason)) == {
        -1: "null_device",
        -2: "wrong_dimension (expected 8)",
        -3: "non_finite_value",
        -4: "null_features",
    }
    assert set(labelled.model_run_id) == {"first"} and sorted(set(labelled.batch_id)) == [0, 1]
    for name in STREAM_TABLES:
        assert_commented(spark, out / name, name)

    assign_input = tmp_path / "known.parquet"
    pq.write_table(known_rows, assign_input)
    assign = [
        "assign",
        "--model-run",
        "first",
        "--config",
        str(config),
        "--set",
        "run_id=assigned",
        "--set",
        f"input.path={assign_input}",
    ]
    assert main(assign) == 0
    assigned = by_row(labels_of(spark, out, "assigned"), "cluster_id", "local_cluster_id")
    known = labelled[~labelled.new_device].set_index("row_id").sort_index()
    assert known.index.equals(assigned.index)
    np.testing.assert_array_equal(known.cluster_id, assigned.cluster_id)
    np.testing.assert_array_equal(known.local_cluster_id, assigned.local_cluster_id)

    new = labelled[labelled.new_device]
    assert sorted(set(new.device_id)) == list(range(SEEN_DEVICES, MIXTURE["devices"]))
    assert new.local_cluster_id.isna().all() and len(new) == unseen.num_rows
    assert adjusted_rand_index(new.true_cluster, new.cluster_id) >= 0.95


@pytest.mark.spark
def test_a_delta_source_is_labelled_available_now_and_a_second_run_takes_only_what_arrived_since(
    spark, published_run, mixture_path, tmp_path
):
    """The features are a Spark ML vector column here (what VectorAssembler writes), one of them null: the
    stream's tables hold them as lists of doubles, which delta-rs reads."""
    config, _ = published_run
    source = str(tmp_path / "events")
    table = pq.read_table(mixture_path)

    def append(rows: pa.Table) -> None:
        frame = spark.createDataFrame(rows.to_pandas())
        frame = frame.withColumn("features", F.when(F.col("features").isNotNull(), array_to_vector("features")))
        frame.write.format("delta").mode("append").save(source)

    append(pa.concat_tables([table.slice(0, 1000), bad_rows().slice(3, 1)]))  # the null features
    settings = [
        f"input.path={source}",
        "input.format=delta",
        f"stream.labels={tmp_path / 'labels'}",
        f"stream.quarantine={tmp_path / 'quarantine'}",
        f"stream.checkpoint={tmp_path / 'checkpoint'}",
    ]
    cfg = load_config(config, settings)
    model = stored_model(OutputTables(spark, cfg.output), "first")
    for rows, bad in ((1000, 1), (1500, 0)):
        stream = start(spark, cfg, model, available_now=True)
        stream.query.awaitTermination(120)
        result = stream.result()
        assert (result.batches, result.n_labelled, result.n_quarantined) == (1, rows, bad)
        append(table.slice(1000, 1500))
    labelled = DeltaTable(str(tmp_path / "labels")).to_pyarrow_table()
    assert sorted(labelled.column("row_id").to_pylist()) == list(range(2500))
    assert not any(labelled.column("new_device").to_pylist())
    given = dict(zip(table.column("row_id").to_pylist(), table.column("features").to_pylist()))
    assert all(
        given[row_id] == features
        for row_id, features in zip(labelled.column("row_id").to_pylist(), labelled.column("features").to_pylist())
    )
    quarantined = DeltaTable(str(tmp_path / "quarantine")).to_pyarrow_table()
    assert quarantined.column("features").to_pylist() == [None] and quarantined.column("reason").to_pylist() == [
        "null_features"
    ]


@pytest.mark.spark
def test_transform_is_a_plan_that_runs_no_job_and_streams(spark, published_run, mixture_path, tmp_path):
    _, out = published_run
    model = KFedModel.from_run(str(out), "first")
    assert (model.getK(), model.getKPerDevice(), model.getSeed()) == (MIXTURE["k"], MIXTURE["k_per_device"], 11)
    rows = spark.read.parquet(mixture_path)
    tracker, group = spark.sparkContext.statusTracker(), "kfed-transform-plan"
    spark.sparkContext.setJobGroup(group, "transform must run no job")
    try:
        labelled = model.transform(rows)
        assert tracker.getJobIdsForGroup(group) == []
    finally:
        spark.sparkContext.setJobGroup(None, None)
    expected = by_row(labels_of(spark, out, "first"), "cluster_id", "local_cluster_id")
    got = by_row(labelled, "prediction", "local_prediction")
    np.testing.assert_array_equal(got.prediction, expected.cluster_id)
    np.testing.assert_array_equal(got.local_prediction, expected.local_cluster_id)

    arriving = spark.readStream.schema(rows.schema).parquet(mixture_path)
    query = (
        model.transform(arriving)
        .select("row_id", "prediction")
        .writeStream.format("memory")
        .queryName("kfed_streamed")
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    streamed = spark.table("kfed_streamed").toPandas().set_index("row_id").sort_index()
    np.testing.assert_array_equal(streamed.prediction, expected.cluster_id)


@pytest.mark.spark
def test_a_saved_estimator_model_serves_assign_and_its_runs_name_it(spark, config, mixture_path, tmp_path):
    rows = spark.read.parquet(mixture_path)
    model = mixture_estimator().fit(rows)
    model.write().overwrite().save(str(tmp_path / "model"))
    assert main(["assign", "--model", str(tmp_path / "model"), "--config", str(config), "--set", "run_id=saved"]) == 0
    out = tmp_path / "out"
    assigned = by_row(labels_of(spark, out, "saved"), "cluster_id")
    np.testing.assert_array_equal(assigned.cluster_id, by_row(model.transform(rows), "prediction").prediction)
    [run] = OutputTables(spark, load_config(config).output).read("runs").collect()
    assert run.parent_run_id == f"model:{tmp_path / 'model'}"


@pytest.mark.integration
def test_a_stream_killed_with_sigkill_resumes_without_duplicates_and_stops_at_once_on_sigterm(
    published_run, tmp_path, mixture_path
):
    """SIGKILL at the worst moment: the batch's rows are committed to both tables, the checkpoint does not
    know it yet. The restarted stream runs on, a micro-batch a second, until SIGTERM (what Airflow sends on
    a timeout). Its tables and checkpoint are configured paths, away from the published run it reads."""
    config, _ = published_run
    source = tmp_path / "arriving"
    source.mkdir()
    table = pq.read_table(mixture_path)
    parts = [table.slice(0, 2000), pa.concat_tables([table.slice(2000, 2000), bad_rows()]), table.slice(4000)]
    for i, part in enumerate(parts):
        pq.write_table(part, source / f"part-{i}.parquet")
    args = [
        "stream",
        "--config",
        str(config),
        "--set",
        f"input.path={source}",
        "--set",
        "stream.max_files_per_trigger=1",
    ]
    for name in ("labels", "quarantine", "checkpoint"):
        args += ["--set", f"stream.{name}={tmp_path / name}"]
    killed = run_cli_process(
        *args, "--available-now", timeout=300, env={**clean_environment(), FAULT_ENV: "kill:stream_batch"}
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]

    log = tmp_path / "resumed.log"
    with open(log, "w") as err:
        resumed = cli_process(*args, "--trigger-seconds", "1", stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 240
            while log.read_text().count("stream batch ") < 3 and time.monotonic() < deadline:  # the killed batch
                time.sleep(0.5)  # again, two more
            resumed.send_signal(signal.SIGTERM)
            resumed.wait(timeout=60)
        finally:
            resumed.kill()
    stderr = log.read_text()
    assert resumed.returncode == 1 and stderr.count("stream batch ") == 3, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == f"kfed-spark: error: {STREAM_STOPPED}"

    labelled = DeltaTable(str(tmp_path / "labels")).to_pyarrow_table().column("row_id").to_pylist()
    quarantined = DeltaTable(str(tmp_path / "quarantine")).to_pyarrow_table().column("row_id").to_pylist()
    assert len(quarantined) == 4 and len(labelled) == table.num_rows
    assert sorted(labelled + quarantined) == sorted(table.column("row_id").to_pylist() + [-1, -2, -3, -4])
