"""The local step (alg. 1 of Dennis, Li and Smith, ICML 2021) on one device's rows, and the private
local step that takes its place under a privacy budget: numpy, no Spark.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from kfed_spark.core.linalg import (
    COST_TIE,
    DUPLICATE_TOLERANCE,
    RANDOMIZED_SVD_MIN_DIM,
    device_normals,
    device_rng,
    device_uniforms,
    distinct_rows,
    kmeans_plusplus,
    lloyd,
    noise_normals,
    plain,
    top_right_singular_vectors,
)
from kfed_spark.core.privacy import NoiseScales
from kfed_spark.core.sampling import scale_counts
from kfed_spark.params import DEFAULTS, AlgorithmParams

MARGIN = 3.0
"""Alg. 1 keeps a point for a rough center r when it is MARGIN times closer to r than to any other."""


ROUGH_LLOYD_ITERATIONS = 10
"""Lloyd steps after k-means++ in the projection: the analysis only needs a constant-factor start."""


ROUGH_ROWS = 256
ROUGH_ROWS_PER_CENTER = 32
"""The rough clustering of a device takes about max(ROUGH_ROWS, ROUGH_ROWS_PER_CENTER * k) of its distinct rows
at most (_rough_rows)."""


SPLIT_STEP = 1e-6
"""The private local step splits a center by moving its copy this fraction of the box's half-width."""


@dataclass(frozen=True)
class DeviceCenters:
    """What one device shares: its centers, their point counts and sums of squared errors."""

    centers: np.ndarray  # (m, d) float64
    counts: np.ndarray  # (m,) int64
    sse: np.ndarray  # (m,) float64


@dataclass(frozen=True)
class DevicesCenters:
    """What many devices' local steps found, device after device: each center's device (its position
    among the devices given), the center, its point count and its sum of squared errors."""

    owner: np.ndarray  # (m,) int64
    centers: np.ndarray  # (m, d) float64
    counts: np.ndarray  # (m,) int64
    sse: np.ndarray  # (m,) float64

    def of_device(self, position: int) -> DeviceCenters:
        """The centers of the device at this position."""
        mine = self.owner == position
        return DeviceCenters(self.centers[mine], self.counts[mine], self.sse[mine])

    def ids(self) -> np.ndarray:
        """Each center's id within its device: 0, 1, ... in order."""
        first = np.flatnonzero(np.concatenate([[True], self.owner[1:] != self.owner[:-1]]))
        return np.arange(len(self.owner)) - np.repeat(first, np.diff(np.append(first, len(self.owner))))

    def with_counts_of(self, seen: np.ndarray, clustered: np.ndarray) -> "DevicesCenters":
        """The centers of devices clustered on a sample, with the counts and SSE of all their rows: seen[i]
        rows of device i were clustered as clustered[i]."""
        counts = self.counts.copy()
        for position in np.flatnonzero(seen != clustered):
            mine = self.owner == position
            counts[mine] = scale_counts(self.counts[mine], int(seen[position]))
        return dataclasses.replace(self, counts=counts, sse=self.sse * (seen / clustered)[self.owner])

    def subset(self, keep: np.ndarray) -> "DevicesCenters":
        """The centers where keep is True (or at the positions it lists, in its order)."""
        return DevicesCenters(self.owner[keep], self.centers[keep], self.counts[keep], self.sse[keep])

    def shared_first(self, min_points: int) -> "DevicesCenters":
        """The same centers, on each device those it may share (at least min_points rows) before those it
        holds back: a center of fewer rows is nearly the rows themselves, so it never joins a global
        cluster nor the local_centers table, and its rows take the nearest global center
        (LocalCenters.held_back). ids() then numbers the shared ones 0, 1, ... as they are published."""
        return self.subset(np.lexsort((self.counts < min_points, self.owner)))

    @classmethod
    def joined(cls, parts: list["DevicesCenters"], dim: int) -> "DevicesCenters":
        """parts' centers in one, in the order of their devices' positions."""
        if not parts:
            return cls(np.zeros(0, np.int64), np.zeros((0, dim)), np.zeros(0, np.int64), np.zeros(0))
        owner = np.concatenate([part.owner for part in parts])
        order = np.argsort(owner, kind="stable")
        return cls(
            owner[order],
            np.concatenate([part.centers for part in parts])[order],
            np.concatenate([part.counts for part in parts])[order],
            np.concatenate([part.sse for part in parts])[order],
        )


