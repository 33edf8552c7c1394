"""A finished model from a run's tables (kfed_spark.store.models), applied to new input by `kfed-spark assign`."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import (
    MIXTURE,
    N_ROWS,
    by_row,
    labels_of,
    published,
    refused,
    run_cli,
    runs_of,
)
from kfed_spark.cli import main
from kfed_spark.core.metrics import adjusted_rand_index

pytestmark = pytest.mark.spark


def test_assign_labels_new_input_with_a_finished_runs_model(spark, config, tmp_path, mixture_path):
    table = pq.read_table(mixture_path)
    pq.write_table(table.filter(pa.compute.less(table.column("device_id"), 45)), tmp_path / "seen.parquet")
    assert run_cli(config, f"input.path={tmp_path / 'seen.parquet'}") == 0
    args = ["assign", "--model-run", "first", "--config", str(config), "--set", "run_id=assigned"]
    assert main(args) == 0

    out = tmp_path / "out"
    runs = sorted(runs_of(spark, out), key=lambda r: r.run_id)
    assert [(r.run_id, r.parent_run_id) for r in runs] == [("assigned", "first"), ("first", None)]
    assert runs[0].n_labelled == N_ROWS and runs[0].n_devices == MIXTURE["devices"]
    assigned = by_row(labels_of(spark, out, "assigned"), "device_id", "true_cluster", "cluster_id")
    first = by_row(labels_of(spark, out, "first"), "cluster_id")
    known = assigned[assigned.device_id < 45]
    np.testing.assert_array_equal(known.cluster_id.to_numpy(), first.cluster_id.to_numpy())
    fresh = assigned[assigned.device_id >= 45]
    assert adjusted_rand_index(fresh.true_cluster, fresh.cluster_id) >= 0.95
    centers = published(spark, out, "centers")
    same = centers.filter("run_id = 'assigned'").orderBy("cluster_id").select("center").collect()
    assert same == centers.filter("run_id = 'first'").orderBy("cluster_id").select("center").collect()


def test_assign_from_a_missing_run_is_a_clear_error(published_run, capsys):
    config, out = published_run
    assert main(["assign", "--model-run", "nope", "--config", str(config), "--set", "run_id=x"]) == 2
    assert capsys.readouterr().err.strip() == f"kfed-spark: error: no published run 'nope' under {out}"


def test_assign_cannot_name_its_own_run_as_the_model(spark, published_run, capsys):
    config, out = published_run
    assert main(["assign", "--model-run", "first", "--config", str(config)]) == 2
    assert refused(capsys) == (
        "kfed-spark: error: run 'first' cannot take its own model: give the new run another run_id"
    )
    assert [r.status for r in runs_of(spark, out)] == ["succeeded"]
