"""The k sweep over local centers (kfed_spark.core.k_sweep): numpy only, no Spark."""

import dataclasses

import numpy as np
import pytest

from kfed_spark.bench.synthetic import close_means_mixture, mixture, uneven_mixture
from kfed_spark.core.k_sweep import k_values, sweep
from kfed_spark.core.local_centers import feature_matrix
from kfed_spark.core.metrics import cost_of_labels
from kfed_spark.core.reference import federated_kmeans, local_clusterings
from kfed_spark.params import AlgorithmParams

pytestmark = pytest.mark.fast


def rows_of(table):
    return (
        feature_matrix(table.column("features")),
        table.column("device_id").to_numpy(),
        table.column("true_cluster").to_numpy(),
    )


def swept(x, devices, k_per_device, ks, **settings):
    params = AlgorithmParams(k=max(ks), k_per_device=k_per_device, **settings)
    local = local_clusterings(x, devices, params)
    return sweep(local.centers, local.counts, local.sse, local.devices, local.ids, ks, params), local, params


def test_well_separated_clusters_of_even_sizes_give_the_true_k_by_every_criterion():
    x, devices, _ = rows_of(mixture(k=24, k_per_device=4, devices=300, points_per_device=100, dim=16, seed=1))
    result, _, _ = swept(x, devices, 4, k_values(16, 32))
    assert result.recommended_k == 24
    assert result.choices == {"bic": 24, "silhouette": 24, "noise_ratio": 24}
    assert result.disagreements == []
    assert result.figure(24).stability == pytest.approx(1.0)


def test_rare_clusters_under_one_percent_of_the_rows_are_counted():
    table = uneven_mixture(0)
    x, devices, truth = rows_of(table)
    shares = np.bincount(truth) / len(truth)
    assert np.sum(shares < 0.01) >= 5  # the mixture is what the test says it is
    result, _, _ = swept(x, devices, 4, k_values(28, 44))
    assert result.recommended_k == 36


def test_close_means_give_a_k_within_ten_percent_of_the_true_one():
    x, devices, truth = rows_of(close_means_mixture(0))
    result, _, _ = swept(x, devices, 7, k_values(40, 58, 3))  # every third k, 49 among them
    assert abs(result.recommended_k - 49) <= 4.9
    assert len(np.unique(truth)) == 49


def test_each_k_has_the_exact_sse_of_the_labels_the_run_would_give_and_the_range_edge_is_said():
    x, devices, _ = rows_of(mixture(k=8, k_per_device=3, devices=40, points_per_device=60, dim=5, seed=2))
    result, local, params = swept(x, devices, 3, [4, 6, 8])
    for figure in result.figures:
        labels = federated_kmeans(x, devices, dataclasses.replace(params, k=figure.k), local).labels
        assert figure.sse == pytest.approx(cost_of_labels(x, labels), rel=1e-9)
    assert result.recommended_k == 8
    assert any("widen the range" in line for line in result.disagreements)
    assert "recommended k = 8" in result.text()


def test_shifting_or_scaling_the_features_changes_no_choice():
    x, devices, _ = rows_of(mixture(k=10, k_per_device=3, devices=60, points_per_device=80, dim=6, seed=3))
    base, _, _ = swept(x, devices, 3, k_values(4, 16))
    moved, _, _ = swept(x * 1e4 + 1e7, devices, 3, k_values(4, 16))
    assert moved.recommended_k == base.recommended_k and moved.choices == base.choices
    for a, b in zip(base.figures, moved.figures):
        assert b.sse == pytest.approx(a.sse * 1e8, rel=1e-6)
        assert b.silhouette == pytest.approx(a.silhouette, abs=1e-6)
        assert b.noise_ratio == pytest.approx(a.noise_ratio, rel=1e-6)


def test_a_k_range_is_checked():
    assert k_values(2, 10, 4) == [2, 6, 10] and k_values(2, 11, 4) == [2, 6, 10, 11]
    with pytest.raises(ValueError, match="1 <= LO <= HI"):
        k_values(5, 3)
