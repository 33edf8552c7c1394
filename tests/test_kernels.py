"""The numeric core, without Spark."""

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from kfed_spark.kernels import (
    device_rng,
    kmeans_plusplus,
    local_step,
    margin_initial_centers,
    nearest_center,
    nearest_device_center,
    scale_counts,
    server_step,
    squared_distances,
)
from kfed_spark.metrics import adjusted_rand_index, within_cluster_cost


def blobs(rng, means, n, noise=1.0):
    truth = rng.integers(0, len(means), size=n)
    return means[truth] + noise * rng.standard_normal((n, means.shape[1])), truth


def test_squared_distances_match_direct_computation():
    rng = np.random.default_rng(0)
    x, c = rng.normal(size=(50, 7)), rng.normal(size=(4, 7))
    direct = ((x[:, None, :] - c[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(squared_distances(x, c), direct, atol=1e-10)


def test_device_rng_depends_on_seed_and_device_only():
    draw = lambda seed, device: device_rng(seed, device).random(3)  # noqa: E731
    np.testing.assert_array_equal(draw(1, 5), draw(1, 5))
    np.testing.assert_array_equal(draw(1, "phone-a"), draw(1, "phone-a"))
    assert not np.array_equal(draw(1, 5), draw(2, 5))
    assert not np.array_equal(draw(1, 5), draw(1, 6))
    assert not np.array_equal(draw(1, 5), draw(1, "5"))
    np.testing.assert_array_equal(draw(1, np.int64(5)), draw(1, 5))


def test_local_step_recovers_planted_clusters():
    rng = np.random.default_rng(1)
    means = rng.normal(0, 5, size=(6, 20))
    x, truth = blobs(rng, means, 900)
    result = local_step(x, 6, device_rng(0, 1))
    labels, _ = nearest_center(x, result.centers)
    assert adjusted_rand_score(truth, labels) == 1.0
    assert result.counts.sum() == 900
    planted = np.array([x[truth == j].mean(axis=0) for j in range(6)])
    order = nearest_center(planted, result.centers)[0]
    np.testing.assert_allclose(result.centers[order], planted, atol=1e-9)
    expected_sse = sum(((x[truth == j] - planted[j]) ** 2).sum() for j in range(6))
    assert result.sse.sum() == pytest.approx(expected_sse)


def test_margin_rule_keeps_only_points_three_times_closer():
    rough = np.array([[0.0], [10.0]])
    projected = np.array([[0.0], [1.0], [4.0], [9.0], [10.0]])
    # Original rows differ from the projection so that the means show which rows were used.
    original = np.array([[0.0, 0.0], [1.0, 2.0], [4.0, 100.0], [9.0, 4.0], [10.0, 6.0]])
    centers = margin_initial_centers(original, projected, np.ones(5), rough)
    # The point at 4 is 4 from the first rough center and 6 from the second: not 3x closer, dropped.
    np.testing.assert_allclose(centers, [[0.5, 1.0], [9.5, 5.0]])


def test_margin_rule_uses_original_rows_and_weights():
    rough = np.array([[0.0], [10.0]])
    projected = np.array([[0.0], [1.0], [10.0]])
    original = np.array([[0.0, 3.0], [1.0, 9.0], [10.0, 0.0]])
    centers = margin_initial_centers(original, projected, np.array([1.0, 3.0, 1.0]), rough)
    np.testing.assert_allclose(centers[0], [0.75, 7.5])


def test_margin_rule_falls_back_to_the_cell_when_no_point_is_kept():
    rough = np.array([[0.0], [2.0]])
    projected = np.array([[0.9], [1.2], [10.0]])
    centers = margin_initial_centers(projected, projected, np.ones(3), rough)
    np.testing.assert_allclose(centers, [[0.9], [5.6]])


@pytest.mark.parametrize("n", [1, 2, 3])
def test_device_with_at_most_k_rows_sends_its_rows(n):
    x = np.arange(n * 2, dtype=float).reshape(n, 2)
    result = local_step(x, 3, device_rng(0, 0))
    np.testing.assert_array_equal(result.centers, x)
    np.testing.assert_array_equal(result.counts, np.ones(n))
    np.testing.assert_array_equal(result.sse, np.zeros(n))


def test_device_with_few_distinct_rows_sends_them_with_multiplicities():
    x = np.array([[1.0, 1.0]] * 5 + [[2.0, 0.0]] * 3)
    result = local_step(x, 4, device_rng(0, 0))
    np.testing.assert_array_equal(result.centers, [[1.0, 1.0], [2.0, 0.0]])
    np.testing.assert_array_equal(result.counts, [5, 3])


def test_fewer_dimensions_than_local_clusters():
    rng = np.random.default_rng(2)
    means = np.array([[0.0, 0.0], [20.0, 0.0], [0.0, 20.0], [20.0, 20.0], [40.0, 40.0]])
    x, truth = blobs(rng, means, 500)
    result = local_step(x, 5, device_rng(0, 0))
    assert len(result.centers) == 5
    assert adjusted_rand_score(truth, nearest_center(x, result.centers)[0]) == 1.0


def test_randomized_svd_path_for_wide_devices():
    rng = np.random.default_rng(3)
    means = rng.normal(0, 3, size=(4, 600))
    x, truth = blobs(rng, means, 200)
    result = local_step(x, 4, device_rng(0, 0))
    assert adjusted_rand_score(truth, nearest_center(x, result.centers)[0]) == 1.0


def test_local_step_is_deterministic_and_ignores_row_order():
    rng = np.random.default_rng(4)
    x, _ = blobs(rng, rng.normal(0, 1.5, size=(5, 6)), 400)  # overlapping: the draws matter
    first = local_step(x, 5, device_rng(9, "dev"))
    again = local_step(x, 5, device_rng(9, "dev"))
    shuffled = local_step(x[rng.permutation(len(x))], 5, device_rng(9, "dev"))
    for other in (again, shuffled):
        np.testing.assert_array_equal(first.centers, other.centers)
        np.testing.assert_array_equal(first.counts, other.counts)


def test_kmeans_plusplus_picks_one_seed_per_separated_blob():
    rng = np.random.default_rng(5)
    x, truth = blobs(rng, rng.normal(0, 50, size=(8, 3)), 800)
    for seed in range(20):
        chosen = kmeans_plusplus(x, np.ones(len(x)), 8, np.random.default_rng(seed))
        assert sorted(truth[chosen]) == list(range(8))


def farthest_first_reference(centers, seed_rows, k):
    chosen = list(seed_rows)
    while len(chosen) < k:
        to_set = squared_distances(centers, centers[chosen]).min(axis=1)
        chosen.append(int(np.argmax(to_set)))
    return centers[chosen]


def test_server_seeds_from_the_device_with_most_centers_then_farthest_points():
    rng = np.random.default_rng(6)
    centers = rng.normal(size=(9, 3))
    devices = np.array([4, 4, 2, 2, 2, 7, 7, 7, 9])
    local_ids = np.array([0, 1, 0, 1, 2, 0, 1, 2, 0])
    result = server_step(centers, np.ones(9), devices, local_ids, 5, refine="none")
    assert result.seed_device == 2  # devices 2 and 7 have 3 centers; 2 is the smaller id
    np.testing.assert_array_equal(result.centers, farthest_first_reference(centers, [2, 3, 4], 5))


def test_server_step_does_not_depend_on_device_order():
    rng = np.random.default_rng(7)
    centers = rng.normal(size=(40, 4))
    counts = rng.integers(1, 50, size=40)
    devices = np.repeat(np.array(["a", "b", "c", "d", "e", "f", "g", "h"]), 5)
    local_ids = np.tile(np.arange(5), 8)
    first = server_step(centers, counts, devices, local_ids, 6)
    order = rng.permutation(40)
    permuted = server_step(centers[order], counts[order], devices[order], local_ids[order], 6)
    np.testing.assert_array_equal(first.centers, permuted.centers)
    np.testing.assert_array_equal(first.assignment[order], permuted.assignment)


def test_server_refinement_weights_local_centers_by_point_count():
    centers = np.array([[0.0], [1.0], [10.0]])
    result = server_step(centers, np.array([100, 1, 1]), np.array([0, 1, 2]), np.zeros(3), 2, refine="lloyd")
    np.testing.assert_allclose(np.sort(result.centers[:, 0]), [1.0 / 101.0, 10.0])
    np.testing.assert_array_equal(result.assignment[0], result.assignment[1])


def test_server_step_rejects_k_above_distinct_local_centers():
    centers = np.array([[0.0], [0.0], [1.0]])
    with pytest.raises(ValueError, match="k = 3 is more than the 2 distinct local centers"):
        server_step(centers, np.ones(3), np.array([0, 1, 2]), np.zeros(3), 3)
    # Equal centers whose BLAS-form distance leaves rounding residue are still duplicates.
    rng = np.random.default_rng(10)
    distinct = rng.normal(size=(5, 16)) * 1e3
    centers = np.concatenate([distinct, distinct[::-1]])
    with pytest.raises(ValueError, match="k = 6 is more than the 5 distinct local centers"):
        server_step(centers, np.ones(10), np.arange(10), np.zeros(10), 6)


def test_nearest_device_center_uses_each_rows_own_device():
    device_centers = np.array([[[0.0], [10.0]], [[5.0], [0.0]]])
    valid = np.array([[True, True], [True, False]])
    x = np.array([[9.0], [9.0], [-1.0]])
    labels, dist = nearest_device_center(x, np.array([0, 1, 1]), device_centers, valid)
    np.testing.assert_array_equal(labels, [1, 0, 0])
    np.testing.assert_allclose(dist, [1.0, 16.0, 36.0])


def test_adjusted_rand_index_matches_scikit_learn():
    rng = np.random.default_rng(8)
    truth, labels = rng.integers(0, 5, 300), rng.integers(0, 4, 300)
    assert adjusted_rand_index(truth, labels) == pytest.approx(adjusted_rand_score(truth, labels))
    assert adjusted_rand_index(truth, (truth + 1) % 5) == pytest.approx(1.0)


def test_within_cluster_cost_from_moments():
    rng = np.random.default_rng(9)
    x, truth = rng.normal(size=(200, 3)), rng.integers(0, 4, 200)
    counts = np.bincount(truth)
    sums = np.stack([x[truth == j].sum(axis=0) for j in range(4)])
    squared_norms = np.bincount(truth, weights=(x**2).sum(axis=1))
    expected = sum(((x[truth == j] - x[truth == j].mean(axis=0)) ** 2).sum() for j in range(4))
    assert within_cluster_cost(counts, sums, squared_norms) == pytest.approx(expected)


def test_scale_counts_keeps_proportions_and_the_total():
    np.testing.assert_array_equal(scale_counts(np.array([30, 30, 40]), 1000), [300, 300, 400])
    scaled = scale_counts(np.array([1, 1, 1]), 100)
    assert scaled.sum() == 100 and sorted(scaled) == [33, 33, 34]
