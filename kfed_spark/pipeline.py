"""The k-FED Spark job: validate, local step per device, server step, labels, Delta tables.

input --> validate --> repartition(device) --> mapInArrow: alg. 1 per device --> local centers
      --> collect --> alg. 2 on the driver --> labelling function (broadcast) --> Delta tables
      --> publish (one commit of the attempt's runs row; see kfed_spark.attempts)
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.metadata import version

import numpy as np
import pyarrow as pa
from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_type
from pyspark.sql.types import (
    ArrayType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    NumericType,
    StringType,
    StructField,
    StructType,
)

from kfed_spark.batches import (
    SQ_DIST_COL,
    LabelModel,
    LocalStepSpec,
    feature_matrix,
    label_batches,
    label_moments,
    local_centers_from_batches,
)
from kfed_spark import faults, report
from kfed_spark.attempts import RUNS_SCHEMA, Attempt, Ledger, new_attempt_id
from kfed_spark.config import KFedConfig, as_dict, resolve_run_id
from kfed_spark.errors import ConfigError, InputError, KFedError, describe
from kfed_spark.io import TABLES, OutputTables, absolute, attempt_filter, read_input, read_side_table
from kfed_spark.kernels import ServerClustering, nearest_center, server_step
from kfed_spark.metrics import ari_of, contingency, within_cluster_cost

log = logging.getLogger("kfed_spark")

FEATURES_COL = "__kfed_features"
REASON_COL = "__kfed_reason"
DEVICE_K_COL = "__kfed_k"
FEATURES_SOURCE = "kfed_features_source"
"""Metadata key of FEATURES_COL when it is the input's own features column under another name."""
ADDED_COLUMNS = ("cluster_id", "local_cluster_id", "run_id", "attempt_id")
RUN_ID_FIELD = StructField("run_id", StringType(), False)
LOCAL_CENTER_COLUMNS = ["device_id", "local_cluster_id", "center", "n_points", "sse"]
LOCAL_CENTER_FIELDS = [
    StructField("local_cluster_id", IntegerType(), False),
    StructField("center", ArrayType(DoubleType(), False), False),
    StructField("n_points", LongType(), False),
    StructField("sse", DoubleType(), False),
]
"""The fields of a local center after its device_id."""
CENTERS_FIELDS = [
    StructField("cluster_id", IntegerType(), False),
    StructField("center", ArrayType(DoubleType(), False), False),
    StructField("n_points", LongType(), False),
    StructField("n_devices", LongType(), False),
]
CENTERS_COLUMNS = [f.name for f in CENTERS_FIELDS]
DIMENSION_SAMPLE_ROWS = 10_000


@dataclass
class RunResult:
    """What a finished run reports; the same figures are in its row of the runs table."""

    run_id: str
    attempt_id: str
    parent_run_id: str | None
    n_input: int
    n_labelled: int
    n_quarantined: int
    n_devices: int
    n_local_centers: int
    dim: int
    cost: float
    ari: float | None
    truth_cost: float | None
    output_path: str
    timings: dict[str, float] = field(default_factory=dict)


class StageTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 3)
        log.info("stage %s took %.2f s", name, self.seconds[name])


