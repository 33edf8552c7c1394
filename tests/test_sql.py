"""Querying the outputs: Spark SQL through the CLI and the catalog, DuckDB without Spark, and dry runs."""

import duckdb
import numpy as np
import pytest
from deltalake import DeltaTable

from helpers import DUCKDB_PUBLISHED_LABELS, MIXTURE, N_ROWS, docs_device_profile_queries, run_cli
from kfed_spark.cli import main
from kfed_spark.config import OutputConfig
from kfed_spark.store.output import OutputTables

pytestmark = pytest.mark.spark


def test_sql_command_queries_the_tables_and_the_latest_run(spark, config_after_first_run, tmp_path, capsys):
    config = config_after_first_run
    assert run_cli(config, "run_id=second", "k=6") == 0
    capsys.readouterr()
    query = "SELECT run_id, count(DISTINCT cluster_id) AS clusters, count(*) AS n FROM latest_labels GROUP BY run_id"
    assert main(["sql", query, "--output", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == ["run_id", "clusters", "n", "second", "6", str(N_ROWS)]
    assert main(["sql", "SELECT count(*) AS runs FROM runs", "--config", str(config)]) == 0
    assert capsys.readouterr().out.split() == ["runs", "2"]
    assert main(["sql", "SELECT count(*) AS n FROM labels", "--config", str(config)]) == 0
    assert capsys.readouterr().out.split() == ["n", str(2 * N_ROWS)]


def test_the_readme_s_device_profile_queries(spark, published_run, capsys):
    """Per-cluster training devices and a client selection covering every cluster, as the docs run them."""
    _, out = published_run
    training, selection = docs_device_profile_queries()
    tables = OutputTables(spark, OutputConfig(path=str(out)))
    tables.register_views()
    profiles = spark.sql("SELECT * FROM latest_device_clusters").toPandas()
    per_cluster = spark.sql(training).toPandas()
    assert list(per_cluster.cluster_id) == list(range(MIXTURE["k"]))  # every cluster has devices to train on
    for row in per_cluster.itertuples():
        mine = profiles[(profiles.cluster_id == row.cluster_id) & profiles.device_id.isin(row.devices)]
        assert len(mine) == row.n_devices and mine.n_points.sum() == row.n_rows and (mine.device_share >= 0.2).all()
    chosen = spark.sql(selection).toPandas()
    assert set(chosen.cluster_id) == set(range(MIXTURE["k"]))
    for cluster, picked in chosen.groupby("cluster_id"):
        holders = profiles[profiles.cluster_id == cluster].n_points.sort_values(ascending=False).to_numpy()
        needed = int(np.searchsorted(np.cumsum(holders), 0.5 * holders.sum())) + 1  # fewest devices for half
        assert len(picked) == needed and picked.n_points.sum() >= 0.5 * holders.sum()
    assert main(["sql", training, "--output", str(out)]) == 0
    assert capsys.readouterr().out.split()[:4] == ["cluster_id", "n_devices", "n_rows", "devices"]


def test_sql_without_tables_is_a_clear_error(spark, tmp_path, capsys):
    assert main(["sql", "SELECT 1", "--output", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip() == f"kfed-spark: error: no kfed-spark tables under {tmp_path / 'nothing'}"


def test_catalog_gets_a_latest_labels_view(spark, config, tmp_path):
    assert run_cli(config, "output.database=kfed_views") == 0
    assert run_cli(config, "output.database=kfed_views", "run_id=later", "k=6") == 0
    rows = spark.sql("SELECT DISTINCT run_id FROM kfed_views.latest_labels").collect()
    assert [r.run_id for r in rows] == ["later"]


def test_duckdb_reads_the_published_labels_through_delta_rs(spark, config_after_first_run, tmp_path, monkeypatch):
    """Without Spark: delta-rs opens the tables, DuckDB keeps the published attempts (the docs' recipe)."""
    config = config_after_first_run
    assert run_cli(config, "k=6") == 0  # a second attempt of the run id: the first is superseded
    monkeypatch.chdir(tmp_path)
    # DuckDB reads these two by their Python names: the docs' view selects FROM labels and runs.
    labels = DeltaTable("out/labels").to_pyarrow_dataset()
    runs = DeltaTable("out/runs").to_pyarrow_dataset()  # noqa: F841
    duckdb.sql(DUCKDB_PUBLISHED_LABELS)  # the view the docs define
    counts = duckdb.sql(
        "SELECT cluster_id, count(*) AS n FROM published_labels WHERE run_id = 'first' GROUP BY ALL ORDER BY cluster_id"
    ).fetchall()
    assert [c for c, _ in counts] == list(range(6)) and sum(n for _, n in counts) == N_ROWS
    assert labels.count_rows() == 2 * N_ROWS  # the raw table still holds the superseded attempt


def test_dry_run_checks_and_prints_the_plan_without_writing(spark, config, tmp_path, capsys):
    assert main(["run", "--config", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "features: features (dimension 8)" in out and "dry run: nothing was written" in out
    assert "cluster ids: stable, matched to the newest published run of another run id" in out
    assert not (tmp_path / "out").exists()
    assert main(["run", "--config", str(config), "--dry-run", "--set", "input.device_col=nope"]) == 2
