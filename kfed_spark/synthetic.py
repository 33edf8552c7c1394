"""Heterogeneous Gaussian mixtures spread over devices, as in the paper's synthetic study."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kfed_spark.kernels import device_rng

MEAN_SCALE = 4.0
"""Cluster means are drawn from N(0, MEAN_SCALE^2 I); points add N(0, I) noise: well separated."""


def mixture(
    k: int, k_per_device: int, devices: int, points_per_device: int, dim: int, seed: int
) -> pa.Table:
    """Each device holds k_per_device of the k clusters (drawn without replacement) in equal odds.

    Columns: row_id, device_id, features (list<double>), true_cluster. Everything is drawn from
    the seed, device by device, so the same arguments give the same table.
    """
    if not 1 <= k_per_device <= k:
        raise ValueError(f"k_per_device must be between 1 and k ({k}), got {k_per_device}")
    means = np.random.default_rng([seed, 0xC0FFEE]).normal(0.0, MEAN_SCALE, size=(k, dim))
    features = np.empty((devices * points_per_device, dim))
    truth = np.empty(devices * points_per_device, dtype=np.int32)
    for device in range(devices):
        rng = device_rng(seed, device)
        held = rng.choice(k, size=k_per_device, replace=False)
        rows = slice(device * points_per_device, (device + 1) * points_per_device)
        truth[rows] = held[rng.integers(0, k_per_device, size=points_per_device)]
        features[rows] = means[truth[rows]] + rng.standard_normal((points_per_device, dim))
    n = len(truth)
    offsets = np.arange(0, n * dim + 1, dim, dtype=np.int32)
    return pa.table(
        {
            "row_id": pa.array(np.arange(n, dtype=np.int64)),
            "device_id": pa.array(np.repeat(np.arange(devices, dtype=np.int64), points_per_device)),
            "features": pa.ListArray.from_arrays(offsets, pa.array(features.ravel())),
            "true_cluster": pa.array(truth),
        }
    )


def write_mixture(path: str | Path, **kwargs) -> pa.Table:
    """Write mixture(**kwargs) as one Parquet file inside the folder path; returns the table."""
    table = mixture(**kwargs)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.parquet"):
        old.unlink()
    pq.write_table(table, folder / "part-0.parquet", row_group_size=100_000)
    return table
