"""Numeric kernels of k-FED (Dennis, Li and Smith, ICML 2021): numpy, no Spark.

The local step (alg. 1) runs on one device's rows, the server step (alg. 2) on the
driver over all local centers; LabelModel labels rows with the result (in the Spark
job's workers and in federated_kmeans, the single-process reference). Spark code calls
these functions; they never call Spark. Only LabelModel's device lookup uses pandas (a
hash index: device ids may be strings).

Squared distances are computed as |x|^2 - 2 x.c + |c|^2 (one matrix product), whose rounding error
grows with the rows' distance from the origin, not with their spread: at 1e9 from the origin it
swamps distances of 1. So every kernel first moves its rows near the origin (by their mean, or the
centers' mean) and moves its centers back at the end; every cut-off is then relative to the rows'
spread, and shifting or scaling the features changes no label.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kfed_spark.params import DEFAULTS, SEEDINGS, AlgorithmParams
from kfed_spark.privacy import NoiseScales

MARGIN = 3.0
"""Alg. 1 keeps a point for a rough center r when it is MARGIN times closer to r than to any other."""

ROUGH_LLOYD_ITERATIONS = 10
"""Lloyd steps after k-means++ in the projection: the analysis only needs a constant-factor start."""

RANDOMIZED_SVD_MIN_DIM = 512
"""Devices with at least this many features use a seeded randomized SVD instead of an exact one."""

DUPLICATE_TOLERANCE = 1e-12
"""Squared distances below this fraction of the largest squared distance from the rows' mean are
rounding residue of equal rows, not distance."""

DISTANCE_CHUNK_ELEMENTS = 1 << 22
"""Distance matrices are built in row chunks of at most this many entries (32 MiB of float64)."""

SPLIT_STEP = 1e-6
"""The private local step splits a center by moving its copy this fraction of the box's half-width."""

LABEL_CHUNK_ROWS = 1 << 16
"""federated_kmeans labels this many rows at a time, as a worker labels one Arrow batch."""


@dataclass(frozen=True)
class LocalClustering:
    """What one device shares: its centers, their point counts and sums of squared errors."""

    centers: np.ndarray  # (m, d) float64
    counts: np.ndarray  # (m,) int64
    sse: np.ndarray  # (m,) float64


@dataclass(frozen=True)
class ServerClustering:
    """Global centers and, for every local center, the global cluster it belongs to."""

    centers: np.ndarray  # (k, d) float64
    assignment: np.ndarray  # (m,) int64, in the order the local centers were given
    seed_device: object  # the device whose centers seeded the farthest-point search
    refine_iterations: int


def device_rng(seed: int, device_id: object) -> np.random.Generator:
    """A generator seeded from (run seed, device id) alone, so partitioning and retries do not matter."""
    return np.random.default_rng([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, *_device_words(device_id)])


def noise_rng(noise_key: int, device_id: object) -> np.random.Generator:
    """The generator of a device's privacy noise: seeded from (the run's secret 128-bit noise key, device id).

    The one draw not seeded from the run seed: the seed is published in the runs table, and noise
    anyone can draw again is noise anyone can subtract."""
    key_words = [(noise_key >> shift) & 0xFFFFFFFF for shift in range(0, 128, 32)]
    return np.random.default_rng([*key_words, *_device_words(device_id)])


def _device_words(device_id: object) -> tuple[int, int]:
    """A device id as (tag, 64-bit key): integers as themselves, anything else by a hash of its text."""
    if isinstance(device_id, (int, np.integer)):
        return 0, int(device_id) & 0xFFFFFFFFFFFFFFFF
    digest = hashlib.blake2b(str(device_id).encode("utf-8"), digest_size=8).digest()
    return 1, int.from_bytes(digest, "little")


def plain(value: object) -> object:
    """A numpy scalar as the Python value it holds (for messages and results); others unchanged."""
    return value.item() if isinstance(value, np.generic) else value