def run(spark: SparkSession, cfg: KFedConfig, parent_run_id: str | None = None) -> RunResult:
    """Cluster the configured input with k-FED as a new attempt of the run id, and publish it.

    Everything that can be checked is checked before anything is written. Then the attempt is
    recorded as running, its rows are appended to every table, and one commit of its `runs` row
    publishes it (kfed_spark.attempts). A failure, or SIGTERM, records it as failed instead.

    With parent_run_id, nothing is fitted: the input is labelled with that published run's model
    (its local and global centers), devices it has not seen are clustered locally and joined to
    the nearest global centers, and the new run records its parent.
    """
    run_id = resolve_run_id(cfg)
    if parent_run_id == run_id:
        raise ConfigError(f"run {run_id!r} cannot take its own model: give the new run another run_id")
    started_at = datetime.now(timezone.utc)
    timer = StageTimer()
    tables = OutputTables(spark, cfg.output)
    with timer.stage("validate"):
        raw = read_input(spark, cfg.input)
        parent = None if parent_run_id is None else stored_model(tables, parent_run_id)
        checked, dim = validated(raw, cfg, None if parent is None else parent.dim)
        check_device_ids(checked, cfg.input.device_col)
        faults.point("checked")
        tables.prepare(output_schemas(raw.schema, cfg.input.device_col))
        faults.point("created")
    ledger = Ledger(tables)
    row = attempt_row(cfg, run_id, new_attempt_id(started_at), parent_run_id, started_at)
    attempt = ledger.begin(row)
    try:
        faults.point("claimed")
        if parent is None:
            clustering = fit_checked(checked, dim, raw.schema[cfg.input.device_col].dataType, cfg, timer)
        else:
            clustering = apply_model(checked, dim, cfg, parent, timer)
        labelled = label_rows(clustering.checked, clustering.model, raw.schema, cfg.input.device_col, clustering.dim)
        if cfg.on_bad_rows == "fail":
            refuse_bad_rows(labelled)
        result, cells = write_attempt(spark, cfg, attempt, timer, tables, raw, clustering, labelled, parent_run_id)
        row.update(result_columns(result))
        if cfg.report:
            with timer.stage("report"):
                tables.write_report(run_id, attempt.attempt_id, run_report(row, cfg, clustering, cells))
            faults.point("report")
        row.update(timings=dict(timer.seconds), finished_at=datetime.now(timezone.utc))
        faults.point("before_publish")
        ledger.publish(attempt, row)
    except BaseException as exc:
        ledger.fail({**row, "timings": dict(timer.seconds)}, describe(exc) or f"{type(exc).__name__}: {exc}")
        raise
    faults.point("published")
    ledger.supersede_others(attempt)
    log.info("run %s: %d rows labelled, %d quarantined, cost %.6g", run_id, result.n_labelled, result.n_quarantined,
             result.cost)
    return result


def output_schemas(raw_schema: StructType, device_col: str) -> dict[str, StructType]:
    """The schema of every output table for an input of this schema; each ends with (run_id, attempt_id)."""
    device = StructField("device_id", raw_schema[device_col].dataType, False)
    tagged = [RUN_ID_FIELD, StructField("attempt_id", StringType(), False)]
    return {
        "labels": StructType(labelled_fields(raw_schema) + tagged),
        "centers": StructType(CENTERS_FIELDS + tagged),
        "local_centers": StructType([device, *LOCAL_CENTER_FIELDS, StructField("cluster_id", IntegerType(), False),
                                     *tagged]),
        "quarantine": StructType(list(raw_schema.fields) + [StructField("reason", StringType(), False), *tagged]),
        "runs": RUNS_SCHEMA,
    }


@dataclass(frozen=True)
class Clustering:
    """k-FED fitted to a DataFrame: what the CLI job writes out and what the estimator's model holds."""

    checked: DataFrame  # the input with the features as array<double> and a reason column
    dim: int
    local: LocalCenters
    server: ServerClustering
    model: LabelModel

    @property
    def valid(self) -> DataFrame:
        return self.checked.filter(F.col(REASON_COL).isNull())


def fit(raw: DataFrame, cfg: KFedConfig, timer: StageTimer | None = None) -> Clustering:
    """Validate the input, run alg. 1 on every device in the executors and alg. 2 on the driver."""
    timer = timer or StageTimer()
    with timer.stage("validate"):
        checked, dim = validated(raw, cfg)
    return fit_checked(checked, dim, raw.schema[cfg.input.device_col].dataType, cfg, timer)


