"""The numeric core, without Spark."""

import dataclasses

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from kfed_spark.bench.synthetic import close_means_mixture
from kfed_spark.core import labels as labels_module
from kfed_spark.core import local_step as local_step_module
from kfed_spark.core import server_step as server_step_module
from kfed_spark.core.labels import nearest_device_center, squared_norms
from kfed_spark.core.linalg import (
    centered,
    device_normals,
    device_rng,
    device_uniforms,
    distinct_rows,
    kmeans_plusplus,
    lloyd,
    nearest_center,
    noise_normals,
    noise_rng,
    squared_distances,
)
from kfed_spark.core.local_centers import feature_matrix
from kfed_spark.core.local_step import device_local_step, estimate_local_k, estimated_ks, local_steps
from kfed_spark.core.metrics import adjusted_rand_index, within_cluster_cost
from kfed_spark.core.reference import federated_kmeans, local_clusterings
from kfed_spark.core.sampling import scale_counts
from kfed_spark.core.server_step import server_step
from kfed_spark.params import AlgorithmParams

pytestmark = pytest.mark.fast


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


@pytest.mark.parametrize("seed", [0, 7, 2**32 + 5, 2**63 - 1])
def test_device_uniforms_are_each_devices_own_generator_draws(seed):
    """The block kernels' draws, made for all their devices at once, are bit for bit each device's own
    device_rng draws (uniform and normal), and its noise_rng draws under a noise key: integer ids of every size
    and sign (one 32-bit entropy word or two), and text ids."""
    noise_key = (seed * 0x9E3779B97F4A7C15 + 3) % 2**128
    rng = np.random.default_rng(3)
    edges = [0, 1, -1, 2**32 - 1, 2**32, -(2**63), 2**63 - 1]
    integers = np.concatenate([np.arange(-3, 40), rng.integers(-(2**63), 2**63 - 1, 300), edges]).astype(np.int64)
    texts = np.array([f"phone-{i}" for i in range(30)] + ["", "5"], dtype=object)
    for ids in (integers, integers[:50].astype(np.int32), texts, texts.astype(str)):
        expected = np.stack([device_rng(seed, device).random(90) for device in ids.tolist()])
        np.testing.assert_array_equal(device_uniforms(seed, ids, 90), expected)
        expected = np.stack([device_rng(seed, device).standard_normal(70) for device in ids.tolist()])
        np.testing.assert_array_equal(device_normals(seed, ids, 70), expected)
        expected = np.stack([noise_rng(noise_key, device).standard_normal(70) for device in ids.tolist()])
        np.testing.assert_array_equal(noise_normals(noise_key, ids, 70), expected)


def test_local_step_recovers_planted_clusters():
    rng = np.random.default_rng(1)
    means = rng.normal(0, 5, size=(6, 20))
    x, truth = blobs(rng, means, 900)
    result = device_local_step(x, 6, 1, AlgorithmParams())
    labels, _ = nearest_center(x, result.centers)
    assert adjusted_rand_score(truth, labels) == 1.0
    assert result.counts.sum() == 900
    planted = np.array([x[truth == j].mean(axis=0) for j in range(6)])
    order = nearest_center(planted, result.centers)[0]
    np.testing.assert_allclose(result.centers[order], planted, atol=1e-9)
    expected_sse = sum(((x[truth == j] - planted[j]) ** 2).sum() for j in range(6))
    assert result.sse.sum() == pytest.approx(expected_sse)


def margin_initial_centers(original, projected, weights, rough):
    """The margin rule on one device: the block kernel with a block of one."""
    one = lambda a: np.asarray(a, dtype=np.float64)[None]  # noqa: E731
    valid, present = np.ones((1, len(original)), dtype=bool), np.ones((1, len(rough)), dtype=bool)
    return local_step_module._margin_initial_centers(
        one(original), one(projected), one(weights), valid, one(rough), present
    )[0]


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
    result = device_local_step(x, 3, 0, AlgorithmParams())
    np.testing.assert_array_equal(result.centers, x)
    np.testing.assert_array_equal(result.counts, np.ones(n))
    np.testing.assert_array_equal(result.sse, np.zeros(n))