def local_steps(
    x: np.ndarray,
    starts: np.ndarray,
    devices: np.ndarray,
    ks: np.ndarray,
    params: AlgorithmParams = DEFAULTS,
    noise_key: int | None = None,
) -> DevicesCenters:
    """Alg. 1 on every device, with params' local_restarts, max_iter, tol and seed: x (n, d) holds the
    rows grouped by device, device i's being x[starts[i]:starts[i + 1]]; devices[i] is its id and
    ks[i] the most local centers it may have. With privacy_epsilon set, the private local step
    (_private_local_steps) takes its place, its noise from noise_key (linalg.noise_rng).

    The devices are clustered together, as arrays with a device axis: numpy calls per block of
    devices, not per device (on a hundred thousand devices of ten rows the calls, not the arithmetic,
    would be the cost). A device's result is what it would be alone: its draws come from
    device_rng(seed, its id), and it is padded to a row count that depends on its own alone
    (padded_rows), so no other device changes any of its floating-point operations.

    Rows are deduplicated first (distinct_rows sorts them), so duplicates cost nothing and the
    result does not depend on the order the rows arrived in. A device with at most k distinct rows
    shares those rows with their multiplicities. The rest works on the centered() rows: the
    projection is on the top singular vectors of the rows around their mean (the paper's uncentered
    rows would give a subspace that depends on where the origin is).
    """
    ks = np.asarray(ks, dtype=np.int64)
    if starts[-1] > ROWS_PER_PASS:
        cuts = np.unique(np.searchsorted(starts, np.arange(0, starts[-1], ROWS_PER_PASS), side="right") - 1)
        cuts = np.append(cuts, len(devices))
        parts = []
        for first, last in zip(cuts[:-1], cuts[1:]):
            found = _devices_local_steps(
                x[starts[first] : starts[last]],
                starts[first : last + 1] - starts[first],
                devices[first:last],
                ks[first:last],
                params,
                noise_key,
            )
            parts.append(dataclasses.replace(found, owner=found.owner + first))
        return DevicesCenters.joined(parts, x.shape[1])
    return _devices_local_steps(x, starts, devices, ks, params, noise_key)


ROWS_PER_PASS = 1 << 17
"""local_steps clusters whole devices of at most about this many rows at a time (32 MiB of 32 features):
its sorts and copies then stay near the cache, instead of paging through the whole input at each step."""


def _devices_local_steps(
    x: np.ndarray,
    starts: np.ndarray,
    devices: np.ndarray,
    ks: np.ndarray,
    params: AlgorithmParams,
    noise_key: int | None,
) -> DevicesCenters:
    """local_steps on devices of at most about ROWS_PER_PASS rows in all."""
    if params.privacy_epsilon is not None:
        if noise_key is None:
            raise ValueError("a private local step needs the run's noise key")
        return _private_local_steps(x, starts, devices, ks, params, noise_key)
    distinct, counts, owner = distinct_rows(x, np.repeat(np.arange(len(devices)), np.diff(starts)))
    sizes = np.bincount(owner, minlength=len(devices))
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    few = sizes[owner] <= ks[owner]
    parts = [DevicesCenters(owner[few], distinct[few], counts[few].astype(np.int64), np.zeros(np.count_nonzero(few)))]
    d = x.shape[1]
    # The largest arrays of a block: its rows (B, P, d), and per restart a row's distance to each center
    # (B, restarts, k, P) or to each seeding candidate (2 + log k of them, fewer than k + 4).
    row_values = lambda k: max(d, (k + 4) * params.local_restarts)  # noqa: E731
    for members, k, width in _blocks(np.flatnonzero(sizes > ks), sizes, ks, row_values):
        rows, valid, index = _padded(distinct, first[members], sizes[members], width)
        weights = np.where(valid, counts[index], 0).astype(np.float64)
        found = _block_local_steps(rows, weights, valid, devices[members], k, params)
        parts.append(dataclasses.replace(found, owner=members[found.owner]))
    return DevicesCenters.joined(parts, d)


