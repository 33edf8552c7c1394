"""Functions over Arrow record batches that Spark runs in its Python workers (mapInArrow).

They hold no Spark objects, so they can be tested with plain pyarrow batches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kfed_spark.core.evaluation import EvaluationSpec, PartitionEvaluation
from kfed_spark.core.labels import LabelModel
from kfed_spark.core.linalg import device_rng, nearest_center
from kfed_spark.core.local_centers import feature_matrix, features_array
from kfed_spark.core.local_step import DevicesCenters, estimated_ks, local_steps
from kfed_spark.core.sampling import row_hashes, smallest_hashes
from kfed_spark.core.server_step import representatives
from kfed_spark.params import AlgorithmParams
from kfed_spark.spark.columns import LOCAL_CENTER_COLUMNS

SQ_DIST_COL = "__kfed_sq_dist"
"""Internal column: a row's squared distance to its global center, summed into the run's cost."""

EVALUATION_COL = "__kfed_evaluation"
"""Internal column: a partition's PartitionEvaluation (kfed_spark.core.evaluation) on its last labelled row."""


@dataclass(frozen=True)
class LocalStepSpec:
    """What the local step needs inside a Python worker (pickled with the function: keep it small).

    k_source: "fixed" clusters every device with k centers, "auto" estimates each device's k_z
    in [1, k] from its rows (local_step.estimate_local_k), "column" reads k_z from the batches'
    third column.
    """

    k: int
    params: AlgorithmParams  # seed, local_restarts, max_iter, tol, max_rows_per_device
    dim: int
    device_type: pa.DataType
    k_source: str = "fixed"
    noise_key: int | None = None
    """With privacy_epsilon: the run's secret key of the privacy noise (linalg.noise_rng), never written."""
    task_fault: str | None = None
    """Test-only (kfed_spark.runtime.fault_injection): 'fail_first_attempt' or 'stall' in every local-step task."""


def local_centers_from_batches(batches: Iterator[pa.RecordBatch], spec: LocalStepSpec) -> Iterator[pa.RecordBatch]:
    """Run alg. 1 once per device over batches of (device, features) rows sorted by device.

    A device's rows may span several batches and a batch may hold several devices. Whole devices are
    gathered until they hold CLUSTER_ROWS rows, then clustered together (local_step.local_steps).
    Rows with a null, NaN or infinite value are skipped. A device with more than
    params.max_rows_per_device rows is clustered on a deterministic sample of that many
    (_DeviceSample); the rest are only counted, and its centers report counts and SSE for all of its
    rows. Yields (device, local_cluster_id, center, n_points, sse): every local center, those of
    fewer than min_center_points rows last on their device (the driver holds them back, LocalCenters).
    """
    if spec.task_fault is not None:
        _task_fault(spec.task_fault)
    gathered = _GatheredDevices(spec)
    open_device: _DeviceSample | None = None  # the last device seen, whose rows may go on in the next batch
    for batch in batches:
        devices = batch.column(0).to_numpy(zero_copy_only=False)
        x = feature_matrix(batch.column(1), spec.dim)
        ks = batch.column(2).to_numpy(zero_copy_only=False) if spec.k_source == "column" else None
        finite = np.isfinite(x).all(axis=1)
        if not finite.all():  # the labelling pass quarantines these rows
            devices, x = devices[finite], x[finite]
            ks = ks[finite] if ks is not None else None
        if not len(devices):
            continue
        starts = np.concatenate([[0], np.flatnonzero(devices[1:] != devices[:-1]) + 1])
        ends = np.append(starts[1:], len(devices))
        if open_device is not None and open_device.device == devices[0]:
            open_device.add(x[: ends[0]])
            starts, ends = starts[1:], ends[1:]
        if not len(starts):
            continue  # the whole batch went on the open device
        if open_device is not None:
            gathered.add_sample(open_device)
        whole = starts[:-1]  # every run but the last is a whole device; the last may go on in the next batch
        if len(whole):
            gathered.add(x[whole[0] : starts[-1]], ends[:-1] - whole, devices[whole], None if ks is None else ks[whole])
        open_device = _DeviceSample(spec, devices[starts[-1]], spec.k if ks is None else int(ks[starts[-1]]))
        open_device.add(x[starts[-1] :])
        if gathered.rows >= CLUSTER_ROWS:
            yield gathered.clustered()
    if open_device is not None:
        gathered.add_sample(open_device)
    if gathered.rows:
        yield gathered.clustered()


CLUSTER_ROWS = 1 << 16
"""Rows of whole devices a Python worker gathers before it clusters them together."""


