"""Heterogeneous Gaussian mixtures spread over devices, as in the paper's synthetic study."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from kfed_spark.bench.datasets import write_parquet_folder
from kfed_spark.core.linalg import device_rng
from kfed_spark.core.local_centers import features_array

MEAN_SCALE = 4.0
"""Cluster means are drawn from N(0, MEAN_SCALE^2 I); points add N(0, I) noise: well separated."""


def mixture(
    k: int,
    k_per_device: int | tuple[int, int],
    devices: int,
    points_per_device: int,
    dim: int,
    seed: int,
    wide: int = 0,
) -> pa.Table:
    """Each device holds k_per_device of the k clusters (drawn without replacement) in equal odds.

    Columns: row_id, device_id, features (list<double>), true_cluster. With k_per_device a range
    (low, high), each device draws how many clusters it holds from it, and a column
    clusters_held says how many. With wide > 0, that many more columns follow (extra_columns), as
    real feature tables carry. Everything is drawn from the seed, device by device, so the same
    arguments give the same table.
    """
    low, high = k_per_device if isinstance(k_per_device, tuple) else (k_per_device, k_per_device)
    if not 1 <= low <= high <= k:
        raise ValueError(f"k_per_device must be between 1 and k ({k}), got {k_per_device}")
    means = np.random.default_rng([seed, 0xC0FFEE]).normal(0.0, MEAN_SCALE, size=(k, dim))
    features = np.empty((devices * points_per_device, dim))
    truth = np.empty(devices * points_per_device, dtype=np.int32)
    held_counts = np.empty(devices, dtype=np.int32)
    for device in range(devices):
        rng = device_rng(seed, device)
        held_counts[device] = rng.integers(low, high + 1) if high > low else low
        held = rng.choice(k, size=held_counts[device], replace=False)
        rows = slice(device * points_per_device, (device + 1) * points_per_device)
        truth[rows] = held[rng.integers(0, held_counts[device], size=points_per_device)]
        features[rows] = means[truth[rows]] + rng.standard_normal((points_per_device, dim))
    n = len(truth)
    columns = {
        "row_id": pa.array(np.arange(n, dtype=np.int64)),
        "device_id": pa.array(np.repeat(np.arange(devices, dtype=np.int64), points_per_device)),
        "features": features_array(features),
        "true_cluster": pa.array(truth),
    }
    if high > low:
        columns["clusters_held"] = pa.array(np.repeat(held_counts, points_per_device))
    return pa.table({**columns, **extra_columns(n, wide, seed)})


WIDE_STRINGS = 1000
"""Distinct values of each string column extra_columns adds."""


def extra_columns(n: int, wide: int, seed: int) -> dict[str, pa.Array]:
    """wide columns of n rows that clustering does not read: doubles (extra_0, extra_2, ...) and
    short strings (extra_1, extra_3, ...) alternating."""
    rng = np.random.default_rng([seed, 0x3D1E])
    vocabulary = pa.array([f"value-{i:04d}" for i in range(WIDE_STRINGS)])
    columns = {}
    for i in range(wide):
        if i % 2 == 0:
            columns[f"extra_{i}"] = pa.array(rng.standard_normal(n))
        else:
            codes = pa.array(rng.integers(0, WIDE_STRINGS, size=n, dtype=np.int32))
            columns[f"extra_{i}"] = pa.DictionaryArray.from_arrays(codes, vocabulary).cast(pa.string())
    return columns


CLOSE_SEPARATION = 4.0 * np.sqrt(2.0)
"""close_means_mixture: the median distance from a cluster mean to its nearest other mean, in noise
standard deviations (two clusters' 2-sigma spheres touch along the line between them)."""


def close_means_mixture(
    seed: int, k: int = 49, per_device: int = 7, devices: int = 300, dim: int = 32, rows: tuple[int, int] = (50, 800)
) -> pa.Table:
    """A harder heterogeneous mixture: close cluster means (CLOSE_SEPARATION) and uneven devices,
    each holding per_device of the k clusters and rows[0] to rows[1] rows. Columns as mixture()."""
    means = np.random.default_rng([seed, 0xC105E]).normal(size=(k, dim))
    means *= CLOSE_SEPARATION / median_nearest_mean_distance(means)
    return devices_table(means, seed, "close-means", devices, per_device, rows)


def median_nearest_mean_distance(means: np.ndarray) -> float:
    """The median over the means of the distance to the nearest other mean."""
    gaps = np.sqrt(((means[:, None] - means[None]) ** 2).sum(axis=2))
    np.fill_diagonal(gaps, np.inf)
    return float(np.median(gaps.min(axis=1)))


UNEVEN_DECAY = 0.9
"""uneven_mixture: cluster j's share of the rows is proportional to UNEVEN_DECAY^j."""


def uneven_mixture(
    seed: int, k: int = 36, k_per_device: int = 4, devices: int = 300, dim: int = 16, rows: tuple[int, int] = (50, 400)
) -> pa.Table:
    """A heterogeneous mixture of very uneven cluster sizes: well separated means (as mixture()'s), each
    device holding k_per_device clusters drawn evenly and rows[0] to rows[1] rows, shared among its
    clusters in proportion to UNEVEN_DECAY^j (at k = 36 the rarest clusters hold under 1% of the rows).
    Columns as mixture()."""
    means = np.random.default_rng([seed, 0x5EED]).normal(0.0, MEAN_SCALE, size=(k, dim))
    return devices_table(means, seed, "uneven", devices, k_per_device, rows, UNEVEN_DECAY ** np.arange(k))


def devices_table(
    means: np.ndarray,
    seed: int,
    key: str,
    devices: int,
    per_device: int,
    rows: tuple[int, int],
    shares: np.ndarray | None = None,
) -> pa.Table:
    """Devices of rows[0] to rows[1] rows, each holding per_device of the clusters of `means` (drawn
    evenly), each row's cluster drawn evenly among them or in proportion to `shares`, plus unit
    Gaussian noise; drawn device by device from (seed, key, device). Columns as mixture()."""
    parts, truths, owners = [], [], []
    for device in range(devices):
        rng = device_rng(seed, (key, device))
        held = rng.choice(len(means), size=per_device, replace=False)
        n = int(rng.integers(rows[0], rows[1] + 1))
        picked = (
            rng.integers(0, per_device, size=n)
            if shares is None
            else rng.choice(per_device, size=n, p=shares[held] / shares[held].sum())
        )
        truth = held[picked]
        parts.append(means[truth] + rng.standard_normal((n, means.shape[1])))
        truths.append(truth.astype(np.int32))
        owners.append(np.full(n, device, dtype=np.int64))
    features = np.concatenate(parts)
    return pa.table(
        {
            "row_id": pa.array(np.arange(len(features), dtype=np.int64)),
            "device_id": pa.array(np.concatenate(owners)),
            "features": features_array(features),
            "true_cluster": pa.array(np.concatenate(truths)),
        }
    )


def write_mixture(path: str | Path, **kwargs) -> pa.Table:
    """Write mixture(**kwargs) as one Parquet file inside the folder path; returns the table."""
    table = mixture(**kwargs)
    write_parquet_folder(table, path)
    return table


def two_days(
    k: int = 20,
    k_per_device: int = 4,
    devices: int = 200,
    points_per_device: int = 100,
    dim: int = 16,
    seed: int = 0,
    replaced: float = 0.15,
) -> tuple[pa.Table, pa.Table]:
    """Two days of one device population, as a nightly run sees them (columns as mixture()).

    Day 1: k clusters (means as mixture()'s) over `devices` devices, each holding k_per_device of
    them. Day 2: every device's rows drawn again, a `replaced` share of the devices replaced by new
    ones (new device ids), cluster 0 moved by one noise standard deviation (a unit step along a random
    direction), cluster k - 1 gone (its holders hold cluster k instead) and cluster k new.
    """
    rng = np.random.default_rng([seed, 0x2DA45])
    means = rng.normal(0.0, MEAN_SCALE, size=(k + 1, dim))
    step = rng.standard_normal(dim)
    day_two_means = means.copy()
    day_two_means[0] += step / np.linalg.norm(step)
    held = np.array(
        [device_rng(seed, ("held", device)).choice(k, size=k_per_device, replace=False) for device in range(devices)]
    )
    n_replaced = int(round(replaced * devices))
    replacing = held[:n_replaced].copy()  # a replaced device's successor holds what it held
    day_two_held = np.concatenate([held[n_replaced:], replacing])
    day_two_held[day_two_held == k - 1] = k
    day_two_ids = np.concatenate([np.arange(n_replaced, devices), np.arange(devices, devices + n_replaced)])

    def day(day_means, day_held, ids, key) -> pa.Table:
        parts, truths = [], []
        for device, clusters in zip(ids, day_held):
            draw = device_rng(seed, (key, int(device)))
            truth = clusters[draw.integers(0, k_per_device, size=points_per_device)]
            parts.append(day_means[truth] + draw.standard_normal((points_per_device, dim)))
            truths.append(truth.astype(np.int32))
        features = np.concatenate(parts)
        return pa.table(
            {
                "row_id": pa.array(np.arange(len(features), dtype=np.int64)),
                "device_id": pa.array(np.repeat(np.asarray(ids, dtype=np.int64), points_per_device)),
                "features": features_array(features),
                "true_cluster": pa.array(np.concatenate(truths)),
            }
        )

    return day(means, held, np.arange(devices), "day-1"), day(day_two_means, day_two_held, day_two_ids, "day-2")
