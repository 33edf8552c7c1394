"""The local step (alg. 1 of Dennis, Li and Smith, ICML 2021) on one device's rows, and the private
local step that takes its place under a privacy budget: numpy, no Spark.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kfed_spark.core.linalg import (
    DUPLICATE_TOLERANCE,
    centered,
    device_rng,
    distinct_rows,
    kmeans_plusplus,
    lloyd,
    lowest_cost,
    nearest_with_norms,
    noise_rng,
    squared_distances,
    top_right_singular_vectors,
    weighted_means,
    weighted_sums,
)
from kfed_spark.core.privacy import NoiseScales
from kfed_spark.params import DEFAULTS, AlgorithmParams

MARGIN = 3.0
"""Alg. 1 keeps a point for a rough center r when it is MARGIN times closer to r than to any other."""


ROUGH_LLOYD_ITERATIONS = 10
"""Lloyd steps after k-means++ in the projection: the analysis only needs a constant-factor start."""


SPLIT_STEP = 1e-6
"""The private local step splits a center by moving its copy this fraction of the box's half-width."""


@dataclass(frozen=True)
class DeviceCenters:
    """What one device shares: its centers, their point counts and sums of squared errors."""

    centers: np.ndarray  # (m, d) float64
    counts: np.ndarray  # (m,) int64
    sse: np.ndarray  # (m,) float64


def margin_initial_centers(x: np.ndarray, projected: np.ndarray, weights: np.ndarray, rough: np.ndarray) -> np.ndarray:
    """Alg. 1's initial centers: for each rough center, the mean of the ORIGINAL rows of the points
    that are at least MARGIN times closer to it than to any other rough center.

    A rough center that keeps no point falls back to the mean of its whole cell.
    """
    k = len(rough)
    dist = np.sqrt(squared_distances(projected, rough))
    labels = np.argmin(dist, axis=1)
    if k > 1:
        nearest_two = np.partition(dist, 1, axis=1)[:, :2]
        kept = MARGIN * nearest_two[:, 0] <= nearest_two[:, 1]
    else:
        kept = np.ones(len(x), dtype=bool)
    margin_means, margin_mass = weighted_means(x[kept], weights[kept], labels[kept], k)
    cell_means, _ = weighted_means(x, weights, labels, k)
    return np.where(margin_mass[:, None] > 0, margin_means, cell_means)


def local_step(x: np.ndarray, k: int, rng: np.random.Generator, params: AlgorithmParams = DEFAULTS) -> DeviceCenters:
    """Alg. 1 on one device's rows x (n, d): at most k local centers with counts and SSE, with
    params' local_restarts, max_iter and tol.

    Rows are deduplicated first (np.unique sorts them), so duplicates cost nothing and the
    result does not depend on the order the rows arrived in. A device with at most k distinct
    rows returns those rows with their multiplicities. The rest works on the centered() rows: the
    projection is on the top singular vectors of the rows around their mean (the paper's uncentered
    rows would give a subspace that depends on where the origin is).
    """
    distinct, counts = distinct_rows(x)
    if len(distinct) <= k:
        return DeviceCenters(distinct, counts.astype(np.int64), np.zeros(len(distinct)))
    weights = counts.astype(np.float64)
    rows, origin = centered(distinct, weights)
    rank = min(k, rows.shape[1])
    projected = rows @ top_right_singular_vectors(rows, weights, rank, rng).T
    rough = rough_centers(projected, weights, k, params.local_restarts, rng)
    initial = margin_initial_centers(rows, projected, weights, rough)
    centers, labels, sq_dist, _ = lloyd(rows, weights, initial, params.max_iter, params.tol)
    mass = np.bincount(labels, weights=weights, minlength=k)
    sse = np.bincount(labels, weights=weights * sq_dist, minlength=k)
    keep = mass > 0
    return DeviceCenters(centers[keep] + origin, mass[keep].astype(np.int64), sse[keep])