class _DeviceSample:
    """A device's rows, or once there are more than max_rows_per_device of them, that many rows
    with the smallest seeded row hashes: the same sample whatever order the rows arrive in, held
    in at most twice that many rows."""

    def __init__(self, spec: LocalStepSpec, device: object, k: int):
        self.limit, self.seed = spec.params.max_rows_per_device, spec.params.seed
        self.device, self.k = device, k
        self.parts: list[np.ndarray] = []
        self.held = self.seen = 0
        self.hashes: np.ndarray | None = None  # set once the device outgrows the limit

    def add(self, x: np.ndarray) -> None:
        self.parts.append(x)
        self.held += len(x)
        self.seen += len(x)
        if self.held > 2 * self.limit:
            self._shrink()

    def _shrink(self) -> None:
        x = np.concatenate(self.parts)
        start = 0 if self.hashes is None else len(self.hashes)
        hashes = row_hashes(x[start:], self.seed)
        hashes = hashes if self.hashes is None else np.concatenate([self.hashes, hashes])
        x, self.hashes = smallest_hashes(x, hashes, self.limit)
        self.parts, self.held = [x], len(x)

    def rows(self) -> np.ndarray:
        if self.held > self.limit:
            self._shrink()
        return self.parts[0] if len(self.parts) == 1 else np.concatenate(self.parts)


class _GatheredDevices:
    """Whole devices' rows, gathered to be clustered together: runs of rows, each device's size, id, k
    and how many rows it had (more than its size where it was sampled)."""

    def __init__(self, spec: LocalStepSpec):
        self.spec = spec
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.rows = 0

    def add(self, x: np.ndarray, sizes: np.ndarray, devices: np.ndarray, ks: np.ndarray | None) -> None:
        """Whole devices, rows x device after device; any over max_rows_per_device is sampled."""
        ks = np.full(len(sizes), self.spec.k) if ks is None else ks.astype(np.int64)
        over = np.flatnonzero(sizes > self.spec.params.max_rows_per_device)
        if len(over):
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            for i in over:
                sample = _DeviceSample(self.spec, devices[i], int(ks[i]))
                sample.add(x[starts[i] : starts[i] + sizes[i]])
                self.add_sample(sample)
            keep = np.ones(len(sizes), dtype=bool)
            keep[over] = False
            x = x[np.repeat(keep, sizes)]
            sizes, devices, ks = sizes[keep], devices[keep], ks[keep]
        self.parts.append((x, sizes, devices, ks, sizes))
        self.rows += len(x)

    def add_sample(self, sample: _DeviceSample) -> None:
        x = sample.rows()
        self.parts.append(
            (x, np.array([len(x)]), np.array([sample.device]), np.array([sample.k]), np.array([sample.seen]))
        )
        self.rows += len(x)

    def clustered(self) -> pa.RecordBatch:
        """The local centers of every device gathered, as (device, local_cluster_id, center, n_points, sse)."""
        x, sizes, devices, ks, seen = (np.concatenate([part[i] for part in self.parts]) for i in range(5))
        self.parts, self.rows = [], 0
        found = _cluster(x, sizes, devices, ks, seen, self.spec).shared_first(self.spec.params.min_center_points)
        return pa.RecordBatch.from_arrays(
            [
                pa.array(devices[found.owner], type=self.spec.device_type),
                pa.array(found.ids(), type=pa.int32()),
                features_array(found.centers),
                pa.array(found.counts, type=pa.int64()),
                pa.array(found.sse, type=pa.float64()),
            ],
            names=LOCAL_CENTER_COLUMNS,
        )


def _task_fault(fault: str) -> None:
    """Test-only faults (kfed_spark.runtime.fault_injection): fail a task's first attempt (Spark must retry it), or
    stall the task (a run that SIGTERM must stop)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    if fault == "stall":
        time.sleep(600)
    elif context is not None and context.attemptNumber() == 0:
        raise RuntimeError(f"injected failure in the first attempt of local-step task {context.partitionId()}")


def _cluster(
    x: np.ndarray, sizes: np.ndarray, devices: np.ndarray, ks: np.ndarray, seen: np.ndarray, spec: LocalStepSpec
) -> DevicesCenters:
    """The local step on whole devices (rows x device after device, sizes[i] of device i, which had seen[i]
    rows before any sampling): every local center, counts and SSE for all of a device's rows."""
    starts = np.append(0, np.cumsum(sizes))
    if spec.k_source == "auto":
        ks = estimated_ks(x, starts, spec.k)
    found = local_steps(x, starts, devices, ks, spec.params, spec.noise_key)
    # a private device shares its sample's noisy counts: its number of rows is not released
    sampled = spec.noise_key is None and np.any(seen != sizes)
    return found.with_counts_of(seen, sizes) if sampled else found


