"""What sets each cluster apart, feature by feature: pure numpy, no Spark.

The labelling pass adds up, per partition and global cluster, the rows, their mean and their sum of
squared deviations from it (ClusterMoments.of, a batch at a time); the driver merges them (Chan, Golub and
LeVeque's pairwise update, which stays exact where clusters lie far from the origin, unlike sums of
squares) and turns them into the cluster_profiles rows: each cluster's and the population's mean and
standard deviation of every feature, and their standardized difference, the cluster's mean minus the
population's over the population's standard deviation: a ratio of spreads, the same whatever the feature's
unit. Standard deviations are the sample's (n - 1), as SQL's stddev.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa


def default_feature_names(dim: int) -> list[str]:
    """f0 ... f{dim-1}: the names of features that came without any."""
    return [f"f{j}" for j in range(dim)]


@dataclass(frozen=True)
class ClusterMoments:
    """Per cluster (ids, ascending): rows, mean and sum of squared deviations from the mean, per feature."""

    ids: np.ndarray  # (c,)
    n: np.ndarray  # (c,)
    mean: np.ndarray  # (c, d)
    m2: np.ndarray  # (c, d)

    @classmethod
    def of(cls, x: np.ndarray, cluster: np.ndarray) -> ClusterMoments:
        """The moments of rows x (n, d) labelled cluster (n,): sums by (cluster, feature) with one bincount over
        the flattened cells, then the squared deviations from the means the same way."""
        position, ids = pd.factorize(cluster, sort=True)
        k, d = len(ids), x.shape[1]
        n = np.bincount(position, minlength=k)
        cells = (position[:, None] * d + np.arange(d)).ravel()
        mean = np.bincount(cells, weights=x.ravel(), minlength=k * d).reshape(k, d) / np.maximum(n, 1)[:, None]
        deviation = x - mean[position]
        m2 = np.bincount(cells, weights=(deviation * deviation).ravel(), minlength=k * d).reshape(k, d)
        return cls(ids.astype(np.int64), n.astype(np.int64), mean, m2)

    @classmethod
    def merge(cls, parts: list[ClusterMoments], dim: int) -> ClusterMoments:
        """Moments of the same clusters from several parts, combined by id."""
        ids = np.unique(np.concatenate([p.ids for p in parts])) if parts else np.empty(0, np.int64)
        n = np.zeros(len(ids), np.int64)
        mean, m2 = np.zeros((len(ids), dim)), np.zeros((len(ids), dim))
        for part in parts:
            at = np.searchsorted(ids, part.ids)
            n[at], mean[at], m2[at] = combined(n[at], mean[at], m2[at], part.n, part.mean, part.m2)
        return cls(ids, n, mean, m2)

    def population(self) -> tuple[int, np.ndarray, np.ndarray]:
        """(rows, mean, sum of squared deviations) of all the clusters' rows together: the clusters' own
        squared deviations plus their rows' times their mean's squared distance to the population's."""
        n = int(self.n.sum())
        mean = (self.n[:, None] * self.mean).sum(axis=0) / max(n, 1)
        apart = self.mean - mean
        return n, mean, self.m2.sum(axis=0) + (self.n[:, None] * apart * apart).sum(axis=0)


def combined(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    """Two groups' (rows, mean, squared deviations) as one group's, row by row of the arrays."""
    n = n_a + n_b
    safe = np.maximum(n, 1)[:, None]
    delta = mean_b - mean_a
    mean = mean_a + delta * (n_b[:, None] / safe)
    m2 = m2_a + m2_b + delta * delta * (n_a[:, None] * n_b[:, None] / safe)
    return n, mean, m2


def profiles_table(moments: ClusterMoments, feature_names: list[str]) -> pa.Table:
    """The cluster_profiles rows (the columns of kfed_spark.store.tables.CLUSTER_PROFILE_FIELDS): one per
    cluster and feature, each cluster's features ranked by how far its mean stands from the population's (1:
    the largest absolute standardized difference). A feature constant over the population has no standardized
    difference (null), nor a cluster of one row a standard deviation."""
    k, d = moments.mean.shape
    n_all, population_mean, population_m2 = moments.population()
    population_sd = np.sqrt(population_m2 / (n_all - 1)) if n_all > 1 else np.full(d, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        sd = np.where(moments.n[:, None] > 1, np.sqrt(moments.m2 / np.maximum(moments.n - 1, 1)[:, None]), np.nan)
        difference = np.where(population_sd > 0, (moments.mean - population_mean) / population_sd, np.nan)
    order = np.argsort(-np.nan_to_num(np.abs(difference), nan=-1.0), axis=1, kind="stable")
    rank = np.empty((k, d), np.int32)
    np.put_along_axis(rank, order, np.arange(1, d + 1, dtype=np.int32)[None].repeat(k, axis=0), axis=1)

    def column(values: np.ndarray) -> pa.Array:
        flat = np.asarray(values, dtype=np.float64).ravel()
        return pa.array(flat, mask=np.isnan(flat), type=pa.float64())

    return pa.table(
        {
            "cluster_id": pa.array(np.repeat(moments.ids, d), type=pa.int32()),
            "feature": pa.array(np.tile(np.asarray(feature_names, dtype=object), k), type=pa.string()),
            "position": pa.array(np.tile(np.arange(d), k), type=pa.int32()),
            "rank": pa.array(rank.ravel(), type=pa.int32()),
            "n_points": pa.array(np.repeat(moments.n, d), type=pa.int64()),
            "share_of_rows": pa.array(np.repeat(moments.n / max(n_all, 1), d), type=pa.float64()),
            "mean": column(moments.mean),
            "sd": column(sd),
            "population_mean": column(np.tile(population_mean, k)),
            "population_sd": column(np.tile(population_sd, k)),
            "standardized_difference": column(difference),
        }
    )
