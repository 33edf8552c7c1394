"""The whole job on real Spark (local mode) writing real Delta tables."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import (
    FAR_MIXTURE,
    FEATURE_MOVES,
    MIXTURE,
    by_row,
    labels_of,
    published,
    report_folder,
    run_cli,
    run_cli_process,
    runs_of,
    spread,
    write_empty_config,
)
from kfed_spark.bench import synthetic
from kfed_spark.bench.datasets import write_parquet_folder
from kfed_spark.cli import main
from kfed_spark.core.local_centers import feature_matrix, features_array
from kfed_spark.core.metrics import adjusted_rand_index
from kfed_spark.core.reference import federated_kmeans, local_clusterings
from kfed_spark.params import AlgorithmParams
from kfed_spark.store.tables import TABLES


@pytest.mark.spark
def test_cli_run_writes_every_table_and_recovers_the_mixture(spark, config, tmp_path, mixture_path, capsys):
    assert run_cli(config) == 0
    out = tmp_path / "out"
    for name in TABLES:
        assert (out / name / "_delta_log").is_dir(), name
    n_rows = MIXTURE["devices"] * MIXTURE["points_per_device"]
    labels = labels_of(spark, out, "first")
    assert labels.count() == n_rows
    assert set(labels.columns) == {
        "row_id",
        "device_id",
        "features",
        "true_cluster",
        "cluster_id",
        "local_cluster_id",
        "distance",
        "margin",
        "run_id",
        "attempt_id",
    }
    cells = labels.groupBy("true_cluster", "cluster_id").count().toPandas()
    assert adjusted_rand_index(cells.true_cluster, cells.cluster_id, cells["count"]) >= 0.95
    stats = {
        name: spark.sql(f"SHOW TBLPROPERTIES delta.`{out / name}`")
        .toPandas()
        .set_index("key")
        .value.get("delta.dataSkippingStatsColumns")
        for name in ("labels", "quarantine", "centers")
    }
    assert stats == {
        "labels": "`device_id`,`local_cluster_id`,`cluster_id`",
        "quarantine": "`device_id`,`reason`",
        "centers": None,
    }

    run = runs_of(spark, out)
    assert len(run) == 1
    run = run[0]
    assert (run.status, run.n_input, run.n_labelled, run.n_quarantined) == ("succeeded", n_rows, n_rows, 0)
    assert run.n_devices == MIXTURE["devices"] and run.ari >= 0.95
    assert json.loads(run.config)["k"] == MIXTURE["k"]
    centers = published(spark, out, "centers").toPandas()
    assert sorted(centers.cluster_id) == list(range(MIXTURE["k"]))
    assert centers.n_points.sum() == n_rows
    local = published(spark, out, "local_centers").toPandas()
    assert local.n_points.sum() == n_rows and local.groupby("device_id").size().max() <= MIXTURE["k_per_device"]
    profiles = published(spark, out, "device_clusters").toPandas()
    assert profiles.n_points.sum() == run.n_labelled
    np.testing.assert_allclose(profiles.groupby("device_id").device_share.sum(), 1.0, rtol=1e-12)
    held = labels.groupBy("device_id", "cluster_id").count().toPandas()
    assert held.merge(profiles, on=["device_id", "cluster_id"]).eval("count == n_points").all()
    assert len(held) == len(profiles)
    assert (profiles.n_points * profiles.mean_sq_distance).sum() == pytest.approx(run.cost, rel=1e-9)

    # The reported cost is the k-means cost of the written labels against the written centers.
    table = pq.read_table(mixture_path).to_pandas().set_index("row_id")
    rows = labels.select("row_id", "cluster_id").toPandas().set_index("row_id").join(table)
    centers_by_id = np.stack(centers.sort_values("cluster_id").center.to_numpy())
    x = np.stack(rows.features.to_numpy())
    cost = ((x - centers_by_id[rows.cluster_id.to_numpy()]) ** 2).sum()
    assert run.cost == pytest.approx(cost, rel=1e-9)
    truth = np.stack([x[rows.true_cluster.to_numpy() == j].mean(axis=0) for j in range(MIXTURE["k"])])
    planted = ((x - truth[rows.true_cluster.to_numpy()]) ** 2).sum()
    assert run.truth_cost == pytest.approx(planted, rel=1e-9)
    assert run.cost <= 1.02 * planted
    assert "ARI" in capsys.readouterr().out


@pytest.mark.spark
@pytest.mark.parametrize("label_mode", ["induced", "nearest"])
def test_spark_job_equals_the_single_process_numpy_run(spark, config, tmp_path, mixture_path, label_mode):
    """Same kernels, same seeds: the distributed job labels every row as federated_kmeans does."""
    assert run_cli(config, f"label_mode={label_mode}", "server_refine=none") == 0
    table = pq.read_table(mixture_path)
    x = np.stack(table.column("features").to_numpy(zero_copy_only=False))
    params = AlgorithmParams(
        k=MIXTURE["k"], k_per_device=MIXTURE["k_per_device"], seed=11, server_refine="none", label_mode=label_mode
    )
    reference = federated_kmeans(x, table.column("device_id").to_numpy(), params)
    got = labels_of(spark, tmp_path / "out", "first").select("row_id", "cluster_id", "local_cluster_id").toPandas()
    got = got.set_index("row_id").loc[table.column("row_id").to_numpy()]
    np.testing.assert_array_equal(got.cluster_id.to_numpy(), reference.labels)
    np.testing.assert_array_equal(got.local_cluster_id.to_numpy(), reference.local_labels)


@pytest.mark.spark
@pytest.mark.parametrize(
    "settings",
    [
        ("seeding=kmeanspp", "server_refine=lloyd", "server_step=driver", "label_mode=induced"),
        ("seeding=farthest", "server_refine=none", "server_step=distributed", "label_mode=nearest"),
    ],
)
def test_shifted_or_scaled_features_give_the_same_labels_and_relative_cost(spark, tmp_path, settings):
    """The job on one table as given, shifted by 1e6 and 1e9 and scaled by 1e-6: the same labels row for
    row and the same cost relative to each table's own spread. Between them the two settings take each
    seeding rule, refinement, server step and label mode; test_robustness holds every combination of
    the kernels to the same."""
    table = synthetic.mixture(**FAR_MIXTURE)
    x = feature_matrix(table.column("features"))
    tables = {
        "given": x,
        **{
            name.replace(" ", "_").replace("-", "m"): x * scale + shift
            for name, (scale, shift) in FEATURE_MOVES.items()
        },
    }
    common = [
        "input.features_col=features",
        "input.truth_col=true_cluster",
        f"output.path={tmp_path / 'out'}",
        f"k={FAR_MIXTURE['k']}",
        f"k_per_device={FAR_MIXTURE['k_per_device']}",
        "seed=4",
        *settings,
        "identity.mode=fresh",
    ]  # each table is far from the others: stable ids would make every cluster new
    for run_id, features in tables.items():
        write_parquet_folder(table.set_column(2, "features", features_array(features)), tmp_path / run_id)
        assert (
            run_cli(write_empty_config(tmp_path), f"input.path={tmp_path / run_id}", f"run_id={run_id}", *common) == 0
        )
    runs = {run.run_id: run for run in runs_of(spark, tmp_path / "out")}
    given = by_row(labels_of(spark, tmp_path / "out", "given"), "cluster_id", "local_cluster_id")
    assert adjusted_rand_index(table.column("true_cluster").to_numpy(), given.cluster_id.to_numpy()) > 0.95
    for run_id, features in tables.items():
        labels = by_row(labels_of(spark, tmp_path / "out", run_id), "cluster_id", "local_cluster_id")
        assert labels.equals(given), run_id
        assert runs[run_id].cost / spread(features) == pytest.approx(runs["given"].cost / spread(x), rel=1e-6)


@pytest.mark.spark
def test_rerunning_a_run_id_replaces_it_and_other_runs_stay(spark, config_after_first_run, tmp_path):
    config, out = config_after_first_run, tmp_path / "out"
    first = labels_of(spark, out, "first").select("row_id", "cluster_id").orderBy("row_id").collect()
    assert run_cli(config) == 0
    assert run_cli(config, "run_id=second", "label_mode=nearest") == 0
    n_rows = MIXTURE["devices"] * MIXTURE["points_per_device"]
    assert published(spark, out, "labels").count() == 2 * n_rows
    assert labels_of(spark, out, "first").select("row_id", "cluster_id").orderBy("row_id").collect() == first
    assert [(r.run_id, r.status) for r in runs_of(spark, out)] == [
        ("first", "superseded"),
        ("first", "succeeded"),
        ("second", "succeeded"),
    ]
    history = spark.sql(f"DESCRIBE HISTORY delta.`{out / 'labels'}`").collect()
    operations = [h.operation for h in reversed(history)]
    assert operations[0] == "CREATE TABLE" and operations.count("WRITE") == 3  # three attempts
    published(spark, out, "labels").createOrReplaceTempView("kfed_labels")
    sizes = spark.sql(
        "SELECT cluster_id, count(*) AS n FROM kfed_labels WHERE run_id = 'second' GROUP BY cluster_id"
    ).collect()
    assert len(sizes) == MIXTURE["k"] and sum(r.n for r in sizes) == n_rows


@pytest.mark.spark
def test_bad_rows_go_to_quarantine_with_a_reason(spark, tmp_path):
    rows = [
        (1, "a", [0.0, 0.0]),
        (2, "a", [0.1, 0.0]),
        (3, "a", [9.0, 9.0]),
        (4, "b", [9.1, 9.0]),
        (5, "b", [0.0, 0.2]),
        (6, None, [1.0, 1.0]),
        (7, "b", None),
        (8, "b", [1.0]),
        (9, "a", [float("nan"), 1.0]),
        (10, "b", [float("inf"), 1.0]),
        (11, "a", []),
    ]
    spark.createDataFrame(rows, "row_id long, device_id string, features array<double>").write.parquet(
        str(tmp_path / "dirty")
    )
    assert (
        run_cli(
            str(write_empty_config(tmp_path)),
            f"input.path={tmp_path / 'dirty'}",
            f"output.path={tmp_path / 'out'}",
            "k=2",
            "min_center_points=1",  # devices of two rows: each shares its rows themselves
            "k_per_device=2",
            "run_id=dirty",
        )
        == 0
    )
    quarantine = published(spark, tmp_path / "out", "quarantine").toPandas()
    reasons = dict(zip(quarantine.row_id, quarantine.reason))
    assert reasons == {
        6: "null_device",
        7: "null_features",
        8: "wrong_dimension (expected 2)",
        9: "non_finite_value",
        10: "non_finite_value",
        11: "empty_features",
    }
    labels = published(spark, tmp_path / "out", "labels").toPandas()
    assert sorted(labels.row_id) == [1, 2, 3, 4, 5]
    assert labels.set_index("row_id").cluster_id[1] != labels.set_index("row_id").cluster_id[3]
    run = runs_of(spark, tmp_path / "out")[0]
    assert (run.n_input, run.n_labelled, run.n_quarantined) == (11, 5, 6)


@pytest.mark.spark
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["input.path=/nonexistent/kfed"], "cannot read parquet input /nonexistent/kfed: [PATH_NOT_FOUND]"),
        (
            ["input.path=null", "input.table=nowhere.devices"],
            "cannot read table nowhere.devices: [TABLE_OR_VIEW_NOT_FOUND]",
        ),
        (["input.device_col=writer"], "input has no device column 'writer'"),
        (["input.features_col=pixels"], "input has no feature column(s) 'pixels'"),
        (["input.features_col=device_id"], "feature column 'device_id' has type bigint"),
        (
            ["k=9000", "k_per_device=3"],
            "k = 9000 is more than the 180 distinct local centers the devices share; lower k, raise k_per_device "
            "or lower min_center_points",
        ),
        (
            ["min_center_points=1000"],
            "no device has a local cluster of at least min_center_points = 1000 rows, so no local center can be "
            "shared; lower min_center_points",
        ),
    ],
)
def test_bad_input_gives_one_line_error(spark, config, capsys, overrides, message):
    assert run_cli(config, *overrides) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kfed-spark: error: ") and "\n" not in err
    assert message in err


@pytest.mark.spark
def test_no_published_local_center_stands_for_fewer_than_min_center_points_rows(spark, tmp_path):
    """Devices of one row and of two, a lone far row on a big device, a bad row: with the default
    min_center_points (3) none of their centers is published and every row is still labelled or
    quarantined; the runs row counts what was held back, as the numpy kernel does. The same input with
    min_center_points 1 publishes them (the paper's reference code shares a device's rows themselves)."""
    rng = np.random.default_rng(11)
    means = [(0.0, 0.0), (20.0, 0.0), (0.0, 20.0)]
    big = [np.concatenate([rng.normal(mean, 1.0, (20, 2)) for mean in means]) for _ in range(4)]
    big[0] = np.concatenate([big[0], [[40.0, 40.0]]])  # far from every cluster: a local cluster of one row
    x = np.concatenate([*big, [[0.5, 0.5]], [[19.0, 1.0], [21.0, -1.0]], [[np.nan, 0.0]]])
    devices = np.array(["d0"] * 61 + ["d1"] * 60 + ["d2"] * 60 + ["d3"] * 60 + ["one", "two", "two", "d1"])
    table = pa.table({"row_id": np.arange(len(x)), "device_id": devices, "features": features_array(x)})
    write_parquet_folder(table, tmp_path / "tiny")
    common = [f"input.path={tmp_path / 'tiny'}", f"output.path={tmp_path / 'out'}", "k=3", "k_per_device=3"]
    assert run_cli(write_empty_config(tmp_path), *common, "run_id=default") == 0
    assert run_cli(write_empty_config(tmp_path), *common, "run_id=everything", "min_center_points=1") == 0

    local = published(spark, tmp_path / "out", "local_centers").toPandas()
    shared = local[local.run_id == "default"]
    assert shared.n_points.min() >= 3 and set(shared.device_id) == {"d0", "d1", "d2", "d3"}
    assert local[local.run_id == "everything"].n_points.min() == 1
    labels = by_row(labels_of(spark, tmp_path / "out", "default"), "device_id", "cluster_id", "local_cluster_id")
    quarantine = published(spark, tmp_path / "out", "quarantine").filter("run_id = 'default'").toPandas()
    assert sorted([*labels.index, *quarantine.row_id]) == list(range(len(x)))
    assert labels.local_cluster_id[labels.device_id.isin(["one", "two"])].isna().all()  # no local center
    assert labels.cluster_id[241] == labels.cluster_id[0] and labels.cluster_id[242] == labels.cluster_id[20]
    kernel = local_clusterings(x[:-1], devices[:-1], AlgorithmParams(k=3, k_per_device=3))
    runs = {run.run_id: run for run in runs_of(spark, tmp_path / "out")}
    default = runs["default"]
    assert (default.min_center_points, default.n_devices, default.n_devices_held_back) == (3, 6, 2)
    assert default.n_rows_held_back == len(x) - 1 - kernel.counts.sum() >= 3
    assert (runs["everything"].n_rows_held_back, runs["everything"].n_devices_held_back) == (0, 0)


@pytest.mark.fast
def test_bad_config_exits_non_zero_with_one_line(tmp_path):
    result = run_cli_process("run", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"kfed-spark: error: cannot read config file {tmp_path / 'nope.yaml'}: No such file or directory"
    ]


@pytest.mark.spark
def test_labels_read_without_spark(published_run):
    from deltalake import DeltaTable as RustDeltaTable

    table = RustDeltaTable(str(published_run[1] / "labels")).to_pyarrow_table()
    assert table.num_rows == MIXTURE["devices"] * MIXTURE["points_per_device"]
    assert set(table.column("run_id").to_pylist()) == {"first"}


@pytest.mark.spark
def test_the_readme_demo_clusters_the_mixture_and_leaves_tables_and_a_report(spark, tmp_path, capsys):
    assert main(["demo", "--folder", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "ARI against the planted clusters 1.0000" in out and "labelled 40000, quarantined 0" in out
    assert (report_folder(tmp_path / "demo" / "output", "demo") / "report.html").exists()
    assert main(["report", "demo", "--output", str(tmp_path / "demo" / "output")]) == 0
    assert "40000 in, 40000 labelled, 0 quarantined" in capsys.readouterr().out
