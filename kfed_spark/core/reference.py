"""k-FED in one process over a whole table in memory: the reference the Spark job is tested against,
and the benchmarks' no-Spark floor.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from kfed_spark.core.local_centers import LocalCenters
from kfed_spark.core.local_step import estimated_ks, local_steps
from kfed_spark.core.server_step import GlobalClusters, server_step
from kfed_spark.params import DEFAULTS, AlgorithmParams

LABEL_CHUNK_ROWS = 1 << 16
"""federated_kmeans labels this many rows at a time, as a worker labels one Arrow batch."""


@dataclass(frozen=True)
class FederatedClustering:
    """k-FED over all devices in one process: per-row labels plus what the Spark job also reports."""

    labels: np.ndarray  # (n,) global cluster per row
    local_labels: np.ndarray  # (n,) local cluster per row, within its device
    server: GlobalClusters
    local_counts: np.ndarray  # (m,) points per local center
    local_devices: np.ndarray  # (m,) device of each local center


def local_clusterings(
    x: np.ndarray, devices: np.ndarray, params: AlgorithmParams = DEFAULTS, noise_key: int | None = None
) -> LocalCenters:
    """Alg. 1 on every device's rows, with params' k_per_device (a number or "auto": each device's
    estimate_local_k, at most min(largest_k, k_per_device_max)), local_restarts, max_iter, tol and seed;
    with privacy_epsilon set, the private local step with noise from noise_key (or a fresh one). The
    centers of fewer than min_center_points rows come back held back (LocalCenters.held_back), as the
    Spark job's driver holds them."""
    if params.privacy_epsilon is not None and noise_key is None:
        noise_key = secrets.randbits(128)
    order = np.argsort(devices, kind="stable")
    keys, starts = np.unique(devices[order], return_index=True)
    bounds = np.append(starts, len(order))
    rows = x[order]
    if params.k_per_device == "auto":
        ks = estimated_ks(rows, bounds, min(params.largest_k, params.k_per_device_max))
    else:
        ks = np.full(len(keys), int(params.k_per_device), dtype=np.int64)
    found = local_steps(rows, bounds, keys, ks, params, noise_key)
    found = found.shared_first(params.min_center_points)
    every = LocalCenters.of(keys[found.owner], found.ids(), found.centers, found.counts, found.sse)
    return every.held_back_from(params.min_center_points)


def federated_kmeans(
    x: np.ndarray,
    devices: np.ndarray,
    params: AlgorithmParams = DEFAULTS,
    local: LocalCenters | None = None,
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
    server = server_step(local.centers, local.counts, local.devices, local.ids, params, initial)
    # a device whose every local center was too small to share: as an unseen one
    model = local.label_model(server.assignment, server.centers, params.label_mode, label_unseen=True)
    local_labels = np.empty(len(x), dtype=np.int64)
    labels = np.empty(len(x), dtype=np.int64)
    for start in range(0, len(x), LABEL_CHUNK_ROWS):
        chunk = slice(start, start + LABEL_CHUNK_ROWS)
        local_labels[chunk], labels[chunk], _, _ = model.label(devices[chunk], x[chunk])
    return FederatedClustering(labels, local_labels, server, local.counts, local.devices)
