"""Cluster ids that keep their meaning from run to run: numpy (and the Arrow rows of cluster_changes), no Spark.

A run's global clusters are matched one to one to a reference run's (by default the location's newest
published run of another run id) at the lowest total cost, where a pair's cost is the distance between
their centers over the pair's gate. The gate is the smaller of
- the pair's spread: the pooled root-mean-square distance of both clusters' rows to their centers,
  times MATCH_SPREADS, and
- half the distance from the reference center to its nearest other reference center, so that a
  matched center is nearer its reference center than any other reference center is.
A pair beyond its gate is never matched. Matched clusters take the reference's id; the others are new
and take ids above the highest ever used in the location (an id is never reused); reference clusters
left unmatched are retired. Every figure is a ratio of distances: shifting or scaling the features
changes no match.

A cluster's spread comes from the local centers alone (their counts, their sums of squared errors
and their distances to the global center), as the run's within-cluster sum of squares does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
from scipy.optimize import linear_sum_assignment

from kfed_spark.core.linalg import between_sse, squared_distances

MATCH_SPREADS = 1.0
"""A cluster whose center moved more than this many times its rows' root-mean-square distance to the
center (pooled over the two runs) is a new cluster, not the old one moved."""

KEPT, NEW, RETIRED = "kept", "new", "retired"

PSI_FLOOR = 0.5
"""Rows a kept cluster counts at least in the population stability index, whose log ratio an empty
cluster would make infinite."""

DRIFT_COLUMNS = (
    "cluster_mix_psi",
    "share_in_new_clusters",
    "share_in_retired_clusters",
    "largest_relative_shift",
    "share_of_devices_moved",
)
"""The runs row's figures of how a run's clusters moved from its reference run's (drift())."""


@dataclass(frozen=True)
class ClusterSummary:
    """What matching knows of a run's global clusters, in the order of its centers."""

    ids: np.ndarray  # (k,) published ids
    centers: np.ndarray  # (k, d)
    n_points: np.ndarray  # (k,) rows
    sse: np.ndarray  # (k,) the rows' sum of squared distances to their center
    n_devices: np.ndarray  # (k,) devices with a local center in the cluster

    @classmethod
    def of(
        cls,
        ids: np.ndarray,
        centers: np.ndarray,
        assignment: np.ndarray,
        local_centers: np.ndarray,
        local_counts: np.ndarray,
        local_sse: np.ndarray,
        local_devices: np.ndarray,
    ) -> "ClusterSummary":
        """From a run's global centers and its local centers (each with its position in `centers`):
        a cluster's SSE is its local centers' SSEs plus each one's count times its squared distance to
        the global center (linalg.between_sse)."""
        k = len(centers)
        within = np.nan_to_num(local_sse)  # a private device shares no SSE: its spread is its centers' alone
        sse = np.bincount(
            assignment, weights=within + between_sse(local_centers, local_counts, centers, assignment), minlength=k
        )
        device_index = np.unique(local_devices, return_inverse=True)[1]
        pairs = np.unique(np.stack([assignment, device_index]), axis=1)
        return cls(
            np.asarray(ids, dtype=np.int64),
            centers,
            np.bincount(assignment, weights=local_counts, minlength=k).astype(np.int64),
            sse,
            np.bincount(pairs[0], minlength=k).astype(np.int64),
        )


@dataclass(frozen=True)
class Matching:
    """The ids of a run's clusters, and how each relates to the reference run's."""

    ids: np.ndarray  # (k,) the id of each of the run's clusters
    reference: np.ndarray  # (k,) position of the matched reference cluster, -1 for a new one
    retired: np.ndarray  # positions of the reference clusters no cluster of the run matched
    center_shift: np.ndarray  # (k,) distance to the matched reference center (NaN for a new cluster)
    relative_shift: np.ndarray  # (k,) center_shift over the pair's pooled spread (NaN for a new cluster)

    @property
    def status(self) -> list[str]:
        return [KEPT if j >= 0 else NEW for j in self.reference]


def fresh_ids(k: int, next_id: int) -> Matching:
    """Ids for a run with nothing to match: next_id, next_id + 1, ... in the order of its centers."""
    nothing = np.full(k, np.nan)
    return Matching(np.arange(next_id, next_id + k), np.full(k, -1), np.zeros(0, dtype=np.int64), nothing, nothing)