def fit_checked(checked: DataFrame, dim: int, device_type, cfg: KFedConfig, timer: StageTimer) -> Clustering:
    """fit() on an input that validated() has prepared."""
    valid = checked.filter(F.col(REASON_COL).isNull())
    with timer.stage("local_step"):
        local = collect_local_centers(valid, cfg, dim, device_type)
    if len(local.counts) == 0:
        raise InputError(f"no row of the input can be clustered (all {checked.count()} rows are bad; see quarantine)")
    with timer.stage("server_step"):
        try:
            server = server_step(
                local.centers, local.counts, local.devices, local.ids, cfg.k, cfg.server_refine, cfg.max_iter, cfg.tol,
                seeding=cfg.seeding, robust_min_size=cfg.robust_min_size, seed=cfg.seed,
            )
        except ValueError as exc:
            raise KFedError(str(exc)) from None
        log.info(
            "server step: %d local centers from %d devices -> %d clusters (seed device %r, %d refine rounds)",
            len(local.counts), len(np.unique(local.devices)), cfg.k, server.seed_device, server.refine_iterations,
        )
    model = LabelModel.build(local.devices, local.ids, local.centers, server.assignment, server.centers,
                             cfg.label_mode)
    return Clustering(checked, dim, local, server, model)


@dataclass(frozen=True)
class StoredModel:
    """A published run's model as its tables hold it: global centers, local centers and their clusters."""

    centers: np.ndarray
    local: pa.Table
    assignment: np.ndarray

    @property
    def dim(self) -> int:
        return self.centers.shape[1]


def stored_model(tables: OutputTables, run_id: str) -> StoredModel:
    """The model of a published run, or a one-line error if the location has no published run of that id."""
    if not tables.check_log("runs") or not tables.check_log("centers"):
        raise KFedError(f"no published run {run_id!r} under {tables.root}")
    this_run = F.col("run_id") == run_id
    centers_rows = tables.published("centers").filter(this_run).orderBy("cluster_id").toArrow()
    if centers_rows.num_rows == 0:
        raise KFedError(f"no published run {run_id!r} under {tables.root}")
    stored = tables.published("local_centers").filter(this_run).select(*LOCAL_CENTER_COLUMNS, "cluster_id").toArrow()
    return StoredModel(
        np.array(centers_rows.column("center").to_pylist(), dtype=np.float64),
        stored.select(LOCAL_CENTER_COLUMNS),
        stored.column("cluster_id").to_numpy(),
    )


def apply_model(checked: DataFrame, dim: int, cfg: KFedConfig, parent: StoredModel, timer: StageTimer) -> Clustering:
    """A published run's model, extended by the input's devices that it has not seen."""
    valid = checked.filter(F.col(REASON_COL).isNull())
    with timer.stage("local_step"):
        local, assignment = extend_with_new_devices(
            valid, cfg, dim, LocalCenters.from_arrow(parent.local, dim), parent.assignment, parent.centers
        )
    server = ServerClustering(parent.centers, assignment, seed_device=None, refine_iterations=0)
    model = LabelModel.build(local.devices, local.ids, local.centers, assignment, parent.centers, cfg.label_mode)
    return Clustering(checked, dim, local, server, model)


def extend_with_new_devices(
    valid: DataFrame, cfg: KFedConfig, dim: int, local: LocalCenters, assignment: np.ndarray, centers: np.ndarray
) -> tuple[LocalCenters, np.ndarray]:
    """Run alg. 1 on the devices of `valid` that `local` does not hold, and give each of their local
    centers the nearest global center: O(k_z k) distance work per new device, no other device touched."""
    device_col = cfg.input.device_col
    device_type = valid.schema[device_col].dataType
    known = valid.sparkSession.createDataFrame(
        pa.table({"known_device": pa.array(np.unique(local.devices).tolist())})
    ).select(F.col("known_device").cast(device_type))
    new_rows = valid.join(F.broadcast(known), valid[device_col] == known["known_device"], "left_anti")
    if new_rows.isEmpty():
        return local, assignment
    new = collect_local_centers(new_rows, cfg, dim, device_type)
    log.info("%d devices the model had not seen: %d local centers", len(np.unique(new.devices)), len(new.counts))
    table = pa.concat_tables([local.table, new.table.cast(local.table.schema)])
    return LocalCenters.from_arrow(table, dim), np.concatenate([assignment, nearest_center(new.centers, centers)[0]])


