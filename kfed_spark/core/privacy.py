"""Differential privacy of what a device shares (privacy_epsilon): the noise each private local step
adds, calibrated to the guarantee.

The guarantee is per row: for every device, the local centers and counts it shares are
(epsilon, delta)-differentially private with respect to adding or removing one of its rows, and so
is everything computed from them alone. The private local step (local_step._private_local_steps) clips
every row into the box [lo, hi]^d of privacy_bounds, starts from one center at the box's center that
it splits without looking at the rows, and runs privacy_rounds Lloyd rounds; each round releases every
local cluster's sum of rows (taken about the box's center) and count, with Gaussian noise of standard
deviation sum_sigma and count_sigma.

Sensitivity: a row x in the box is within radius = sqrt(d) (hi - lo) / 2 of the box's center. In a
round the partition is fixed by the previous round's noisy centers (already released) and x alone,
so adding x changes one cluster's sum by x (about the box's center: norm at most radius) and its
count by 1. A round is then a Gaussian mechanism of sensitivity sqrt(radius^2 / sum_sigma^2 + 1 / count_sigma^2)
on the noise-scaled statistics: mu_round-GDP with mu_round that value (Dong, Roth and Su 2022,
theorem 2.7), and privacy_rounds adaptive rounds compose exactly to mu-GDP with
mu = sqrt(rounds) mu_round (their corollary 3.3). mu-GDP is (epsilon, delta)-DP for
delta = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2) (their corollary 2.13); we take
the largest mu that meets the asked delta at the asked epsilon, so no budget is left unspent.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass


def gdp_delta(epsilon: float, mu: float) -> float:
    """The delta at which mu-GDP is (epsilon, delta)-DP (exact, and increasing in mu)."""
    from scipy.special import log_ndtr, ndtr  # here, not at the top: every Python worker imports this module

    return float(ndtr(-epsilon / mu + mu / 2) - math.exp(epsilon + log_ndtr(-epsilon / mu - mu / 2)))


@functools.cache
def gdp_mu(epsilon: float, delta: float) -> float:
    """The largest mu whose mu-GDP is (epsilon, delta)-DP (computed once per budget: each device asks)."""
    from scipy.optimize import brentq

    high = 1.0
    while gdp_delta(epsilon, high) < delta:
        high *= 2
    return brentq(lambda mu: gdp_delta(epsilon, mu) - delta, 1e-9, high, xtol=1e-12, rtol=1e-12)


@dataclass(frozen=True)
class NoiseScales:
    """The noise of one private local step: per coordinate of each round's cluster sums, and of its counts."""

    sum_sigma: float
    count_sigma: float
    radius: float  # the largest distance of a clipped row from the box's center: the sums' sensitivity
    mu: float  # the whole step's GDP parameter

    @classmethod
    def of(cls, epsilon: float, delta: float, rounds: int, bounds: tuple[float, float], dim: int) -> "NoiseScales":
        """The scales that spend (epsilon, delta) over `rounds` rounds in a box of `dim` features.

        Each round gets an equal share of mu^2. Within a round, the share sqrt(d) / (sqrt(d) + 1)
        goes to the sums and the rest to the counts: that split minimises the noise a center
        (sum / count) gets from both, d sum_sigma^2 + radius^2 count_sigma^2 over count^2.
        """
        mu = gdp_mu(epsilon, delta)
        radius = math.sqrt(dim) * (bounds[1] - bounds[0]) / 2
        per_round = mu**2 / rounds
        sums_share = math.sqrt(dim) / (math.sqrt(dim) + 1)
        return cls(
            sum_sigma=radius / math.sqrt(sums_share * per_round),
            count_sigma=1 / math.sqrt((1 - sums_share) * per_round),
            radius=radius,
            mu=mu,
        )
