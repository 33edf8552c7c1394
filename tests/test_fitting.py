"""k-FED fitted to a DataFrame (kfed_spark.spark.fitting): features of every form, bad rows, what crosses to
Python, sampling, partitioning."""

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.ml.functions import array_to_vector
from pyspark.sql import functions as F

from helpers import (
    MIXTURE,
    dirty_input,
    duckdb_published,
    fitted_labels,
    published,
    run_cli,
    runs_of,
    write_empty_config,
)
from kfed_spark.config import InputConfig
from kfed_spark.spark.input import read_input
from kfed_spark.spark.labelling import label_rows
from kfed_spark.store.tables import TABLES

pytestmark = pytest.mark.spark


def test_vector_and_column_list_features_give_the_same_clustering(spark, tmp_path, mixture_path):
    """Through the fit layer (no table written); the CSV is read by the job's own reader."""
    source = spark.read.parquet(mixture_path)
    columns = [f"x{i}" for i in range(MIXTURE["dim"])]
    source.select("row_id", "device_id", *[F.col("features")[i].alias(c) for i, c in enumerate(columns)]).write.option(
        "header", "true"
    ).csv(str(tmp_path / "csv"))
    from_csv = read_input(spark, InputConfig(path=str(tmp_path / "csv"), format="csv"))
    settings = dict(k=MIXTURE["k"], k_per_device=MIXTURE["k_per_device"], seed=11)
    expected = fitted_labels(source, **settings)[1].set_index("row_id").cluster_id.sort_index()
    for frame, features in (
        (source.withColumn("features", array_to_vector("features")), "features"),
        (from_csv, columns),
    ):
        got = fitted_labels(frame, {"features_col": features}, **settings)[1].set_index("row_id").cluster_id
        assert got.sort_index().equals(expected), features


def test_the_labelling_pass_sends_only_the_device_and_the_features_to_python(spark, mixture_path):
    """The labelling pass is a scalar Arrow UDF over (labellable, device, features): the input's other
    columns stay in the JVM and come out unchanged."""
    raw = spark.read.parquet(mixture_path).withColumn("note", F.concat(F.lit("row "), F.col("row_id").cast("string")))
    clustering, labelled = fitted_labels(raw, k=MIXTURE["k"], k_per_device=MIXTURE["k_per_device"])
    plan = (
        label_rows(clustering.checked, clustering.model, raw.schema, "device_id", clustering.dim)
        ._jdf.queryExecution()
        .executedPlan()
        .toString()
    )
    python_nodes = [line for line in plan.splitlines() if "Python" in line or "Arrow" in line]
    assert len(python_nodes) == 1 and "ArrowEvalPython" in python_nodes[0], plan
    udf_arguments = re.search(r"\[label_partition\((.*?)\)#", python_nodes[0]).group(1)
    assert re.sub(r"#\d+L?", "", udf_arguments) == "isnull(__kfed_reason), device_id, __kfed_features"
    assert (labelled.note == "row " + labelled.row_id.astype(str)).all()
    assert list(labelled.columns) == [*raw.columns, "local_cluster_id", "cluster_id", "distance", "margin"]


def test_null_short_and_nan_vectors_go_to_quarantine_and_get_null_predictions(spark, tmp_path):
    """What VectorAssembler(handleInvalid="keep") or a left join hands over: a null vector, one of the
    wrong size, one holding NaN. The job quarantines them; the estimator's transform predicts null."""
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from kfed_spark.estimator import KFed

    rows = [
        (1, "a", Vectors.dense([0.0, 0.0])),
        (2, "a", Vectors.dense([9.0, 9.0])),
        (3, "b", Vectors.dense([0.1, 0.0])),
        (4, "b", Vectors.dense([9.0, 9.1])),
        (5, "a", None),
        (6, "b", Vectors.dense([1.0])),
        (7, "a", Vectors.dense([float("nan"), 0.0])),
    ]
    schema = StructType(
        [
            StructField("row_id", LongType()),
            StructField("device_id", StringType()),
            StructField("features", VectorUDT()),
        ]
    )
    frame = spark.createDataFrame(rows, schema)
    frame.write.parquet(str(tmp_path / "vectors"))
    assert (
        run_cli(
            str(write_empty_config(tmp_path)),
            f"input.path={tmp_path / 'vectors'}",
            f"output.path={tmp_path / 'out'}",
            "k=2",
            "min_center_points=1",  # devices of two rows: each shares its rows themselves
            "run_id=v",
        )
        == 0
    )
    quarantine = published(spark, tmp_path / "out", "quarantine").toPandas()
    assert dict(zip(quarantine.row_id, quarantine.reason)) == {
        5: "null_features",
        6: "wrong_dimension (expected 2)",
        7: "non_finite_value",
    }
    assert sorted(published(spark, tmp_path / "out", "labels").toPandas().row_id) == [1, 2, 3, 4]
    # Every table opens without Spark (delta-rs refuses Spark's vector type), the vectors as lists of doubles.
    given = {row_id: None if vector is None else vector.toArray().tolist() for row_id, _, vector in rows}
    for name in TABLES:
        table = duckdb_published(tmp_path / "out", name)
        assert table.num_rows > 0, name
        if name in ("labels", "quarantine"):
            assert table.schema.field("features").type.value_type == pa.float64(), name
            got = dict(zip(table.column("row_id").to_pylist(), table.column("features").to_pylist()))
            assert str(got) == str({row_id: given[row_id] for row_id in got}), name  # str: nan equals nan
    assert (
        "Spark ML vector"
        in spark.sql(f"DESCRIBE delta.`{tmp_path / 'out' / 'labels'}`").filter("col_name = 'features'").first().comment
    )
    predicted = (
        KFed(k=2, kPerDevice=2, seed=0, minCenterPoints=1).fit(frame).transform(frame).toPandas().set_index("row_id")
    )
    assert predicted.prediction[[5, 6, 7]].isna().all() and predicted.prediction[[1, 2, 3, 4]].notna().all()