def write_attempt(
    spark: SparkSession,
    cfg: KFedConfig,
    attempt: Attempt,
    timer: StageTimer,
    tables: OutputTables,
    raw: DataFrame,
    clustering: Clustering,
    labelled: DataFrame,
    parent_run_id: str | None,
) -> tuple[RunResult, np.ndarray | None]:
    """Append the attempt's rows to every data table, check that no row was lost, and evaluate
    against the truth column; returns the figures and the truth contingency table (or None)."""
    local, server, dim = clustering.local, clustering.server, clustering.dim
    run_id, attempt_id = attempt.run_id, attempt.attempt_id
    schemas = output_schemas(raw.schema, cfg.input.device_col)
    tag = [F.lit(run_id).alias("run_id"), F.lit(attempt_id).alias("attempt_id")]
    with timer.stage("labels"):
        counted = Observation("kfed_rows")
        labels = (
            labelled.observe(
                counted,
                F.count(F.lit(1)).alias("rows"),
                F.count(REASON_COL).alias("bad"),
                F.sum(SQ_DIST_COL).alias("cost"),
            )
            .filter(F.col(REASON_COL).isNull())
            .select(*[F.col(f.name) for f in labelled_fields(raw.schema)], *tag)
        )
        tables.append({"labels": labels}, run_id, attempt_id)
        faults.point("labels")
        n_quarantined = int(counted.get["bad"])
        n_labelled = int(counted.get["rows"]) - n_quarantined
        cost = float(counted.get["cost"] or 0.0)

    with timer.stage("other_tables"):
        local_with_cluster = local.table.append_column("cluster_id", pa.array(server.assignment, type=pa.int32()))
        frames = {
            "local_centers": conform(spark.createDataFrame(local_with_cluster), schemas["local_centers"].fields[:-2])
            .select("*", *tag),
            "centers": centers_frame(spark, server, local).select(*CENTERS_COLUMNS, *tag),
        }
        if n_quarantined:  # a second labelling pass, only for dirty inputs
            frames["quarantine"] = (
                labelled.filter(F.col(REASON_COL).isNotNull())
                .withColumnRenamed(REASON_COL, "reason")
                .select(*raw.columns, "reason", *tag)
            )
        tables.append(frames, run_id, attempt_id)
        faults.point("tables")

    n_input = raw.count()
    if n_input != n_labelled + n_quarantined:
        raise KFedError(
            f"row accounting failed: {n_input} input rows but {n_labelled} labelled + {n_quarantined} quarantined"
        )
    ari = truth_cost = cells = None
    if cfg.input.truth_col:
        with timer.stage("evaluate"):
            written = tables.read("labels").filter(attempt_filter(run_id, attempt_id))
            cells = truth_contingency(written, cfg.input.truth_col)
            ari = ari_of(cells)
            truth_cost = planted_cost(clustering.valid, cfg.input.truth_col, dim)

    result = RunResult(
        run_id=run_id,
        attempt_id=attempt_id,
        parent_run_id=parent_run_id,
        n_input=n_input,
        n_labelled=n_labelled,
        n_quarantined=n_quarantined,
        n_devices=len(np.unique(local.devices)),
        n_local_centers=len(local.counts),
        dim=dim,
        cost=cost,
        ari=ari,
        truth_cost=truth_cost,
        output_path=tables.root,
        timings=timer.seconds,
    )
    return result, cells


def plan(spark: SparkSession, cfg: KFedConfig) -> str:
    """What `run` would do, checked against the input's schema and the output tables; writes nothing."""
    raw = read_input(spark, cfg.input)
    tables = OutputTables(spark, cfg.output)
    _, dim = validated(raw, cfg)
    existing = []
    for name, schema in output_schemas(raw.schema, cfg.input.device_col).items():
        if tables.check_log(name):
            tables.check_schema(name, schema)
            existing.append(name)
    return "\n".join(
        [
            f"input: {cfg.input.table or cfg.input.format + ' ' + str(cfg.input.path)}",
            f"  columns: {', '.join(f'{f.name} {f.dataType.simpleString()}' for f in raw.schema.fields)}",
            f"  device column: {cfg.input.device_col}; features: {cfg.input.features_col} (dimension {dim})",
            f"k-FED: k = {cfg.k}, k_per_device = {cfg.k_per_device}, seed = {cfg.seed}, "
            f"seeding = {cfg.seeding}, server_refine = {cfg.server_refine}, label_mode = {cfg.label_mode}, "
            f"max_rows_per_device = {cfg.max_rows_per_device}, on_bad_rows = {cfg.on_bad_rows}",
            f"run id: {cfg.run_id or '(from the start time)'}",
            f"output: {tables.root}/{{{','.join(TABLES)}}}"
            + (f" (existing: {', '.join(existing)})" if existing else " (new)")
            + (f"; published views in {cfg.output.database}.*" if cfg.output.database else ""),
            "dry run: nothing was written",
        ]
    )


