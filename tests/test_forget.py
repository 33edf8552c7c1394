"""`kfed-spark forget`: devices taken out of published runs, on real Spark and real Delta tables.

Killing it at every commit point is tested with `run` in tests/test_publish.py.
"""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import MIXTURE, N_ROWS, published, report_folder, run_cli, runs_of, spread, write_empty_config
from kfed_spark.bench.datasets import write_parquet_folder
from kfed_spark.cli import main
from kfed_spark.store.tables import DATA_TABLES

pytestmark = pytest.mark.spark

FORGOTTEN = [3, 7]
"""Device 3 has two bad rows in the test's input, device 7 one."""


def mixture_with_extras(mixture_path):
    """The tests' mixture with bad rows (of devices 3, 7 and 10, and one without a device) and a device of two
    rows, whose local cluster is too small to share (labelled through the nearest global center)."""
    table = pq.read_table(mixture_path)
    dim = MIXTURE["dim"]
    near = table.column("features")[0].as_py()
    extra = pa.table(
        {
            "row_id": pa.array(range(10_000, 10_007), pa.int64()),
            "device_id": pa.array([3, 3, 7, 10, None, 999, 999], pa.int64()),
            "features": pa.array(
                [[float("nan")] * dim, [1.0], [float("inf")] * dim, None, [0.0] * dim, near, near],
                pa.list_(pa.float64()),
            ),
            "true_cluster": pa.array([0] * 7, pa.int32()),
        }
    )
    return pa.concat_tables([table.select(extra.column_names).cast(extra.schema), extra])


def by_cluster_map(forgot, fresh):
    """The one-to-one map of the forgotten run's cluster ids to the fresh run's, read from the rows they share."""
    pairs = set(zip(forgot.cluster_id, fresh.cluster_id))
    mapping = dict(pairs)
    assert len(mapping) == len(pairs) == len(set(mapping.values())), "the two runs' clusters differ"
    return mapping


def test_forget_leaves_what_a_fresh_run_without_the_devices_gives(spark, tmp_path, mixture_path):
    """Two runs (the second's ids matched to the first's) over an input with bad rows and a device too small to
    share anything; forget two devices from both. Every published table of both runs loses every row and center
    of the devices (the tables' current files too: the superseded attempts' rows are deleted), and the rest
    equals two fresh runs over the input without them: the same rows in the same clusters (ids kept from the
    superseded attempts), the same centers, distances, margins, quarantine, device profiles and changes."""
    full, without = tmp_path / "full", tmp_path / "without"
    rows = mixture_with_extras(mixture_path)
    write_parquet_folder(rows, full)
    kept = pa.compute.invert(pa.compute.is_in(rows.column("device_id"), pa.array(FORGOTTEN, pa.int64())))
    write_parquet_folder(rows.filter(pa.compute.fill_null(kept, True)), without)
    config = write_empty_config(tmp_path)
    settings = [
        f"k={MIXTURE['k']}",
        f"k_per_device={MIXTURE['k_per_device']}",
        "seed=11",
        "input.truth_col=true_cluster",
    ]
    for source, out in ((full, tmp_path / "out"), (without, tmp_path / "fresh")):
        for run_id in ("first", "second"):
            assert run_cli(config, f"input.path={source}", f"output.path={out}", f"run_id={run_id}", *settings) == 0
    before = {r.run_id: r for r in runs_of(spark, tmp_path / "out")}
    devices = [arg for d in FORGOTTEN for arg in ("--device", str(d))]
    assert main(["forget", "--output", str(tmp_path / "out"), *devices, "--device", "12345", "--all-runs"]) == 0

    out, fresh = tmp_path / "out", tmp_path / "fresh"
    runs = {r.attempt_id: r for r in runs_of(spark, out)}
    for run_id in ("first", "second"):
        old = runs[before[run_id].attempt_id]
        assert (old.status, old.rows_removed) == ("superseded", True)
        (new,) = [r for r in runs.values() if r.run_id == run_id and r.status == "succeeded"]
        assert new.forgotten_devices == 2 and (new.started_at, new.finished_at) == (old.started_at, old.finished_at)
        assert new.n_input == old.n_input - 200 - 3 and new.n_quarantined == old.n_quarantined - 3
        assert new.n_devices == old.n_devices - 2
        assert report_folder(out, run_id).name == new.attempt_id
        assert json.loads((report_folder(out, run_id) / "report.json").read_text())["attempt_id"] == new.attempt_id
    for name, column in (
        ("labels", "device_id"),
        ("quarantine", "device_id"),
        ("local_centers", "device_id"),
        ("device_clusters", "device_id"),
    ):
        current = spark.read.format("delta").load(str(out / name))  # every attempt's rows, not only published
        assert current.filter(current[column].isin(FORGOTTEN)).count() == 0, name
    changes = spark.read.format("delta").load(str(out / "cluster_changes")).toPandas()
    assert not any(set(FORGOTTEN) & set(ids) for ids in [*changes.devices_in, *changes.devices_out])

    def table(location, name, run_id):
        return published(spark, location, name).filter(f"run_id = '{run_id}'").toPandas()

    for run_id in ("first", "second"):
        forgot = table(out, "labels", run_id).set_index("row_id").sort_index()
        again = table(fresh, "labels", run_id).set_index("row_id").sort_index()
        assert list(forgot.index) == list(again.index)
        ids = by_cluster_map(forgot, again)
        assert set(ids) <= set(table(out, "cluster_changes", run_id).cluster_id)
        x = np.stack(again.features.to_numpy())
        tolerance = 1e-9 * np.sqrt(spread(x) / len(x))
        np.testing.assert_array_equal(forgot.local_cluster_id.fillna(-1), again.local_cluster_id.fillna(-1))
        np.testing.assert_allclose(forgot.distance, again.distance, atol=tolerance)
        np.testing.assert_allclose(forgot.margin, again.margin, atol=1e-9)
        centers = {ids[r.cluster_id]: np.array(r.center) for r in table(out, "centers", run_id).itertuples()}
        for r in table(fresh, "centers", run_id).itertuples():
            np.testing.assert_allclose(centers[r.cluster_id], r.center, atol=tolerance)
        quarantine = table(out, "quarantine", run_id).sort_values("row_id")
        assert list(quarantine.row_id) == sorted(table(fresh, "quarantine", run_id).row_id)
        profiles, fresh_profiles = (
            table(location, "device_clusters", run_id)
            .assign(cluster_id=lambda t, m=m: t.cluster_id.map(m))
            .sort_values(["device_id", "cluster_id"])[["device_id", "cluster_id", "n_points"]]
            .reset_index(drop=True)
            for location, m in ((out, ids), (fresh, {v: v for v in ids.values()}))
        )
        assert profiles.equals(fresh_profiles)
    forgot_changes = table(out, "cluster_changes", "second")
    fresh_changes = table(fresh, "cluster_changes", "second")
    assert sorted(forgot_changes.status) == sorted(fresh_changes.status)
    assert sorted(forgot_changes.n_points.dropna()) == sorted(fresh_changes.n_points.dropna())