def _blocks(
    positions: np.ndarray, sizes: np.ndarray, ks: np.ndarray, row_values: Callable[[int], int]
) -> Iterator[tuple[np.ndarray, int, int]]:
    """The devices at positions (of sizes[i] rows, at most ks[i] centers) in blocks of one k and one padded row
    count P (padded_rows), each as (its devices' positions, k, P): as many devices as keep the block's largest
    array, of row_values(k) values per padded row, within BATCH_ELEMENTS."""
    widths = padded_rows(sizes[positions])
    order = np.lexsort((widths, ks[positions]))
    positions, widths = positions[order], widths[order]
    bucket_starts = np.flatnonzero(
        np.concatenate([[True], (widths[1:] != widths[:-1]) | (ks[positions][1:] != ks[positions][:-1])])
    )[: len(positions)]  # no bucket without devices
    for bucket, bucket_end in zip(bucket_starts, np.append(bucket_starts[1:], len(positions))):
        k, width = int(ks[positions[bucket]]), int(widths[bucket])
        per_block = max(1, BATCH_ELEMENTS // (width * row_values(k)))
        for start in range(bucket, bucket_end, per_block):
            yield positions[start : min(start + per_block, bucket_end)], k, width


def _padded(
    x: np.ndarray, first: np.ndarray, sizes: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A block's rows (B, width, d): device i's are x[first[i]:first[i] + sizes[i]], then zero rows; which are
    real (valid, (B, width)); and each slot's row in x (index, 0 for padding)."""
    slots = np.arange(width)
    valid = slots[None, :] < sizes[:, None]
    index = np.where(valid, first[:, None] + slots[None, :], 0)
    return np.where(valid[:, :, None], x[index], 0.0), valid, index


BATCH_ELEMENTS = 1 << 19
"""Devices are clustered together in blocks of at most this many values per array (4 MiB): large enough
that a block's numpy calls cost little per device, small enough that its arrays stay near the cache."""


def padded_rows(sizes: np.ndarray) -> np.ndarray:
    """The row count a device of `sizes` distinct rows is padded to: itself up to 16, then the next
    multiple of an eighth of its highest power of two (at most an eighth more rows), so that a block
    holds devices of many sizes and a device's padding depends on its own size alone."""
    sizes = np.asarray(sizes, dtype=np.int64)
    power = np.floor(np.log2(np.maximum(sizes, 1))).astype(np.int64)
    step = 2 ** np.maximum(0, power - 3)
    return -(-sizes // step) * step


class _Draws:
    """Uniform draws handed out in order from a row of them: a generator for kmeans_plusplus."""

    def __init__(self, values: np.ndarray):
        self.values, self.used = values, 0

    def random(self, size: int) -> np.ndarray:
        self.used += size
        return self.values[self.used - size : self.used]


def _block_local_steps(
    x: np.ndarray, weights: np.ndarray, valid: np.ndarray, devices: np.ndarray, k: int, params: AlgorithmParams
) -> DevicesCenters:
    """Alg. 1 on a block of B devices with more than k distinct rows each, padded to one row count P:
    x (B, P, d) with zero rows where valid (B, P) is False, weights (B, P) zero there. The owners of
    the result are positions in the block."""
    origin = np.einsum("bp,bpd->bd", weights, x) / weights.sum(axis=1)[:, None]
    rows = np.where(valid[:, :, None], x - origin[:, None, :], 0.0)
    trials = 2 + int(np.log(k))
    per_restart = 1 + trials * (k - 1)
    rank = min(k, x.shape[2])
    if x.shape[2] >= RANDOMIZED_SVD_MIN_DIM:  # the randomized SVD takes each device's first draws
        rngs = [device_rng(params.seed, plain(device)) for device in devices]
        projections = np.stack(
            [top_right_singular_vectors(r[w > 0], w[w > 0], rank, rng).T for r, w, rng in zip(rows, weights, rngs)]
        )
        draws = np.stack([rng.random((params.local_restarts, per_restart)) for rng in rngs])
    else:
        projections = _gram_projections(rows, weights, rank)
        draws = device_uniforms(params.seed, devices, params.local_restarts * per_restart)
        draws = draws.reshape(len(devices), params.local_restarts, per_restart)
    projected = rows @ projections  # (B, P, rank)
    seeding = _rough_rows(valid, k)
    rough, present = _rough_centers(projected[seeding], weights[seeding], valid[seeding], k, draws)
    initial = _margin_initial_centers(rows, projected, weights, valid, rough, present)
    centers, labels, sq_dist = _lloyd(rows, weights, valid, initial, present, params.max_iter, params.tol)
    mass = _by_label(labels, weights, k).sum(axis=2)
    sse = _by_label(labels, weights * sq_dist, k).sum(axis=2)
    keep = mass > 0
    owner = np.repeat(np.arange(len(x)), keep.sum(axis=1))
    return DevicesCenters(owner, (centers + origin[:, None, :])[keep], mass[keep].astype(np.int64), sse[keep])


def _rough_rows(valid: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | slice:
    """Which of a block's rows (valid (B, P)) its rough clustering takes: all of them, or where its devices hold
    more distinct rows than size = padded_rows(max(ROUGH_ROWS, ROUGH_ROWS_PER_CENTER * k)), size of each device's,
    evenly spaced in their lexicographic order: an index into the block's (B, P) arrays.

    The rough clustering only has to be within a constant factor of the best one, since the margin rule and the
    Lloyd rounds after it take every row; its seeding and Lloyd rounds cost in proportion to the rows they take.
    At ROUGH_ROWS_PER_CENTER rows a center on average, a cluster of a few percent of a device's rows still has
    several rows in the sample. Whether a device is sampled depends on its own size alone (its block's row
    count is its own padded_rows) and its sample on its own distinct rows, so it is the same alone or among
    other devices."""
    size = int(padded_rows(np.array([max(ROUGH_ROWS, ROUGH_ROWS_PER_CENTER * k)]))[0])
    if valid.shape[1] <= size:  # padded_rows is monotone and keeps its own results: no device has more rows
        return slice(None)
    sizes = valid.sum(axis=1)
    return np.arange(len(valid))[:, None], np.arange(size)[None, :] * sizes[:, None] // size


def _gram_projections(rows: np.ndarray, weights: np.ndarray, rank: int) -> np.ndarray:
    """(B, d, rank): each device's top right singular vectors of its weighted rows sqrt(w) * x, as columns,
    from the eigenvectors of the smaller of the two Gram matrices, (d, d) or (P, P), for the whole block at
    once (below RANDOMIZED_SVD_MIN_DIM features; from there on a seeded randomized SVD per device does it)."""
    width, d = rows.shape[1:]
    a = rows * np.sqrt(weights)[:, :, None]
    if width >= d:
        return np.linalg.eigh(np.swapaxes(a, 1, 2) @ a)[1][:, :, ::-1][:, :, :rank]  # eigenvalues ascending
    values, left = np.linalg.eigh(a @ np.swapaxes(a, 1, 2))
    singular = np.sqrt(np.maximum(values[:, ::-1][:, :rank], 0.0))
    right = np.swapaxes(a, 1, 2) @ left[:, :, ::-1][:, :, :rank]  # (B, d, rank): columns of length `singular`
    # A singular value at rounding level has no direction: every row's coordinate along it is zero.
    real = singular > DUPLICATE_TOLERANCE * np.max(singular, axis=1, keepdims=True)
    return np.where(real[:, None, :], right / np.where(real, singular, 1.0)[:, None, :], 0.0)


def _by_label(labels: np.ndarray, weights: np.ndarray, k: int) -> np.ndarray:
    """(..., k, P): each row's weight at its label, zero elsewhere; labels (..., P), weights broadcast to them."""
    out = np.zeros((*labels.shape[:-1], k, labels.shape[-1]))
    np.put_along_axis(out, labels[..., None, :], np.broadcast_to(weights, labels.shape)[..., None, :], axis=-2)
    return out


def _nearest(
    x: np.ndarray, x_sq: np.ndarray, centers: np.ndarray, present: np.ndarray, valid: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's nearest present center and squared distance to it: x (B, P, p) near the origin with
    squared norms x_sq (B, P), centers (B, k, p), present (B, k); label 0 and distance 0 where valid
    (B, P) is False.

    The distances are laid out (B, k, P), rows innermost: the minimum over the few centers is then
    taken over long rows of memory, not over short ones."""
    partial = centers @ x.transpose(0, 2, 1)
    partial *= -2.0
    partial += np.where(present, np.einsum("bkp,bkp->bk", centers, centers), np.inf)[:, :, None]
    labels, best = _first_minimum(partial)
    best += x_sq
    return np.where(valid, labels, 0), np.where(valid, np.maximum(best, 0.0), 0.0)


def _first_minimum(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.argmin and np.min of values (B, k, P) over its middle axis (the first of equal minima), one
    center at a time: a pass over (B, P) per center costs less than argmin's reductions over k values
    that lie P apart."""
    best = values[:, 0].copy()
    labels = np.zeros(best.shape, dtype=np.int64)
    for center in range(1, values.shape[1]):
        closer = values[:, center] < best
        labels[closer] = center
        np.minimum(best, values[:, center], out=best)
    return labels, best


def _rough_centers(
    projected: np.ndarray, weights: np.ndarray, valid: np.ndarray, k: int, draws: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The rough clustering of alg. 1 on a block: for each device the best of its restarts (draws
    (B, restarts, ...)), each a greedy k-means++ seeding followed by ROUGH_LLOYD_ITERATIONS Lloyd rounds,
    by weighted cost in the projection; (B, k, rank) centers and which of them are present (a seeding
    that runs out of distinct rows has fewer).

    One rough clustering sometimes merges two close clusters, and every later step inherits it; the
    projection has only k dimensions, so trying several costs little next to the Lloyd rounds on the
    original rows. A device whose seeding runs out of distinct rows is seeded one restart after the
    other (kmeans_plusplus stops there) from the same draws.
    """
    origin = np.einsum("bp,bpr->br", weights, projected) / weights.sum(axis=1)[:, None]
    x = np.where(valid[:, :, None], projected - origin[:, None, :], 0.0)
    centers, costs, ran_out = _rough_clusterings(x, weights, valid, k, draws)
    present = np.ones(centers.shape[:3], dtype=bool)
    for device in np.flatnonzero(ran_out):
        mine = valid[device]
        for restart, restart_draws in enumerate(draws[device]):
            found, cost = _sequential_rough_clustering(x[device][mine], weights[device][mine], k, _Draws(restart_draws))
            centers[device, restart, : len(found)] = found
            present[device, restart] = np.arange(k) < len(found)
            costs[device, restart] = cost
    lowest = np.min(costs, axis=1, keepdims=True)
    best = np.argmax(costs <= lowest + COST_TIE * np.abs(lowest), axis=1)  # linalg.lowest_cost, per device
    devices = np.arange(len(x))
    return centers[devices, best] + origin[:, None, :], present[devices, best]


def _sequential_rough_clustering(x: np.ndarray, weights: np.ndarray, k: int, draws: _Draws) -> tuple[np.ndarray, float]:
    """One restart's rough centers (k or, where the distinct rows run out, fewer) and cost, for one device."""
    seeds = x[kmeans_plusplus(x, weights, k, draws)]
    found, _, sq_dist, _ = lloyd(x, weights, seeds, ROUGH_LLOYD_ITERATIONS, tol=0.0)
    return found, float(weights @ sq_dist)


def _rough_clusterings(
    x: np.ndarray, weights: np.ndarray, valid: np.ndarray, k: int, draws: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every device's and restart's k-means++ seeding and rough Lloyd rounds as arrays (B, restarts, ...):
    the draws in the order kmeans_plusplus takes them, the same choices up to floating-point rounding.
    Returns the centers (B, restarts, k, rank), their costs (B, restarts) and which devices ran out of
    distinct rows (their results are to be replaced: kmeans_plusplus would have stopped early).
    x must be near the origin; padded rows are zero with zero weight.
    """
    n_devices, restarts = draws.shape[:2]
    trials = 2 + int(np.log(k))
    norms = np.einsum("bpr,bpr->bp", x, x)
    last_row = valid.sum(axis=1) - 1
    # Every row within rounding of a seed (kmeans_plusplus's stop) leaves at most this potential.
    running_out = DUPLICATE_TOLERANCE * np.max(norms, axis=1) * weights.sum(axis=1)
    blocks, restart_axis = np.arange(n_devices)[:, None], np.arange(restarts)[None, :]
    mass = np.cumsum(weights, axis=1)
    chosen = np.empty((n_devices, restarts, k), dtype=np.int64)
    chosen[:, :, 0] = _searched(mass[:, None, :], draws[:, :, :1] * mass[:, None, -1:], last_row[:, None])[:, :, 0]
    seeds = x[blocks, chosen[:, :, 0]]  # (B, restarts, rank)
    closest = np.maximum(
        norms[blocks, chosen[:, :, 0]][:, :, None] - 2.0 * seeds @ np.swapaxes(x, 1, 2) + norms[:, None, :], 0.0
    )
    minus_twice_xt = -2.0 * np.swapaxes(x, 1, 2)
    ran_out = np.zeros(n_devices, dtype=bool)
    for step in range(1, k):
        cumulative = np.cumsum(weights[:, None, :] * closest, axis=2)  # (B, restarts, P)
        ran_out |= np.any(cumulative[:, :, -1] <= running_out[:, None], axis=1)
        targets = draws[:, :, 1 + (step - 1) * trials : 1 + step * trials] * cumulative[:, :, -1:]
        candidates = _searched(cumulative, targets, last_row[:, None])  # (B, restarts, trials)
        flat = candidates.reshape(n_devices, restarts * trials)
        candidate_closest = x[blocks, flat] @ minus_twice_xt  # (B, restarts * trials, P)
        candidate_closest += norms[blocks, flat][:, :, None]
        candidate_closest += norms[:, None, :]
        np.maximum(candidate_closest, 0.0, out=candidate_closest)
        candidate_closest = np.minimum(
            candidate_closest.reshape(n_devices, restarts, trials, -1), closest[:, :, None, :]
        )
        best = np.argmin(candidate_closest @ weights[:, None, :, None], axis=2)[:, :, 0]  # (B, restarts)
        chosen[:, :, step] = candidates[blocks, restart_axis, best]
        closest = candidate_closest[blocks, restart_axis, best]
    # Lloyd rounds on each (device, restart) pair as a device of its own.
    pairs, pair_weights = n_devices * restarts, np.repeat(weights, restarts, axis=0)
    centers, _, sq_dist = _lloyd(
        np.repeat(x, restarts, axis=0),
        pair_weights,
        np.repeat(valid, restarts, axis=0),
        x[blocks[:, :, None], chosen].reshape(pairs, k, -1),
        np.ones((pairs, k), dtype=bool),
        ROUGH_LLOYD_ITERATIONS,
        tol=0.0,
    )
    costs = np.einsum("bp,bp->b", sq_dist, pair_weights).reshape(n_devices, restarts)
    return centers.reshape(n_devices, restarts, k, -1), costs, ran_out


def _searched(cumulative: np.ndarray, targets: np.ndarray, last_row: np.ndarray) -> np.ndarray:
    """np.searchsorted(cumulative, targets, side="right") along the last axis, for many rows at once,
    at most last_row: the draw of a row with probability proportional to its increment."""
    return np.minimum(np.sum(cumulative[..., None, :] <= targets[..., None], axis=-1), last_row[..., None])


def _margin_initial_centers(
    rows: np.ndarray,
    projected: np.ndarray,
    weights: np.ndarray,
    valid: np.ndarray,
    rough: np.ndarray,
    present: np.ndarray,
) -> np.ndarray:
    """Alg. 1's initial centers (B, k, d): for each rough center, the mean of the ORIGINAL rows of the
    points that are at least MARGIN times closer to it than to any other rough center.

    A rough center that keeps no point falls back to the mean of its whole cell (zero if empty).
    """
    k = rough.shape[1]
    partial = -2.0 * rough @ projected.transpose(0, 2, 1)  # (B, k, P): see _nearest
    partial += np.where(present, np.einsum("bkr,bkr->bk", rough, rough), np.inf)[:, :, None]
    partial += np.einsum("bpr,bpr->bp", projected, projected)[:, None, :]
    dist = np.sqrt(np.maximum(partial, 0.0))
    labels = np.where(valid, np.argmin(dist, axis=1), 0)
    if k > 1:
        nearest_two = np.partition(dist, 1, axis=1)
        kept = MARGIN * nearest_two[:, 0] <= nearest_two[:, 1]
    else:
        kept = np.ones(labels.shape, dtype=bool)
    cells = _by_label(labels, weights, k)
    margins = _by_label(labels, np.where(kept, weights, 0.0), k)
    cell_mass, margin_mass = cells.sum(axis=2), margins.sum(axis=2)
    cell_means = (cells @ rows) / np.where(cell_mass > 0, cell_mass, 1.0)[:, :, None]
    margin_means = (margins @ rows) / np.where(margin_mass > 0, margin_mass, 1.0)[:, :, None]
    return np.where(margin_mass[:, :, None] > 0, margin_means, cell_means)


def _lloyd(
    x: np.ndarray,
    weights: np.ndarray,
    valid: np.ndarray,
    centers: np.ndarray,
    present: np.ndarray,
    max_iter: int,
    tol: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """linalg.lloyd on every device of a block (x (B, P, d) near the origin, centers (B, k, d), absent
    ones never taken): each device stops where linalg.lloyd stops on it alone, and stops costing work
    there. Returns the centers, each row's label and squared distance to its center."""
    k = centers.shape[1]
    x_sq = np.einsum("bpd,bpd->bp", x, x)
    scale = np.einsum("bp,bp->b", weights, x_sq) / weights.sum(axis=1)
    scale[scale == 0] = 1.0
    centers = centers.copy()
    labels, sq_dist = _nearest(x, x_sq, centers, present, valid)
    active = np.arange(len(x))
    for _ in range(max_iter):
        if not len(active):
            break
        by_label = _by_label(labels[active], weights[active], k)
        mass = by_label.sum(axis=2)
        moved = mass > 0
        means = (by_label @ x[active]) / np.where(moved, mass, 1.0)[:, :, None]
        old = centers[active]
        shift = np.max(np.where(moved, np.sum((means - old) ** 2, axis=2), 0.0), axis=1)
        centers[active] = np.where(moved[:, :, None], means, old)
        new_labels, new_sq_dist = _nearest(x[active], x_sq[active], centers[active], present[active], valid[active])
        unchanged = np.all(new_labels == labels[active], axis=1)
        labels[active], sq_dist[active] = new_labels, new_sq_dist
        active = active[~(unchanged | (shift <= tol * scale[active]))]
    return centers, labels, sq_dist


def _private_local_steps(
    x: np.ndarray, starts: np.ndarray, devices: np.ndarray, ks: np.ndarray, params: AlgorithmParams, noise_key: int
) -> DevicesCenters:
    """The local step in alg. 1's place when privacy_epsilon is set, on devices of at most about ROWS_PER_PASS
    rows: what each device shares is (privacy_epsilon, privacy_delta)-differentially private per row
    (kfed_spark.core.privacy).

    Rows are clipped into the box of privacy_bounds. privacy_rounds noisy Lloyd rounds follow, each
    moving every center to its cluster's noisy sum over its noisy count, clipped into the box; a
    center whose noisy count is under 1 stays where it was and shares a count of 0. The centers
    start as one, at the box's center, and double before each round (split along random directions
    from device_rng, the run seed's; the heaviest split first) until there are k, all k by the last
    round: bisecting, so that no starting center is placed by looking at the rows. The counts shared
    are the last round's, rounded; the SSE is not shared (NaN).

    How many centers each round has depends on k alone, and so do how many directions and noise values a
    device draws: each device draws them all from its own generators first, and devices of one k and one
    padded row count (padded_rows) then run their rounds together as arrays.
    """
    sizes, d = np.diff(starts), x.shape[1]
    parts = []
    # The largest arrays of a block: its rows (B, P, d), and a row's distance to each center (B, k, P).
    for members, k, width in _blocks(np.arange(len(devices)), sizes, ks, lambda k: max(d, k)):
        rows, valid, _ = _padded(x, starts[members], sizes[members], width)
        rounds = _private_round_centers(k, params.privacy_rounds)
        directions, normals = _private_draws(params.seed, noise_key, devices[members], rounds, d)
        found = _private_block_steps(rows, valid, k, directions, normals, params)
        parts.append(dataclasses.replace(found, owner=members[found.owner]))
    return DevicesCenters.joined(parts, d)


def _private_round_centers(k: int, rounds: int) -> list[int]:
    """How many centers each round of the private local step has: doubling from one, k in the last."""
    return [k if round_ == rounds - 1 else min(k, 2**round_) for round_ in range(rounds)]


def _private_draws(
    seed: int, noise_key: int, devices: np.ndarray, rounds: list[int], d: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each device's standard normal draws for the private local step, rows in the devices' order: the split
    directions (B, (k - 1) d) from device_rng(seed, device), and each round's noise, its centers' sums (m, d)
    then counts (m,), one round after the other (B, sum of m (d + 1)) from noise_rng(noise_key, device)."""
    return device_normals(seed, devices, (rounds[-1] - 1) * d), noise_normals(noise_key, devices, sum(rounds) * (d + 1))


def _private_block_steps(
    x: np.ndarray, valid: np.ndarray, k: int, directions: np.ndarray, normals: np.ndarray, params: AlgorithmParams
) -> DevicesCenters:
    """The private local step (_private_local_steps) on a block of B devices padded to one row count P: x
    (B, P, d) with zero rows where valid (B, P) is False, each device's draws (_private_draws) in the rows of
    directions and normals. The owners of the result are positions in the block."""
    if params.privacy_epsilon is None or params.privacy_bounds is None:
        raise ValueError("the private local step needs privacy_epsilon and privacy_bounds")
    low, high = params.privacy_bounds
    middle, half = (low + high) / 2, (high - low) / 2
    n_devices, _, d = x.shape
    rows = np.where(valid[:, :, None], np.clip(x, low, high) - middle, 0.0)
    norms = np.einsum("bpd,bpd->bp", rows, rows)
    weights = valid.astype(np.float64)
    scales = NoiseScales.of(params.privacy_epsilon, params.privacy_delta, params.privacy_rounds, (low, high), d)
    centers, counts = np.zeros((n_devices, 1, d)), np.zeros((n_devices, 1))
    split_at, noise_at = 0, 0  # where the round's draws start
    for wanted in _private_round_centers(k, params.privacy_rounds):
        new = wanted - centers.shape[1]
        centers = _split(centers, counts, directions[:, split_at : split_at + new * d].reshape(n_devices, new, d), half)
        labels, _ = _nearest(rows, norms, centers, np.ones(centers.shape[:2], dtype=bool), valid)
        round_normals = normals[:, noise_at : noise_at + wanted * (d + 1)]
        sums, counts = noisy_cluster_sums(rows, weights, labels, scales, round_normals)
        split_at, noise_at = split_at + new * d, noise_at + wanted * (d + 1)
        moved = counts >= 1
        means = np.clip(sums / np.where(moved, counts, 1.0)[:, :, None], -half, half)
        centers = np.where(moved[:, :, None], means, centers)
    shared_counts = np.where(moved, np.rint(counts), 0).astype(np.int64)
    owner = np.repeat(np.arange(n_devices), centers.shape[1])
    return DevicesCenters(owner, (centers + middle).reshape(-1, d), shared_counts.ravel(), np.full(len(owner), np.nan))


def noisy_cluster_sums(
    rows: np.ndarray, weights: np.ndarray, labels: np.ndarray, scales: NoiseScales, normals: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One round's release of the private local step on a block of devices: the (B, m, d) sums and (B, m) counts
    of the rows (B, P, d) by label (B, P), weights (B, P) one for a row and zero for padding, each with its
    Gaussian noise (scales: kfed_spark.core.privacy) from standard normal draws (B, m (d + 1)): the sums' first,
    then the counts'. rows are clipped into the box and taken about its center, so one row moves a sum by at
    most scales.radius."""
    n_devices, _, d = rows.shape
    m = normals.shape[1] // (d + 1)
    by_label = _by_label(labels, weights, m)
    sums = by_label @ rows + scales.sum_sigma * normals[:, : m * d].reshape(n_devices, m, d)
    return sums, by_label.sum(axis=2) + scales.count_sigma * normals[:, m * d :]


def _split(centers: np.ndarray, counts: np.ndarray, directions: np.ndarray, half: float) -> np.ndarray:
    """centers (B, m, d) plus, for each of directions (B, new, d), a copy of the heaviest centers (by counts, in
    turn) moved a hair along that direction: the next assignment cuts each split cluster by a random hyperplane
    through its center."""
    if not directions.shape[1]:
        return centers
    order = np.argsort(-counts, axis=1, kind="stable")
    parents = order[:, np.arange(directions.shape[1]) % centers.shape[1]]
    unit = directions / np.linalg.norm(directions, axis=2, keepdims=True)
    moved = np.take_along_axis(centers, parents[:, :, None], axis=1) + SPLIT_STEP * half * unit
    return np.concatenate([centers, moved], axis=1)


def device_local_step(
    x: np.ndarray, k: int, device: object, params: AlgorithmParams, noise_key: int | None = None
) -> DeviceCenters:
    """One device's local centers: local_steps on it alone."""
    one = np.array([device], dtype=object)
    return local_steps(x, np.array([0, len(x)]), one, np.array([k]), params, noise_key).of_device(0)


def estimated_ks(x: np.ndarray, starts: np.ndarray, k_max: int) -> np.ndarray:
    """estimate_local_k of every device's rows x[starts[i]:starts[i + 1]] (k_per_device: auto), the devices
    with the same number of distinct rows together: a few numpy calls per such group, not per device (an SVD
    per device costs several times a small device's whole local step). Each device's matrix is the one it
    would have alone, so its estimate does not depend on the other devices."""
    distinct, counts, owner = distinct_rows(x, np.repeat(np.arange(len(starts) - 1), np.diff(starts)))
    sizes = np.bincount(owner, minlength=len(starts) - 1)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    ks = np.maximum(1, np.minimum(k_max, sizes))  # at most two distinct rows: one cluster per row
    d = x.shape[1]
    for n in np.unique(sizes[sizes > 2]):
        group = np.flatnonzero(sizes == n)
        per_block = max(1, BATCH_ELEMENTS // (n * d))
        for start in range(0, len(group), per_block):
            members = group[start : start + per_block]
            index = first[members][:, None] + np.arange(n)
            ks[members] = _signal_ks(distinct[index], counts[index], k_max)
    return ks


def _signal_ks(rows: np.ndarray, counts: np.ndarray, k_max: int) -> np.ndarray:
    """estimate_local_k's estimate for devices of n distinct rows each: rows (B, n, d), counts (B, n) their
    multiplicities."""
    n, d = rows.shape[1:]
    weights = counts.astype(np.float64)[:, :, None]
    mean = (rows * weights).sum(axis=1) / weights.sum(axis=1)  # as np.average sums, row after row
    singular = np.linalg.svd((rows - mean[:, None, :]) * np.sqrt(weights), compute_uv=False)
    beta = min(n, d) / max(n, d)
    omega = 0.56 * beta**3 - 0.95 * beta**2 + 1.82 * beta + 1.43
    signal = np.sum(singular > omega * np.median(singular, axis=1, keepdims=True), axis=1)
    return np.minimum(np.minimum(k_max, 1 + signal), n)


def estimate_local_k(x: np.ndarray, k_max: int) -> int:
    """How many clusters one device's rows hold, in [1, k_max], from its singular values alone.

    k separated clusters put k - 1 directions of between-cluster spread into the centered rows;
    noise spreads evenly over the rest. A direction counts as signal when its singular value is
    above the Gavish-Donoho hard threshold for unknown noise, omega(beta) times the median
    singular value (Gavish and Donoho 2014, beta = aspect ratio of the matrix), of the device's
    distinct rows weighted by their multiplicities. The estimate is 1 + the number of such
    directions, so it needs d >= k - 1 and roughly isotropic noise; on data with structure in many
    directions (images) it stays at k_max.
    """
    return int(estimated_ks(x, np.array([0, len(x)]), k_max)[0])