def refuse_bad_rows(labelled: DataFrame) -> None:
    """on_bad_rows: fail. Count the bad rows by reason (one more pass) and stop before writing."""
    by_reason = labelled.filter(F.col(REASON_COL).isNotNull()).groupBy(REASON_COL).count().collect()
    if by_reason:
        counts = sorted(((row[REASON_COL], row["count"]) for row in by_reason), key=lambda rc: -rc[1])
        total = sum(count for _, count in counts)
        raise InputError(
            f"{total} bad input rows ({', '.join(f'{reason}: {count}' for reason, count in counts)}) "
            "and on_bad_rows is 'fail'; nothing of this run was published"
        )


def validated(raw: DataFrame, cfg: KFedConfig, dim: int | None = None) -> tuple[DataFrame, int]:
    """The input with a double-array features column, its dimension, and a reason column.

    The reason is set here when the device is null, the features are null or empty, or their
    length differs from the table's dimension (given, or found by table_dimension). Null, NaN
    and infinite values are found by the Python functions, where numpy checks them for free;
    a Spark SQL check per element costs a lambda call per value.
    """
    inp = cfg.input
    columns = set(raw.columns)
    if inp.device_col not in columns:
        raise InputError(f"input has no device column {inp.device_col!r}; columns: {', '.join(raw.columns)}")
    if inp.truth_col is not None and inp.truth_col not in columns:
        raise InputError(f"input has no truth column {inp.truth_col!r} (input.truth_col); columns: {', '.join(raw.columns)}")
    if isinstance(cfg.k_per_device, str) and cfg.k_per_device != "auto" and cfg.k_per_device not in columns:
        k_side_table(raw.sparkSession, cfg.k_per_device, inp.device_col)
    clashes = [c for c in (*ADDED_COLUMNS, FEATURES_COL, REASON_COL) if c in columns]
    if clashes:
        raise InputError(f"input already has column(s) {', '.join(clashes)}, which the output adds; rename them")
    source = inp.features_col if isinstance(inp.features_col, str) else None
    kind = raw.schema[source].dataType if source in columns else None
    if isinstance(kind, ArrayType) and isinstance(kind.elementType, DoubleType):
        # Already what the Python functions read: renamed, not copied, so each row's features
        # cross to Python once; label_rows puts the original name back (FEATURES_SOURCE).
        prepared = raw.select(
            *[raw[c].alias(FEATURES_COL, metadata={FEATURES_SOURCE: c}) if c == source else raw[c] for c in raw.columns]
        )
    else:
        prepared = raw.withColumn(FEATURES_COL, features_column(raw, inp.features_col))
    if dim is None:
        dim = table_dimension(raw, prepared)
    feature = F.col(FEATURES_COL)
    reason = (
        F.when(F.col(inp.device_col).isNull(), "null_device")
        .when(feature.isNull(), "null_features")
        .when(F.size(feature) == 0, "empty_features")
        .when(F.size(feature) != dim, F.lit(f"wrong_dimension (expected {dim})"))
    )
    return prepared.withColumn(REASON_COL, reason), dim