def match_clusters(current: ClusterSummary, reference: ClusterSummary, next_id: int) -> Matching:
    """Match the run's clusters to the reference run's (see the module's docstring); new clusters take
    next_id, next_id + 1, ... in the order of their centers."""
    origin = reference.centers.mean(axis=0)  # near the origin: accurate expanded distances (kernels' docstring)
    ours, theirs = current.centers - origin, reference.centers - origin
    shift = np.sqrt(squared_distances(ours, theirs))
    pooled = pooled_spread(current.sse[:, None], current.n_points[:, None], reference.sse[None, :], reference.n_points)
    gate = MATCH_SPREADS * pooled
    if len(theirs) > 1:
        between = np.sqrt(squared_distances(theirs, theirs))
        np.fill_diagonal(between, np.inf)
        gate = np.minimum(gate, between.min(axis=1)[None, :] / 2.0)
    allowed = shift <= gate
    cost = np.where(allowed, np.divide(shift, gate, out=np.zeros(shift.shape), where=gate > 0), 1e6)
    rows, cols = linear_sum_assignment(cost)
    keep = allowed[rows, cols]
    rows, cols = rows[keep], cols[keep]
    matched = np.full(len(ours), -1)
    matched[rows] = cols
    new = np.flatnonzero(matched < 0)
    ids = np.empty(len(ours), dtype=np.int64)
    ids[rows] = reference.ids[cols]
    ids[new] = np.arange(next_id, next_id + len(new))
    center_shift = np.full(len(ours), np.nan)
    relative_shift = np.full(len(ours), np.nan)
    center_shift[rows] = shift[rows, cols]
    relative_shift[rows] = np.divide(
        shift[rows, cols], pooled[rows, cols], out=np.zeros(len(rows)), where=pooled[rows, cols] > 0
    )
    retired = np.setdiff1d(np.arange(len(theirs)), cols)
    return Matching(ids, matched, retired, center_shift, relative_shift)


def pooled_spread(sse: np.ndarray, n_points: np.ndarray, other_sse: np.ndarray, other_n: np.ndarray) -> np.ndarray:
    """The root-mean-square distance of two clusters' rows to their centers, pooled (0 without rows); broadcasts."""
    sse_sum, n_sum = np.broadcast_arrays(sse + other_sse, n_points + other_n)
    return np.sqrt(np.divide(sse_sum, n_sum, out=np.zeros(sse_sum.shape), where=n_sum > 0))


def matching_by_ids(current: ClusterSummary, reference: ClusterSummary) -> Matching:
    """How clusters that already have their ids relate to a reference run's: a cluster is kept when the
    reference has its id (the shifts measured to that cluster), new otherwise; reference ids no cluster
    has are retired. For an attempt that kept its ids from an earlier attempt of its run (`forget`)."""
    position = {int(i): j for j, i in enumerate(reference.ids)}
    matched = np.array([position.get(int(i), -1) for i in current.ids], dtype=np.int64)
    rows, cols = np.flatnonzero(matched >= 0), matched[matched >= 0]
    center_shift = np.full(len(current.ids), np.nan)
    relative_shift = np.full(len(current.ids), np.nan)
    center_shift[rows] = np.linalg.norm(current.centers[rows] - reference.centers[cols], axis=1)
    pooled = pooled_spread(current.sse[rows], current.n_points[rows], reference.sse[cols], reference.n_points[cols])
    relative_shift[rows] = np.divide(center_shift[rows], pooled, out=np.zeros(len(rows)), where=pooled > 0)
    retired = np.setdiff1d(np.arange(len(reference.ids)), cols)
    return Matching(np.asarray(current.ids, dtype=np.int64), matched, retired, center_shift, relative_shift)


@dataclass(frozen=True)
class ReferenceRun:
    """The published attempt a run's clusters are matched to."""

    run_id: str
    attempt_id: str
    clusters: ClusterSummary
    largest_share: pd.Series  # its largest_share()


def largest_share(devices: np.ndarray, clusters: np.ndarray, counts: np.ndarray) -> pd.Series:
    """Each device's cluster with the most of its rows, as its local centers count them (ties: the
    smaller id), indexed by device; from the local centers' (device, cluster id, rows)."""
    frame = (
        pd.DataFrame({"device_id": devices, "cluster_id": clusters, "n_points": counts})
        .groupby(["device_id", "cluster_id"], sort=False, as_index=False)
        .n_points.sum()
    )
    frame = frame.sort_values(["device_id", "n_points", "cluster_id"], ascending=[True, False, True], kind="stable")
    return frame.drop_duplicates("device_id").set_index("device_id")["cluster_id"]


