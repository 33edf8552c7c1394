"""What a run reports about its rows, gathered in the pass that labels them instead of passes of
its own: the device profiles (the device_clusters table) and the evaluation.

Each Python worker adds up, over the labelled rows of its partition, each (device, global cluster)
pair's rows and squared distances to the global center, the truth x cluster counts, each truth
class's moments (rows, sum, sum of squared norms), each global cluster's moments per feature (the
cluster_profiles: kfed_spark.core.profiles) and the rows whose seeded hash falls under a threshold
(the sample of the report and the heterogeneity check). It hands them to Spark as one small text on the partition's
last row; the driver collects the blobs with an Observation and merges them (Evaluation.merge). The
same rows, figures and sample come out however the rows are partitioned. Pure numpy and pandas.
"""

from __future__ import annotations

import base64
import pickle
import zlib
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kfed_spark.core.metrics import contingency, within_cluster_cost
from kfed_spark.core.profiles import ClusterMoments
from kfed_spark.core.sampling import row_hashes

NULL_TRUTH = "\0null"
"""The truth class of rows whose truth value is null (truth values are compared as text)."""


@dataclass(frozen=True)
class EvaluationSpec:
    """What a worker gathers: per-class figures if truth_col is set, sample rows (hash < sample_below), and
    the clusters' moments per feature with profiles."""

    truth_col: str | None
    sample_below: int
    seed: int
    profiles: bool = False

    @classmethod
    def of(
        cls, truth_col: str | None, sample_rows: int, expected_rows: int, seed: int, profiles: bool = False
    ) -> EvaluationSpec:
        """Aim at four times sample_rows sampled rows out of expected_rows, so that the merge almost
        surely finds sample_rows of them; the merge keeps the sample_rows smallest hashes."""
        share = 0.0 if sample_rows == 0 else min(1.0, 4.0 * sample_rows / max(expected_rows, 1))
        return cls(truth_col, min(int(share * 2.0**64), 2**64 - 1), seed, profiles)


class PartitionEvaluation:
    """What one partition's labelled rows add to the evaluation.

    The class moments are taken of the rows minus origin (the labelling model's), the same point in
    every partition: the planted cost from them is then as accurate far from the origin as near it.
    """

    def __init__(self, spec: EvaluationSpec, origin: np.ndarray):
        self.spec = spec
        self.origin = origin
        self.device_clusters: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.cells: list[pd.Series] = []
        self.moments: list[pd.DataFrame] = []
        self.sample: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.cluster_moments: list[ClusterMoments] = []

    def add(
        self, devices: np.ndarray, truth: pa.Array | None, x: np.ndarray, cluster: np.ndarray, sq_dist: np.ndarray
    ) -> None:
        """Labelled rows: their devices, truth values (None without a truth column), features, clusters
        and squared distances to their global centers."""
        if len(x):
            self.device_clusters.append(pair_sums(devices, cluster, sq_dist))
            if self.spec.profiles:
                self.cluster_moments.append(ClusterMoments.of(x, cluster))
        if self.spec.sample_below:
            hashes = row_hashes(x, self.spec.seed)
            chosen = hashes < np.uint64(self.spec.sample_below)
            self.sample.append((hashes[chosen], x[chosen], cluster[chosen], devices[chosen]))
        if truth is None or len(x) == 0:
            return
        classes = pc.fill_null(pc.cast(truth, pa.string()), NULL_TRUTH).to_numpy(zero_copy_only=False)
        self.cells.append(pd.Series(cluster).groupby([classes, cluster]).size())
        moved = x - self.origin
        sums = pd.DataFrame(moved).groupby(classes).sum()
        sums["n"] = pd.Series(classes).value_counts()
        sums["sum_sq"] = pd.Series(np.einsum("ij,ij->i", moved, moved)).groupby(classes).sum()
        self.moments.append(sums)

    def to_text(self) -> str:
        """The partition's figures as ASCII text (compressed, base64): Spark hands the driver an
        Observation's strings at C speed, its binary values a byte at a time through Python."""
        figures = (
            pairs_added(self.device_clusters),
            _added(self.cells),
            _added(self.moments),
            tuple(np.concatenate(part) for part in zip(*self.sample)) if self.sample else None,
            ClusterMoments.merge(self.cluster_moments, len(self.origin)) if self.cluster_moments else None,
        )
        return base64.b64encode(zlib.compress(pickle.dumps(figures, protocol=pickle.HIGHEST_PROTOCOL), 1)).decode()


