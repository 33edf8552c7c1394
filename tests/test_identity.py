"""Runs that mean the same thing tomorrow: stable cluster ids, the record of what changed, each row's
distance and margin."""

import dataclasses
import json
import shutil

import numpy as np
import pandas as pd
import pytest

from helpers import MIXTURE, published, report_folder, run_cli, runs_of
from kfed_spark.bench.datasets import write_parquet_folder
from kfed_spark.bench.synthetic import mixture, two_days
from kfed_spark.cli import main
from kfed_spark.config import OutputConfig
from kfed_spark.core.identity import ClusterSummary, match_clusters, matching_by_ids
from kfed_spark.core.labels import assigned_with_margin
from kfed_spark.core.linalg import nearest_center
from kfed_spark.core.local_centers import feature_matrix
from kfed_spark.core.metrics import adjusted_rand_index
from kfed_spark.core.reference import local_clusterings
from kfed_spark.core.server_step import server_step
from kfed_spark.params import AlgorithmParams
from kfed_spark.runs.attempt import past_sizes
from kfed_spark.store.models import stored_model
from kfed_spark.store.output import OutputTables

K = 20


def summary(table, params, initial=None, local=None) -> tuple[ClusterSummary, np.ndarray]:
    """The federated clustering of a table's rows, as matching knows it, and each row's cluster position;
    local: the rows' local step, if already taken (it does not depend on the server's settings)."""
    x, devices = feature_matrix(table.column("features")), table.column("device_id").to_numpy()
    local = local_clusterings(x, devices, params) if local is None else local
    server = server_step(local.centers, local.counts, local.devices, local.ids, params, initial)
    labels, sq_dist = nearest_center(x, server.centers)
    sse = np.bincount(labels, weights=sq_dist, minlength=params.k)
    return ClusterSummary(
        np.arange(params.k),
        server.centers,
        np.bincount(labels, minlength=params.k),
        sse,
        np.ones(params.k, dtype=np.int64),
    ), labels


@pytest.mark.fast
def test_matching_keeps_the_persistent_clusters_and_no_shift_or_scale_changes_it():
    params = AlgorithmParams(k=K, k_per_device=4)
    day_one, day_two = two_days(k=K)
    (before, labels_one), (after, labels_two) = summary(day_one, params), summary(day_two, params)
    truth_one, truth_two = (t.column("true_cluster").to_numpy() for t in (day_one, day_two))
    before = dataclasses.replace(before, ids=np.arange(100, 100 + K))  # yesterday's ids
    matching = match_clusters(after, before, next_id=500)
    id_of_truth_one = {t: 100 + np.bincount(labels_one[truth_one == t]).argmax() for t in range(K)}
    id_of_truth_two = {t: matching.ids[np.bincount(labels_two[truth_two == t]).argmax()] for t in np.unique(truth_two)}
    assert all(id_of_truth_one[t] == id_of_truth_two[t] for t in range(K - 1))
    assert id_of_truth_two[K] == 500 and list(before.ids[matching.retired]) == [id_of_truth_one[K - 1]]
    moved = np.nanargmax(matching.center_shift)
    assert matching.ids[moved] == id_of_truth_two[0]
    # Clusters that already carry these ids (an attempt of `forget`) relate to the reference just as matched.
    by_ids = matching_by_ids(dataclasses.replace(after, ids=matching.ids), before)
    for name in ("ids", "reference", "retired"):
        np.testing.assert_array_equal(getattr(by_ids, name), getattr(matching, name))
    np.testing.assert_allclose(by_ids.relative_shift, matching.relative_shift, rtol=1e-9)
    np.testing.assert_allclose(by_ids.center_shift, matching.center_shift, rtol=1e-6)
    for scale, shift in ((1e-6, 0.0), (1.0, 1e9), (3.0, -7.0)):

        def moved_by(s: ClusterSummary) -> ClusterSummary:
            return dataclasses.replace(s, centers=s.centers * scale + shift, sse=s.sse * scale**2)

        again = match_clusters(moved_by(after), moved_by(before), next_id=500)
        np.testing.assert_array_equal(again.ids, matching.ids)
        np.testing.assert_allclose(again.relative_shift, matching.relative_shift, rtol=1e-6)


@pytest.mark.fast
def test_a_cluster_beyond_the_gate_is_new_even_when_it_is_the_only_candidate():
    one = ClusterSummary(np.array([7]), np.array([[0.0, 0.0]]), np.array([100]), np.array([200.0]), np.array([3]))
    near = ClusterSummary(np.array([0]), np.array([[0.5, 0.0]]), np.array([100]), np.array([200.0]), np.array([3]))
    far = ClusterSummary(np.array([0]), np.array([[5.0, 0.0]]), np.array([100]), np.array([200.0]), np.array([3]))
    assert list(match_clusters(near, one, next_id=8).ids) == [7]  # moved by a third of its spread
    gone = match_clusters(far, one, next_id=8)  # moved by three and a half times its spread
    assert list(gone.ids) == [8] and list(gone.retired) == [0] and gone.status == ["new"]


