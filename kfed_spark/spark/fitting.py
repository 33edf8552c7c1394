"""k-FED fitted to a DataFrame and rows labelled with it: what the job and the estimator share.

Feature preparation (validated), alg. 1 on every device in the executors (collect_local_centers),
alg. 2 on the driver (fit); devices a model has not seen and the labelling pass are
kfed_spark.spark.labelling. Nothing is written here, and the only table read is the side table
k_per_device may name (input.read_side_table); the functions Spark runs in the Python workers are in
kfed_spark.spark.workers, the numpy in kfed_spark.core.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_type
from pyspark.sql.types import (
    ArrayType,
    DoubleType,
    NumericType,
    StructField,
    StructType,
)

from kfed_spark.config import FitSettings
from kfed_spark.core.identity import ClusterSummary
from kfed_spark.core.k_sweep import KSweep, k_values
from kfed_spark.core.labels import LabelModel
from kfed_spark.core.local_centers import LocalCenters
from kfed_spark.core.profiles import default_feature_names
from kfed_spark.core.server_step import GlobalClusters, server_step
from kfed_spark.errors import InputError, KFedError
from kfed_spark.params import AlgorithmParams
from kfed_spark.runtime import fault_injection
from kfed_spark.spark.columns import ADDED_COLUMNS, LOCAL_CENTER_FIELDS
from kfed_spark.spark.distributed import global_centers, with_clusters
from kfed_spark.spark.input import read_side_table
from kfed_spark.spark.workers import LocalStepSpec, local_centers_from_batches

log = logging.getLogger("kfed_spark")

FEATURES_COL = "__kfed_features"

REASON_COL = "__kfed_reason"

DEVICE_K_COL = "__kfed_k"

FEATURES_SOURCE = "kfed_features_source"
"""Metadata key of FEATURES_COL when it is the input's own features column under another name."""


DIMENSION_SAMPLE_ROWS = 10_000


class StageTimer:
    """Seconds each named stage of a run took (the runs table's timings)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 3)
        log.info("stage %s took %.2f s", name, self.seconds[name])


@dataclass(frozen=True)
class Clustering:
    """k-FED fitted to a DataFrame: what the CLI job writes out and what the estimator's model holds."""

    checked: DataFrame  # the input with the features as array<double> and a reason column
    dim: int
    local: LocalCenters
    server: GlobalClusters
    model: LabelModel
    cluster_ids: np.ndarray  # the published id of each global center (kfed_spark.core.identity)
    k_sweep: KSweep | None = None  # with k 'auto': the sweep that chose the k

    def clusters(self) -> ClusterSummary:
        """The global clusters as identity matching knows them, under their positions as ids."""
        local, server = self.local, self.server
        return ClusterSummary.of(
            np.arange(len(server.centers)),
            server.centers,
            server.assignment,
            local.centers,
            local.counts,
            local.sse,
            local.devices,
        )

    def with_ids(self, cluster_ids: np.ndarray) -> "Clustering":
        """The same clustering with its global clusters published under these ids."""
        return dataclasses.replace(
            self, cluster_ids=cluster_ids, model=dataclasses.replace(self.model, cluster_ids=cluster_ids)
        )


def fit(
    raw: DataFrame, settings: FitSettings, timer: StageTimer | None = None, initial: np.ndarray | None = None
) -> Clustering:
    """Validate the input, run alg. 1 on every device in the executors and alg. 2 on the driver
    (warm-started from `initial` centers, if given)."""
    timer = timer or StageTimer()
    with timer.stage("validate"):
        checked, dim = validated(raw, settings)
    return fit_checked(checked, dim, raw.schema[settings.input.device_col].dataType, settings, timer, lambda: initial)