def check_device_ids(checked: DataFrame, device_col: str) -> None:
    """Refuse device ids that are NaN (a floating-point device column) or null in every row."""
    device = F.col(device_col)
    if isinstance(checked.schema[device_col].dataType, (DoubleType, FloatType)):
        n_nan = checked.filter(F.isnan(device)).count()
        if n_nan:
            raise InputError(f"device column {device_col!r} is NaN in {n_nan} rows; device ids must be strings or "
                             "whole numbers")
    if checked.filter(device.isNotNull()).isEmpty():
        raise InputError(f"the device column {device_col!r} is null in every row")


def table_dimension(raw: DataFrame, prepared: DataFrame) -> int:
    """The most common feature length among the first DIMENSION_SAMPLE_ROWS rows with features."""
    sizes = (
        prepared.select(F.size(FEATURES_COL).alias("dim"))
        .filter("dim > 0")
        .limit(DIMENSION_SAMPLE_ROWS)
        .groupBy("dim")
        .count()
        .orderBy(F.desc("count"), "dim")
        .first()
    )
    if sizes is None:
        if raw.isEmpty():
            raise InputError("the input has no rows")
        raise InputError("no row of the input has any feature values")
    return int(sizes["dim"])


def features_column(df: DataFrame, features: str | list[str]) -> Column:
    """The features as array<double>, from an array column, a vector column or numeric columns."""
    names = features if isinstance(features, list) else [features]
    missing = [name for name in names if name not in df.columns]
    if missing:
        raise InputError(f"input has no feature column(s) {', '.join(map(repr, missing))}; columns: {', '.join(df.columns)}")
    types = {name: df.schema[name].dataType for name in names}
    if isinstance(features, list):
        wrong = [name for name, t in types.items() if not isinstance(t, NumericType)]
        if wrong:
            raise InputError(f"feature column(s) {', '.join(wrong)} are not numeric")
        return F.array(*[F.col(name).cast("double") for name in names])
    kind = types[features]
    if isinstance(kind, VectorUDT):  # vector_to_array fails on a null vector; a null array is quarantined
        return F.when(F.col(features).isNotNull(), vector_to_array(F.col(features)))
    if isinstance(kind, ArrayType) and isinstance(kind.elementType, NumericType):
        return F.col(features).cast("array<double>")
    raise InputError(
        f"feature column {features!r} has type {kind.simpleString()}; expected array of numbers, "
        "a Spark ML vector, or a list of numeric columns"
    )


@dataclass(frozen=True)
class LocalCenters:
    """All devices' local centers, collected on the driver: the Arrow table and numpy views of it."""

    table: pa.Table
    devices: np.ndarray
    ids: np.ndarray
    centers: np.ndarray
    counts: np.ndarray

    @classmethod
    def from_arrow(cls, table: pa.Table, dim: int) -> "LocalCenters":
        return cls(
            table=table,
            devices=table.column("device_id").to_numpy(zero_copy_only=False),
            ids=table.column("local_cluster_id").to_numpy(),
            centers=feature_matrix(table.column("center"), dim),
            counts=table.column("n_points").to_numpy(),
        )


def collect_local_centers(valid: DataFrame, cfg: KFedConfig, dim: int, device_type) -> LocalCenters:
    """Alg. 1 on every device in the executors; only the local centers come back to the driver."""
    fixed = not isinstance(cfg.k_per_device, str)
    spec = LocalStepSpec(
        cfg.k_per_device if fixed else min(cfg.k, cfg.k_per_device_max),
        cfg.seed,
        cfg.max_iter,
        cfg.tol,
        dim,
        to_arrow_type(device_type),
        cfg.max_rows_per_device,
        k_source="fixed" if fixed else "auto" if cfg.k_per_device == "auto" else "column",
        task_fault=faults.task_fault(),
    )
    schema = StructType([StructField("device_id", device_type, False), *LOCAL_CENTER_FIELDS])
    rows = local_step_rows(valid, cfg)
    partitions = cfg.local_partitions or int(valid.sparkSession.conf.get("spark.sql.shuffle.partitions"))
    shuffled = rows.repartition(partitions, "device_id").sortWithinPartitions("device_id")
    table = shuffled.mapInArrow(lambda batches: local_centers_from_batches(batches, spec), schema).toArrow()
    return LocalCenters.from_arrow(table, dim)