def test_a_device_with_a_third_of_the_rows_is_sampled_and_still_fully_labelled(spark, tmp_path):
    """max_rows_per_device bounds a worker's memory; every row of the big device is still labelled."""
    rng = np.random.default_rng(0)
    means = np.array([[0.0, 0.0], [20.0, 0.0], [0.0, 20.0], [20.0, 20.0]])
    devices = np.concatenate([np.zeros(900, dtype=np.int64), np.repeat(np.arange(1, 21), 100)])
    truth = np.where(devices == 0, rng.integers(0, 2, len(devices)), 2 + rng.integers(0, 2, len(devices)))
    x = means[truth] + rng.standard_normal((len(devices), 2))
    rows = [(i, int(d), xs.tolist(), int(t)) for i, (d, xs, t) in enumerate(zip(devices, x, truth))]
    spark.createDataFrame(rows, "row_id long, device_id long, features array<double>, true_cluster int").write.parquet(
        str(tmp_path / "skewed")
    )
    settings = ["k=4", "k_per_device=2", "max_rows_per_device=150", "run_id=skew", "input.truth_col=true_cluster"]
    config = write_empty_config(tmp_path)
    assert run_cli(config, f"input.path={tmp_path / 'skewed'}", f"output.path={tmp_path / 'out'}", *settings) == 0
    run = runs_of(spark, tmp_path / "out")[0]
    assert run.n_labelled == len(rows) and run.ari == pytest.approx(1.0)
    local = published(spark, tmp_path / "out", "local_centers").toPandas()
    assert local[local.device_id == 0].n_points.sum() == 900
    assert local.n_points.sum() == len(rows)


def test_null_values_inside_features_are_quarantined(spark, tmp_path):
    dirty_input(spark, tmp_path / "dirty")
    assert (
        run_cli(
            str(write_empty_config(tmp_path)),
            f"input.path={tmp_path / 'dirty'}",
            f"output.path={tmp_path / 'out'}",
            "k=2",
            "min_center_points=1",  # devices of two rows: each shares its rows themselves
            "run_id=r",
        )
        == 0
    )
    quarantine = published(spark, tmp_path / "out", "quarantine").toPandas()
    assert dict(zip(quarantine.row_id, quarantine.reason)) == {
        5: "null_device",
        6: "non_finite_value",
        7: "non_finite_value",
    }


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


def test_rows_of_held_back_centers_take_the_nearest_global_center_in_the_job_and_the_estimator(spark, tmp_path):
    """Phones of ten rows from two clusters: the rows of a local center under min_center_points get the
    nearest global center and a null local cluster, in Spark as in the reference, and in the estimator's
    transform with its fitted model."""
    from kfed_spark.bench.datasets import write_parquet_folder
    from kfed_spark.bench.synthetic import mixture
    from kfed_spark.core.local_centers import feature_matrix
    from kfed_spark.core.metrics import adjusted_rand_index
    from kfed_spark.core.reference import federated_kmeans
    from kfed_spark.estimator import KFed
    from kfed_spark.params import AlgorithmParams

    table = mixture(k=8, k_per_device=2, devices=300, points_per_device=10, dim=16, seed=3)
    write_parquet_folder(table, tmp_path / "phones")
    raw = spark.read.parquet(str(tmp_path / "phones"))
    clustering, rows = fitted_labels(raw, k=8, k_per_device=2)
    rows = rows.sort_values("row_id")
    reference = federated_kmeans(
        feature_matrix(table.column("features")),
        table.column("device_id").to_numpy(),
        AlgorithmParams(k=8, k_per_device=2),
    )
    held = rows.local_cluster_id.isna().to_numpy()
    assert held.sum() == np.sum(reference.local_labels == -1) > 30
    assert len(clustering.local.held_back.counts) > 0 and clustering.local.counts.min() >= 3
    assert adjusted_rand_index(table.column("true_cluster").to_numpy(), rows.cluster_id.to_numpy()) == 1.0
    np.testing.assert_array_equal(rows.local_cluster_id.fillna(-1).to_numpy(), reference.local_labels)
    transformed = KFed(k=8, kPerDevice=2).fit(raw).transform(raw).orderBy("row_id").toPandas()
    np.testing.assert_array_equal(transformed.local_prediction.isna().to_numpy(), held)
    assert adjusted_rand_index(rows.cluster_id.to_numpy(), transformed.prediction.to_numpy()) == 1.0