def drift(changes: pa.Table, now: pd.Series, reference: ReferenceRun | None) -> dict[str, float | None]:
    """How far a run moved from its reference run, in one figure each (DRIFT_COLUMNS), from its cluster_changes
    rows and its devices' largest shares (`now`): the population stability index of the cluster mix over the
    kept clusters (sum of (p - q) ln(p / q), 0 for the same mix; above 0.25 is commonly read as a shift), the
    share of the run's rows in new clusters and of the reference's rows in retired ones, the largest center
    shift over its spread, and the share of the devices in both runs whose largest cluster changed. All None
    without a reference run."""
    if reference is None:
        return dict.fromkeys(DRIFT_COLUMNS)
    status = np.asarray(changes.column("status").to_pylist())
    n_points = np.asarray(changes.column("n_points").to_pylist(), dtype=np.float64)
    reference_n = np.asarray(changes.column("reference_n_points").to_pylist(), dtype=np.float64)
    kept = status == KEPT
    p, q = np.maximum(n_points[kept], PSI_FLOOR), np.maximum(reference_n[kept], PSI_FLOOR)
    p, q = p / p.sum(), q / q.sum()
    shifts = [v for v, k in zip(changes.column("relative_shift").to_pylist(), kept, strict=True) if k and v is not None]
    in_both = len(now.index.intersection(reference.largest_share.index))
    moved = sum(len(devices) for devices in changes.column("devices_in").to_pylist())
    current_rows, reference_rows = np.nansum(n_points[status != RETIRED]), np.nansum(reference_n[status != NEW])
    return {
        "cluster_mix_psi": float(np.sum((p - q) * np.log(p / q))) if kept.any() else None,
        "share_in_new_clusters": float(n_points[status == NEW].sum() / current_rows) if current_rows else None,
        "share_in_retired_clusters": float(reference_n[status == RETIRED].sum() / reference_rows)
        if reference_rows
        else None,
        "largest_relative_shift": max(shifts, default=None),
        "share_of_devices_moved": moved / in_both if in_both else None,
    }


def changes_table(
    matching: Matching,
    current: ClusterSummary,
    reference: ReferenceRun | None,
    now: pd.Series,
    device_type: pa.DataType,
) -> pa.Table:
    """The cluster_changes rows of a run: one per cluster of the run (kept or new) and one per retired
    cluster of the reference. A device moved in (out) of a cluster when it is in both runs and its
    largest share (`now`: the run's largest_share) is (was) in that cluster and was (is) in another."""
    retired = matching.retired
    if reference is None:
        before, ref_ids = pd.Series(dtype=object), np.zeros(0, dtype=np.int64)
    else:
        before, ref_ids = reference.largest_share, reference.clusters.ids
    both = now.index.intersection(before.index)
    now_both, before_both = now.loc[both], before.loc[both]
    moved = now_both != before_both
    into = now_both[moved].groupby(now_both[moved]).groups
    out_of = before_both[moved].groupby(before_both[moved]).groups

    def devices(groups, cluster_id) -> list:
        return sorted(groups.get(cluster_id, []))

    def referenced(values: np.ndarray, positions: np.ndarray) -> list:
        return [None if j < 0 else int(values[j]) for j in positions]

    ids = [int(i) for i in matching.ids] + [int(ref_ids[j]) for j in retired]
    ref_points = np.zeros(0) if reference is None else reference.clusters.n_points
    ref_devices = np.zeros(0) if reference is None else reference.clusters.n_devices
    shift = [None if np.isnan(v) else float(v) for v in matching.center_shift]
    relative = [None if np.isnan(v) else float(v) for v in matching.relative_shift]
    return pa.table(
        {
            "cluster_id": pa.array(ids, type=pa.int32()),
            "status": pa.array(matching.status + [RETIRED] * len(retired)),
            "reference_run_id": pa.array(
                [None if reference is None else reference.run_id] * len(ids), type=pa.string()
            ),
            "center_shift": pa.array(shift + [None] * len(retired), type=pa.float64()),
            "relative_shift": pa.array(relative + [None] * len(retired), type=pa.float64()),
            "n_points": pa.array([int(n) for n in current.n_points] + [None] * len(retired), type=pa.int64()),
            "reference_n_points": pa.array(
                referenced(ref_points, matching.reference) + [int(ref_points[j]) for j in retired], type=pa.int64()
            ),
            "n_devices": pa.array([int(n) for n in current.n_devices] + [None] * len(retired), type=pa.int64()),
            "reference_n_devices": pa.array(
                referenced(ref_devices, matching.reference) + [int(ref_devices[j]) for j in retired], type=pa.int64()
            ),
            "devices_in": pa.array([devices(into, i) for i in ids], type=pa.list_(device_type)),
            "devices_out": pa.array([devices(out_of, i) for i in ids], type=pa.list_(device_type)),
        }
    )