@pytest.mark.fast
def test_a_warm_start_from_yesterday_finds_today_s_clusters():
    """Seeds from day 1's centers: the gone cluster's seed is dropped, the new cluster is seeded by the rule."""
    day_one, day_two = two_days(k=K)
    truth = day_two.column("true_cluster").to_numpy()
    local_step = AlgorithmParams(k=K, k_per_device=4)
    local_one, local_two = (
        local_clusterings(feature_matrix(day.column("features")), day.column("device_id").to_numpy(), local_step)
        for day in (day_one, day_two)
    )
    for seeding in ("kmeanspp", "farthest"):
        params = dataclasses.replace(local_step, seeding=seeding)
        yesterday, _ = summary(day_one, params, local=local_one)
        _, cold = summary(day_two, params, local=local_two)
        _, warm = summary(day_two, params, initial=yesterday.centers, local=local_two)
        assert adjusted_rand_index(truth, warm) >= adjusted_rand_index(truth, cold) - 0.005
        assert adjusted_rand_index(truth, warm) > 0.99


@pytest.mark.fast
def test_the_margin_is_a_ratio_of_distances():
    centers = np.array([[0.0], [10.0]])
    x = np.array([[1.0], [5.0], [9.0], [0.0]])
    cluster, sq_dist, margin = assigned_with_margin(x, centers, np.array([-1, -1, 0, -1]))
    assert list(cluster) == [0, 0, 0, 0] and list(sq_dist) == [1.0, 25.0, 81.0, 0.0]
    np.testing.assert_allclose(margin, [0.8, 0.0, -0.8, 1.0])  # the third row is nearer the other center
    _, _, alone = assigned_with_margin(x, centers[:1], np.full(4, -1))
    assert list(alone) == [1.0] * 4  # one cluster: nothing to be confused with


def day_config(tmp_path, data):
    path = tmp_path / "kfed.yaml"
    path.write_text(f"""
input: {{path: "{data}", format: parquet, truth_col: true_cluster}}
output: {{path: "{tmp_path / "out"}"}}
k: {K}
k_per_device: 4
seed: 5
report: false
""")
    return path


def sql(query: str, out, capsys) -> pd.DataFrame:
    """A query's answer as `kfed-spark sql` prints it (whitespace-separated columns)."""
    capsys.readouterr()
    assert main(["sql", query, "--output", str(out)]) == 0
    header, *lines = capsys.readouterr().out.strip().splitlines()
    return pd.DataFrame([line.split() for line in lines], columns=header.split())


def ids_by_truth(spark, out, run_id) -> dict[int, int]:
    """Each planted cluster's published cluster id in a run (the id most of its rows took)."""
    labels = published(spark, out, "labels").filter(f"run_id = '{run_id}'").select("true_cluster", "cluster_id")
    counts = labels.groupBy("true_cluster", "cluster_id").count().toPandas()
    top = counts.sort_values("count", ascending=False).drop_duplicates("true_cluster")
    return dict(zip(top.true_cluster, top.cluster_id))