def pair_sums(
    devices: np.ndarray, cluster: np.ndarray, sq_dist: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows (n_points) and their sum of squared distances (sum_sq_dist) per (device, cluster) pair of a batch,
    as arrays (devices, clusters, n_points, sum_sq_dist), the pairs in no particular order: hash codes of the
    devices and of the pairs, then bincounts (a groupby on two keys costs a batch several times more)."""
    device_codes, device_ids = pd.factorize(devices)
    width = int(cluster.max()) + 1
    pair_codes, pairs = pd.factorize(device_codes * width + cluster)
    return device_ids[pairs // width], pairs % width, np.bincount(pair_codes), np.bincount(pair_codes, weights=sq_dist)


def pairs_added(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> pd.DataFrame | None:
    """Batches' pair_sums as one frame indexed by (device, cluster), each pair's added up; None if there are
    none. The index is built once per partition, not per batch: it costs a batch more than its sums."""
    if not parts:
        return None
    devices, clusters, n_points, sums = (np.concatenate(column) for column in zip(*parts))
    index = pd.MultiIndex.from_arrays([devices, clusters])
    return pd.DataFrame({"n_points": n_points, "sum_sq_dist": sums}, index=index).groupby(level=[0, 1]).sum()


def _added(parts: list):
    """Series or frames indexed by class (and cluster), added up; None if there are none."""
    return pd.concat(parts).groupby(level=list(range(parts[0].index.nlevels))).sum() if parts else None


@dataclass(frozen=True)
class Evaluation:
    """The merged figures: every (device, cluster) pair's rows and sum of squared distances
    (device_clusters, indexed by the pair), truth x cluster counts and the planted clusters' cost
    (None without a truth column), the sampled rows with their clusters and devices, and the clusters'
    moments per feature (None without profiles)."""

    device_clusters: pd.DataFrame
    cells: np.ndarray | None
    truth_cost: float | None
    sample_x: np.ndarray
    sample_labels: np.ndarray
    sample_devices: np.ndarray
    cluster_moments: ClusterMoments | None = None

    @classmethod
    def merge(cls, blobs: list[str], sample_rows: int, dim: int) -> Evaluation:
        """The partitions' figures (PartitionEvaluation.to_text) merged."""
        parts = [pickle.loads(zlib.decompress(base64.b64decode(blob))) for blob in blobs]
        profiles = _added([p[0] for p in parts if p[0] is not None])
        if profiles is None:
            no_pairs = pd.MultiIndex.from_arrays([[], np.empty(0, np.int64)])
            profiles = pd.DataFrame({"n_points": [], "sum_sq_dist": []}, index=no_pairs, dtype=np.float64)
        cells = _added([p[1] for p in parts if p[1] is not None])
        moments = _added([p[2] for p in parts if p[2] is not None])
        samples = [p[3] for p in parts if p[3] is not None]
        moments_parts = [p[4] for p in parts if p[4] is not None]
        cluster_moments = ClusterMoments.merge(moments_parts, dim) if moments_parts else None
        hashes, x, labels, devices = (
            (np.concatenate(column) for column in zip(*samples))
            if samples
            else (np.empty(0, np.uint64), np.empty((0, dim)), np.empty(0, np.int64), np.empty(0, object))
        )
        keep = np.lexsort((labels, hashes))[:sample_rows]  # by hash: the same whatever the partitions
        sample = (x[keep], labels[keep], devices[keep])
        if cells is None:
            return cls(profiles, None, None, *sample, cluster_moments)
        classes, clusters = (cells.index.get_level_values(level).to_numpy() for level in (0, 1))
        truth_cost = within_cluster_cost(
            moments["n"].to_numpy(), moments[list(range(dim))].to_numpy(), moments["sum_sq"].to_numpy()
        )
        return cls(profiles, contingency(classes, clusters, cells.to_numpy()), truth_cost, *sample, cluster_moments)