def test_forget_then_vacuum_leaves_no_file_that_holds_the_device(
    spark, capsys, config_after_first_run, mixture_path, tmp_path
):
    """Devices no run holds change nothing; an unknown run is refused in one line. A run that labels with
    another's model (assign) is labelled again with that model as published without the device, as assign
    over its input without the device labels it, and refused while that model still holds the device. After
    forget the device's rows are deleted but their files stay in the tables' history; `maintain --vacuum`
    removes them once the tables' retention has passed (here set to none)."""
    config, out = config_after_first_run, tmp_path / "out"
    attempts = [r.attempt_id for r in runs_of(spark, out)]
    assert main(["forget", "--output", str(out), "--device", "12345", "--all-runs"]) == 0
    assert "nothing to forget" in capsys.readouterr().out
    assert [r.attempt_id for r in runs_of(spark, out)] == attempts
    assert main(["forget", "--output", str(out), "--device", "3", "--run", "nope"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"kfed-spark: error: no published run 'nope' under {out}"

    def assign(run_id, *settings):
        overrides = [arg for item in (f"run_id={run_id}", *settings) for arg in ("--set", item)]
        return main(["assign", "--model-run", "first", "--config", str(config), *overrides])

    assert assign("assigned") == 0
    attempts = [r.attempt_id for r in runs_of(spark, out)]
    assert main(["forget", "--output", str(out), "--device", "3", "--run", "assigned"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "kfed-spark: error: run 'assigned' takes the model of first, which holds the devices too: forget them there "
        "too (--all-runs)"
    )
    assert [r.attempt_id for r in runs_of(spark, out)] == attempts

    def files_holding_device_3():
        return [
            path
            for name in ("labels", "local_centers", "device_clusters")
            for path in (out / name).glob("run_id=*/attempt_id=*/*.parquet")
            if 3 in pq.read_table(path, columns=["device_id"]).column("device_id").to_pylist()
        ]

    assert main(["forget", "--output", str(out), "--device", "3", "--all-runs"]) == 0
    without_3 = tmp_path / "without_3"
    rows = pq.read_table(mixture_path)
    write_parquet_folder(rows.filter(pa.compute.not_equal(rows.column("device_id"), 3)), without_3)
    assert assign("again", f"input.path={without_3}") == 0
    labels = published(spark, out, "labels").toPandas()
    forgot, again = (labels[labels.run_id == r].set_index("row_id").sort_index() for r in ("assigned", "again"))
    assert len(forgot) == N_ROWS - MIXTURE["points_per_device"] and forgot.index.equals(again.index)
    assert forgot.cluster_id.equals(again.cluster_id) and np.allclose(forgot.distance, again.distance)

    assert len(files_holding_device_3()) >= 6  # deleted rows, in the tables' history
    for name in DATA_TABLES:
        retention = "'delta.deletedFileRetentionDuration' = 'interval 0 hours'"
        spark.sql(f"ALTER TABLE delta.`{out / name}` SET TBLPROPERTIES ({retention})")
    assert main(["maintain", "--output", str(out), "--vacuum"]) == 0
    assert files_holding_device_3() == []


def test_a_run_that_nothing_is_left_of_is_retracted(spark, capsys, tmp_path, mixture_path):
    """Three runs: `all` over the mixture, `few` over three of its devices with k = 4, and `assigned` with few's
    model over the same three. Forgetting two of them: `all` gets a new attempt; `few` keeps three local centers,
    fewer than its k, so a run without the devices would fail: it is retracted (one commit of its runs row),
    and `assigned`, whose model is gone, with it. Neither then shows in any published table, no current file
    holds a row of the devices, their report folders are gone, describe, report and forget say why in one line,
    and running `few` again publishes it."""
    rows = pq.read_table(mixture_path)
    few, out = tmp_path / "few", tmp_path / "out"
    write_parquet_folder(rows.filter(pa.compute.is_in(rows.column("device_id"), pa.array([0, 1, 2], pa.int64()))), few)
    config = write_empty_config(tmp_path)
    settings = [f"output.path={out}", f"k_per_device={MIXTURE['k_per_device']}", "seed=11"]
    assert run_cli(config, f"input.path={mixture_path}", "run_id=all", f"k={MIXTURE['k']}", *settings) == 0
    assert run_cli(config, f"input.path={few}", "run_id=few", "k=4", *settings) == 0
    assign = ["assign", "--model-run", "few", "--config", str(config)]
    assert main([*assign, *(f"--set={s}" for s in (f"input.path={few}", "run_id=assigned", *settings))]) == 0
    before = {r.run_id: r for r in runs_of(spark, out)}
    capsys.readouterr()

    assert main(["forget", "--output", str(out), "--device", "0", "--device", "1", "--all-runs"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("run all: attempt ")
    assert printed[1:3] == [
        "run few: retracted, with no attempt published now: without 2 of the devices, k = 4 is more than the 3 "
        f"distinct local centers the devices share; attempt {before['few'].attempt_id} and its 300 rows deleted",
        "run assigned: retracted, with no attempt published now: without 2 of the devices, the model it takes, "
        f"run few's, is no longer published; attempt {before['assigned'].attempt_id} and its 300 rows deleted",
    ]
    runs = {r.attempt_id: r for r in runs_of(spark, out)}
    for run_id in ("few", "assigned"):
        retracted = runs[before[run_id].attempt_id]
        assert (retracted.status, retracted.rows_removed, retracted.forgotten_devices) == ("retracted", True, 2)
        assert retracted.publish_seq == before[run_id].publish_seq + 1
        assert retracted.error.startswith("retracted by forget: ")
        assert not (out / "reports" / run_id).exists() or not any((out / "reports" / run_id).iterdir())
    for name in DATA_TABLES:
        assert {r.run_id for r in published(spark, out, name).select("run_id").distinct().collect()} <= {"all"}, name
    for name in ("labels", "quarantine", "local_centers", "device_clusters"):
        current = spark.read.format("delta").load(str(out / name))  # every attempt's rows, not only published
        assert current.filter(current.device_id.isin(0, 1)).count() == 0, name

    why = "retracted by forget: k = 4 is more than the 3 distinct local centers the devices share"
    for command in (["describe", "--run", "few"], ["report", "few"], ["forget", "--device", "2", "--run", "few"]):
        assert main([*command, "--output", str(out)]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last == f"kfed-spark: error: no published run 'few' under {out} ({why})", command

    assert run_cli(config, f"input.path={few}", "run_id=few", "k=4", *settings) == 0
    assert published(spark, out, "labels").filter("run_id = 'few'").count() == 3 * MIXTURE["points_per_device"]