@pytest.mark.spark
def test_a_second_day_keeps_the_ids_and_records_what_changed(spark, tmp_path, capsys):
    day_one, day_two = two_days(k=K)
    unrelated = mixture(k=K, k_per_device=4, devices=200, points_per_device=100, dim=16, seed=99)
    for name, table in (("day1", day_one), ("day2", day_two), ("other", unrelated)):
        write_parquet_folder(table, tmp_path / name)
    config = day_config(tmp_path, tmp_path / "day1")
    out = tmp_path / "out"
    assert run_cli(config, "run_id=day-1", "identity.reference=day-0") == 2  # a backfill's reference must exist
    assert "identity.reference 'day-0' is not a published run" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not out.exists()
    assert run_cli(config, "run_id=day-1") == 0
    assert run_cli(config, "run_id=day-2", f"input.path={tmp_path / 'day2'}", "report=true") == 0

    before, after = ids_by_truth(spark, out, "day-1"), ids_by_truth(spark, out, "day-2")
    persistent = range(K - 1)  # planted cluster K - 1 is gone on day 2, K is new
    assert sum(before[t] == after[t] for t in persistent) >= 18
    assert after[K] not in before.values() and after[K] > max(before.values())
    changes = sql(
        "SELECT cluster_id, status, reference_run_id, center_shift, relative_shift FROM latest_cluster_changes",
        out,
        capsys,
    )
    status = dict(zip(changes.cluster_id.astype(int), changes.status))
    assert status[after[K]] == "new" and status[before[K - 1]] == "retired"
    assert set(changes.reference_run_id) == {"day-1"}
    kept = changes[changes.status == "kept"]
    assert kept.cluster_id.astype(int)[kept.center_shift.astype(float).idxmax()] == after[0]  # the moved one
    folder = report_folder(out, "day-2")
    since = json.loads((folder / "report.json").read_text())["since_reference"]
    assert (since["reference_run_id"], since["new"], since["retired"]) == ("day-1", [after[K]], [before[K - 1]])
    assert (
        since["largest_shift"]["cluster_id"] == after[0]
        and 'alt="since_reference"' in (folder / "report.html").read_text()
    )
    [row] = [r for r in runs_of(spark, out) if r.run_id == "day-2"]
    assert (row.identity_mode, row.reference_run_id, row.highest_cluster_id) == ("stable", "day-1", max(after.values()))
    # The drift figures: one planted cluster of K replaced, one moved.
    sizes = (
        sql(
            "SELECT status, sum(n_points) AS n, sum(reference_n_points) AS r FROM latest_cluster_changes "
            "GROUP BY status",
            out,
            capsys,
        )
        .set_index("status")
        .astype(float)
    )
    assert row.share_in_new_clusters == pytest.approx(sizes.n["new"] / sizes.n.sum()) and 0 < row.share_in_new_clusters
    assert row.share_in_retired_clusters == pytest.approx(sizes.r["retired"] / sizes.r.sum())
    assert 0 < row.share_in_retired_clusters < 2 / K and 0 <= row.cluster_mix_psi < 0.1
    assert row.largest_relative_shift == pytest.approx(kept.relative_shift.astype(float).max(), rel=1e-5)  # as printed
    # Day 2 replaced 15% of the 200 devices; each device holds 4 clusters evenly, so its largest is a toss-up.
    moved = sql("SELECT sum(size(devices_in)) AS n FROM latest_cluster_changes", out, capsys).n.astype(int)[0]
    assert row.share_of_devices_moved == moved / 170 and moved > 0
    page = (folder / "report.html").read_text()
    assert "cluster mix PSI" in page and 'alt="sizes_over_runs"' in page  # day-1 and day-2, by cluster id

    # Each row's distance and margin, against numpy from the published centers; the squares add up to the cost.
    labels = published(spark, out, "labels").filter("run_id = 'day-2'").toArrow()
    centers = published(spark, out, "centers").filter("run_id = 'day-2'").toPandas()
    by_id = {int(c): np.asarray(v) for c, v in zip(centers.cluster_id, centers.center)}
    x = feature_matrix(labels.column("features"))
    ids = labels.column("cluster_id").to_numpy()
    distances = np.sqrt(((x[:, None, :] - np.stack(list(by_id.values()))[None]) ** 2).sum(axis=2))
    own = np.linalg.norm(x - np.stack([by_id[i] for i in ids]), axis=1)
    position = {cluster: j for j, cluster in enumerate(by_id)}
    distances[np.arange(len(ids)), [position[i] for i in ids]] = np.inf
    other = distances.min(axis=1)
    np.testing.assert_allclose(labels.column("distance").to_numpy(), own, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(labels.column("margin").to_numpy(), (other - own) / (other + own), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(np.sum(labels.column("distance").to_numpy() ** 2), row.cost, rtol=1e-9)

    # Day 2 again: the same ids. Unrelated data: every cluster is new.
    assert run_cli(config, "run_id=day-2", f"input.path={tmp_path / 'day2'}") == 0
    assert ids_by_truth(spark, out, "day-2") == after
    assert run_cli(config, "run_id=other", f"input.path={tmp_path / 'other'}") == 0
    changes = sql(
        "SELECT status, count(*) AS n FROM latest_cluster_changes GROUP BY status ORDER BY status", out, capsys
    )
    assert dict(zip(changes.status, changes.n.astype(int))) == {"new": K, "retired": K}
    [unrelated] = [r for r in runs_of(spark, out) if r.run_id == "other"]
    assert (unrelated.share_in_new_clusters, unrelated.share_in_retired_clusters) == (1.0, 1.0)
    assert (unrelated.cluster_mix_psi, unrelated.largest_relative_shift) == (None, None)

    # Another run id over day 1's input against day 1: no drift at all.
    assert run_cli(config, "run_id=day-1-again", "identity.reference=day-1") == 0
    [again] = [r for r in runs_of(spark, out) if r.run_id == "day-1-again"]
    assert (again.cluster_mix_psi, again.share_in_new_clusters, again.share_in_retired_clusters) == (0.0, 0.0, 0.0)
    assert again.share_of_devices_moved == 0.0 and again.largest_relative_shift < 1e-6  # the same centers, to rounding

    # A next run's report draws the sizes of the published attempts before it: day-2's re-run, not its first;
    # `assign` takes the models the published views show (the newest run's by default).
    tables = OutputTables(spark, OutputConfig(path=str(out)))
    sizes, run_ids = past_sizes(tables, "day-3")
    views = {row.run_id: row.attempt_id for row in published(spark, out, "runs").collect()}
    assert (stored_model(tables).origin, stored_model(tables).attempt_id) == ("day-1-again", views["day-1-again"])
    first_day_2 = [row.attempt_id for row in runs_of(spark, out) if row.run_id == "day-2"][0]
    assert stored_model(tables, "day-2").attempt_id == views["day-2"] != first_day_2
    assert run_ids == ["day-1", "day-2", "other", "day-1-again"]
    expected = published(spark, out, "centers").select("run_id", "cluster_id", "n_points").toPandas()
    pd.testing.assert_frame_equal(
        sizes.sort_values(["run_id", "cluster_id"]).reset_index(drop=True),
        expected.sort_values(["run_id", "cluster_id"]).reset_index(drop=True),
    )

    # The location over time: history prints every published run with its drift, and draws the sizes by id.
    capsys.readouterr()
    figure = tmp_path / "history.png"
    assert main(["history", "--output", str(out), "--json", "--figure", str(figure)]) == 0
    told = {row["run_id"]: row for row in json.loads(capsys.readouterr().out)["runs"]}
    assert list(told) == ["day-1", "day-2", "other", "day-1-again"]  # oldest first; day-2's re-run is published
    assert told["day-2"]["share_in_new_clusters"] == pytest.approx(row.share_in_new_clusters)  # its re-run
    assert told["day-1"]["cluster_mix_psi"] is None and told["day-1-again"]["cluster_mix_psi"] == 0.0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 5000
    assert main(["history", "--output", str(out), "--last", "2"]) == 0
    header, *lines = capsys.readouterr().out.strip().splitlines()
    assert header.split()[:2] == ["run_id", "finished_at"] and [line.split()[0] for line in lines] == [
        "other",
        "day-1-again",
    ]
    assert main(["describe", "--output", str(out), "--run", "day-2"]) == 0
    described = capsys.readouterr().out.strip().splitlines()
    assert described[0] == f"run day-2: {K} clusters" and f"cluster {after[K]}: " in "\n".join(described)


@pytest.mark.spark
def test_a_location_of_the_previous_release_is_upgraded_and_its_ids_kept(spark, config_after_first_run, tmp_path):
    """The previous releases wrote runs without the identity, k sweep, tracking and held-back columns, labels
    without distance and margin, and no cluster_changes or cluster_profiles (made here from a run of this one):
    the next run adds them before any work and matches its clusters to the old run's, whose ids were 0..k-1."""
    config, out = config_after_first_run, tmp_path / "out"
    for name, added in (
        (
            "runs",
            [
                *("identity_mode", "reference_run_id", "reference_attempt_id", "highest_cluster_id", "k_range"),
                *("k_sweep", "mlflow_run_id", "tracking_error"),
                *("min_center_points", "n_rows_held_back", "n_devices_held_back", "forgotten_devices"),
                *("privacy_epsilon", "privacy_delta", "clusters_per_device_in_effect", "clusters_in_effect"),
                *("cluster_mix_psi", "share_in_new_clusters", "share_in_retired_clusters", "largest_relative_shift"),
                *("share_of_devices_moved", "feature_names"),
            ],
        ),
        ("labels", ["distance", "margin"]),
    ):
        older = spark.read.format("delta").load(str(out / name)).drop(*added).cache()
        older.count()
        (
            older.write.format("delta")
            .mode("overwrite")
            .option("overwriteSchema", "true")
            .partitionBy("run_id", "attempt_id")
            .save(str(out / name))
        )
        older.unpersist()
    shutil.rmtree(out / "cluster_changes")
    shutil.rmtree(out / "cluster_profiles")
    assert run_cli(config, "run_id=second") == 0
    runs = {row.run_id: row for row in runs_of(spark, out)}
    assert (runs["first"].identity_mode, runs["second"].reference_run_id) == (None, "first")
    changes = published(spark, out, "cluster_changes").toPandas()
    assert set(changes.status) == {"kept"} and sorted(changes.cluster_id) == list(range(MIXTURE["k"]))
    profiled = published(spark, out, "cluster_profiles").select("run_id").distinct().collect()
    assert [row.run_id for row in profiled] == ["second"] and runs["second"].feature_names == [
        f"f{j}" for j in range(MIXTURE["dim"])
    ]
    assert published(spark, out, "labels").filter("run_id = 'first' AND distance IS NOT NULL").isEmpty()
