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
from kfed_spark.core.local_step import DeviceCenters, device_local_step, estimate_local_k, shared_centers
from kfed_spark.core.sampling import row_hashes, scale_counts, smallest_hashes
from kfed_spark.core.server_step import representatives
from kfed_spark.params import AlgorithmParams
from kfed_spark.spark.columns import LOCAL_CENTER_COLUMNS

SQ_DIST_COL = "__kfed_sq_dist"
"""Internal column: a row's squared distance to its global center, summed into the run's cost."""

EVALUATION_COL = "__kfed_evaluation"
"""Internal column: a partition's PartitionEvaluation (kfed_spark.core.evaluation) on its last labelled row."""

LOCAL_OUTPUT_ROWS = 4096
"""Local-center rows gathered before a batch is sent back to Spark."""


def device_runs(devices: np.ndarray) -> Iterator[tuple[object, int, int]]:
    """(device, start, end) for each run of equal consecutive device ids."""
    if len(devices) == 0:
        return
    change = np.flatnonzero(devices[1:] != devices[:-1]) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(devices)]])
    for start, end in zip(starts, ends):
        yield devices[start], int(start), int(end)


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

    A device's rows may span several batches and a batch may hold several devices: rows are
    buffered until the device id changes. Rows with a null, NaN or infinite value are skipped.
    A device with more than params.max_rows_per_device rows is clustered on a deterministic sample of that
    many (_DeviceSample); the rest are only counted, and its centers report counts and SSE for
    all of its rows.
    Yields (device, local_cluster_id, center, n_points, sse).
    """
    if spec.task_fault is not None:
        _task_fault(spec.task_fault)
    out = _LocalCenterRows(spec.device_type)
    device, device_k, sample, seen = None, spec.k, _DeviceSample(spec), 0
    for batch in batches:
        devices = batch.column(0).to_numpy(zero_copy_only=False)
        x = feature_matrix(batch.column(1), spec.dim)
        ks = batch.column(2).to_numpy(zero_copy_only=False) if spec.k_source == "column" else None
        finite = np.isfinite(x).all(axis=1)
        if not finite.all():  # the labelling pass quarantines these rows
            devices, x = devices[finite], x[finite]
            ks = ks[finite] if ks is not None else None
        for run_device, start, end in device_runs(devices):
            if seen and run_device != device:
                out.add(device, _cluster(device, device_k, sample.rows(), seen, spec))
                sample, seen = _DeviceSample(spec), 0
            if not seen and ks is not None:
                device_k = int(ks[start])
            device = run_device
            sample.add(x[start:end])
            seen += end - start
        if len(out) >= LOCAL_OUTPUT_ROWS:
            yield out.flush()
    if seen:
        out.add(device, _cluster(device, device_k, sample.rows(), seen, spec))
    if len(out):
        yield out.flush()


class _DeviceSample:
    """A device's rows, or once there are more than max_rows_per_device of them, that many rows
    with the smallest seeded row hashes: the same sample whatever order the rows arrive in, held
    in at most twice that many rows."""

    def __init__(self, spec: LocalStepSpec):
        self.limit, self.seed = spec.params.max_rows_per_device, spec.params.seed
        self.parts: list[np.ndarray] = []
        self.held = 0
        self.hashes: np.ndarray | None = None  # set once the device outgrows the limit

    def add(self, x: np.ndarray) -> None:
        self.parts.append(x)
        self.held += len(x)
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


def _task_fault(fault: str) -> None:
    """Test-only faults (kfed_spark.runtime.fault_injection): fail a task's first attempt (Spark must retry it), or
    stall the task (a run that SIGTERM must stop)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    if fault == "stall":
        time.sleep(600)
    elif context is not None and context.attemptNumber() == 0:
        raise RuntimeError(f"injected failure in the first attempt of local-step task {context.partitionId()}")


def _cluster(device: object, k: int, x: np.ndarray, seen: int, spec: LocalStepSpec) -> DeviceCenters:
    if spec.k_source == "auto":
        k = estimate_local_k(x, spec.k)
    result = device_local_step(x, k, device, spec.params, spec.noise_key)
    if seen != len(x) and spec.noise_key is None:
        # clustered on a sample: the counts and SSE of all its rows (a private device shares its sample's noisy
        # counts instead: its number of rows is not released)
        result = DeviceCenters(result.centers, scale_counts(result.counts, seen), result.sse * (seen / len(x)))
    return shared_centers(result, spec.params.min_center_points)


class _LocalCenterRows:
    def __init__(self, device_type: pa.DataType):
        self.device_type = device_type
        self._reset()

    def _reset(self) -> None:
        self.devices, self.ids, self.centers, self.counts, self.sse = [], [], [], [], []

    def __len__(self) -> int:
        return len(self.devices)

    def add(self, device: object, result) -> None:
        m = len(result.counts)
        self.devices.extend([device] * m)
        self.ids.extend(range(m))
        self.centers.append(result.centers)
        self.counts.append(result.counts)
        self.sse.append(result.sse)

    def flush(self) -> pa.RecordBatch:
        centers = np.concatenate(self.centers)
        batch = pa.RecordBatch.from_arrays(
            [
                pa.array(self.devices, type=self.device_type),
                pa.array(self.ids, type=pa.int32()),
                features_array(centers),
                pa.array(np.concatenate(self.counts), type=pa.int64()),
                pa.array(np.concatenate(self.sse), type=pa.float64()),
            ],
            names=LOCAL_CENTER_COLUMNS,
        )
        self._reset()
        return batch


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
        yield _labels(held, None if gathered is None else gathered.to_bytes())


def _labels(fields: list[pa.Array], blob: bytes | None) -> pa.StructArray:
    """A batch's label fields with EVALUATION_COL, holding blob (if any) on its last row."""
    n = len(fields[0])
    blobs = (
        pa.nulls(n, pa.binary())
        if blob is None
        else pa.concat_arrays([pa.nulls(n - 1, pa.binary()), pa.array([blob], type=pa.binary())])
    )
    return pa.StructArray.from_arrays([*fields, blobs], names=list(LABEL_FIELDS))


def _scatter(
    values: np.ndarray, rows: np.ndarray, unlabelled: np.ndarray, kind: pa.DataType, unset: int | None = None
) -> pa.Array:
    """values placed at rows of a column of len(unlabelled) rows; null elsewhere and where a value is `unset`."""
    full = np.zeros(len(unlabelled), dtype=values.dtype)
    full[rows] = values
    return pa.array(full, type=kind, mask=unlabelled if unset is None else unlabelled | (full == unset))