def centered(x: np.ndarray, weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(x minus its (weighted) mean, the mean): rows near the origin, whose expanded squared distances
    are accurate to their spread (see the module's docstring)."""
    origin = x.mean(axis=0) if weights is None else (weights @ x) / weights.sum()
    return x - origin, origin


def distinct_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of x in lexicographic order, and how often each occurs: what
    np.unique(x, axis=0, return_counts=True) returns, a tenth of its time on continuous features.

    Rows are sorted by their first value; only runs of rows that tie on it are sorted by all their
    values (where most rows tie, as on images whose first pixel is always 0, np.unique does it).
    """
    x = np.asarray(x, dtype=np.float64)
    if len(x) == 0:
        return x, np.zeros(0, dtype=np.int64)
    ordered = x[np.argsort(x[:, 0], kind="stable")]
    tied = ordered[1:, 0] == ordered[:-1, 0]
    if np.count_nonzero(tied) > len(x) // 2:
        return np.unique(x, axis=0, return_counts=True)
    if tied.any():
        in_run = np.zeros(len(x), dtype=bool)
        in_run[1:] |= tied
        in_run[:-1] |= tied
        run = np.cumsum(np.concatenate([[True], ~tied]))
        rows = np.flatnonzero(in_run)
        ordered[rows] = ordered[rows[np.lexsort((*ordered[rows, ::-1].T, run[rows]))]]  # last key first
    starts = np.flatnonzero(np.concatenate([[True], np.any(ordered[1:] != ordered[:-1], axis=1)]))
    return ordered[starts], np.diff(np.append(starts, len(x)))


def squared_distances(
    x: np.ndarray, centers: np.ndarray, x_sq: np.ndarray | None = None, c_sq: np.ndarray | None = None
) -> np.ndarray:
    """(n, k) squared Euclidean distances as |x|^2 - 2 x.c + |c|^2 (one matrix product), clipped at 0.

    Accurate to the rows' spread only for rows near the origin: callers pass centered() rows.
    x_sq and c_sq are the rows' squared norms, if the caller already has them.
    """
    x_sq = np.einsum("ij,ij->i", x, x) if x_sq is None else x_sq
    c_sq = np.einsum("ij,ij->i", centers, centers) if c_sq is None else c_sq
    dist = x @ centers.T
    dist *= -2.0
    dist += x_sq[:, None]
    dist += c_sq[None, :]
    np.maximum(dist, 0.0, out=dist)
    return dist


def nearest_center(x: np.ndarray, centers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of and squared distance to the nearest center for every row, in bounded-memory chunks.

    Rows and centers are first moved by the centers' mean, so that the result is as accurate far
    from the origin as near it.
    """
    centers, origin = centered(centers)
    x = x - origin
    return _nearest(x, np.einsum("ij,ij->i", x, x), centers)


def _nearest(x: np.ndarray, x_sq: np.ndarray, centers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """nearest_center of rows x that are already near the origin, given their squared norms x_sq;
    centers may have a leading axis of restarts, (r, k, d), and so then do the results, (r, n)."""
    transposed = np.swapaxes(centers, -1, -2)
    c_sq = np.einsum("...kd,...kd->...k", centers, centers)[..., None, :]
    step = max(1, DISTANCE_CHUNK_ELEMENTS // max(1, centers.shape[-2] * (centers.shape[0] if centers.ndim == 3 else 1)))
    parts = []
    for start in range(0, max(1, len(x)), step):  # one (empty) chunk for no rows
        # |c|^2 - 2 x.c orders the centers as the squared distance does; |x|^2 is added to the winner only.
        partial = x[start : start + step] @ transposed
        partial *= -2.0
        partial += c_sq
        parts.append((np.argmin(partial, axis=-1), np.min(partial, axis=-1) + x_sq[start : start + step]))
    if len(parts) == 1:
        nearest, best = parts[0]
    else:
        nearest, best = (np.concatenate([part[i] for part in parts], axis=-1) for i in (0, 1))
    return nearest, np.maximum(best, 0.0, out=best)


def weighted_means(x: np.ndarray, weights: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-label weighted sums divided by per-label weights; also returns the weights (0 for empty)."""
    sums, mass = weighted_sums(x, weights, labels, k)
    means = np.divide(sums, mass[:, None], out=np.zeros_like(sums), where=mass[:, None] > 0)
    return means, mass


def weighted_sums(x: np.ndarray, weights: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-label weighted sums of the rows, and per-label weights.

    The sums are matrix products with the (k, rows) matrix of the rows' weights by label, in row
    chunks of bounded size: a few numpy calls where a device has few rows.
    """
    mass = np.bincount(labels, weights=weights, minlength=k)
    sums = np.zeros((k, x.shape[1]))
    step = max(1, DISTANCE_CHUNK_ELEMENTS // max(1, k))
    for start in range(0, len(x), step):
        chunk = slice(start, start + step)
        by_label = np.zeros((k, len(x[chunk])))
        by_label[labels[chunk], np.arange(len(by_label[0]))] = weights[chunk]
        sums += by_label @ x[chunk]
    return sums, mass


def kmeans_plusplus(x: np.ndarray, weights: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Greedy k-means++ seeding over weighted rows; returns the chosen row indices.

    Each step draws 2 + log(k) candidates with probability proportional to weight times squared
    distance and keeps the one that lowers the potential most (Arthur and Vassilvitskii 2007,
    as scikit-learn does): single-draw k-means++ often puts two seeds in one cluster.
    """
    trials = 2 + int(np.log(k))
    x, _ = centered(x, weights)
    norms = np.einsum("ij,ij->i", x, x)
    # Squared distances up to this are rounding residue of equal rows: once every row is that close
    # to a seed, the distinct rows have run out.
    duplicate_below = DUPLICATE_TOLERANCE * float(np.max(norms))
    chosen = [_draw(np.cumsum(weights), rng, 1)[0]]
    closest = squared_distances(x[chosen], x, norms[chosen], norms)[0]
    for _ in range(1, k):
        if np.max(closest) <= duplicate_below:
            break
        candidates = _draw(np.cumsum(weights * closest), rng, trials)
        candidate_closest = np.minimum(closest[None, :], squared_distances(x[candidates], x, norms[candidates], norms))
        best = int(np.argmin(candidate_closest @ weights))
        chosen.append(int(candidates[best]))
        closest = candidate_closest[best]
    return np.asarray(chosen, dtype=np.int64)


def _draw(cumulative: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
    """Indices drawn with probability proportional to the increments of cumulative."""
    picks = np.searchsorted(cumulative, rng.random(size) * cumulative[-1], side="right")
    return np.minimum(picks, len(cumulative) - 1)


def lloyd(
    x: np.ndarray,
    weights: np.ndarray,
    centers: np.ndarray,
    max_iter: int,
    tol: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Weighted Lloyd from the given centers until assignments stop changing.

    Also stops after max_iter rounds or once no center moves more than tol (squared, relative
    to the data's total variance, so that shifting the data does not change when it stops, as
    scikit-learn scales its tol). An emptied cluster keeps its previous center. The means are
    taken of centered() rows, so that they are as accurate far from the origin as near it.
    Returns (centers, each row's label and squared distance under them, rounds run).
    """
    k = len(centers)
    x, origin = centered(x, weights)
    centers = np.asarray(centers, dtype=np.float64) - origin
    x_sq = np.einsum("ij,ij->i", x, x)
    scale = float(weights @ x_sq / weights.sum()) or 1.0
    labels, sq_dist = _nearest(x, x_sq, centers)
    rounds = 0
    while rounds < max_iter:
        rounds += 1
        means, mass = weighted_means(x, weights, labels, k)
        moved = mass > 0
        shift = float(np.max(np.sum((means[moved] - centers[moved]) ** 2, axis=1), initial=0.0))
        centers[moved] = means[moved]
        new_labels, sq_dist = _nearest(x, x_sq, centers)
        unchanged = np.array_equal(new_labels, labels)
        labels = new_labels
        if unchanged or shift <= tol * scale:
            break
    return centers + origin, labels, sq_dist, rounds


def top_right_singular_vectors(x: np.ndarray, weights: np.ndarray, rank: int, rng: np.random.Generator) -> np.ndarray:
    """(rank, d) top right singular vectors of the weighted rows sqrt(w) * x.

    Below RANDOMIZED_SVD_MIN_DIM features they are the top eigenvectors of the (d, d) Gram matrix
    (a device is a tall, thin matrix: a quarter of an SVD's time at 500 x 32), or the SVD itself
    when the device has fewer rows than features.
    """
    a = x * np.sqrt(weights)[:, None]
    if x.shape[1] < RANDOMIZED_SVD_MIN_DIM:
        if len(a) < a.shape[1]:
            return np.linalg.svd(a, full_matrices=False)[2][:rank]
        vectors = np.linalg.eigh(a.T @ a)[1]  # eigenvalues in ascending order
        return vectors[:, ::-1][:, :rank].T
    # Randomized range finder (Halko, Martinsson and Tropp 2011) with two power iterations.
    sketch = a @ rng.standard_normal((x.shape[1], min(x.shape[1], rank + 10)))
    for _ in range(2):
        sketch = a @ (a.T @ np.linalg.qr(sketch)[0])
    basis = np.linalg.qr(sketch)[0]
    return np.linalg.svd(basis.T @ a, full_matrices=False)[2][:rank]


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


def local_step(x: np.ndarray, k: int, rng: np.random.Generator, params: AlgorithmParams = DEFAULTS) -> LocalClustering:
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
        return LocalClustering(distinct, counts.astype(np.int64), np.zeros(len(distinct)))
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
    return LocalClustering(centers[keep] + origin, mass[keep].astype(np.int64), sse[keep])


def private_local_step(
    x: np.ndarray, k: int, rng: np.random.Generator, noise: np.random.Generator, params: AlgorithmParams
) -> LocalClustering:
    """The local step in alg. 1's place when privacy_epsilon is set: what it shares is
    (privacy_epsilon, privacy_delta)-differentially private per row (kfed_spark.privacy).

    Rows are clipped into the box of privacy_bounds. privacy_rounds noisy Lloyd rounds follow, each
    moving every center to its cluster's noisy sum over its noisy count, clipped into the box; a
    center whose noisy count is under 1 stays where it was and shares a count of 0. The centers
    start as one, at the box's center, and double before each round (split along random directions
    from rng, the run seed's; the heaviest split first) until there are k, all k by the last round:
    bisecting, so that no starting center is placed by looking at the rows. The counts shared are
    the last round's, rounded; the SSE is not shared (NaN).
    """
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
        labels, _ = _nearest(rows, norms, centers)
        sums, counts = noisy_cluster_sums(rows, labels, len(centers), scales, noise)
        moved = counts >= 1
        centers[moved] = np.clip(sums[moved] / counts[moved, None], -half, half)
    shared_counts = np.where(moved, np.rint(counts), 0).astype(np.int64)
    return LocalClustering(centers + middle, shared_counts, np.full(len(centers), np.nan))


def noisy_cluster_sums(
    rows: np.ndarray, labels: np.ndarray, k: int, scales: NoiseScales, noise: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """One round's release of the private local step: the (k, d) sums and (k,) counts of the rows by label,
    each with its Gaussian noise (scales: kfed_spark.privacy). rows are clipped into the box and taken about
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
) -> LocalClustering:
    """One device's local centers, before shared_centers: alg. 1, or with privacy_epsilon set the
    private local step, whose noise comes from noise_key (kernels.noise_rng)."""
    rng = device_rng(params.seed, device)
    if params.privacy_epsilon is None:
        return local_step(x, k, rng, params)
    if noise_key is None:
        raise ValueError("a private local step needs the run's noise key")
    return private_local_step(x, k, rng, noise_rng(noise_key, device), params)


def shared_centers(result: LocalClustering, min_points: int) -> LocalClustering:
    """The local centers a device may share: those standing for at least min_points rows. A center of
    fewer is (nearly) the rows themselves; its rows are labelled by the device's nearest shared center,
    or, with none left, as an unseen device's rows are (LabelModel.label_unseen)."""
    keep = result.counts >= min_points
    if keep.all():
        return result
    return LocalClustering(result.centers[keep], result.counts[keep], result.sse[keep])


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
    labels, sq_dist = _nearest(x, norms, centers)
    for _ in range(ROUGH_LLOYD_ITERATIONS):
        by_label = np.zeros((restarts, k, n))
        by_label[rows[:, None], labels, np.arange(n)[None, :]] = weights
        cluster_mass = by_label.sum(axis=2)
        moved = cluster_mass > 0
        centers = np.where(moved[:, :, None], (by_label @ x) / np.where(moved, cluster_mass, 1.0)[:, :, None], centers)
        new_labels, sq_dist = _nearest(x, norms, centers)
        unchanged = np.array_equal(new_labels, labels)
        labels = new_labels
        if unchanged:  # every restart has converged (one more round would change none of them)
            break
    return centers, sq_dist @ weights


COST_TIE = 1e-9
"""Restarts whose costs differ by less than this fraction are ties: rounding must not pick the winner."""


def lowest_cost(costs: list[float]) -> int:
    """The first of the restarts whose cost is within COST_TIE of the lowest.

    Restarts that end in one clustering (in another order) have costs equal up to rounding, and
    rounding depends on where the origin is; the first of them wins, so a shifted or scaled table
    keeps the same ids.
    """
    lowest = min(costs)
    return next(i for i, cost in enumerate(costs) if cost <= lowest + COST_TIE * abs(lowest))


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


def row_hashes(x: np.ndarray, seed: int) -> np.ndarray:
    """A seeded 64-bit hash of each row's values: the same whatever order or batch a row comes in."""
    words = np.ascontiguousarray(x, dtype=np.float64).view(np.uint64)
    multipliers = np.random.default_rng([seed & 0xFFFFFFFF, 0x5A3D]).integers(
        1, np.iinfo(np.int64).max, size=x.shape[1], dtype=np.uint64
    ) | np.uint64(1)
    mixed = (words * multipliers).sum(axis=1, dtype=np.uint64)  # wraps modulo 2^64
    mixed ^= mixed >> np.uint64(33)  # the finalizer of MurmurHash3, so every bit depends on every word
    mixed *= np.uint64(0xFF51AFD7ED558CCD)
    mixed ^= mixed >> np.uint64(33)
    return mixed


def smallest_hashes(x: np.ndarray, hashes: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The size rows of x with the smallest hashes (all rows if there are fewer), and their hashes."""
    if len(x) <= size:
        return x, hashes
    keep = np.argpartition(hashes, size - 1)[:size]
    return x[keep], hashes[keep]


def scale_counts(counts: np.ndarray, total: int) -> np.ndarray:
    """Integer counts proportional to counts that add up to total (largest remainders get the rest).

    A device clustered on a sample of its rows reports counts for all of its rows this way.
    """
    counts = np.asarray(counts, dtype=np.float64)
    exact = counts * (total / counts.sum())
    scaled = np.floor(exact).astype(np.int64)
    remainder = int(total - scaled.sum())
    if remainder:
        scaled[np.argsort(-(exact - scaled), kind="stable")[:remainder]] += 1
    return scaled


KMEANSPP_RESTARTS = 10
"""Seedings tried by seeding="kmeanspp"; the one with the lowest weighted cost after refinement is kept."""

KMEANSPP_SAMPLE_PER_CLUSTER = 32
"""seeding="kmeanspp" seeds and compares its restarts on a seeded sample of this many local centers
per global cluster (all of them when there are fewer), then refines the best over all of them."""

SERVER_RNG_KEY = "__kfed_server__"
"""Device id under which the server step's own random draws are seeded from the run seed."""


def server_step(
    centers: np.ndarray,
    counts: np.ndarray,
    device_ids: np.ndarray,
    local_ids: np.ndarray,
    params: AlgorithmParams = DEFAULTS,
    initial: np.ndarray | None = None,
) -> ServerClustering:
    """Alg. 2: merge all devices' local centers into k global clusters, with params' k, seeding,
    robust_min_size, server_refine, max_iter, tol and seed.

    With `initial` (a warm start: an earlier run's global centers) the seeds are those centers (the k
    that draw the most weight, if there are more) and as many more as k asks for by the seeding rule
    (warm_seeds); the refinement is as without.

    The outlier filter first: with robust_min_size > 0 only the local centers backed by at least
    that times the median center count take part in seeding and refinement, so a few stray
    points can neither become seeds nor pull a center away; the small ones are assigned to the
    nearest global center at the end. Then the seeding rule over those centers:
    - "farthest" (the paper; "robust" is its older name): the seed set starts as the centers of
      the device with the most local centers (ties: smallest id) and grows by farthest-point
      additions; every center goes to its nearest seed.
    - "kmeanspp": greedy k-means++ over the count-weighted centers, KMEANSPP_RESTARTS times
      (seeded from the run seed), keeping the lowest weighted cost after refinement. Above
      KMEANSPP_SAMPLE_PER_CLUSTER x k centers the restarts run on one seeded sample of that
      size, whose counts stand for the rest, and the best is then refined over all centers.
    server_refine="lloyd" runs Lloyd over the local centers weighted by their point counts,
    "none" keeps the seeds as the global centers. Local centers are put in (device, position)
    order first, so the result does not depend on the order the devices were given in.
    """
    k, refine, seeding = params.k, params.server_refine, params.seeding
    if refine not in ("lloyd", "none"):
        raise ValueError(f"server_refine must be 'lloyd' or 'none', not {refine!r}")
    if seeding not in SEEDINGS:
        raise ValueError(f"seeding must be one of {', '.join(SEEDINGS)}, not {seeding!r}")
    centers = np.asarray(centers, dtype=np.float64)
    device_ids = np.asarray(device_ids)
    by_local_id = np.argsort(local_ids, kind="stable")
    order = by_local_id[np.argsort(device_ids[by_local_id], kind="stable")]
    ordered = centers[order]
    weights = np.asarray(counts, dtype=np.float64)[order]
    eligible = weights >= params.robust_min_size * np.median(weights)
    if initial is not None:
        seed_device = None
        seeds = warm_seeds(ordered[eligible], weights[eligible], np.asarray(initial, dtype=np.float64), params)
        global_centers, ordered_assignment, rounds, _ = _refine(ordered[eligible], weights[eligible], seeds, params)
    elif seeding == "kmeanspp":
        seed_device = None
        found = _kmeanspp_centers(ordered[eligible], weights[eligible], params)
        if found is None and not eligible.all():  # too few distinct centers pass the filter: use them all
            eligible[:] = True
            found = _kmeanspp_centers(ordered, weights, params)
        if found is None:  # counted by the rule that ran out of them, so that the numbers agree
            distinct = len(kmeans_plusplus(ordered, weights, len(ordered), device_rng(params.seed, SERVER_RNG_KEY)))
            raise too_few_distinct(k, distinct)
        global_centers, ordered_assignment, rounds = found
    else:
        initial, seed_device = _largest_device_centers(ordered, device_ids[order], eligible, k)
        seeds = _farthest_point_seeds(ordered, initial, eligible, k)
        global_centers, ordered_assignment, rounds, _ = _refine(
            ordered[eligible], weights[eligible], ordered[seeds], params
        )
    if not eligible.all():  # the centers the filter left out go to their nearest global center
        ordered_assignment, _ = nearest_center(ordered, global_centers)
    assignment = np.empty_like(ordered_assignment)
    assignment[order] = ordered_assignment
    return ServerClustering(global_centers, assignment, seed_device, rounds)


def warm_seeds(x: np.ndarray, weights: np.ndarray, initial: np.ndarray, params: AlgorithmParams) -> np.ndarray:
    """k seeds from earlier centers over the weighted local centers x: of the initial centers that some
    local center is nearest to, the k with the most weight nearest them (ties: the earlier one); then,
    while fewer than k, the local center farthest from the seeds (seeding farthest) or one drawn in
    proportion to weight times squared distance (kmeanspp, seeded from the run seed)."""
    x, origin = centered(x, weights)
    seeds = initial - origin
    nearest, _ = nearest_center(x, seeds)
    mass = np.bincount(nearest, weights=weights, minlength=len(seeds))
    kept = np.sort(np.argsort(-mass, kind="stable")[: params.k])
    seeds = seeds[kept[mass[kept] > 0]]  # an earlier center no local center is nearest to: its cluster is gone
    rng = device_rng(params.seed, f"{SERVER_RNG_KEY}warm")
    _, to_seeds = nearest_center(x, seeds)
    while len(seeds) < params.k:
        score = weights * to_seeds
        if not np.any(score > 0):
            raise too_few_distinct(params.k, len(seeds))
        if params.seeding == "kmeanspp":
            chosen = int(_draw(np.cumsum(score), rng, 1)[0])
        else:
            chosen = int(np.argmax(to_seeds))
        seeds = np.vstack([seeds, x[chosen]])
        diff = x - x[chosen]
        np.minimum(to_seeds, np.einsum("ij,ij->i", diff, diff), out=to_seeds)
    return seeds + origin


REPRESENTATIVE_SAMPLE = 4
"""representatives() seeds with k-means++ on a sample of this many rows per representative."""

REPRESENTATIVE_ROUNDS = 1
"""Lloyd rounds representatives() runs over all its rows: enough for a summary, which the merge refines."""


def representatives(
    x: np.ndarray, weights: np.ndarray, m: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """At most m weighted points that stand for the weighted rows (x, weights), with the same total
    weight: the means of a weighted m-means of the rows, each weighing what its rows weigh.

    The distributed server step reduces each partition of local centers with it, and merges the
    union (a composable coreset). Seeds: k-means++ on a sample of REPRESENTATIVE_SAMPLE x m rows,
    then REPRESENTATIVE_ROUNDS weighted Lloyd rounds over all rows: O(rows x m x d) work.
    """
    if len(x) <= m:
        return x, weights
    x, origin = centered(x, weights)
    sample = np.sort(rng.choice(len(x), min(len(x), REPRESENTATIVE_SAMPLE * m), replace=False))
    seeds = x[sample[kmeans_plusplus(x[sample], weights[sample], m, rng)]]
    _, labels, _, _ = lloyd(x, weights, seeds, REPRESENTATIVE_ROUNDS, 0.0)
    means, mass = weighted_means(x, weights, labels, len(seeds))
    held = mass > 0
    return means[held] + origin, mass[held]


def _kmeanspp_centers(
    x: np.ndarray, weights: np.ndarray, params: AlgorithmParams, sample_size: int | None = None
) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(global centers, assignment of x, Lloyd rounds) from the best of KMEANSPP_RESTARTS k-means++
    seedings of a seeded sample of sample_size rows of x (default KMEANSPP_SAMPLE_PER_CLUSTER x k;
    all of x if it is smaller, or if the sample has fewer than k distinct rows), refined over all
    of x; None if x has fewer than k distinct rows."""
    sample_size = sample_size or KMEANSPP_SAMPLE_PER_CLUSTER * params.k
    sample = np.arange(len(x))
    if len(x) > sample_size:
        rng = device_rng(params.seed, f"{SERVER_RNG_KEY}sample")
        sample = np.sort(rng.choice(len(x), sample_size, replace=False))
    tried = []
    for restart in range(KMEANSPP_RESTARTS):
        rng = device_rng(params.seed, f"{SERVER_RNG_KEY}{restart}")
        seeds = kmeans_plusplus(x[sample], weights[sample], params.k, rng)
        if len(seeds) < params.k:
            return None if len(sample) == len(x) else _kmeanspp_centers(x, weights, params, len(x))
        tried.append(_refine(x[sample], weights[sample], x[sample][seeds], params))
    centers, assignment, rounds, _ = tried[lowest_cost([result[3] for result in tried])]
    if len(sample) < len(x):
        centers, assignment, more_rounds, _ = _refine(x, weights, centers, params)
        rounds += more_rounds
    return centers, assignment, rounds


def _refine(x, weights, seeds, params: AlgorithmParams) -> tuple[np.ndarray, np.ndarray, int, float]:
    """(centers, assignment of x, Lloyd rounds, weighted cost) from the given seeds, as server_refine says."""
    if params.server_refine == "lloyd":
        centers, assignment, sq_dist, rounds = lloyd(x, weights, seeds, params.max_iter, params.tol)
    else:
        centers, rounds = np.array(seeds), 0
        assignment, sq_dist = nearest_center(x, centers)
    return centers, assignment, rounds, float(weights @ sq_dist)


def _largest_device_centers(x, devices, eligible, k) -> tuple[np.ndarray, object]:
    """Positions of the eligible centers of the device with the most of them (ties: smallest id)."""
    keys, slot = np.unique(devices[eligible], return_inverse=True)
    per_device = np.bincount(slot, minlength=len(keys))
    chosen = int(np.argmax(per_device))
    if per_device[chosen] > k:
        raise ValueError(f"device {plain(keys[chosen])!r} has {per_device[chosen]} local centers, more than k = {k}")
    return np.flatnonzero(eligible)[slot == chosen], plain(keys[chosen])


def _farthest_point_seeds(x: np.ndarray, initial: np.ndarray, eligible: np.ndarray, k: int) -> np.ndarray:
    """Grow the seed set to k by repeatedly adding the eligible point farthest from it.

    Every point's squared distance to the seed set is kept up to date with one matrix-vector
    product per added seed (O(k m d) in all, no m x k matrix). When the eligible points run out
    of distinct candidates, the others may be picked too; fewer than k distinct points is an error.
    """
    x, _ = centered(x)
    norms = np.einsum("ij,ij->i", x, x)
    # |x|^2 - 2x.c + |c|^2 leaves rounding residue for equal points: below this, a point is a duplicate.
    duplicate_below = DUPLICATE_TOLERANCE * float(np.max(norms))
    seeds = [int(i) for i in initial]
    pools = [eligible] if eligible.all() else [eligible, np.ones_like(eligible)]
    for pool in pools:
        # Points outside the pool get distance -inf, which np.minimum keeps: they are never picked.
        _, to_seeds = nearest_center(x, x[seeds])
        to_seeds[~pool] = -np.inf
        while len(seeds) < k:
            farthest = int(np.argmax(to_seeds))
            if to_seeds[farthest] <= duplicate_below:
                break
            seeds.append(farthest)
            to_new = x @ x[farthest]
            to_new *= -2.0
            to_new += norms
            to_new += norms[farthest]
            np.minimum(to_seeds, to_new, out=to_seeds)
    if len(seeds) < k:
        raise too_few_distinct(k, len(seeds))
    return np.asarray(seeds)


def between_sse(
    local_centers: np.ndarray, local_counts: np.ndarray, centers: np.ndarray, assignment: np.ndarray
) -> np.ndarray:
    """Each local center's count times its squared distance to its global center (centers[assignment]):
    with the local centers' own SSEs, the exact within-cluster SSE of the rows they stand for."""
    gap = np.asarray(local_centers, dtype=np.float64) - np.asarray(centers, dtype=np.float64)[assignment]
    return np.asarray(local_counts, dtype=np.float64) * np.einsum("ij,ij->i", gap, gap)


def too_few_distinct(k: int, distinct: int) -> ValueError:
    """The error of a server step asked for more clusters than there are distinct local centers."""
    return ValueError(
        f"k = {k} is more than the {distinct} distinct local centers the devices share; lower k, raise k_per_device "
        "or lower min_center_points"
    )


def nearest_device_center(
    x: np.ndarray, slots: np.ndarray, device_centers: np.ndarray, device_center_valid: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For each row, the nearest of its own device's local centers.

    device_centers is (devices, k', d), padded; device_center_valid (devices, k') marks real
    centers; slots gives each row's device index. Returns (local index, squared distance).
    """
    rows = device_centers[slots]
    dist = np.einsum("ij,ij->i", x, x)[:, None] - 2.0 * np.einsum("ij,ikj->ik", x, rows)
    dist += np.einsum("ikj,ikj->ik", rows, rows)
    np.maximum(dist, 0.0, out=dist)
    dist[~device_center_valid[slots]] = np.inf
    labels = np.argmin(dist, axis=1)
    return labels, dist[np.arange(len(x)), labels]


@dataclass(frozen=True)
class LabelModel:
    """Everything needed to label a row: each device's local centers and their global clusters.

    Devices are rows of padded arrays: device_centers (devices, k', d), center_valid (devices,
    k'), center_cluster (devices, k'). Centers are held relative to origin, the global centers'
    mean, and rows are moved by it before any distance (see the module's docstring). It travels to
    the workers inside the labelling function, which Spark broadcasts once it is large.

    With label_unseen, a row of a device the model has no local centers for takes the nearest global
    center and local cluster -1 (what streams and the estimator's transform do: the label then depends
    on the row alone, never on which other rows of its device arrived with it); without, it is an error.
    """

    devices: np.ndarray
    device_centers: np.ndarray  # relative to origin
    center_valid: np.ndarray
    center_cluster: np.ndarray
    global_centers: np.ndarray  # relative to origin
    origin: np.ndarray
    label_mode: str
    label_unseen: bool = False
    cluster_ids: np.ndarray | None = None  # the published id of each global center; None: its position

    @classmethod
    def build(
        cls,
        devices,
        local_ids,
        centers,
        clusters,
        global_centers,
        label_mode,
        label_unseen: bool = False,
        cluster_ids: np.ndarray | None = None,
    ) -> "LabelModel":
        keys, slot = np.unique(np.asarray(devices), return_inverse=True)
        width = int(np.max(local_ids)) + 1
        global_centers, origin = centered(np.asarray(global_centers, dtype=np.float64))
        device_centers = np.zeros((len(keys), width, centers.shape[1]))
        center_valid = np.zeros((len(keys), width), dtype=bool)
        center_cluster = np.full((len(keys), width), -1, dtype=np.int64)
        device_centers[slot, local_ids] = centers - origin
        center_valid[slot, local_ids] = True
        center_cluster[slot, local_ids] = clusters
        return cls(
            keys,
            device_centers,
            center_valid,
            center_cluster,
            global_centers,
            origin,
            label_mode,
            label_unseen,
            None if cluster_ids is None else np.asarray(cluster_ids, dtype=np.int64),
        )

    def label(self, devices: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(local_cluster_id, cluster_id, squared distance to the global center, margin) per row; the
        cluster ids are cluster_ids' (positions of the global centers without them)."""
        x = x - self.origin
        slots = pd.Index(self.devices).get_indexer(devices)
        unseen = slots < 0
        if np.any(unseen) and not self.label_unseen:
            raise ValueError(f"device {plain(devices[np.flatnonzero(unseen)[0]])!r} has no local centers in this model")
        seen = np.flatnonzero(~unseen) if np.any(unseen) else slice(None)  # a slice: no copy of x in the usual case
        local = np.full(len(x), -1, dtype=np.int64)
        assigned = np.full(len(x), -1, dtype=np.int64)  # -1: the nearest global center
        local[seen], _ = nearest_device_center(x[seen], slots[seen], self.device_centers, self.center_valid)
        if self.label_mode != "nearest":
            assigned[seen] = self.center_cluster[slots[seen], local[seen]]
        cluster, sq_dist, margin = assigned_with_margin(x, self.global_centers, assigned)
        if self.label_mode != "nearest":  # the exact distance to the assigned center, as the cost adds it up
            diff = x[seen] - self.global_centers[cluster[seen]]
            sq_dist[seen] = np.einsum("ij,ij->i", diff, diff)
        return local, cluster if self.cluster_ids is None else self.cluster_ids[cluster], sq_dist, margin


def assigned_with_margin(
    x: np.ndarray, centers: np.ndarray, assigned: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For rows x near the origin: (global cluster, squared distance to it, margin) per row, where the
    cluster is `assigned` or, where that is -1, the nearest center.

    The margin is (d_other - d_own) / (d_other + d_own), with d_own the row's distance to its cluster's
    center and d_other to the nearest other center: 1 on its own center, 0 half-way between two
    centers, negative for a row nearer another center than its own (label_mode induced); 1 with k = 1.
    A ratio of distances: shifting or scaling the features leaves it as it is.
    """
    cluster = assigned.copy()
    sq_dist = np.empty(len(x))
    other = np.full(len(x), np.inf)
    x_sq = np.einsum("ij,ij->i", x, x)
    c_sq = np.einsum("ij,ij->i", centers, centers)
    step = max(1, DISTANCE_CHUNK_ELEMENTS // len(centers))
    for start in range(0, len(x), step):
        chunk = slice(start, start + step)
        # |c|^2 - 2 x.c orders the centers as the squared distance does; |x|^2 is added to the two kept only.
        partial = x[chunk] @ centers.T
        partial *= -2.0
        partial += c_sq
        rows, pick = np.arange(len(partial)), cluster[chunk]  # a view: filling it fills cluster
        free = pick < 0
        if free.all():
            pick[:] = np.argmin(partial, axis=1)
        elif free.any():
            pick[free] = np.argmin(partial[free], axis=1)
        sq_dist[chunk] = partial[rows, pick]
        if len(centers) > 1:
            partial[rows, pick] = np.inf
            other[chunk] = np.min(partial, axis=1)
    sq_dist += x_sq
    other += x_sq
    np.maximum(sq_dist, 0.0, out=sq_dist)
    np.maximum(other, 0.0, out=other)
    own, other = np.sqrt(sq_dist), np.sqrt(other)
    with np.errstate(invalid="ignore"):
        margin = np.where(np.isinf(other), 1.0, (other - own) / (other + own))
    margin[own + other == 0] = 0.0  # two equal centers
    return cluster, sq_dist, margin


@dataclass(frozen=True)
class FederatedClustering:
    """k-FED over all devices in one process: per-row labels plus what the Spark job also reports."""

    labels: np.ndarray  # (n,) global cluster per row
    local_labels: np.ndarray  # (n,) local cluster per row, within its device
    server: ServerClustering
    local_counts: np.ndarray  # (m,) points per local center
    local_devices: np.ndarray  # (m,) device of each local center


@dataclass(frozen=True)
class DeviceClusterings:
    """Alg. 1's output for every device, in device order: what the server step takes."""

    devices: np.ndarray  # (m,) device of each local center
    local_ids: np.ndarray  # (m,) position of each local center within its device
    centers: np.ndarray  # (m, d)
    counts: np.ndarray  # (m,)
    sse: np.ndarray  # (m,)


def local_clusterings(
    x: np.ndarray, devices: np.ndarray, params: AlgorithmParams = DEFAULTS, noise_key: int | None = None
) -> DeviceClusterings:
    """Alg. 1 on every device's rows, with params' k_per_device (a number or "auto": each device's
    estimate_local_k, at most min(largest_k, k_per_device_max)), local_restarts, max_iter, tol and seed;
    with privacy_epsilon set, the private local step with noise from noise_key (or a fresh one)."""
    if params.privacy_epsilon is not None and noise_key is None:
        noise_key = secrets.randbits(128)
    order = np.argsort(devices, kind="stable")
    keys, starts = np.unique(devices[order], return_index=True)
    ends = np.append(starts[1:], len(order))
    results = []
    for key, s, e in zip(keys, starts, ends):
        rows = x[order[s:e]]
        k_z = (
            estimate_local_k(rows, min(params.largest_k, params.k_per_device_max))
            if params.k_per_device == "auto"
            else params.k_per_device
        )
        found = device_local_step(rows, k_z, plain(key), params, noise_key)
        results.append(shared_centers(found, params.min_center_points))
    per_device = np.array([len(r.counts) for r in results])
    return DeviceClusterings(
        np.repeat(keys, per_device),
        np.concatenate([np.arange(m) for m in per_device]),
        np.concatenate([r.centers for r in results]),
        np.concatenate([r.counts for r in results]),
        np.concatenate([r.sse for r in results]),
    )


def federated_kmeans(
    x: np.ndarray,
    devices: np.ndarray,
    params: AlgorithmParams = DEFAULTS,
    local: DeviceClusterings | None = None,
    initial: np.ndarray | None = None,
) -> FederatedClustering:
    """The whole of k-FED without Spark: the same kernels, in the same order, as the Spark job.

    max_rows_per_device does not apply (every row is clustered). local, if given, is
    local_clusterings of the same rows with the same local parameters (a benchmark comparing
    server settings computes it once); initial, the centers to warm-start the server step from. It is
    the single-process floor of the benchmark and the
    reference the Spark job is tested against.
    """
    local = local or local_clusterings(x, devices, params)
    server = server_step(local.centers, local.counts, local.devices, local.local_ids, params, initial)
    model = LabelModel.build(  # a device whose every local center was too small to share: as an unseen one
        local.devices, local.local_ids, local.centers, server.assignment, server.centers, params.label_mode, True
    )
    local_labels = np.empty(len(x), dtype=np.int64)
    labels = np.empty(len(x), dtype=np.int64)
    for start in range(0, len(x), LABEL_CHUNK_ROWS):
        chunk = slice(start, start + LABEL_CHUNK_ROWS)
        local_labels[chunk], labels[chunk], _, _ = model.label(devices[chunk], x[chunk])
    return FederatedClustering(labels, local_labels, server, local.counts, local.devices)