def test_device_with_few_distinct_rows_sends_them_with_multiplicities():
    x = np.array([[1.0, 1.0]] * 5 + [[2.0, 0.0]] * 3)
    result = device_local_step(x, 4, 0, AlgorithmParams())
    np.testing.assert_array_equal(result.centers, [[1.0, 1.0], [2.0, 0.0]])
    np.testing.assert_array_equal(result.counts, [5, 3])


@pytest.mark.parametrize("first_owner", [0, 1 << 16])
@pytest.mark.parametrize("rows", ["continuous", "duplicated", "first_value_tied", "mostly_tied"])
def test_distinct_rows_are_each_owners_np_unique(rows, first_owner):
    """distinct_rows per owner is np.unique(axis=0, return_counts=True) whichever of its paths it takes:
    no tie on (owner, first value), some ties (whole rows equal or not), or most rows tied; owners that fit
    16 bits (sorted by value, then radix-sorted by owner) or not (np.lexsort)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(600, 3))
    if rows == "duplicated":
        x[300:400] = x[:100]
    elif rows == "first_value_tied":
        x[::4, 0] = 0.5
        x[1::8] = x[::8]
    elif rows == "mostly_tied":
        x[:, 0] = np.round(x[:, 0])
        x[::3] = x[1::3]
    owner = first_owner + rng.integers(0, 7, size=len(x))
    distinct, counts, owned = distinct_rows(x, owner)
    for device in range(first_owner, first_owner + 7):
        expected, expected_counts = np.unique(x[owner == device], axis=0, return_counts=True)
        np.testing.assert_array_equal(distinct[owned == device], expected)
        np.testing.assert_array_equal(counts[owned == device], expected_counts)
    assert np.all(np.diff(owned) >= 0)


def test_fewer_dimensions_than_local_clusters():
    rng = np.random.default_rng(2)
    means = np.array([[0.0, 0.0], [20.0, 0.0], [0.0, 20.0], [20.0, 20.0], [40.0, 40.0]])
    x, truth = blobs(rng, means, 500)
    result = device_local_step(x, 5, 0, AlgorithmParams())
    assert len(result.centers) == 5
    assert adjusted_rand_score(truth, nearest_center(x, result.centers)[0]) == 1.0


def test_randomized_svd_path_for_wide_devices():
    rng = np.random.default_rng(3)
    means = rng.normal(0, 3, size=(4, 600))
    x, truth = blobs(rng, means, 200)
    result = device_local_step(x, 4, 0, AlgorithmParams())
    assert adjusted_rand_score(truth, nearest_center(x, result.centers)[0]) == 1.0


def test_local_step_is_deterministic_and_ignores_row_order():
    rng = np.random.default_rng(4)
    x, _ = blobs(rng, rng.normal(0, 1.5, size=(5, 6)), 400)  # overlapping: the draws matter
    first = device_local_step(x, 5, "dev", AlgorithmParams(seed=9))
    again = device_local_step(x, 5, "dev", AlgorithmParams(seed=9))
    shuffled = device_local_step(x[rng.permutation(len(x))], 5, "dev", AlgorithmParams(seed=9))
    for other in (again, shuffled):
        np.testing.assert_array_equal(first.centers, other.centers)
        np.testing.assert_array_equal(first.counts, other.counts)


def rows_of_a_block(*sizes):
    """valid (B, P) of a block of devices of these sizes, which pad to one row count P as _blocks groups them."""
    width = set(local_step_module.padded_rows(np.array(sizes)))
    assert len(width) == 1
    return np.arange(width.pop())[None, :] < np.array(sizes)[:, None]


def test_a_large_devices_rough_clustering_takes_evenly_spaced_rows_of_its_own():
    sizes = (320, 300, 290)
    block, rows = local_step_module._rough_rows(rows_of_a_block(*sizes), 2)  # max(ROUGH_ROWS, 32 k): 256
    np.testing.assert_array_equal(block[:, 0], [0, 1, 2])
    assert rows.shape == (3, 256)
    for i, n in enumerate(sizes):
        gaps = np.diff(rows[i])
        assert rows[i, 0] == 0 and rows[i, -1] < n  # its own rows only, from the first
        assert gaps.min() >= 1 and gaps.max() - gaps.min() <= 1  # distinct and evenly spaced
    assert local_step_module._rough_rows(rows_of_a_block(256, 250), 2) == slice(None)
    assert local_step_module._rough_rows(rows_of_a_block(*sizes), 10) == slice(None)  # 32 rows a center: 320
    assert local_step_module._rough_rows(rows_of_a_block(640), 16)[1].shape == (1, 512)


def test_a_large_device_finds_a_small_separated_cluster_its_rough_sample_barely_holds():
    """3,000 rows of 8 clusters, one of 45 rows: about 4 of them are among the rough clustering's 256."""
    rng = np.random.default_rng(12)
    means = rng.normal(0, 6, size=(8, 16))
    sizes = [45] + [422] * 6 + [3000 - 45 - 6 * 422]
    truth = np.repeat(np.arange(8), sizes)
    x = means[truth] + rng.standard_normal((3000, 16))
    for seed in range(5):
        result = device_local_step(x, 8, "phone", AlgorithmParams(seed=seed))
        assert adjusted_rand_score(truth, nearest_center(x, result.centers)[0]) == 1.0
        assert sorted(result.counts)[0] == 45


