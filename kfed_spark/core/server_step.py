"""The server step (alg. 2 of Dennis, Li and Smith, ICML 2021): all devices' local centers merged
into k global clusters on the driver: numpy, no Spark.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kfed_spark.core.linalg import (
    DUPLICATE_TOLERANCE,
    _draw,
    centered,
    device_rng,
    kmeans_plusplus,
    lloyd,
    lowest_cost,
    nearest_center,
    plain,
    too_few_distinct,
    weighted_means,
)
from kfed_spark.params import DEFAULTS, SEEDINGS, AlgorithmParams


@dataclass(frozen=True)
class GlobalClusters:
    """Global centers and, for every local center, the global cluster it belongs to."""

    centers: np.ndarray  # (k, d) float64
    assignment: np.ndarray  # (m,) int64, in the order the local centers were given
    seed_device: object  # the device whose centers seeded the farthest-point search
    refine_iterations: int


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
) -> GlobalClusters:
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
    k, refine, seeding = params.fixed_k, params.server_refine, params.seeding
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
    return GlobalClusters(global_centers, assignment, seed_device, rounds)


def warm_seeds(x: np.ndarray, weights: np.ndarray, initial: np.ndarray, params: AlgorithmParams) -> np.ndarray:
    """k seeds from earlier centers over the weighted local centers x: of the initial centers that some
    local center is nearest to, the k with the most weight nearest them (ties: the earlier one); then,
    while fewer than k, the local center farthest from the seeds (seeding farthest) or one drawn in
    proportion to weight times squared distance (kmeanspp, seeded from the run seed)."""
    x, origin = centered(x, weights)
    seeds = initial - origin
    nearest, _ = nearest_center(x, seeds)
    mass = np.bincount(nearest, weights=weights, minlength=len(seeds))
    kept = np.sort(np.argsort(-mass, kind="stable")[: params.fixed_k])
    seeds = seeds[kept[mass[kept] > 0]]  # an earlier center no local center is nearest to: its cluster is gone
    rng = device_rng(params.seed, f"{SERVER_RNG_KEY}warm")
    _, to_seeds = nearest_center(x, seeds)
    while len(seeds) < params.fixed_k:
        score = weights * to_seeds
        if not np.any(score > 0):
            raise too_few_distinct(params.fixed_k, len(seeds))
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
    sample_size = sample_size or KMEANSPP_SAMPLE_PER_CLUSTER * params.fixed_k
    sample = np.arange(len(x))
    if len(x) > sample_size:
        rng = device_rng(params.seed, f"{SERVER_RNG_KEY}sample")
        sample = np.sort(rng.choice(len(x), sample_size, replace=False))
    tried = []
    for restart in range(KMEANSPP_RESTARTS):
        rng = device_rng(params.seed, f"{SERVER_RNG_KEY}{restart}")
        seeds = kmeans_plusplus(x[sample], weights[sample], params.fixed_k, rng)
        if len(seeds) < params.fixed_k:
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