def private_local_step(
    x: np.ndarray, k: int, rng: np.random.Generator, noise: np.random.Generator, params: AlgorithmParams
) -> DeviceCenters:
    """The local step in alg. 1's place when privacy_epsilon is set: what it shares is
    (privacy_epsilon, privacy_delta)-differentially private per row (kfed_spark.core.privacy).

    Rows are clipped into the box of privacy_bounds. privacy_rounds noisy Lloyd rounds follow, each
    moving every center to its cluster's noisy sum over its noisy count, clipped into the box; a
    center whose noisy count is under 1 stays where it was and shares a count of 0. The centers
    start as one, at the box's center, and double before each round (split along random directions
    from rng, the run seed's; the heaviest split first) until there are k, all k by the last round:
    bisecting, so that no starting center is placed by looking at the rows. The counts shared are
    the last round's, rounded; the SSE is not shared (NaN).
    """
    if params.privacy_epsilon is None or params.privacy_bounds is None:
        raise ValueError("the private local step needs privacy_epsilon and privacy_bounds")
    low, high = params.privacy_bounds
    middle, half = (low + high) / 2, (high - low) / 2
    rows = np.clip(x, low, high) - middle
    norms = np.einsum("ij,ij->i", rows, rows)
    scales = NoiseScales.of(
        params.privacy_epsilon, params.privacy_delta, params.privacy_rounds, (low, high), x.shape[1]
    )
    centers, counts = np.zeros((1, x.shape[1])), np.zeros(1)
    for round_ in range(params.privacy_rounds):
        wanted = k if round_ == params.privacy_rounds - 1 else min(k, 2**round_)
        centers = _split(centers, counts, wanted, half, rng)
        labels, _ = nearest_with_norms(rows, norms, centers)
        sums, counts = noisy_cluster_sums(rows, labels, len(centers), scales, noise)
        moved = counts >= 1
        centers[moved] = np.clip(sums[moved] / counts[moved, None], -half, half)
    shared_counts = np.where(moved, np.rint(counts), 0).astype(np.int64)
    return DeviceCenters(centers + middle, shared_counts, np.full(len(centers), np.nan))


