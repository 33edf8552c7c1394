"""Per-device k: a fixed number, a column, a side table, or each device's own estimate."""

import numpy as np
import pytest
from pyspark.sql import functions as F

from helpers import fitted_labels
from kfed_spark.bench.synthetic import write_mixture
from kfed_spark.cli import main
from kfed_spark.core.metrics import adjusted_rand_index

pytestmark = pytest.mark.spark

VARIED = dict(k=12, k_per_device=(1, 5), devices=40, points_per_device=150, dim=16, seed=5)


@pytest.fixture(scope="module")
def varied_path(tmp_path_factory):
    """Devices holding 1 to 5 of 12 clusters; clusters_held says how many."""
    path = tmp_path_factory.mktemp("varied")
    write_mixture(path, **VARIED)
    return str(path)


def run_varied(varied_path, out, k_per_device, *extra):
    config = out.parent / "varied.yaml"
    config.write_text(
        f"input: {{path: {varied_path}, truth_col: true_cluster}}\noutput: {{path: {out}}}\n"
        f"k: {VARIED['k']}\nrun_id: varied\n"
    )
    settings = [f"k_per_device={k_per_device}", *extra]
    return main(["run", "--config", str(config), *[arg for item in settings for arg in ("--set", item)]])


def local_counts_and_ari(spark, varied_path, k_per_device, **settings):
    """Through the fit layer: {device: (its local centers, the clusters it holds)} and the labels' ARI."""
    clustering, labels = fitted_labels(
        spark.read.parquet(varied_path), k=VARIED["k"], k_per_device=k_per_device, **settings
    )
    devices, counts = np.unique(clustering.local.devices, return_counts=True)
    held = labels.groupby("device_id")["clusters_held"].first()
    found = {device: (count, held[device]) for device, count in zip(devices, counts)}
    return found, adjusted_rand_index(labels.true_cluster, labels.cluster_id)


def test_auto_estimates_how_many_clusters_each_device_holds(spark, varied_path):
    found, ari = local_counts_and_ari(spark, varied_path, "auto", k_per_device_max=8)
    assert len(found) == VARIED["devices"]
    assert all(estimated == held for estimated, held in found.values()), found
    assert ari >= 0.95


def test_a_column_of_the_input_gives_each_devices_k(spark, varied_path):
    found, ari = local_counts_and_ari(spark, varied_path, "clusters_held")
    assert all(used == held for used, held in found.values()), found
    assert ari >= 0.95


def test_a_side_table_gives_each_devices_k(spark, varied_path, tmp_path):
    side = str(tmp_path / "device_k")
    (
        spark.read.parquet(varied_path)
        .groupBy("device_id")
        .agg(F.max("clusters_held").alias("k"))
        .write.format("delta")
        .save(side)
    )
    found, _ = local_counts_and_ari(spark, varied_path, side)
    assert all(used == held for used, held in found.values()), found


def test_per_device_k_out_of_range_or_missing_is_a_one_line_error(spark, varied_path, tmp_path, capsys):
    side = str(tmp_path / "too_big")
    spark.createDataFrame([(0, 13)], "device_id long, k int").write.format("delta").save(side)
    assert run_varied(varied_path, tmp_path / "out", side) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "must be a whole number in [1, k = 12] for every device" in err
    assert run_varied(varied_path, tmp_path / "out", "no_such_thing") == 2
    assert "cannot read table no_such_thing" in capsys.readouterr().err