def representatives_from_batches(
    batches: Iterator[pa.RecordBatch], m: int, dim: int, seed: int
) -> Iterator[pa.RecordBatch]:
    """One partition of (device_id, local_cluster_id, center, n_points) local centers reduced to at
    most m weighted representatives (server_step.representatives); yields (center, weight). The draws are
    seeded from the run seed and the partition's first local center's ids (not its values, which
    shifting the features would change), so a retried task draws the same."""
    table = pa.Table.from_batches(list(batches))
    if table.num_rows == 0:
        return
    first = f"representatives:{table.column(0)[0].as_py()!r}:{table.column(1)[0].as_py()}"
    x = feature_matrix(table.column(2), dim)
    weights = table.column(3).to_numpy().astype(np.float64)
    found, mass = representatives(x, weights, m, device_rng(seed, first))
    yield pa.RecordBatch.from_arrays([features_array(found), pa.array(mass)], names=["center", "weight"])


def cluster_batches(batches: Iterator[pa.RecordBatch], centers: np.ndarray) -> Iterator[pa.RecordBatch]:
    """Append cluster_id, the nearest of the global centers, to every batch of local centers."""
    for batch in batches:
        nearest, _ = nearest_center(feature_matrix(batch.column("center"), centers.shape[1]), centers)
        yield batch.append_column("cluster_id", pa.array(nearest, type=pa.int32()))


NON_FINITE = "non_finite_value"

LABEL_FIELDS = ("local_cluster_id", "cluster_id", SQ_DIST_COL, "margin", "non_finite", EVALUATION_COL)
"""What label_arrays returns per row, in this order (fitting.label_rows gives their Spark types)."""


def label_arrays(
    batches: Iterator[tuple[pa.Array, ...]], model: LabelModel, dim: int, evaluation: EvaluationSpec | None = None
) -> Iterator[pa.StructArray]:
    """Label one partition's rows from (labellable, device, features[, truth]) arrays: the only
    columns that cross to Python; every other column of the row stays in the JVM.

    Rows that are not labellable (validation gave them a reason) get nulls. A labellable row whose
    features hold a null, NaN or infinite value gets non_finite = true instead of a label: numpy
    checks that for next to nothing. Labelled rows get local_cluster_id (null for a device the model
    has not seen), cluster_id, their squared distance to the global center and their margin
    (labels.assigned_with_margin). With an evaluation spec, the partition's
    PartitionEvaluation (the truth is the fourth array) is on the last row's EVALUATION_COL, null on
    every other row; each batch is held until the next one shows it is not the last.
    """
    gathered = None if evaluation is None else PartitionEvaluation(evaluation, model.origin)
    held = None
    for arrays in batches:
        labellable, device_array, features = arrays[:3]
        candidates = np.flatnonzero(labellable.to_numpy(zero_copy_only=False))
        every_row = len(candidates) == len(labellable)  # the usual batch: no copies of its columns
        x = feature_matrix(features if every_row else features.take(candidates), dim)
        finite = np.isfinite(x).all(axis=1)
        if not finite.all():
            x, every_row = x[finite], False
        rows = candidates[finite]
        devices = (device_array if every_row else device_array.take(rows)).to_numpy(zero_copy_only=False)
        local, cluster, sq_dist, margin = model.label(devices, x)
        unlabelled = np.ones(len(labellable), dtype=bool)
        unlabelled[rows] = False
        non_finite = np.zeros(len(labellable), dtype=bool)
        non_finite[candidates[~finite]] = True
        if gathered is not None:
            truth = None if evaluation.truth_col is None else arrays[3] if every_row else arrays[3].take(rows)
            gathered.add(devices, truth, x, cluster, sq_dist)
        if held is not None:
            yield _labels(held, None)
        held = [
            _scatter(local, rows, unlabelled, pa.int32(), unset=-1),  # -1: a device the model has not seen
            _scatter(cluster, rows, unlabelled, pa.int32()),
            _scatter(sq_dist, rows, unlabelled, pa.float64()),
            _scatter(margin, rows, unlabelled, pa.float64()),
            pa.array(non_finite),
        ]
    if held is not None:
        yield _labels(held, None if gathered is None else gathered.to_text())


def _labels(fields: list[pa.Array], blob: str | None) -> pa.StructArray:
    """A batch's label fields with EVALUATION_COL, holding blob (if any) on its last row."""
    n = len(fields[0])
    blobs = (
        pa.nulls(n, pa.string())
        if blob is None
        else pa.concat_arrays([pa.nulls(n - 1, pa.string()), pa.array([blob], type=pa.string())])
    )
    return pa.StructArray.from_arrays([*fields, blobs], names=list(LABEL_FIELDS))


def _scatter(
    values: np.ndarray, rows: np.ndarray, unlabelled: np.ndarray, kind: pa.DataType, unset: int | None = None
) -> pa.Array:
    """values placed at rows of a column of len(unlabelled) rows; null elsewhere and where a value is `unset`."""
    full = np.zeros(len(unlabelled), dtype=values.dtype)
    full[rows] = values
    return pa.array(full, type=kind, mask=unlabelled if unset is None else unlabelled | (full == unset))
