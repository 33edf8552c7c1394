"""Choosing k from one run's local centers: numpy, no Spark, no pass over the rows.

The local step does not depend on k, and a run's local centers with their counts and squared errors
are all the server step needs, so sweep() runs the job's own server step for every k in a range over
them. Each k's figures are exact or drawn from those three arrays alone:

- sse: the within-cluster sum of squares over the rows, exact: the local centers' own SSE plus each
  local center's count times its squared distance to its global center (the between part).
- bic: a Gaussian BIC with one spherical variance per cluster (X-means' likelihood, each cluster's
  variance from its exact SSE), penalised by the parameters of k such clusters; higher is better.
- silhouette: the count-weighted silhouette of (a seeded sample of) the local centers, with the
  distance between two local clusters' rows taken as the root of its expected square (the centers'
  squared distance plus both clusters' own variance), so the rows' spread counts, not only the centers'.
- noise_ratio: the between part over what the local centers' own sampling error explains (a pure
  local cluster of n rows of variance v sits about v / n from its true mean, squared): about 1 once
  every true cluster has its own global center, far above while clusters are merged.
- stability: the count-weighted ARI between the server step with the run seed and with the next seed,
  for the candidate ks only (it costs a second server step).

The recommended k is the smallest whose BIC is within BIC_TOLERANCE nats per row of the best: past the
true k the BIC flattens and wobbles, and the smallest of the near-best is the one the data support.
Every shift or scaling of the features leaves every figure, and so the choice, unchanged.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from kfed_spark.core.linalg import between_sse, centered, device_rng, squared_distances
from kfed_spark.core.metrics import adjusted_rand_index
from kfed_spark.core.server_step import SERVER_RNG_KEY, server_step
from kfed_spark.params import AlgorithmParams

BIC_TOLERANCE = 0.005
"""Nats per row: ks whose BIC is this close to the best are as good as it; the smallest is recommended."""

NOISE_RATIO_LIMIT = 1.25
"""The noise rule's k: the smallest whose between part is at most this many times the sampling noise."""

SILHOUETTE_CENTERS = 1000
"""The silhouette is taken over at most this many local centers (a seeded sample; each weighs its count)."""

VARIANCE_FLOOR = 1e-9
"""A cluster's variance is at least this fraction of the data's (a cluster of one repeated row has none)."""

CRITERIA = ("bic", "silhouette", "noise_ratio")


@dataclass(frozen=True)
class KFigures:
    """One k of a sweep."""

    k: int
    sse: float
    between_sse: float
    bic: float
    silhouette: float
    noise_ratio: float | None  # None when no local center has two rows or more
    stability: float | None  # only for the candidate ks
    seconds: float


@dataclass(frozen=True)
class KSweep:
    """Every k's figures, the recommended k and what each criterion on its own would choose."""

    figures: list[KFigures]
    recommended_k: int
    choices: dict[str, int | None]  # criterion -> its k (noise_ratio: None if no k meets the limit)
    n_rows: int
    n_local_centers: int
    dim: int

    @property
    def rule(self) -> str:
        return (
            f"the smallest k whose BIC is within {BIC_TOLERANCE:g} nats per row ({BIC_TOLERANCE * self.n_rows:.4g} "
            f"in all) of the best"
        )

    @property
    def disagreements(self) -> list[str]:
        """What the other criteria choose where it is not the recommended k; a BIC still rising at the range's top."""
        said = [
            f"{name} chooses k = {k}"
            if k is not None
            else f"{name}: no k in the range is at most {NOISE_RATIO_LIMIT:g}"
            for name, k in self.choices.items()
            if k != self.recommended_k
        ]
        ks = [f.k for f in self.figures]
        if self.choices["bic"] == max(ks) and len(ks) > 1:
            said.append(f"the BIC is still rising at the top of the range (k = {max(ks)}): widen the range")
        return said

    def figure(self, k: int) -> KFigures:
        return next(f for f in self.figures if f.k == k)

    def as_dict(self) -> dict:
        return {
            "recommended_k": self.recommended_k,
            "rule": self.rule,
            "choices": self.choices,
            "disagreements": self.disagreements,
            "n_rows": self.n_rows,
            "n_local_centers": self.n_local_centers,
            "dim": self.dim,
            "figures": [dataclasses.asdict(f) for f in self.figures],
        }

    def text(self) -> str:
        """The sweep as a plain table, the recommendation and the disagreements below it."""
        lines = [f"{'k':>5} {'sse':>12} {'bic':>14} {'silhouette':>10} {'noise_ratio':>11} {'stability':>9}"]
        for f in self.figures:
            noise = "-" if f.noise_ratio is None else f"{f.noise_ratio:.3f}"
            stability = "" if f.stability is None else f"{f.stability:.3f}"
            mark = "  <- recommended" if f.k == self.recommended_k else ""
            lines.append(
                f"{f.k:>5} {f.sse:>12.6g} {f.bic:>14.8g} {f.silhouette:>10.4f} {noise:>11} {stability:>9}" + mark
            )
        lines.append(f"recommended k = {self.recommended_k}: {self.rule}")
        lines.extend(f"  {said}" for said in self.disagreements)
        return "\n".join(lines)


