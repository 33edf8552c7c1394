"""Every device's shared local centers, as the server step, labelling and the k sweep take them: numpy arrays
over an Arrow table (what the local step's output holds, and what the `local_centers` table stores)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kfed_spark.core.k_sweep import KSweep, sweep
from kfed_spark.core.labels import LabelModel
from kfed_spark.core.linalg import nearest_center
from kfed_spark.errors import KFedError
from kfed_spark.params import AlgorithmParams


def feature_matrix(column: pa.Array | pa.ChunkedArray, dim: int | None = None) -> np.ndarray:
    """(n, dim) float64 view of a list<double> column whose rows all have dim values (by default, as
    many as the values divide evenly)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    values = column.flatten().to_numpy(zero_copy_only=False)
    return values.reshape(len(column), -1 if dim is None else dim)


def features_array(x: np.ndarray) -> pa.ListArray:
    """(n, d) numbers as a list<double> column: feature_matrix's inverse."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    offsets = np.arange(0, x.size + 1, x.shape[1], dtype=np.int32)
    return pa.ListArray.from_arrays(offsets, pa.array(x.ravel()))


@dataclass(frozen=True)
class LocalCenters:
    """Every device's local centers, in an Arrow table (as the local step returns them from Spark and the
    local_centers table stores them) and numpy views of it: each center's device, its id within the device,
    the center, its rows and its sum of squared errors.

    held_back: the local centers of fewer than min_center_points rows (held_back_from), which never
    join a global cluster nor the local_centers table: they only mark their rows, which the label
    model gives the nearest global center and no local cluster."""

    table: pa.Table
    devices: np.ndarray
    ids: np.ndarray
    centers: np.ndarray
    counts: np.ndarray
    sse: np.ndarray
    held_back: LocalCenters | None = None

    @classmethod
    def of(
        cls, devices: np.ndarray, ids: np.ndarray, centers: np.ndarray, counts: np.ndarray, sse: np.ndarray
    ) -> LocalCenters:
        """From the local step's arrays (one process, no Spark), with their Arrow table."""
        table = pa.table(
            {
                "device_id": pa.array(devices),
                "local_cluster_id": pa.array(ids, type=pa.int32()),
                "center": features_array(centers),
                "n_points": pa.array(counts, type=pa.int64()),
                "sse": pa.array(sse, type=pa.float64()),
            }
        )
        return cls(table, devices, ids, centers, counts, sse)

    @classmethod
    def from_arrow(cls, table: pa.Table, dim: int) -> LocalCenters:
        return cls(
            table=table,
            devices=table.column("device_id").to_numpy(zero_copy_only=False),
            ids=table.column("local_cluster_id").to_numpy(),
            centers=feature_matrix(table.column("center"), dim),
            counts=table.column("n_points").to_numpy(),
            sse=table.column("sse").to_numpy(),  # NaN where a private device shared none
        )

    def held_back_from(self, min_points: int) -> LocalCenters:
        """These centers as a device may share them, those of at least min_points rows (a center of
        fewer is nearly the rows themselves), with the rest held back."""
        small = pc.less(self.table.column("n_points"), min_points)
        shared = LocalCenters.from_arrow(self.table.filter(pc.invert(small)), self.centers.shape[1])
        held = LocalCenters.from_arrow(self.table.filter(small), self.centers.shape[1])
        return dataclasses.replace(shared, held_back=held)

    def sweep(self, ks: list[int], params: AlgorithmParams) -> KSweep:
        """The server step for every k of ks over these local centers, with its figures (kfed_spark.core.k_sweep)."""
        if np.isnan(self.sse).any():
            raise KFedError("the k sweep needs every local center's SSE, which a private run's devices do not share")
        try:
            return sweep(self.centers, self.counts, self.sse, self.devices, self.ids, ks, params)
        except ValueError as exc:  # k above the distinct local centers, or below a device's count with farthest
            raise KFedError(f"the k sweep cannot run: {exc}") from None

    def joined(
        self, new: "LocalCenters", assignment: np.ndarray, centers: np.ndarray
    ) -> tuple["LocalCenters", np.ndarray]:
        """These local centers (each in the global cluster `assignment` gives) and the new ones after them, each
        new one in the cluster of its nearest center: how a model takes devices it has not seen."""
        table = pa.concat_tables([self.table, new.table.cast(self.table.schema)])
        joined = nearest_center(new.centers, centers)[0] if len(new.counts) else np.zeros(0, dtype=assignment.dtype)
        held = [part.held_back.table.cast(self.table.schema) for part in (self, new) if part.held_back is not None]
        found = LocalCenters.from_arrow(table, centers.shape[1])
        if held:
            found = dataclasses.replace(
                found, held_back=LocalCenters.from_arrow(pa.concat_tables(held), centers.shape[1])
            )
        return found, np.concatenate([assignment, joined])

    def label_model(
        self,
        assignment: np.ndarray,
        centers: np.ndarray,
        label_mode: str,
        label_unseen: bool = False,
        cluster_ids: np.ndarray | None = None,
    ) -> LabelModel:
        """What labels rows with these local centers, given the global cluster each joined (its position in
        centers) and the centers, with their published ids (default: their positions). The held-back
        centers' rows take the nearest global center and no local cluster."""
        held = self.held_back or LocalCenters.from_arrow(self.table.slice(0, 0), self.centers.shape[1])
        return LabelModel.build(
            np.concatenate([self.devices, held.devices]),
            np.concatenate([self.ids, held.ids]),
            np.concatenate([self.centers, held.centers]),
            np.concatenate([assignment, np.full(len(held.counts), -1, dtype=np.asarray(assignment).dtype)]),
            centers,
            label_mode,
            label_unseen,
            cluster_ids,
            held_back=np.arange(len(self.counts) + len(held.counts)) >= len(self.counts),
        )