def draws_for(device, k, restarts):
    """The uniform draws a device's rough clusterings take (after none for its projection, d < 512)."""
    return device_rng(1, device).random((restarts, 1 + (2 + int(np.log(k))) * (k - 1)))


@pytest.mark.parametrize("rows, k, restarts", [(500, 8, 3), (60, 7, 5), (40, 2, 1)])
def test_restarts_side_by_side_choose_what_one_after_the_other_does(rows, k, restarts):
    """The rough clusterings of a block of devices, restarts side by side, take the same draws and
    reach the same centers and costs as kmeans_plusplus and Lloyd run one restart and one device after
    the other (up to floating-point rounding), with weights from duplicated rows and padded devices."""
    rng = np.random.default_rng(rows)
    devices = []
    for size in (rows, rows // 2 + k):
        x, _ = blobs(rng, rng.normal(0, 3, size=(k, 5)), size)
        devices.append((centered(x)[0], rng.integers(1, 4, size=size).astype(np.float64)))
    x = np.zeros((2, rows, 5))
    weights, valid = np.zeros((2, rows)), np.zeros((2, rows), dtype=bool)
    for i, (rows_i, weights_i) in enumerate(devices):
        x[i, : len(rows_i)], weights[i, : len(rows_i)], valid[i, : len(rows_i)] = rows_i, weights_i, True
    draws = np.stack([draws_for(i, k, restarts) for i in range(2)])
    centers, costs, ran_out = local_step_module._rough_clusterings(x, weights, valid, k, draws)
    assert not ran_out.any()
    for i, (rows_i, weights_i) in enumerate(devices):
        for r in range(restarts):
            found, cost = local_step_module._sequential_rough_clustering(
                rows_i, weights_i, k, local_step_module._Draws(draws[i, r])
            )
            np.testing.assert_allclose(centers[i, r], found, rtol=1e-9, atol=1e-12)
            assert costs[i, r] == pytest.approx(cost, rel=1e-9)


def test_rough_clusterings_of_rows_that_run_out_of_distinct_points_fall_back_to_one_by_one():
    x = np.repeat(np.array([[0.0, 0.0], [5.0, 5.0]]), 20, axis=0)[None]  # two distinct points for k = 3
    weights, valid, draws = np.ones((1, 40)), np.ones((1, 40), dtype=bool), draws_for(0, 3, 2)[None]
    assert local_step_module._rough_clusterings(x - 2.5, weights, valid, 3, draws)[2].all()
    rough, present = local_step_module._rough_centers(x, weights, valid, 3, draws)
    np.testing.assert_array_equal(np.sort(rough[0][present[0]], axis=0), [[0.0, 0.0], [5.0, 5.0]])


@pytest.mark.parametrize("private", [False, True])
def test_a_device_finds_the_same_local_centers_alone_and_among_others(monkeypatch, private):
    """A device's result does not depend on which devices share its block or its pass over the rows: the
    same draws, the same padding, the same floating-point operations; and it is what the kernel finds one
    device at a time. So for the private local step, whose noise comes from the noise key and the device."""
    table = close_means_mixture(0, devices=40, rows=(5, 300))
    x = feature_matrix(table.column("features"))
    devices = table.column("device_id").to_numpy()
    assert np.bincount(devices).max() > local_step_module.ROUGH_ROWS  # some rough clusterings take a sample
    params = AlgorithmParams(k=49, k_per_device=7)
    if private:
        params = dataclasses.replace(params, privacy_epsilon=3.0, privacy_bounds=(float(x.min()), float(x.max())))
    starts = np.append(np.flatnonzero(np.diff(devices, prepend=-1)), len(devices))
    keys = devices[starts[:-1]]
    together = local_steps(x, starts, keys, np.full(len(keys), 7), params, noise_key=11)
    for i, key in enumerate(keys):
        alone = device_local_step(x[starts[i] : starts[i + 1]], 7, key, params, noise_key=11)
        mine = together.of_device(i)
        np.testing.assert_array_equal(mine.centers, alone.centers)
        np.testing.assert_array_equal(mine.counts, alone.counts)
        np.testing.assert_array_equal(mine.sse, alone.sse)
    monkeypatch.setattr(local_step_module, "ROWS_PER_PASS", 1000)  # passes of a few devices each
    in_passes = local_steps(x, starts, keys, np.full(len(keys), 7), params, noise_key=11)
    for name in ("owner", "centers", "counts", "sse"):
        np.testing.assert_array_equal(getattr(in_passes, name), getattr(together, name))
    monkeypatch.undo()
    uneven = np.full(len(keys), 7)
    uneven[::3] = 3  # devices of other k in the same call: other blocks, the same results
    mixed = local_steps(x, starts, keys, uneven, params, noise_key=11)
    for i in range(1, len(keys), 3):
        np.testing.assert_array_equal(mixed.of_device(i).centers, together.of_device(i).centers)


@pytest.mark.parametrize("device", [2, 8])
def test_local_restarts_keep_the_cheapest_rough_clustering_and_split_merged_close_clusters(device):
    """Two devices of the close-means mixture whose one rough clustering merges two clusters."""
    table = close_means_mixture(0)
    mine = table.column("device_id").to_numpy() == device
    x = feature_matrix(table.column("features"))[mine]
    truth = table.column("true_cluster").to_numpy()[mine]
    ari = {}
    for restarts in (1, 3):
        result = device_local_step(x, 7, device, AlgorithmParams(local_restarts=restarts))
        ari[restarts] = adjusted_rand_index(truth, nearest_center(x, result.centers)[0])
    assert ari[1] < 0.9 and ari[3] > 0.99
    one = lambda a: a[None]  # noqa: E731
    costs = [
        nearest_center(
            x,
            local_step_module._rough_centers(
                one(x), np.ones((1, len(x))), np.ones((1, len(x)), dtype=bool), 7, one(draws_for(device, 7, restarts))
            )[0][0],
        )[1].sum()
        for restarts in (1, 3, 10)
    ]
    assert costs[0] >= costs[1] >= costs[2]  # the first draws are shared: more restarts never cost more


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
    result = server_step(
        centers, np.ones(9), devices, local_ids, AlgorithmParams(k=5, seeding="farthest", server_refine="none")
    )
    assert result.seed_device == 2  # devices 2 and 7 have 3 centers; 2 is the smaller id
    np.testing.assert_array_equal(result.centers, farthest_first_reference(centers, [2, 3, 4], 5))


def test_server_step_does_not_depend_on_device_order():
    rng = np.random.default_rng(7)
    centers = rng.normal(size=(40, 4))
    counts = rng.integers(1, 50, size=40)
    devices = np.repeat(np.array(["a", "b", "c", "d", "e", "f", "g", "h"]), 5)
    local_ids = np.tile(np.arange(5), 8)
    first = server_step(centers, counts, devices, local_ids, AlgorithmParams(k=6))
    order = rng.permutation(40)
    permuted = server_step(centers[order], counts[order], devices[order], local_ids[order], AlgorithmParams(k=6))
    np.testing.assert_array_equal(first.centers, permuted.centers)
    np.testing.assert_array_equal(first.assignment[order], permuted.assignment)


def test_server_refinement_weights_local_centers_by_point_count():
    centers = np.array([[0.0], [1.0], [10.0]])
    result = server_step(
        centers, np.array([100, 1, 1]), np.array([0, 1, 2]), np.zeros(3), AlgorithmParams(k=2, server_refine="lloyd")
    )
    np.testing.assert_allclose(np.sort(result.centers[:, 0]), [1.0 / 101.0, 10.0])
    np.testing.assert_array_equal(result.assignment[0], result.assignment[1])


@pytest.mark.parametrize("seeding", ["farthest", "kmeanspp"])
def test_server_step_rejects_k_above_distinct_local_centers(seeding):
    centers = np.array([[0.0], [0.0], [1.0]])
    with pytest.raises(ValueError, match="k = 3 is more than the 2 distinct local centers"):
        server_step(centers, np.ones(3), np.array([0, 1, 2]), np.zeros(3), AlgorithmParams(k=3, seeding=seeding))
    # Equal centers whose BLAS-form distance leaves rounding residue are still duplicates.
    rng = np.random.default_rng(10)
    distinct = rng.normal(size=(5, 16)) * 1e3
    centers = np.concatenate([distinct, distinct[::-1]])
    with pytest.raises(ValueError, match="k = 6 is more than the 5 distinct local centers"):
        server_step(centers, np.ones(10), np.arange(10), np.zeros(10), AlgorithmParams(k=6, seeding=seeding))
    # Far from the origin, centers a unit apart are still distinct: the count agrees with np.unique's.
    far = np.concatenate([distinct, distinct[::-1]]) / 1e3 + 1e9
    assert len(np.unique(far, axis=0)) == 5
    with pytest.raises(ValueError, match="k = 6 is more than the 5 distinct local centers"):
        server_step(far, np.ones(10), np.arange(10), np.zeros(10), AlgorithmParams(k=6, seeding=seeding))
    assert (
        len(
            np.unique(
                server_step(
                    far, np.ones(10), np.arange(10), np.zeros(10), AlgorithmParams(k=5, seeding=seeding)
                ).assignment
            )
        )
        == 5
    )


def test_pruned_farthest_point_search_equals_the_plain_one():
    rng = np.random.default_rng(11)
    x, _ = blobs(rng, rng.normal(0, 20, size=(80, 6)), 4000)
    devices, local_ids = np.arange(len(x)) // 4, np.arange(len(x)) % 4
    result = server_step(
        x, np.ones(len(x)), devices, local_ids, AlgorithmParams(k=120, seeding="farthest", server_refine="none")
    )
    np.testing.assert_array_equal(result.centers, farthest_first_reference(x, [0, 1, 2, 3], 120))


def outlier_setting(rng):
    """Local centers of 30 devices, each on 3 of 6 clusters, plus 10 one-point devices far out."""
    means = rng.normal(0, 30, size=(6, 5))
    truth = np.concatenate([rng.choice(6, size=3, replace=False) for _ in range(30)])
    x = means[truth] + rng.standard_normal((len(truth), 5))
    stray = rng.normal(0, 1, size=(10, 5)) + 150.0 * rng.choice([-1, 1], size=(10, 5))
    centers = np.concatenate([x, stray])
    counts = np.concatenate([np.full(len(x), 50), np.ones(10, dtype=int)])
    devices = np.concatenate([np.arange(len(x)) // 3, 100 + np.arange(10)])
    local_ids = np.concatenate([np.arange(len(x)) % 3, np.zeros(10, dtype=int)])
    return centers, counts, devices, local_ids, truth


@pytest.mark.parametrize("seeding", ["farthest", "kmeanspp"])
def test_the_outlier_filter_ignores_small_outlying_centers_that_seeding_picks(seeding):
    centers, counts, devices, local_ids, truth = outlier_setting(np.random.default_rng(12))
    inliers = slice(0, len(truth))
    filtered = server_step(centers, counts, devices, local_ids, AlgorithmParams(k=6, seeding=seeding))
    assert adjusted_rand_index(truth, filtered.assignment[inliers]) == pytest.approx(1.0)
    assert len(filtered.assignment) == len(centers)  # the small centers are still assigned
    if seeding == "farthest":  # unfiltered, each far one-point center becomes a seed
        unfiltered = server_step(
            centers, counts, devices, local_ids, AlgorithmParams(k=6, seeding=seeding, robust_min_size=0)
        )
        assert adjusted_rand_index(truth, unfiltered.assignment[inliers]) < 0.8


def test_robust_is_the_older_name_of_farthest_point_seeding():
    centers, counts, devices, local_ids, _ = outlier_setting(np.random.default_rng(12))
    older = server_step(centers, counts, devices, local_ids, AlgorithmParams(k=6, seeding="robust"))
    farthest = server_step(centers, counts, devices, local_ids, AlgorithmParams(k=6, seeding="farthest"))
    np.testing.assert_array_equal(older.centers, farthest.centers)


def test_kmeanspp_seeds_on_a_sample_when_the_local_centers_are_many(monkeypatch):
    rng = np.random.default_rng(14)
    means = rng.normal(0, 30, size=(8, 4))
    x, truth = blobs(rng, means, 2000)
    devices, local_ids = np.arange(2000) // 4, np.arange(2000) % 4
    params = AlgorithmParams(k=8, seeding="kmeanspp", seed=3)
    monkeypatch.setattr(server_step_module, "KMEANSPP_SAMPLE_PER_CLUSTER", 4)  # 32 of the 2000 centers
    sampled = server_step(x, np.ones(2000), devices, local_ids, params)
    assert adjusted_rand_index(truth, sampled.assignment) == pytest.approx(1.0)
    np.testing.assert_array_equal(sampled.centers, server_step(x, np.ones(2000), devices, local_ids, params).centers)


def test_kmeanspp_seeding_is_seeded_and_finds_the_clusters():
    rng = np.random.default_rng(13)
    means = rng.normal(0, 30, size=(8, 4))
    x, truth = blobs(rng, means, 400)
    devices, local_ids = np.arange(400) // 4, np.arange(400) % 4
    first = server_step(x, np.ones(400), devices, local_ids, AlgorithmParams(k=8, seeding="kmeanspp", seed=3))
    again = server_step(x, np.ones(400), devices, local_ids, AlgorithmParams(k=8, seeding="kmeanspp", seed=3))
    np.testing.assert_array_equal(first.centers, again.centers)
    assert adjusted_rand_index(truth, first.assignment) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="seeding must be one of"):
        server_step(x, np.ones(400), devices, local_ids, AlgorithmParams(k=8, seeding="best"))


@pytest.mark.parametrize("clusters", [1, 2, 3, 5, 8])
def test_local_k_estimate_counts_the_clusters_a_device_holds(clusters):
    rng = np.random.default_rng(clusters)
    x, _ = blobs(rng, rng.normal(0, 4, size=(clusters, 32)), 400)
    assert estimate_local_k(x, k_max=10) == clusters
    assert estimate_local_k(x, k_max=2) == min(clusters, 2)


def test_local_k_estimates_of_many_devices_are_each_devices_own():
    """Devices estimated together (those of equal distinct-row counts in one group) get what each gets alone,
    in any order: small devices with duplicate rows, devices of 1 and 2 distinct rows, and large ones."""
    rng = np.random.default_rng(11)
    parts = []
    for size in [10] * 40 + [3, 1, 2, 2, 300, 57, 10, 4] * 5:
        clusters = int(rng.integers(1, 5))
        x, _ = blobs(rng, rng.normal(0, 4, size=(clusters, 6)), size)
        parts.append(np.repeat(x[: max(1, size // 2)], 2, axis=0)[:size] if rng.random() < 0.3 else x)
    alone = [estimate_local_k(x, k_max=5) for x in parts]
    assert len(set(alone)) > 2
    for order in (np.arange(len(parts)), rng.permutation(len(parts))):
        x = np.concatenate([parts[i] for i in order])
        starts = np.concatenate([[0], np.cumsum([len(parts[i]) for i in order])])
        np.testing.assert_array_equal(estimated_ks(x, starts, 5), np.array(alone)[order])


def test_local_k_estimate_of_tiny_devices():
    assert estimate_local_k(np.ones((5, 3)), k_max=4) == 1
    assert estimate_local_k(np.array([[0.0, 1.0], [2.0, 3.0]]), k_max=4) == 2


def test_nearest_device_center_uses_each_rows_own_device():
    device_centers = np.array([[[0.0], [10.0]], [[5.0], [0.0]]])
    valid = np.array([[True, True], [True, False]])
    x = np.array([[9.0], [9.0], [-1.0]])
    labels, dist = nearest_device_center(x, np.array([0, 1, 1]), device_centers, valid, squared_norms(device_centers))
    np.testing.assert_array_equal(labels, [1, 0, 0])
    np.testing.assert_allclose(dist, [1.0, 16.0, 36.0])


def test_nearest_device_center_sums_the_same_device_by_device_as_row_by_row(monkeypatch):
    """Rows of devices that hold many rows of a batch are multiplied device by device (a slice per run of one
    device's rows where they arrive grouped, else gathered), others row by row against a copy of their
    device's centers: the same floating-point sums, so a row's local center and distance do not depend on
    which rows share its batch nor on their order."""
    rng = np.random.default_rng(10)
    device_centers = rng.normal(size=(30, 8, 32)) * 10.0
    valid = rng.random((30, 8)) < 0.9
    valid[:, 0] = True
    slots = rng.permutation(np.repeat(np.arange(30), 200))  # devices of 200 rows each, in no order
    x = device_centers[slots, rng.integers(0, 8, len(slots))] + rng.normal(size=(len(slots), 32))
    center_sq = squared_norms(device_centers)
    grouped = np.argsort(slots, kind="stable")
    by_device = nearest_device_center(x, slots, device_centers, valid, center_sq)
    by_run = nearest_device_center(x[grouped], slots[grouped], device_centers, valid, center_sq)
    monkeypatch.setattr(labels_module, "ROWS_PER_DEVICE_PRODUCT", len(x) + 1)
    by_row = nearest_device_center(x, slots, device_centers, valid, center_sq)
    for label_or_distance in (0, 1):
        np.testing.assert_array_equal(by_device[label_or_distance], by_row[label_or_distance])
        np.testing.assert_array_equal(by_run[label_or_distance], by_row[label_or_distance][grouped])


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


def test_nmi_accuracy_and_silhouette_match_scikit_learn():
    from sklearn.metrics import normalized_mutual_info_score, silhouette_score

    from kfed_spark.core.metrics import contingency, matched_accuracy_of, nmi_of, silhouette

    rng = np.random.default_rng(9)
    truth, labels, x = rng.integers(0, 4, 400), rng.integers(0, 6, 400), rng.normal(size=(400, 5))
    assert nmi_of(contingency(truth, labels)) == pytest.approx(normalized_mutual_info_score(truth, labels))
    assert silhouette(x, labels) == pytest.approx(silhouette_score(x, labels))
    assert matched_accuracy_of(contingency(truth, (truth + 2) % 4)) == pytest.approx(1.0)
    # Class 0: 3 rows in cluster 0, 1 in cluster 1; class 1: 1 row in cluster 0. Best: 0 -> 0, 1 -> 1: 3 of 5.
    assert matched_accuracy_of(contingency([0, 0, 0, 0, 1], [0, 0, 0, 1, 0])) == pytest.approx(0.6)


def test_row_hashes_depend_on_values_and_seed_only():
    from kfed_spark.core.sampling import row_hashes, smallest_hashes

    rng = np.random.default_rng(14)
    x = rng.normal(size=(500, 6))
    order = rng.permutation(500)
    np.testing.assert_array_equal(row_hashes(x, 3)[order], row_hashes(x[order], 3))
    assert len(np.unique(row_hashes(x, 3))) == 500
    assert not np.array_equal(row_hashes(x, 3), row_hashes(x, 4))
    kept, _ = smallest_hashes(x, row_hashes(x, 3), 50)
    again, _ = smallest_hashes(x[order], row_hashes(x[order], 3), 50)
    assert {tuple(r) for r in kept} == {tuple(r) for r in again}


def test_lloyd_stops_where_it_would_on_the_data_shifted_far_from_the_origin():
    """Sensor and price data sit far from 0: tol is relative to the spread of the data, not its norm."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(500, 32)) + rng.normal(scale=3.0, size=(8, 32))[rng.integers(0, 8, 500)]
    weights = np.ones(len(x))
    start = x[rng.choice(len(x), 8, replace=False)]
    centers, labels, sq_dist, rounds = lloyd(x, weights, start, max_iter=300, tol=1e-4)
    shifted = lloyd(x + 1e6, weights, start + 1e6, max_iter=300, tol=1e-4)
    assert rounds > 2 and shifted[3] == rounds
    np.testing.assert_array_equal(shifted[1], labels)
    assert shifted[2].sum() == pytest.approx(sq_dist.sum(), rel=1e-3)  # |x|^2 - 2xc + |c|^2 at 1e6 loses digits


def test_max_iter_bounds_the_server_step_too():
    """The parameter table: max_iter is the most Lloyd rounds "on each device and on the server"."""
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.normal(loc=c, size=(60, 4)) for c in (0.0, 2.0, 4.0, 6.0)])
    devices = np.repeat(np.arange(12), 20)
    for max_iter in (1, 2):
        params = AlgorithmParams(k=4, k_per_device=4, seed=0, max_iter=max_iter, tol=0.0)
        result = federated_kmeans(x, devices, params)
        assert result.server.refine_iterations <= max_iter


def test_no_local_center_of_fewer_than_min_center_points_rows_leaves_its_device():
    """A far row of its own on a device, a device of one row and one of two distinct rows: none of their
    centers is shared; every row still gets a global cluster, a held-back row (on a device with shared
    centers or none) the nearest global center and no local cluster (-1)."""
    rng = np.random.default_rng(7)
    means = np.array([[0.0, 0.0], [20.0, 0.0]])
    big = np.concatenate([means[0] + rng.standard_normal((30, 2)), means[1] + rng.standard_normal((30, 2))])
    lone = np.array([[10.0, 30.0]])  # far from both clusters: the big device's third local cluster, of one row
    x = np.concatenate([big, lone, [[0.5, 0.5]], [[19.0, 1.0], [21.0, -1.0]]])
    devices = np.array([0] * 61 + [1] + [2, 2])
    params = AlgorithmParams(k=2, k_per_device=3, min_center_points=3)
    local = local_clusterings(x, devices, params)
    assert local.counts.min() >= 3 and set(local.devices) == {0} and local.counts.sum() == 60
    result = federated_kmeans(x, devices, params)
    assert len(result.labels) == len(x) and (result.labels >= 0).all()
    assert list(result.local_labels[61:]) == [-1, -1, -1]  # devices 1 and 2 share nothing
    assert result.labels[61] == result.labels[0] and result.labels[62] == result.labels[30]  # nearest global
    assert result.local_labels[60] == -1  # the lone row: held back although its device shares two centers
    nearest = nearest_center(lone, result.server.centers)[0][0]
    assert result.labels[60] == nearest and set(result.local_labels[:60]) == {0, 1}
    assert local.held_back.counts.tolist() == [1, 1, 1, 1] and local.held_back.ids.tolist() == [2, 0, 0, 1]
    everything = local_clusterings(x, devices, AlgorithmParams(k=2, k_per_device=3, min_center_points=1))
    assert everything.counts.min() == 1 and len(everything.counts) == 3 + 1 + 2  # 1 shares what it has