def local_step_rows(valid: DataFrame, cfg: KFedConfig) -> DataFrame:
    """(device_id, features) of the valid rows, plus each row's device's k_z when k_per_device
    names a column of the input or a side table (device column + `k`), checked to be in [1, k]."""
    device_col = cfg.input.device_col
    rows = valid.select(F.col(device_col), F.col(FEATURES_COL))
    source = cfg.k_per_device
    if isinstance(source, str) and source != "auto":
        if source in valid.columns:
            rows = valid.select(device_col, FEATURES_COL, F.col(source).alias(DEVICE_K_COL))
        else:
            side = k_side_table(valid.sparkSession, source, device_col).select(device_col, F.col("k").alias(DEVICE_K_COL))
            rows = rows.join(F.broadcast(side), device_col, "left")
        if not isinstance(rows.schema[DEVICE_K_COL].dataType, NumericType):
            raise InputError(f"k_per_device column {source!r} is not numeric")
        k_z = F.col(DEVICE_K_COL)
        bad = rows.filter(k_z.isNull() | (k_z < 1) | (k_z > cfg.k) | (k_z != F.floor(k_z))).first()
        if bad is not None:
            raise InputError(
                f"k_per_device from {source!r} must be a whole number in [1, k = {cfg.k}] for every device; "
                f"device {bad[device_col]!r} has {bad[DEVICE_K_COL]!r}"
            )
        rows = rows.withColumn(DEVICE_K_COL, k_z.cast("int"))
    return rows.withColumnRenamed(device_col, "device_id")


def k_side_table(spark: SparkSession, source: str, device_col: str) -> DataFrame:
    """The side table that k_per_device names, checked to hold the device column and `k`."""
    side = read_side_table(spark, source)
    if device_col not in side.columns or "k" not in side.columns:
        raise InputError(
            f"k_per_device {source!r} is neither a column of the input nor a table with columns "
            f"{device_col!r} and 'k' (its columns: {', '.join(side.columns)})"
        )
    return side


def conform(df: DataFrame, fields: list[StructField]) -> DataFrame:
    """df's columns in the order of `fields`, cast where the type differs (an Arrow table built on the
    driver holds int64 where a table holds int; nullability is left as it is)."""
    return df.select(*[
        F.col(f.name) if df.schema[f.name].dataType.simpleString() == f.dataType.simpleString()
        else F.col(f.name).cast(f.dataType)
        for f in fields
    ])


def labelled_fields(raw_schema: StructType) -> list[StructField]:
    """The input's columns followed by the two cluster columns the labels table adds."""
    return list(raw_schema.fields) + [
        StructField("local_cluster_id", IntegerType(), True),
        StructField("cluster_id", IntegerType(), True),
    ]


def label_rows(rows: DataFrame, model: LabelModel, raw_schema: StructType, device_col: str, dim: int) -> DataFrame:
    """Every row with its local and global cluster, its squared distance and its reason (null if labelled)."""
    schema = StructType(
        labelled_fields(raw_schema)
        + [StructField(SQ_DIST_COL, DoubleType(), True), StructField(REASON_COL, StringType(), True)]
    )
    keep_as = rows.schema[FEATURES_COL].metadata.get(FEATURES_SOURCE)
    return rows.mapInArrow(
        lambda batches: label_batches(batches, model, device_col, FEATURES_COL, REASON_COL, dim, keep_as), schema
    )


def centers_frame(spark: SparkSession, server: ServerClustering, local: LocalCenters) -> DataFrame:
    k = len(server.centers)
    n_points = np.bincount(server.assignment, weights=local.counts, minlength=k).astype(np.int64)
    device_index = np.unique(local.devices, return_inverse=True)[1]
    cluster_device_pairs = np.unique(np.stack([server.assignment, device_index]), axis=1)
    n_devices = np.bincount(cluster_device_pairs[0], minlength=k)
    rows = [(c, server.centers[c].tolist(), int(n_points[c]), int(n_devices[c])) for c in range(k)]
    return spark.createDataFrame(rows, StructType(CENTERS_FIELDS))