def fit_checked(
    checked: DataFrame,
    dim: int,
    device_type,
    settings: FitSettings,
    timer: StageTimer,
    warm_start: Callable[[], np.ndarray | None] = lambda: None,
) -> Clustering:
    """fit() on an input that validated() has prepared. warm_start gives the centers to seed the server
    step with (server_step.server_step's initial), called once the local step is done; the distributed server
    step does not take them.

    The server step runs on the driver, or distributed (kfed_spark.spark.distributed) as settings.algorithm.server_step
    says; unless it is "driver", the local centers are cached and counted, and "auto" picks by
    their number. Either way the driver ends up with every local center, for the labelling model:
    what leaves the driver with "distributed" is the merge, the server step's memory and work.

    With k 'auto' the local centers come to the driver and the sweep over k_range (kfed_spark.core.k_sweep)
    chooses k before the server step; the sweep runs on the driver whatever server_step says."""
    valid = checked.filter(F.col(REASON_COL).isNull())
    with timer.stage("local_step"):
        frame = local_centers_frame(valid, settings, dim, device_type)
        where = settings.algorithm.server_step
        if where != "driver":
            frame = frame.persist()
            n_local = frame.count()  # the local step runs here; the server step reads the cached result
            if where == "auto":
                where = "distributed" if n_local > settings.algorithm.server_distributed_above else "driver"
        local = (
            LocalCenters.from_arrow(frame.toArrow(), dim).held_back_from(settings.algorithm.min_center_points)
            if where == "driver" or settings.algorithm.k == "auto"
            else None
        )
    chosen = None
    try:
        settings, chosen = choose_k(local, settings, timer)
        params = settings.algorithm
        with timer.stage("server_step"):
            try:
                if where == "driver":
                    local, server = merged_on_driver(local, params, warm_start())
                else:
                    if warm_start() is not None:
                        log.warning("identity.warm_start applies to the driver's server step only: cold seeding")
                    local, server = merged_in_spark(frame, dim, params)
            except ValueError as exc:
                raise KFedError(str(exc)) from None
    finally:
        if settings.algorithm.server_step != "driver":
            frame.unpersist()
    if server is None and not valid.isEmpty():
        raise InputError(
            "no device has a local cluster of at least min_center_points = "
            f"{settings.algorithm.min_center_points} rows, so no local center can be shared; lower min_center_points"
        )
    if server is None:
        raise InputError(f"no row of the input can be clustered (all {checked.count()} rows are bad; see quarantine)")
    log.info(
        "server step (%s): %d local centers from %d devices -> %d clusters (seed device %r, %d refine rounds)",
        where,
        len(local.counts),
        len(np.unique(local.devices)),
        settings.algorithm.k,
        server.seed_device,
        server.refine_iterations,
    )
    return Clustering(
        checked,
        dim,
        local,
        server,
        # a device whose local centers were all too small to share (min_center_points): as an unseen one
        local.label_model(server.assignment, server.centers, settings.algorithm.label_mode, label_unseen=True),
        np.arange(len(server.centers)),
        chosen,
    )


def choose_k(local: LocalCenters | None, settings: FitSettings, timer: StageTimer) -> tuple[FitSettings, KSweep | None]:
    """With k 'auto', the sweep over k_range (kfed_spark.core.k_sweep) and the settings with the k it
    recommends; else the settings as they are and no sweep."""
    if settings.algorithm.k != "auto" or not len(local.counts):
        return settings, None
    with timer.stage("k_sweep"):
        chosen = local.sweep(k_values(*settings.algorithm.k_range), settings.algorithm)
    log.info("k auto: the sweep of k = %d..%d recommends k = %d", *settings.algorithm.k_range, chosen.recommended_k)
    algorithm = dataclasses.replace(settings.algorithm, k=chosen.recommended_k)
    return dataclasses.replace(settings, algorithm=algorithm), chosen


def merged_on_driver(
    local: LocalCenters, params: AlgorithmParams, initial: np.ndarray | None = None
) -> tuple[LocalCenters, GlobalClusters | None]:
    """Alg. 2 over the local centers the driver holds (None without any), warm-started from initial if given."""
    if len(local.counts) == 0:
        return local, None
    return local, server_step(local.centers, local.counts, local.devices, local.ids, params, initial)


def merged_in_spark(frame: DataFrame, dim: int, params: AlgorithmParams) -> tuple[LocalCenters, GlobalClusters | None]:
    """Alg. 2 with Spark doing the work (kfed_spark.spark.distributed) over the local centers that frame
    holds of at least min_center_points rows; then the local centers come to the driver with the global
    cluster each one took (None without any), and the held-back ones without."""
    small = F.col("n_points") < params.min_center_points
    shared = frame.filter(~small)
    if shared.isEmpty():
        return None, None
    merged = global_centers(shared, dim, params)
    table = with_clusters(shared, merged.centers).toArrow()
    held = LocalCenters.from_arrow(frame.filter(small).toArrow(), dim)
    local = dataclasses.replace(LocalCenters.from_arrow(table.drop_columns(["cluster_id"]), dim), held_back=held)
    return local, GlobalClusters(merged.centers, table.column("cluster_id").to_numpy(), None, merged.refine_iterations)


def validated(raw: DataFrame, settings: FitSettings, dim: int | None = None) -> tuple[DataFrame, int]:
    """The input with a double-array features column, its dimension, and a reason column.

    The reason is set here when the device is null, the features are null or empty, or their
    length differs from the table's dimension (given, or found by table_dimension). Null, NaN
    and infinite values are found by the Python functions, where numpy checks them for free;
    a Spark SQL check per element costs a lambda call per value.
    """
    inp = settings.input
    columns = set(raw.columns)
    if inp.device_col not in columns:
        raise InputError(f"input has no device column {inp.device_col!r}; columns: {', '.join(raw.columns)}")
    if inp.truth_col is not None and inp.truth_col not in columns:
        raise InputError(
            f"input has no truth column {inp.truth_col!r} (input.truth_col); columns: {', '.join(raw.columns)}"
        )
    if (
        isinstance(settings.algorithm.k_per_device, str)
        and settings.algorithm.k_per_device != "auto"
        and settings.algorithm.k_per_device not in columns
    ):
        k_side_table(raw.sparkSession, settings.algorithm.k_per_device, inp.device_col)
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


