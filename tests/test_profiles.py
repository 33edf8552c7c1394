"""cluster_profiles: each cluster's mean and spread per feature against the population's, gathered in the
labelling pass (kfed_spark.core.profiles), named after the input's features."""

import html
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from helpers import docs_page, published, report_folder, run_cli, runs_of
from kfed_spark.cli import main
from kfed_spark.config import OutputConfig
from kfed_spark.core.profiles import ClusterMoments, profiles_table
from kfed_spark.store.output import OutputTables
from kfed_spark.store.tables import CLUSTER_PROFILE_FIELDS

FEATURES = ["spend", "visits", "age"]
PLANTED = np.array([[0.0, 0.0, 0.0], [6.0, 0.0, 6.0], [-6.0, 0.0, 6.0], [0.0, 12.0, 0.0]])
"""Four clusters over named features; the last differs from the first in visits only, and the others share
the first's visits: what sets it apart is visits."""


def named_table(devices: int = 40, rows: int = 100, seed: int = 7) -> pa.Table:
    """Device d holds clusters d mod 4 and d + 1 mod 4, half of its rows each; noise sd 0.5."""
    rng = np.random.default_rng(seed)
    device = np.repeat(np.arange(devices), rows)
    held = np.stack([device % 4, (device + 1) % 4], axis=1)[np.arange(len(device)), np.arange(len(device)) % 2]
    x = PLANTED[held] + rng.normal(0.0, 0.5, size=(len(device), 3)) + [250.0, 3.0, 40.0]  # far from the origin
    return pa.table({"device_id": device, **{name: x[:, j] for j, name in enumerate(FEATURES)}, "truth": held})


@pytest.mark.fast
def test_merged_moments_are_the_rows_moments_however_the_rows_are_split():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 3)) * [1.0, 1e-3, 1e3] + [1e6, -5.0, 0.0]
    cluster = rng.integers(0, 5, 1000)
    for cuts in ([1000], [1, 10, 300, 1000], list(range(37, 1000, 37)) + [1000]):
        parts = [ClusterMoments.of(x[a:b], cluster[a:b]) for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]
        merged = ClusterMoments.merge(parts, 3)
        for j in range(5):
            rows = x[cluster == j]
            assert merged.n[j] == len(rows)
            np.testing.assert_allclose(merged.mean[j], rows.mean(axis=0), rtol=1e-12)
            np.testing.assert_allclose(np.sqrt(merged.m2[j] / (len(rows) - 1)), rows.std(axis=0, ddof=1), rtol=1e-9)
        n, mean, m2 = merged.population()
        np.testing.assert_allclose(np.sqrt(m2 / (n - 1)), x.std(axis=0, ddof=1), rtol=1e-9)


@pytest.mark.fast
def test_a_cluster_s_features_are_ranked_by_how_far_they_stand_from_the_population():
    table = named_table()
    x = np.stack([table.column(name).to_numpy() for name in FEATURES], axis=1)
    truth = table.column("truth").to_numpy()
    constant = np.concatenate([x, np.ones((len(x), 1))], axis=1)  # a constant feature has no difference
    profile = profiles_table(ClusterMoments.of(constant, truth), [*FEATURES, "one"]).to_pandas()
    first = profile[profile["rank"] == 1].set_index("cluster_id").feature
    assert first[3] == "visits"
    one = profile[profile.feature == "one"]
    assert one.standardized_difference.isna().all() and (one["rank"] == 4).all() and (one.sd == 0).all()
    assert profile.groupby("cluster_id").share_of_rows.first().sum() == pytest.approx(1.0)
    assert list(profile.columns) == [field.name for field in CLUSTER_PROFILE_FIELDS]  # the table's one schema


def input_records_since(spark, stage_id: int) -> tuple[int, int]:
    """The records Spark's stages after stage_id read (its status store's inputRecords), and the last stage's id."""
    spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty()  # the status store is filled from Spark's events
    gateway = spark.sparkContext._gateway
    no_quantiles = gateway.new_array(gateway.jvm.double, 0)
    stages = spark.sparkContext._jsc.sc().statusStore().stageList(None, False, False, no_quantiles, None)
    newer = [stage for stage in (stages.apply(i) for i in range(stages.size())) if stage.stageId() > stage_id]
    return sum(stage.inputRecords() for stage in newer), max([stage_id, *(stage.stageId() for stage in newer)])