def k_values(lo: int, hi: int, step: int = 1) -> list[int]:
    """The ks of a range LO:HI[:STEP]: every STEP-th from LO, and HI."""
    if not 1 <= lo <= hi or step < 1:
        raise ValueError(f"a k range needs 1 <= LO <= HI and STEP >= 1, got {lo}:{hi}:{step}")
    return sorted({*range(lo, hi + 1, step), hi})


def sweep(
    centers: np.ndarray,
    counts: np.ndarray,
    sse: np.ndarray,
    devices: np.ndarray,
    local_ids: np.ndarray,
    ks: list[int],
    params: AlgorithmParams,
) -> KSweep:
    """The server step for every k of ks over these local centers (params' other settings), and its figures."""
    centers = np.asarray(centers, dtype=np.float64)
    weights = np.asarray(counts, dtype=np.float64)
    sse = np.asarray(sse, dtype=np.float64)
    x, _ = centered(centers, weights)  # distances are accurate to the spread (kernels' docstring)
    n_rows, dim = float(weights.sum()), centers.shape[1]
    total_variance = (sse.sum() + weights @ np.einsum("ij,ij->i", x, x)) / (n_rows * dim)
    noise = np.where(weights >= 2, sse / np.maximum(weights - 1, 1), 0.0)
    silhouette = CenterSilhouette.of(x, weights, sse, params.seed)
    figures, assignments = [], {}
    for k in ks:
        start = time.perf_counter()
        server = server_step(centers, counts, devices, local_ids, dataclasses.replace(params, k=k))
        assignments[k] = server.assignment
        between = between_sse(centers, weights, server.centers, server.assignment)
        figures.append(
            KFigures(
                k=k,
                sse=float(sse.sum() + between.sum()),
                between_sse=float(between.sum()),
                bic=bic(server.assignment, weights, sse + between, k, dim, total_variance),
                silhouette=silhouette.score(server.assignment),
                noise_ratio=float(between[weights >= 2].sum() / noise.sum()) if noise.sum() > 0 else None,
                stability=None,
                seconds=round(time.perf_counter() - start, 4),
            )
        )
    choices = criteria_choices(figures)
    recommended = recommended_k(figures, n_rows)
    for k in {recommended, *[k for k in choices.values() if k is not None]}:
        start = time.perf_counter()
        other = server_step(centers, counts, devices, local_ids, dataclasses.replace(params, k=k, seed=params.seed + 1))
        at = ks.index(k)
        figures[at] = dataclasses.replace(
            figures[at],
            stability=adjusted_rand_index(assignments[k], other.assignment, counts),
            seconds=round(figures[at].seconds + time.perf_counter() - start, 4),
        )
    return KSweep(figures, recommended, choices, int(n_rows), len(weights), dim)


