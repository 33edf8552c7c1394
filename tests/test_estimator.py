"""KFed / KFedModel: the pyspark.ml face of the same implementation the CLI runs."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.clustering import KMeans

from helpers import MIXTURE, N_ROWS, by_row, labels_of, mixture_estimator, published, runs_of
from kfed_spark.core.metrics import adjusted_rand_index
from kfed_spark.estimator import KFed, KFedModel


@pytest.mark.spark
def test_shares_param_names_and_defaults_style_with_mllib_kmeans(spark):
    mine, theirs = KFed(), KMeans()
    for name in ("k", "featuresCol", "predictionCol", "maxIter", "tol", "seed"):
        assert mine.hasParam(name) and theirs.hasParam(name), name
    assert (mine.getFeaturesCol(), mine.getPredictionCol()) == (theirs.getFeaturesCol(), theirs.getPredictionCol())
    assert KFed(k=5).setKPerDevice(3).getKPerDevice() == 3
    # The documented default, 0, in every process: MLlib's default is a hash of the class name, which
    # differs between processes (PYTHONHASHSEED), so comparing two instances in one process proves nothing.
    import subprocess
    import sys

    other = subprocess.run(
        [sys.executable, "-c", "from kfed_spark.estimator import KFed; print(KFed().getSeed())"],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "7"},
    )
    assert KFed().getSeed() == int(other.stdout) == 0


@pytest.mark.spark
def test_fit_transform_equals_the_cli_run(spark, published_run, mixture_path):
    _, out = published_run
    rows = spark.read.parquet(mixture_path)
    model = mixture_estimator().fit(rows)
    got = by_row(model.transform(rows), "prediction", "local_prediction")
    expected = by_row(labels_of(spark, out, "first"), "cluster_id", "local_cluster_id")
    np.testing.assert_array_equal(got.prediction.to_numpy(), expected.cluster_id.to_numpy())
    np.testing.assert_array_equal(got.local_prediction.to_numpy(), expected.local_cluster_id.to_numpy())

    centers = published(spark, out, "centers").orderBy("cluster_id").toPandas()
    np.testing.assert_allclose(np.stack(model.clusterCenters()), np.stack(centers.center.to_numpy()))
    run = runs_of(spark, out)[0]
    assert model.summary.trainingCost == pytest.approx(run.cost, rel=1e-9)
    assert sum(model.summary.clusterSizes) == N_ROWS and model.summary.numDevices == MIXTURE["devices"]
    assert model.localCenters.count() == run.n_local_centers

    # The training rows' profiles: one pass, as the run's labelling pass gathers them; from_run reads the run's.
    published_profiles = published(spark, out, "cluster_profiles").drop("run_id", "attempt_id")
    expected = published_profiles.orderBy("cluster_id", "rank").toPandas()
    for summary in (model.summary, KFedModel.from_run(str(out)).summary):
        profiles = summary.clusterProfiles.toPandas()
        assert list(profiles.columns) == list(expected.columns)
        for column in ("cluster_id", "feature", "position", "rank", "n_points"):
            assert list(profiles[column]) == list(expected[column]), column
        for column in ("mean", "sd", "population_mean", "population_sd", "standardized_difference"):
            np.testing.assert_allclose(profiles[column], expected[column], rtol=1e-9, err_msg=column)


@pytest.mark.spark
def test_rows_of_new_devices_take_the_nearest_global_center_without_refitting(spark, mixture_path, tmp_path):
    table = pq.read_table(mixture_path)
    seen = pa.compute.less(table.column("device_id"), 45)
    pq.write_table(table.filter(seen), tmp_path / "seen.parquet")
    train = spark.read.parquet(str(tmp_path / "seen.parquet"))
    everyone = spark.read.parquet(mixture_path)
    model = mixture_estimator().fit(train)

    labelled = by_row(model.transform(everyone), "device_id", "true_cluster", "prediction", "local_prediction")
    on_train = by_row(model.transform(train), "prediction")
    known = labelled[labelled.device_id < 45]
    np.testing.assert_array_equal(known.prediction.to_numpy(), on_train.prediction.to_numpy())
    fresh = labelled[labelled.device_id >= 45]
    assert len(fresh) == 15 * MIXTURE["points_per_device"] and fresh.prediction.notna().all()
    assert fresh.local_prediction.isna().all() and known.local_prediction.notna().all()
    assert adjusted_rand_index(fresh.true_cluster, fresh.prediction) >= 0.95
    np.testing.assert_array_equal(
        np.stack(model.clusterCenters()), np.stack(mixture_estimator().fit(train).clusterCenters())
    )


@pytest.mark.spark
def test_save_load_and_pipeline_round_trip(spark, mixture_path, tmp_path):
    rows = spark.read.parquet(mixture_path)
    model = mixture_estimator().fit(rows)
    model.write().overwrite().save(str(tmp_path / "model"))
    with pytest.raises(FileExistsError, match="use write\\(\\).overwrite\\(\\).save"):
        model.write().save(str(tmp_path / "model"))
    loaded = KFedModel.load(str(tmp_path / "model"))
    np.testing.assert_array_equal(np.stack(loaded.clusterCenters()), np.stack(model.clusterCenters()))
    assert (loaded.getK(), loaded.getKPerDevice(), loaded.uid) == (model.getK(), model.getKPerDevice(), model.uid)
    assert by_row(loaded.transform(rows), "prediction").equals(by_row(model.transform(rows), "prediction"))

    fitted = Pipeline(stages=[mixture_estimator()]).fit(rows)
    fitted.write().overwrite().save(str(tmp_path / "pipeline"))
    again = PipelineModel.load(str(tmp_path / "pipeline"))
    assert by_row(again.transform(rows), "prediction").equals(by_row(fitted.transform(rows), "prediction"))
    mixture_estimator().write().overwrite().save(str(tmp_path / "estimator"))
    assert KFed.load(str(tmp_path / "estimator")).getK() == MIXTURE["k"]


@pytest.mark.spark
def test_auto_k_per_device_and_robust_seeding_through_the_estimator(spark, mixture_path, tmp_path):
    rows = spark.read.parquet(mixture_path)
    kfed = KFed(k=MIXTURE["k"], kPerDevice="auto", seeding="robust", seed=11)
    model = kfed.fit(rows)
    per_device = model.localCenters.groupBy("device_id").count().toPandas()["count"]
    assert per_device.max() <= MIXTURE["k_per_device"]  # each device holds 3 clusters (fewer may show)
    cells = model.transform(rows).groupBy("true_cluster", "prediction").count().toPandas()
    assert adjusted_rand_index(cells.true_cluster, cells.prediction, cells["count"]) >= 0.95
    kfed.write().overwrite().save(str(tmp_path / "estimator"))
    loaded = KFed.load(str(tmp_path / "estimator"))
    assert (loaded.getKPerDevice(), loaded.getSeeding()) == ("auto", "robust")


@pytest.mark.spark
def test_bad_rows_get_no_prediction_and_are_not_dropped(spark):
    rows = spark.createDataFrame(
        [(1, "a", [0.0]), (2, "a", [10.0]), (3, "b", [0.2]), (4, "b", [9.8]), (5, "b", [float("nan")])],
        "row_id long, device_id string, features array<double>",
    )
    out = by_row(KFed(k=2, kPerDevice=2, minCenterPoints=1).fit(rows).transform(rows), "prediction")
    assert len(out) == 5 and out.prediction.isna().tolist() == [False, False, False, False, True]
    assert out.prediction[1] == out.prediction[3] != out.prediction[2]


@pytest.mark.spark
def test_a_reference_model_s_ids_and_the_optional_distance_and_margin(spark, mixture_path):
    rows = spark.read.parquet(mixture_path)
    first = mixture_estimator().fit(rows)
    by_truth = {}
    for seed, warm in ((99, False), (99, True), (None, False)):
        estimator = mixture_estimator().setReferenceModel(first, warmStart=warm)
        if seed is not None:
            estimator.setSeed(seed)
        model = estimator.fit(rows)
        assert sorted(model.clusterIds) == sorted(first.clusterIds)
        labelled = by_row(model.transform(rows), "true_cluster", "prediction")
        by_truth[(seed, warm)] = labelled.groupby("true_cluster").prediction.agg(lambda p: p.mode()[0]).to_dict()
    plain = by_row(first.transform(rows), "true_cluster", "prediction")
    expected = plain.groupby("true_cluster").prediction.agg(lambda p: p.mode()[0]).to_dict()
    assert all(found == expected for found in by_truth.values())

    assert "distance" not in first.transform(rows).columns  # optional, off by default
    scored = by_row(first.setDistanceCol("distance").setMarginCol("margin").transform(rows), "distance", "margin")
    assert (scored.distance >= 0).all() and scored.margin.between(-1, 1).all()
    assert (scored.distance**2).sum() == pytest.approx(first.summary.trainingCost, rel=1e-9)


@pytest.mark.spark
def test_k_auto_and_a_sweep_of_a_fitted_model(spark, mixture_path, tmp_path):
    rows = spark.read.parquet(mixture_path)
    kfed = KFed(k="auto", kRange=[3, 20], kPerDevice=MIXTURE["k_per_device"], seed=11)
    model = kfed.fit(rows)
    assert model.getK() == MIXTURE["k"] and model.kSweep.recommended_k == MIXTURE["k"]
    assert [f.k for f in model.kSweep.figures] == list(range(3, 21)) and kfed.getK() == "auto"
    assert rows.count() == model.transform(rows).filter("prediction IS NOT NULL").count()
    # A model fitted with a given k sweeps its own local centers: the same local step, the same answer.
    swept = mixture_estimator().fit(rows).sweepK((3, 20))

    def figures(sweep):
        return [(f.k, f.sse, f.bic, f.silhouette, f.noise_ratio, f.stability) for f in sweep.figures]

    assert swept.recommended_k == MIXTURE["k"] and figures(swept) == figures(model.kSweep)
    kfed.write().overwrite().save(str(tmp_path / "estimator"))
    assert (KFed.load(str(tmp_path / "estimator")).getK(), KFed.load(str(tmp_path / "estimator")).getKRange()) == (
        "auto",
        [3, 20],
    )


@pytest.mark.fast
def test_the_params_are_declared_as_the_parameter_table_generates_them():
    """estimator_params.py is what kfed_spark.params_codegen writes from kfed_spark.params: after a change
    to the table, `python -m kfed_spark.params_codegen` rewrites it."""
    from dataclasses import fields

    from kfed_spark.params import ESTIMATOR_COLUMNS, AlgorithmParams, camel
    from kfed_spark.params_codegen import ESTIMATOR_PARAMS, module

    assert module() == ESTIMATOR_PARAMS.read_text()
    table = [camel(spec.name) for spec in fields(AlgorithmParams)] + list(ESTIMATOR_COLUMNS)
    assert sorted(param.name for param in KFed().params) == sorted(table)
    assert all(hasattr(KFed, f"set{name[0].upper()}{name[1:]}") for name in table)


@pytest.mark.fast
@pytest.mark.parametrize(
    "make", [KFed, lambda: KFed(k="auto", kRange=[3, 9]), KFedModel], ids=["KFed", "KFed-set", "KFedModel"]
)
def test_explain_params_prints_every_param_with_its_default(make):
    instance = make()
    explained = instance.explainParams().splitlines()
    assert len(explained) == len(instance.params)
    for param, line in zip(sorted(instance.params, key=lambda p: p.name), explained):
        assert line.startswith(f"{param.name}: ") and f"default: {instance._defaultParamMap[param]}" in line


@pytest.mark.spark
def test_the_examples_run(spark):
    import doctest

    import kfed_spark.estimator as estimator

    result = doctest.testmod(estimator, extraglobs={"spark": spark}, report=True)
    assert result.attempted >= 7 and result.failed == 0