def truth_contingency(labels: DataFrame, truth_col: str) -> np.ndarray:
    """(classes, clusters) counts of cluster_id against a ground-truth column, aggregated in Spark."""
    table = labels.groupBy(truth_col, "cluster_id").count().toPandas()
    return contingency(table[truth_col].to_numpy(), table["cluster_id"].to_numpy(), table["count"].to_numpy())


def run_report(summary: dict, cfg: KFedConfig, clustering: Clustering, cells: np.ndarray | None) -> dict[str, bytes]:
    """report.json and report.html of a run, from what the driver holds plus a seeded row sample."""
    device_col = cfg.input.device_col
    sample = (
        clustering.valid.select(device_col, FEATURES_COL)
        .orderBy(F.xxhash64(F.lit(cfg.seed), FEATURES_COL))
        .limit(report.SILHOUETTE_SAMPLE_ROWS)
        .toArrow()
    )
    x = feature_matrix(sample.column(FEATURES_COL), clustering.dim)
    finite = np.isfinite(x).all(axis=1)
    devices = sample.column(device_col).to_numpy(zero_copy_only=False)[finite]
    _, sample_labels, _ = clustering.model.label(devices, x[finite])
    local, server = clustering.local, clustering.server
    facts = report.RunFacts(
        summary={**summary, "truth_col": cfg.input.truth_col, "output": absolute(str(cfg.output.path))},
        local_devices=local.devices, local_centers=local.centers, local_counts=local.counts,
        assignment=server.assignment, global_centers=server.centers,
        sample_x=x[finite], sample_labels=sample_labels, truth_cells=cells,
    )
    content = report.build(facts)
    return {
        "report.json": report.to_json(content).encode(),
        "report.html": report.render_html(content, report.figures(content, facts)).encode(),
    }


def planted_cost(valid: DataFrame, truth_col: str, dim: int) -> float:
    """k-means cost of the ground-truth clusters around their own means (the planted cost).

    Workers send per-batch moments (a few rows per label); the driver adds them up.
    """
    schema = "label string, n long, sum array<double>, sum_sq double"
    partial = valid.select(truth_col, FEATURES_COL).mapInArrow(
        lambda batches: label_moments(batches, truth_col, FEATURES_COL, dim), schema
    ).toArrow()
    _, label_index = np.unique(partial.column("label").to_numpy(zero_copy_only=False), return_inverse=True)
    labels = int(label_index.max()) + 1
    sums = np.zeros((labels, dim))
    np.add.at(sums, label_index, feature_matrix(partial.column("sum"), dim))
    counts = np.bincount(label_index, weights=partial.column("n").to_numpy(), minlength=labels)
    squared_norms = np.bincount(label_index, weights=partial.column("sum_sq").to_numpy(), minlength=labels)
    return within_cluster_cost(counts, sums, squared_norms)


def attempt_row(cfg: KFedConfig, run_id: str, attempt_id: str, parent_run_id: str | None,
                started_at: datetime) -> dict:
    """The attempt's row of the runs table with its settings; result_columns() adds the figures."""
    inp = cfg.input
    return {
        "run_id": run_id,
        "attempt_id": attempt_id,
        "parent_run_id": parent_run_id,
        "started_at": started_at,
        "finished_at": None,
        "input": inp.table or f"{inp.format}:{inp.path}",
        "k": cfg.k,
        "k_per_device": str(cfg.k_per_device),
        "seed": cfg.seed,
        "seeding": cfg.seeding,
        "server_refine": cfg.server_refine,
        "label_mode": cfg.label_mode,
        **{name: None for name in RESULT_COLUMNS},
        "timings": {},
        "config": json.dumps(as_dict(cfg), sort_keys=True),
        "versions": {name: version(name) for name in ("kfed-spark", "pyspark", "delta-spark", "numpy")},
    }


RESULT_COLUMNS = ("dim", "n_input", "n_labelled", "n_quarantined", "n_devices", "n_local_centers", "cost", "ari",
                  "truth_cost")


def result_columns(result: RunResult) -> dict:
    return {name: getattr(result, name) for name in RESULT_COLUMNS}
