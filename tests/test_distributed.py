"""The distributed server step: each partition's representatives, merged on the driver, then every
local center assigned in the executors; the same clusters as the driver's server step."""

from dataclasses import replace

import numpy as np
import pytest

from helpers import MIXTURE, fitted_labels
from kfed_spark.bench.synthetic import close_means_mixture
from kfed_spark.core.linalg import nearest_center
from kfed_spark.core.local_centers import feature_matrix
from kfed_spark.core.metrics import adjusted_rand_index
from kfed_spark.core.reference import local_clusterings
from kfed_spark.core.server_step import representatives, server_step
from kfed_spark.params import AlgorithmParams


@pytest.mark.fast
def test_representatives_keep_the_weight_and_summarize_separated_groups():
    rng = np.random.default_rng(5)
    means = rng.normal(0.0, 50.0, size=(6, 3))
    group = rng.integers(0, 6, size=3000)
    x = means[group] + rng.normal(size=(3000, 3))
    weights = rng.integers(1, 100, size=3000).astype(float)
    found, mass = representatives(x, weights, 6, np.random.default_rng(0))
    assert len(found) <= 6 and mass.sum() == pytest.approx(weights.sum())
    truth = np.array([np.average(x[group == g], axis=0, weights=weights[group == g]) for g in range(6)])
    nearest = np.argmin(((found[:, None] - truth[None]) ** 2).sum(axis=2), axis=1)
    assert sorted(nearest) == list(range(6))  # one representative per group, at its weighted mean
    np.testing.assert_allclose(found, truth[nearest], atol=1e-9)
    np.testing.assert_allclose(mass, [weights[group == g].sum() for g in nearest])
    same, same_mass = representatives(x[:5], weights[:5], 6, np.random.default_rng(0))
    assert same is not None and np.array_equal(same, x[:5]) and np.array_equal(same_mass, weights[:5])


@pytest.mark.fast
def test_merging_each_partitions_representatives_costs_what_merging_all_local_centers_does():
    """What the distributed step computes, without Spark: four partitions of close-means local centers,
    each reduced to k representatives, merged; the weighted cost over all local centers is within 2%
    of the driver's server step over all of them (1.1% here; 35% if a partition kept its first k centers)."""
    table = close_means_mixture(seed=2, devices=120)
    params = AlgorithmParams(k=49, k_per_device=7)
    local = local_clusterings(feature_matrix(table.column("features")), table.column("device_id").to_numpy(), params)
    parts = [
        representatives(x, w, params.k, np.random.default_rng(i))
        for i, (x, w) in enumerate(zip(np.array_split(local.centers, 4), np.array_split(local.counts.astype(float), 4)))
    ]
    reps, weights = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    assert len(reps) <= 4 * params.k < len(local.centers)
    merged = server_step(reps, weights, np.arange(len(reps)), np.zeros(len(reps)), replace(params, robust_min_size=0))
    driver = server_step(local.centers, local.counts, local.devices, local.ids, params)

    def cost(centers):
        return float(local.counts @ nearest_center(local.centers, centers)[1])

    assert cost(merged.centers) <= 1.02 * cost(driver.centers), (cost(merged.centers), cost(driver.centers))


def close_means_frame(spark):
    table = close_means_mixture(seed=2, devices=120)
    return spark.createDataFrame(table.to_pandas()), dict(k=49, k_per_device=7)


@pytest.mark.spark
@pytest.mark.parametrize("problem", ["mixture", "close-means"])
def test_forced_distributed_server_step_clusters_as_the_driver_does(spark, mixture_path, problem, caplog):
    """One representative per global cluster and partition, over four partitions of local centers:
    each partition really is reduced (it holds more local centers than that)."""
    if problem == "mixture":
        raw, settings = spark.read.parquet(mixture_path), dict(k=MIXTURE["k"], k_per_device=MIXTURE["k_per_device"])
    else:
        raw, settings = close_means_frame(spark)
    ari = {}
    caplog.set_level("INFO", logger="kfed_spark")
    for where in ("driver", "distributed"):
        caplog.clear()
        clustering, labelled = fitted_labels(
            raw, server_step=where, server_representatives=1, local_partitions=4, **settings
        )
        ari[where] = adjusted_rand_index(labelled.true_cluster, labelled.cluster_id)
        assert len(clustering.local.counts) > 4 * settings["k"]
        assert f"server step ({where})" in caplog.text
    assert ari["distributed"] >= ari["driver"] - 0.01, ari
