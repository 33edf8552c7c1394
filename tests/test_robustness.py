"""Numerical edge cases of the whole algorithm (federated_kmeans runs the kernels the Spark job runs)."""

import functools

import numpy as np
import pytest

from helpers import FAR_MIXTURE, FEATURE_MOVES, spread
from kfed_spark.bench import synthetic
from kfed_spark.core.linalg import nearest_center
from kfed_spark.core.local_centers import LocalCenters, feature_matrix
from kfed_spark.core.local_step import device_local_step
from kfed_spark.core.metrics import adjusted_rand_index, cost_of_labels
from kfed_spark.core.reference import federated_kmeans, local_clusterings
from kfed_spark.params import AlgorithmParams

pytestmark = pytest.mark.fast


def mixture(scale=1.0, dim=4, k=6, k_per_device=2, devices=30, rows=40, seed=0):
    rng = np.random.default_rng(seed)
    means = rng.normal(0, 10, size=(k, dim))
    held = np.array([rng.choice(k, k_per_device, replace=False) for _ in range(devices)])
    truth = np.concatenate([held[z][rng.integers(0, k_per_device, rows)] for z in range(devices)])
    x = (means[truth] + rng.standard_normal((len(truth), dim))) * scale
    return x, np.repeat(np.arange(devices), rows), truth


@pytest.mark.parametrize("scale", [1e150, 1e-150, 1.0])
def test_huge_and_tiny_magnitudes_cluster_like_unit_ones(scale):
    x, devices, truth = mixture(scale)
    result = federated_kmeans(x, devices, AlgorithmParams(k=6, k_per_device=2, seed=0))
    assert adjusted_rand_index(truth, result.labels) == pytest.approx(1.0)
    assert np.all(np.isfinite(result.server.centers))


def test_one_dimension_and_one_cluster():
    x, devices, truth = mixture(dim=1, k=3, k_per_device=2)
    labels = federated_kmeans(x, devices, AlgorithmParams(k=3, k_per_device=2, seed=0)).labels
    assert adjusted_rand_index(truth, labels) > 0.9
    one = federated_kmeans(x, devices, AlgorithmParams(k=1, k_per_device=1, seed=0))
    assert set(one.labels) == {0}
    np.testing.assert_allclose(one.server.centers[0], x.mean(axis=0))


def test_five_thousand_features_take_the_randomized_svd_path():
    x, devices, truth = mixture(dim=5000, k=4, k_per_device=2, devices=6, rows=30)
    labels = federated_kmeans(x, devices, AlgorithmParams(k=4, k_per_device=2, seed=0)).labels
    assert adjusted_rand_index(truth, labels) == pytest.approx(1.0)


def test_tiny_devices_and_identical_rows():
    x = np.array([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [10.0, 10.0], [10.0, 0.0], [0.0, 10.1], [10.0, 10.1]])
    devices = np.array(["same", "same", "same", "one", "two", "two", "three"])
    # min_center_points 1: a device may share its rows themselves (the paper's reference code does)
    result = federated_kmeans(x, devices, AlgorithmParams(k=4, k_per_device=3, seed=0, min_center_points=1))
    assert len(result.labels) == 7 and len(np.unique(result.labels)) == 4
    same = device_local_step(x[:3], 3, "same", AlgorithmParams())
    np.testing.assert_array_equal(same.centers, [[0.0, 0.0]])
    np.testing.assert_array_equal(same.counts, [3])


def test_all_devices_holding_one_point():
    x = np.ones((20, 3))
    devices = np.repeat(np.arange(5), 4)
    assert set(federated_kmeans(x, devices, AlgorithmParams(k=1, k_per_device=2, seed=0)).labels) == {0}
    with pytest.raises(ValueError, match="k = 2 is more than the 1 distinct local centers"):
        federated_kmeans(x, devices, AlgorithmParams(k=2, k_per_device=2, seed=0))


def test_string_and_integer_device_ids_give_the_same_clustering():
    x, devices, _ = mixture()
    as_int = federated_kmeans(x, devices, AlgorithmParams(k=6, k_per_device=2, seed=3))
    as_str = federated_kmeans(
        x, np.array([f"phone-{d:03d}" for d in devices]), AlgorithmParams(k=6, k_per_device=2, seed=3)
    )
    assert adjusted_rand_index(as_int.labels, as_str.labels) == pytest.approx(1.0)


