"""Labelling rows with a finished clustering: each row's local center on its device, its global
cluster, distance and margin. Only LabelModel's device lookup uses pandas (a hash index: device ids
may be strings).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kfed_spark.core.linalg import DISTANCE_CHUNK_ELEMENTS, centered, plain


def nearest_device_center(
    x: np.ndarray,
    slots: np.ndarray,
    device_centers: np.ndarray,
    device_center_valid: np.ndarray,
    center_sq: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """For each row, the nearest of its own device's local centers.

    device_centers is (devices, k', d), padded; device_center_valid (devices, k') marks real
    centers; center_sq (devices, k') their squared norms (squared_norms, once per model); slots gives
    each row's device index. Returns (local index, squared distance).
    """
    dist = np.einsum("ij,ij->i", x, x)[:, None] - 2.0 * _products(x, slots, device_centers)
    dist += center_sq[slots]
    np.maximum(dist, 0.0, out=dist)
    dist[~device_center_valid[slots]] = np.inf
    labels = np.argmin(dist, axis=1)
    return labels, dist[np.arange(len(x)), labels]


ROWS_PER_DEVICE_PRODUCT = 64
"""A batch whose devices hold at least this many of its rows on average is multiplied device by device."""


def _products(x: np.ndarray, slots: np.ndarray, device_centers: np.ndarray) -> np.ndarray:
    """(n, k'): each row's dot product with each of its device's centers. Where devices hold many rows each,
    a device's rows against its own centers at a time (a slice of x per run of rows of one device, as rows
    arrive grouped; else the device's rows gathered); else each row against a copy of its device's centers
    (one copy per row costs less than a numpy call per device). The same sums every way."""
    out = np.empty((len(x), device_centers.shape[1]))
    runs = np.flatnonzero(slots[1:] != slots[:-1]) + 1
    if len(x) >= ROWS_PER_DEVICE_PRODUCT * (len(runs) + 1):
        for start, end in zip([0, *runs.tolist()], [*runs.tolist(), len(x)]):
            np.einsum("ij,kj->ik", x[start:end], device_centers[slots[start]], out=out[start:end])
        return out
    order = np.argsort(slots, kind="stable")
    bounds = np.flatnonzero(slots[order][1:] != slots[order][:-1]) + 1
    if len(x) < ROWS_PER_DEVICE_PRODUCT * (len(bounds) + 1):
        return np.einsum("ij,ikj->ik", x, device_centers[slots])
    for rows in np.split(order, bounds):
        out[rows] = np.einsum("ij,kj->ik", x[rows], device_centers[slots[rows[0]]])
    return out


def squared_norms(device_centers: np.ndarray) -> np.ndarray:
    """(devices, k') squared norms of padded local centers (devices, k', d)."""
    return np.einsum("ikj,ikj->ik", device_centers, device_centers)


@dataclass(frozen=True)
class LabelModel:
    """Everything needed to label a row: each device's local centers and their global clusters.

    Devices are rows of padded arrays: device_centers (devices, k', d), center_valid (devices,
    k'), center_cluster (devices, k'; -1: the row's nearest global center), center_local (devices,
    k': the local_cluster_id its rows get, -1 for a held-back center, whose rows get none). Centers
    are held relative to origin, the global centers' mean, and rows are moved by it before any
    distance (see the module's docstring). It travels to the workers inside the labelling function,
    which Spark broadcasts once it is large.

    With label_unseen, a row of a device the model has no local centers for takes the nearest global
    center and local cluster -1 (what streams and the estimator's transform do: the label then depends
    on the row alone, never on which other rows of its device arrived with it); without, it is an error.
    """

    devices: np.ndarray
    device_centers: np.ndarray  # relative to origin
    center_valid: np.ndarray
    center_cluster: np.ndarray
    center_local: np.ndarray
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
        held_back: np.ndarray | None = None,
    ) -> "LabelModel":
        """The model of local centers (device, local id, center, global cluster); held_back marks centers
        that no global cluster took, whose rows get the nearest global center and no local cluster."""
        keys, slot = np.unique(np.asarray(devices), return_inverse=True)
        width = int(np.max(local_ids)) + 1
        global_centers, origin = centered(np.asarray(global_centers, dtype=np.float64))
        device_centers = np.zeros((len(keys), width, centers.shape[1]))
        center_valid = np.zeros((len(keys), width), dtype=bool)
        center_cluster = np.full((len(keys), width), -1, dtype=np.int64)
        center_local = np.full((len(keys), width), -1, dtype=np.int64)
        device_centers[slot, local_ids] = centers - origin
        center_valid[slot, local_ids] = True
        center_cluster[slot, local_ids] = clusters
        center_local[slot, local_ids] = np.where(held_back, -1, local_ids) if held_back is not None else local_ids
        return cls(
            keys,
            device_centers,
            center_valid,
            center_cluster,
            center_local,
            global_centers,
            origin,
            label_mode,
            label_unseen,
            None if cluster_ids is None else np.asarray(cluster_ids, dtype=np.int64),
        )

    @functools.cached_property
    def center_sq(self) -> np.ndarray:
        """The local centers' squared norms (devices, k'), computed once per model."""
        return squared_norms(self.device_centers)

    @functools.cached_property
    def device_index(self) -> pd.Index:
        """The devices' hash index, built once per model (a worker labels many batches with one model)."""
        return pd.Index(self.devices)

    def label(self, devices: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(local_cluster_id, cluster_id, squared distance to the global center, margin) per row; the
        cluster ids are cluster_ids' (positions of the global centers without them)."""
        x = x - self.origin
        slots = self.device_index.get_indexer(devices)
        unseen = slots < 0
        if np.any(unseen) and not self.label_unseen:
            raise ValueError(f"device {plain(devices[np.flatnonzero(unseen)[0]])!r} has no local centers in this model")
        seen = np.flatnonzero(~unseen) if np.any(unseen) else slice(None)  # a slice: no copy of x in the usual case
        local = np.full(len(x), -1, dtype=np.int64)
        assigned = np.full(len(x), -1, dtype=np.int64)  # -1: the nearest global center
        nearest, _ = nearest_device_center(x[seen], slots[seen], self.device_centers, self.center_valid, self.center_sq)
        local[seen] = self.center_local[slots[seen], nearest]
        if self.label_mode != "nearest":
            assigned[seen] = self.center_cluster[slots[seen], nearest]
        cluster, sq_dist, margin = assigned_with_margin(x, self.global_centers, assigned)
        if self.label_mode != "nearest":  # the exact distance to the assigned center, as the cost adds it up
            held = assigned < 0  # unseen devices' and held-back centers' rows: the nearest center's distance
            induced = np.flatnonzero(~held) if held.any() else slice(None)
            diff = x[induced] - self.global_centers[cluster[induced]]
            sq_dist[induced] = np.einsum("ij,ij->i", diff, diff)
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
    minus_twice = -2.0 * centers.T  # scaling by -2 is exact: the same sums as -2 (x @ c)
    step = max(1, DISTANCE_CHUNK_ELEMENTS // len(centers))
    for start in range(0, len(x), step):
        chunk = slice(start, start + step)
        # |c|^2 - 2 x.c orders the centers as the squared distance does; |x|^2 is added to the two kept only.
        partial = x[chunk] @ minus_twice
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