@pytest.mark.spark
def test_a_run_on_named_columns_profiles_its_clusters_as_sql_over_its_labels_does(spark, tmp_path, capsys):
    (tmp_path / "named").mkdir()
    pq.write_table(named_table(), tmp_path / "named" / "part-0.parquet")
    out = tmp_path / "out"
    config = tmp_path / "named.yaml"
    config.write_text(
        f"input: {{path: '{tmp_path / 'named'}', format: parquet, features_col: [spend, visits, age], "
        f"truth_col: truth}}\noutput: {{path: '{out}'}}\nk: 4\nk_per_device: 2\nreport: false\n"
    )
    # Two first runs, each in a location of its own, without and with profiles: the profiles come from the
    # labelling pass, where a pass of their own would read the input's 4,000 rows again (the records of the
    # Delta logs that each run reads make the rest of the difference).
    plain = tmp_path / "plain"
    last_stage = input_records_since(spark, -1)[1]
    assert run_cli(config, "run_id=plain", "profiles=false", f"output.path={plain}") == 0
    records_without, last_stage = input_records_since(spark, last_stage)
    assert run_cli(config, "run_id=profiled", "report=true") == 0
    records_with, _ = input_records_since(spark, last_stage)
    assert abs(records_with - records_without) < 4000 / 2 and records_without > 4000

    (row,) = [r for r in runs_of(spark, out) if r.run_id == "profiled"]
    assert row.feature_names == FEATURES and row.ari > 0.99
    profiles = published(spark, out, "cluster_profiles")
    assert published(spark, plain, "cluster_profiles").isEmpty()  # none when off
    profile = profiles.toPandas()
    labels = published(spark, out, "labels").filter("run_id = 'profiled'")
    labels.createOrReplaceTempView("profiled_labels")
    for j, name in enumerate(FEATURES):
        expected = spark.sql(
            f"SELECT cluster_id, count(*) AS n, avg({name}) AS mean, stddev({name}) AS sd FROM profiled_labels "
            "GROUP BY cluster_id ORDER BY cluster_id"
        ).toPandas()
        mine = profile[profile.feature == name].sort_values("cluster_id")
        assert (mine.position == j).all() and list(mine.cluster_id) == list(expected.cluster_id)
        assert list(mine.n_points) == list(expected.n)
        np.testing.assert_allclose(mine["mean"], expected["mean"], rtol=1e-9)
        np.testing.assert_allclose(mine.sd, expected.sd, rtol=1e-9)
        everyone = spark.sql(f"SELECT avg({name}) AS m, stddev({name}) AS s FROM profiled_labels").first()
        np.testing.assert_allclose(mine.population_mean, everyone.m, rtol=1e-9)
        np.testing.assert_allclose(mine.population_sd, everyone.s, rtol=1e-9)

    visits_cluster = profile[profile.feature == "visits"].sort_values("mean").cluster_id.iloc[-1]
    ranked = profile[profile.cluster_id == visits_cluster].sort_values("rank")
    assert list(ranked.feature)[0] == "visits" and ranked.standardized_difference.iloc[0] > 1.5

    docs = docs_page("output-tables.md")
    start = docs.index("-- Each cluster's three most telling features.")
    OutputTables(spark, OutputConfig(path=str(out))).register_views()
    told = spark.sql(docs[start : docs.index(";", start)]).toPandas().set_index("cluster_id")
    assert told.stands_out[visits_cluster].startswith("visits +")
    assert list(told.n_points) == list(profile.groupby("cluster_id").n_points.first())

    read = DeltaTable(str(out / "cluster_profiles")).to_pyarrow_table()  # a reader that is not Spark
    assert read.num_rows == len(profile) == 4 * len(FEATURES)

    capsys.readouterr()
    assert main(["describe", "--output", str(out)]) == 0  # the newest run
    header, *lines = capsys.readouterr().out.strip().splitlines()
    assert header == "run profiled: 4 clusters" and len(lines) == 4
    (visits_line,) = [line for line in lines if line.startswith(f"cluster {visits_cluster}: ")]
    assert re.search(r" rows \(2\d\.\d%\) on \d+ devices; visits \+\d\.\d sd, ", visits_line), visits_line
    assert main(["describe", "--output", str(out), "--cluster", str(visits_cluster), "--json"]) == 0
    (told,) = json.loads(capsys.readouterr().out)["clusters"]
    assert [f["feature"] for f in told["features"]][0] == "visits" and told["n_points"] == ranked.n_points.iloc[0]
    assert main(["describe", "--output", str(plain), "--run", "plain"]) == 2  # profiles: false
    assert "no cluster profiles of a published run 'plain'" in capsys.readouterr().err.strip().splitlines()[-1]

    # The report tells the same: a line per cluster and the heatmap of standardized differences.
    page = (report_folder(out, "profiled") / "report.html").read_text()
    assert f"<li>{html.escape(visits_line)}</li>" in page and 'alt="standardized_differences"' in page
    assert main(["report", "profiled", "--output", str(out)]) == 0
    assert visits_line in capsys.readouterr().out.splitlines()


@pytest.mark.spark
def test_the_estimator_names_the_features_after_a_vector_assembler_s_columns(spark):
    from pyspark.ml.feature import VectorAssembler

    from kfed_spark.estimator import KFed

    rows = VectorAssembler(inputCols=FEATURES, outputCol="features").transform(spark.createDataFrame(named_table()))
    model = KFed(k=4, kPerDevice=2, deviceCol="device_id").fit(rows)
    profile = model.summary.clusterProfiles.toPandas()
    assert sorted(set(profile.feature)) == sorted(FEATURES) and len(profile) == 4 * len(FEATURES)
    visits = profile[profile.feature == "visits"].sort_values("mean").cluster_id.iloc[-1]
    assert profile[(profile.cluster_id == visits) & (profile["rank"] == 1)].feature.iloc[0] == "visits"


@pytest.mark.spark
def test_forget_keeps_the_names_a_vector_column_gave_the_features(spark, tmp_path):
    """The stored labels hold the features as an array without the vector's attributes: the run's new attempt
    takes the names its runs row recorded."""
    from pyspark.ml.feature import VectorAssembler

    rows = VectorAssembler(inputCols=FEATURES, outputCol="features").transform(spark.createDataFrame(named_table()))
    rows.select("device_id", "features").write.parquet(str(tmp_path / "vectors"))
    out = tmp_path / "out"
    config = tmp_path / "vectors.yaml"
    config.write_text(f"input: {{path: '{tmp_path / 'vectors'}', format: parquet}}\noutput: {{path: '{out}'}}\nk: 4\n")
    assert run_cli(config, "k_per_device=2", "report=false") == 0
    assert main(["forget", "--output", str(out), "--device", "3", "--all-runs"]) == 0
    first, forgotten = runs_of(spark, out)
    assert first.feature_names == forgotten.feature_names == FEATURES and forgotten.forgotten_devices == 1
    assert set(published(spark, out, "cluster_profiles").toPandas().feature) == set(FEATURES)