@functools.cache
def far_mixture(move: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, LocalCenters]:
    """(rows, devices, truth, local step) of FAR_MIXTURE, its features moved by FEATURE_MOVES[move] (as given
    with None). The local step depends on none of the settings the shift-and-scale cases vary, so the eight
    cases share one per move (it is most of their time)."""
    table = synthetic.mixture(**FAR_MIXTURE)
    x, devices = feature_matrix(table.column("features")), table.column("device_id").to_numpy()
    if move is not None:
        scale, shift = FEATURE_MOVES[move]
        x = x * scale + shift
    params = AlgorithmParams(k=FAR_MIXTURE["k"], k_per_device=FAR_MIXTURE["k_per_device"], seed=2)
    return x, devices, table.column("true_cluster").to_numpy(), local_clusterings(x, devices, params)


@pytest.mark.parametrize("label_mode", ["induced", "nearest"])
@pytest.mark.parametrize("server_refine", ["lloyd", "none"])
@pytest.mark.parametrize("seeding", ["kmeanspp", "farthest"])
def test_shifting_or_scaling_the_features_changes_no_label(seeding, server_refine, label_mode):
    """Every tolerance is relative to the rows' spread, never to their norms: at 1e9 from the origin the
    expanded distance formula alone would round distances of 1 away, and the duplicate cut-off would
    take every local center for a copy of the first."""
    x, devices, truth, local = far_mixture(None)
    params = AlgorithmParams(
        k=FAR_MIXTURE["k"],
        k_per_device=FAR_MIXTURE["k_per_device"],
        seeding=seeding,
        server_refine=server_refine,
        label_mode=label_mode,
        seed=2,
    )
    given = federated_kmeans(x, devices, params, local)
    assert adjusted_rand_index(truth, given.labels) > 0.95
    for move in FEATURE_MOVES:
        moved, _, _, moved_local = far_mixture(move)
        result = federated_kmeans(moved, devices, params, moved_local)
        np.testing.assert_array_equal(result.labels, given.labels)
        np.testing.assert_array_equal(result.local_labels, given.local_labels)
        cost = np.sum((moved - result.server.centers[result.labels]) ** 2)
        assert cost / spread(moved) == pytest.approx(
            np.sum((x - given.server.centers[given.labels]) ** 2) / spread(x), rel=1e-6
        )


def test_identical_rows_and_one_point_far_from_the_origin_are_still_duplicates():
    x = np.full((20, 3), 1e9)
    devices = np.repeat(np.arange(5), 4)
    assert set(federated_kmeans(x, devices, AlgorithmParams(k=1, k_per_device=2, seed=0)).labels) == {0}
    for seeding in ("kmeanspp", "farthest"):
        with pytest.raises(ValueError, match="k = 2 is more than the 1 distinct local centers"):
            federated_kmeans(x, devices, AlgorithmParams(k=2, k_per_device=2, seeding=seeding, seed=0))


def test_rows_of_held_back_centers_take_their_nearest_global_center_on_phones_of_ten_rows():
    """Devices of ten rows from two clusters: one split 8/2 or 9/1 holds its small center back
    (min_center_points 3). Its rows take the nearest global center, not the device's other shared center
    (a cluster far away), and no local cluster."""
    table = synthetic.mixture(k=8, k_per_device=2, devices=600, points_per_device=10, dim=16, seed=3)
    x = feature_matrix(table.column("features"))
    devices, truth = table.column("device_id").to_numpy(), table.column("true_cluster").to_numpy()
    result = federated_kmeans(x, devices, AlgorithmParams(k=8, k_per_device=2))
    assert adjusted_rand_index(truth, result.labels) == 1.0
    held = result.local_labels == -1
    assert held.sum() > 100
    assert cost_of_labels(x, result.labels) == pytest.approx(cost_of_labels(x, truth), rel=1e-12)
    np.testing.assert_array_equal(result.labels[held], nearest_center(x[held], result.server.centers)[0])