def bic(assignment: np.ndarray, weights: np.ndarray, sse: np.ndarray, k: int, dim: int, total_variance: float) -> float:
    """BIC of k spherical Gaussians, one variance each, fitted by hard assignment: from each local center's
    count and its SSE about its global center (its own SSE plus the between part)."""
    n = np.bincount(assignment, weights=weights, minlength=k)
    cluster_sse = np.bincount(assignment, weights=sse, minlength=k)
    held = n > 0
    n, cluster_sse = n[held], cluster_sse[held]
    variance = np.maximum(cluster_sse / (n * dim), VARIANCE_FLOOR * total_variance)
    total = n.sum()
    log_likelihood = float(n @ np.log(n / total) - 0.5 * dim * (n @ (np.log(2 * np.pi * variance) + 1.0)))
    parameters = (k - 1) + k * dim + k
    return float(log_likelihood - 0.5 * parameters * np.log(total))


def criteria_choices(figures: list[KFigures]) -> dict[str, int | None]:
    """Each criterion's own k: the best BIC, the best silhouette, the smallest k within the noise limit."""
    return {
        "bic": max(figures, key=lambda f: f.bic).k,
        "silhouette": max(figures, key=lambda f: f.silhouette).k,
        "noise_ratio": next(
            (f.k for f in figures if f.noise_ratio is not None and f.noise_ratio <= NOISE_RATIO_LIMIT), None
        ),
    }


def recommended_k(figures: list[KFigures], n_rows: float) -> int:
    best = max(f.bic for f in figures)
    return min(f.k for f in figures if best - f.bic <= BIC_TOLERANCE * n_rows)


@dataclass(frozen=True)
class CenterSilhouette:
    """The silhouette of rows as their local centers stand for them, for any assignment of the centers.

    Between two local clusters (means c, c', variances v, v' per row, summed over the features) the
    expected squared distance of a row of one to a row of the other is |c - c'|^2 + v + v'; within one
    it is 2v. The distances are the roots of those, computed once over a seeded sample of at most
    SILHOUETTE_CENTERS local centers; each k then costs one matrix product.
    """

    distances: np.ndarray  # (s, s); the diagonal is the within distance
    weights: np.ndarray  # (s,) rows behind each sampled center
    sample: np.ndarray  # (s,) positions of the sampled centers

    @classmethod
    def of(cls, x: np.ndarray, weights: np.ndarray, sse: np.ndarray, seed: int) -> "CenterSilhouette":
        sample = np.arange(len(x))
        if len(x) > SILHOUETTE_CENTERS:
            rng = device_rng(seed, f"{SERVER_RNG_KEY}silhouette")
            sample = np.sort(rng.choice(len(x), SILHOUETTE_CENTERS, replace=False))
        variance = sse[sample] / weights[sample]
        squared = squared_distances(x[sample], x[sample]) + variance[:, None] + variance[None, :]
        np.fill_diagonal(squared, 2.0 * variance)
        return cls(np.sqrt(squared), weights[sample], sample)

    def score(self, assignment: np.ndarray) -> float:
        labels = np.unique(assignment[self.sample], return_inverse=True)[1]
        k = int(labels.max()) + 1
        if k < 2:
            return 0.0
        members = np.zeros((len(labels), k))
        members[np.arange(len(labels)), labels] = self.weights
        sums = self.distances @ members  # (s, k): weighted distance sums to each cluster's rows
        mass = members.sum(axis=0)
        own = np.arange(len(labels)), labels
        # Rows of the own cluster other than the row itself: its own local cluster counts one row fewer.
        own_sum = sums[own] - np.diag(self.distances)
        own_mass = mass[labels] - 1.0
        a = np.divide(own_sum, own_mass, out=np.zeros(len(labels)), where=own_mass > 0)
        other = sums / mass
        other[own] = np.inf
        b = other.min(axis=1)
        s = np.where(own_mass > 0, (b - a) / np.maximum(np.maximum(a, b), np.finfo(float).tiny), 0.0)
        return float(self.weights @ s / self.weights.sum())