def table_dimension(raw: DataFrame, prepared: DataFrame) -> int:
    """The most common feature length among the first DIMENSION_SAMPLE_ROWS rows with features.

    A limit at the top of the plan is a CollectLimit: Spark reads the first partition and only
    goes on while it has not found enough rows (under an aggregate, every partition would be read).
    """
    sizes = [
        row.dim
        for row in prepared.select(F.size(FEATURES_COL).alias("dim"))
        .filter("dim > 0")
        .limit(DIMENSION_SAMPLE_ROWS)
        .collect()
    ]
    if not sizes:
        if raw.isEmpty():
            raise InputError("the input has no rows")
        raise InputError("no row of the input has any feature values")
    values, counts = np.unique(sizes, return_counts=True)
    return int(values[np.argmax(counts)])  # the smallest of equally common lengths


def feature_names(schema: StructType, features: str | list[str], dim: int) -> list[str]:
    """The features' names: the columns of a list, a vector column's from its ML attribute metadata (as
    VectorAssembler writes it), else f0 ... f{dim-1}."""
    if isinstance(features, list):
        return list(features)
    attributes = schema[features].metadata.get("ml_attr", {}).get("attrs", {}) if features in schema.names else {}
    named = {int(a["idx"]): a["name"] for group in attributes.values() for a in group if "name" in a and "idx" in a}
    if sorted(named) == list(range(dim)):
        return [named[j] for j in range(dim)]
    return default_feature_names(dim)


def features_column(df: DataFrame, features: str | list[str]) -> Column:
    """The features as array<double>, from an array column, a vector column or numeric columns."""
    names = features if isinstance(features, list) else [features]
    missing = [name for name in names if name not in df.columns]
    if missing:
        raise InputError(
            f"input has no feature column(s) {', '.join(map(repr, missing))}; columns: {', '.join(df.columns)}"
        )
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


def collect_local_centers(valid: DataFrame, settings: FitSettings, dim: int, device_type) -> LocalCenters:
    """Alg. 1 on every device in the executors; only the local centers come back to the driver, those of
    fewer than min_center_points rows held back (LocalCenters.held_back)."""
    found = LocalCenters.from_arrow(local_centers_frame(valid, settings, dim, device_type).toArrow(), dim)
    return found.held_back_from(settings.algorithm.min_center_points)


def local_centers_frame(valid: DataFrame, settings: FitSettings, dim: int, device_type) -> DataFrame:
    """Alg. 1 on every device, as a DataFrame of local centers (LOCAL_CENTER_COLUMNS), those held back
    (fewer than min_center_points rows) included."""
    fixed = not isinstance(settings.algorithm.k_per_device, str)
    spec = LocalStepSpec(
        settings.algorithm.k_per_device
        if fixed
        else min(settings.algorithm.largest_k, settings.algorithm.k_per_device_max),
        settings.algorithm,
        dim,
        to_arrow_type(device_type),
        k_source="fixed" if fixed else "auto" if settings.algorithm.k_per_device == "auto" else "column",
        noise_key=None if settings.algorithm.privacy_epsilon is None else secrets.randbits(128),
        task_fault=fault_injection.task_fault(),
    )
    schema = StructType([StructField("device_id", device_type, False), *LOCAL_CENTER_FIELDS])
    rows = local_step_rows(valid, settings)
    partitions = settings.local_partitions or int(valid.sparkSession.conf.get("spark.sql.shuffle.partitions"))
    shuffled = rows.repartition(partitions, "device_id").sortWithinPartitions("device_id")
    return shuffled.mapInArrow(lambda batches: local_centers_from_batches(batches, spec), schema)


def local_step_rows(valid: DataFrame, settings: FitSettings) -> DataFrame:
    """(device_id, features) of the valid rows, plus each row's device's k_z when k_per_device
    names a column of the input or a side table (device column + `k`), checked to be in [1, k]."""
    device_col = settings.input.device_col
    rows = valid.select(F.col(device_col), F.col(FEATURES_COL))
    source = settings.algorithm.k_per_device
    if isinstance(source, str) and source != "auto":
        if source in valid.columns:
            rows = valid.select(device_col, FEATURES_COL, F.col(source).alias(DEVICE_K_COL))
        else:
            side = k_side_table(valid.sparkSession, source, device_col).select(
                device_col, F.col("k").alias(DEVICE_K_COL)
            )
            rows = rows.join(F.broadcast(side), device_col, "left")
        if not isinstance(rows.schema[DEVICE_K_COL].dataType, NumericType):
            raise InputError(f"k_per_device column {source!r} is not numeric")
        k_z = F.col(DEVICE_K_COL)
        bad = rows.filter(
            k_z.isNull() | (k_z < 1) | (k_z > settings.algorithm.largest_k) | (k_z != F.floor(k_z))
        ).first()
        if bad is not None:
            raise InputError(
                f"k_per_device from {source!r} must be a whole number in [1, k = {settings.algorithm.largest_k}] for "
                f"every device; device {bad[device_col]!r} has {bad[DEVICE_K_COL]!r}"
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