def noisy_cluster_sums(
    rows: np.ndarray, labels: np.ndarray, k: int, scales: NoiseScales, noise: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """One round's release of the private local step: the (k, d) sums and (k,) counts of the rows by label,
    each with its Gaussian noise (scales: kfed_spark.core.privacy). rows are clipped into the box and taken about
    its center, so one row moves a sum by at most scales.radius."""
    sums, counts = weighted_sums(rows, np.ones(len(rows)), labels, k)
    return sums + noise.normal(0.0, scales.sum_sigma, sums.shape), counts + noise.normal(0.0, scales.count_sigma, k)


def _split(centers: np.ndarray, counts: np.ndarray, wanted: int, half: float, rng: np.random.Generator) -> np.ndarray:
    """centers plus copies of the heaviest ones (by counts, in turn), each moved a hair along a random
    direction, until there are `wanted`: the next assignment cuts each split cluster by a random
    hyperplane through its center."""
    if len(centers) >= wanted:
        return centers
    order = np.argsort(-counts, kind="stable")
    parents = order[np.arange(wanted - len(centers)) % len(centers)]
    directions = rng.standard_normal((len(parents), centers.shape[1]))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return np.concatenate([centers, centers[parents] + SPLIT_STEP * half * directions])


def device_local_step(
    x: np.ndarray, k: int, device: object, params: AlgorithmParams, noise_key: int | None = None
) -> DeviceCenters:
    """One device's local centers, before shared_centers: alg. 1, or with privacy_epsilon set the
    private local step, whose noise comes from noise_key (linalg.noise_rng)."""
    rng = device_rng(params.seed, device)
    if params.privacy_epsilon is None:
        return local_step(x, k, rng, params)
    if noise_key is None:
        raise ValueError("a private local step needs the run's noise key")
    return private_local_step(x, k, rng, noise_rng(noise_key, device), params)


def shared_centers(result: DeviceCenters, min_points: int) -> DeviceCenters:
    """The local centers a device may share: those standing for at least min_points rows. A center of
    fewer is (nearly) the rows themselves; its rows are labelled by the device's nearest shared center,
    or, with none left, as an unseen device's rows are (LabelModel.label_unseen)."""
    keep = result.counts >= min_points
    if keep.all():
        return result
    return DeviceCenters(result.centers[keep], result.counts[keep], result.sse[keep])


def rough_centers(
    projected: np.ndarray, weights: np.ndarray, k: int, restarts: int, rng: np.random.Generator
) -> np.ndarray:
    """The rough clustering of alg. 1: the best of `restarts` greedy k-means++ seedings, each followed
    by ROUGH_LLOYD_ITERATIONS Lloyd rounds, by weighted cost in the projection.

    One rough clustering sometimes merges two close clusters, and every later step inherits it;
    the projection has only k dimensions, so trying several costs little next to the Lloyd
    rounds on the original rows. The restarts run side by side as arrays with a leading restart
    axis (_batched_rough_clusterings): on a device's few hundred rows the numpy calls, not the
    arithmetic, are the cost. Where a seeding runs out of distinct rows they run one after the
    other instead, from the same draws.
    """
    projected, origin = centered(projected, weights)
    state = rng.bit_generator.state
    found: tuple[np.ndarray | list[np.ndarray], np.ndarray | list[float]] | None
    found = _batched_rough_clusterings(projected, weights, k, restarts, rng)
    if found is None:
        rng.bit_generator.state = state
        found = _sequential_rough_clusterings(projected, weights, k, restarts, rng)
    centers, costs = found
    return centers[lowest_cost(list(costs))] + origin


def _sequential_rough_clusterings(
    projected: np.ndarray, weights: np.ndarray, k: int, restarts: int, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[float]]:
    """Each restart's rough centers and cost, one restart after the other."""
    centers, costs = [], []
    for _ in range(restarts):
        seeds = projected[kmeans_plusplus(projected, weights, k, rng)]
        found, _, sq_dist, _ = lloyd(projected, weights, seeds, ROUGH_LLOYD_ITERATIONS, tol=0.0)
        centers.append(found)
        costs.append(float(weights @ sq_dist))
    return centers, costs


def _batched_rough_clusterings(
    x: np.ndarray, weights: np.ndarray, k: int, restarts: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray] | None:
    """_sequential_rough_clusterings with the restarts as a leading array axis: the same draws (each
    restart's from the generator in turn), the same choices up to floating-point rounding. None if
    a seeding runs out of distinct rows (the sequential one then stops early, and this cannot).
    x must be near the origin (centered()).
    """
    n, trials = len(x), 2 + int(np.log(k))
    draws = rng.random((restarts, 1 + trials * (k - 1)))  # restart r's draws, in the order kmeans_plusplus takes them
    norms = np.einsum("ij,ij->i", x, x)
    duplicate_below = DUPLICATE_TOLERANCE * float(np.max(norms))
    rows = np.arange(restarts)
    mass = np.cumsum(weights)
    chosen = np.empty((restarts, k), dtype=np.int64)
    chosen[:, 0] = np.minimum(np.searchsorted(mass, draws[:, 0] * mass[-1], side="right"), n - 1)
    closest = np.maximum(norms[chosen[:, :1]] - 2.0 * (x[chosen[:, 0]] @ x.T) + norms[None, :], 0.0)
    minus_twice_xt = -2.0 * x.T
    running_out = duplicate_below * float(weights.sum())
    for step in range(1, k):
        cumulative = np.cumsum(weights * closest, axis=1)
        # Every row within rounding of a seed (kmeans_plusplus's stop) leaves at most this potential.
        if np.any(cumulative[:, -1] <= running_out):
            return None
        targets = draws[:, 1 + (step - 1) * trials : 1 + step * trials] * cumulative[:, -1:]
        candidates = np.minimum([np.searchsorted(cumulative[r], targets[r], side="right") for r in rows], n - 1)
        candidate_closest = x[candidates] @ minus_twice_xt
        candidate_closest += norms[candidates][:, :, None]
        candidate_closest += norms
        np.maximum(candidate_closest, 0.0, out=candidate_closest)
        np.minimum(candidate_closest, closest[:, None, :], out=candidate_closest)
        best = np.argmin(candidate_closest @ weights, axis=1)
        chosen[:, step] = candidates[rows, best]
        closest = candidate_closest[rows, best]
    centers = x[chosen]  # (restarts, k, p)
    labels, sq_dist = nearest_with_norms(x, norms, centers)
    for _ in range(ROUGH_LLOYD_ITERATIONS):
        by_label = np.zeros((restarts, k, n))
        by_label[rows[:, None], labels, np.arange(n)[None, :]] = weights
        cluster_mass = by_label.sum(axis=2)
        moved = cluster_mass > 0
        centers = np.where(moved[:, :, None], (by_label @ x) / np.where(moved, cluster_mass, 1.0)[:, :, None], centers)
        new_labels, sq_dist = nearest_with_norms(x, norms, centers)
        unchanged = np.array_equal(new_labels, labels)
        labels = new_labels
        if unchanged:  # every restart has converged (one more round would change none of them)
            break
    return centers, sq_dist @ weights


def estimate_local_k(x: np.ndarray, k_max: int) -> int:
    """How many clusters one device's rows hold, in [1, k_max], from its singular values alone.

    k separated clusters put k - 1 directions of between-cluster spread into the centered rows;
    noise spreads evenly over the rest. A direction counts as signal when its singular value is
    above the Gavish-Donoho hard threshold for unknown noise, omega(beta) times the median
    singular value (Gavish and Donoho 2014, beta = aspect ratio of the matrix). The estimate is
    1 + the number of such directions, so it needs d >= k - 1 and roughly isotropic noise; on
    data with structure in many directions (images) it stays at k_max.
    """
    distinct, counts = distinct_rows(x)
    if len(distinct) <= 2:
        return max(1, min(k_max, len(distinct)))
    mean = np.average(distinct, axis=0, weights=counts)
    singular = np.linalg.svd((distinct - mean) * np.sqrt(counts)[:, None], compute_uv=False)
    beta = min(distinct.shape) / max(distinct.shape)
    omega = 0.56 * beta**3 - 0.95 * beta**2 + 1.82 * beta + 1.43
    signal = int(np.sum(singular > omega * np.median(singular)))
    return int(min(k_max, 1 + signal, len(distinct)))
