"""The table contract: every output table's name, schema, comments, partitioning and statistics
columns, and the rule that says which attempt of a run readers see. Every reader and writer takes
them from here, or from kfed_spark.spark.columns for what the pipeline adds to the input's rows
(kfed_spark.store.delta writes them, kfed_spark.store.ledger keeps the runs table, the job and
the stream fill them); only pyspark's types are imported.

Each table of a run is partitioned by (run_id, attempt_id); an attempt appends its own rows, and the
runs table's rows say which attempt of each run id is published (PUBLISHED_ATTEMPTS). The stream's
tables hold final rows only and are not partitioned.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from typing import Any, get_args, get_type_hints

from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from kfed_spark.spark.columns import (
    ATTEMPT_COLUMNS,
    LOCAL_CENTER_FIELDS,
    labelled_fields,
)

TABLES = (
    "labels",
    "centers",
    "local_centers",
    "quarantine",
    "device_clusters",
    "cluster_changes",
    "cluster_profiles",
    "runs",
)
DATA_TABLES = TABLES[:-1]
"""The tables whose rows belong to one attempt of a run; `runs` says which attempts are published."""
STREAM_TABLES = ("stream_labels", "stream_quarantine")
"""The tables `kfed-spark stream` appends each micro-batch to, exactly once; not partitioned by attempt:
every row in them is final."""
PARTITION_COLUMNS = ATTEMPT_COLUMNS

RUNNING, SUCCEEDED, SUPERSEDED, FAILED, ABANDONED, RETRACTED = (
    "running",
    "succeeded",
    "superseded",
    "failed",
    "abandoned",
    "retracted",
)
"""The statuses of an attempt's runs row (kfed_spark.store.ledger moves attempts through them)."""
PUBLISHED_ATTEMPTS = (
    "SELECT run_id, max_by(attempt_id, publish_seq) AS attempt_id FROM {runs} "
    "WHERE status = 'succeeded' GROUP BY run_id"
)
"""The published attempt of every run id: its succeeded attempt with the highest publish number."""
LATEST_ATTEMPT = (
    "SELECT run_id, attempt_id FROM {runs} WHERE status = 'succeeded' AND (run_id, attempt_id) IN ("
    + PUBLISHED_ATTEMPTS
    + ") ORDER BY finished_at DESC, run_id DESC LIMIT 1"
)
"""The published attempt of the newest succeeded run."""
TABLE_COMMENTS = {
    "labels": "k-FED: every valid input row with its global cluster (cluster_id), one partition per attempt "
    "of a run; read the published attempt through the labels view or the runs table",
    "centers": "k-FED: the k global cluster centers of each attempt of a run",
    "local_centers": "k-FED: the local centers each device shared (the only data that left a device), with "
    "the global cluster each one joined",
    "quarantine": "k-FED: input rows that could not be clustered, with the reason",
    "device_clusters": "k-FED: each device's profile, one row per device and global cluster it has rows in "
    "(for per-cluster models and client selection)",
    "cluster_changes": "k-FED: how each run's clusters relate to its reference run's (kept, new or retired), "
    "one row per cluster of the run and per retired cluster of the reference",
    "cluster_profiles": "k-FED: what sets each cluster apart, one row per cluster and feature: its mean and "
    "standard deviation against the population's, and their standardized difference",
    "runs": "k-FED: one row per attempt of a run; the succeeded attempt with the highest publish_seq of a "
    "run_id is the published one",
    "stream_labels": "k-FED stream: every valid row that arrived, with its global cluster from a finished run's "
    "model, written exactly once",
    "stream_quarantine": "k-FED stream: rows that arrived and could not be labelled, with the reason",
}
"""Each output table's Delta comment (DESCRIBE DETAIL shows it as description)."""
COLUMN_COMMENTS = {
    "run_id": "the run (re-running a run id replaces its published attempt)",
    "attempt_id": "the attempt of the run that wrote the row; only the published attempt's rows count",
    "local_cluster_id": "the device's local cluster the row belongs to",
    "center": "the center's coordinates, one per feature",
    "feature": "the feature's name: its input column, its name in a vector column's ML attributes, or f<position>",
    "position": "the feature's place in the features (0 first), as in center",
    "rank": "1 for the cluster's feature with the largest absolute standardized difference, 2 for the next, ...",
    "share_of_rows": "the cluster's share of the run's labelled rows",
    "mean": "the mean of the feature over the cluster's labelled rows",
    "sd": "the sample standard deviation (n - 1) of the feature over the cluster's rows; null for one row",
    "population_mean": "the mean of the feature over every labelled row of the run",
    "population_sd": "the sample standard deviation of the feature over every labelled row of the run",
    "standardized_difference": "(mean - population_mean) / population_sd: how many of the population's standard "
    "deviations the cluster's mean stands from the population's; null for a constant feature",
    "feature_names": "the features' names, in their order (see cluster_profiles.feature)",
    "distance": "the row's Euclidean distance to its global cluster's center (the squares add up to the run's cost)",
    "margin": "(d_other - d) / (d_other + d), d the row's distance to its cluster's center and d_other to the "
    "nearest other center: 1 on its center, 0 half-way, negative nearer another center",
    "sse": "sum of squared distances of the local cluster's rows to its center",
    "reason": "why the row was not clustered",
    "status": "running, succeeded, failed, abandoned, superseded or retracted",
    "error": "the one-line error of a failed or abandoned attempt, or why a retracted one was retracted",
    "publish_seq": "the attempt's publish number: the succeeded attempt with the highest one is published",
    "rows_removed": "whether the rows of this unpublished attempt were deleted from the other tables",
    "host": "the host of the driver process of the attempt",
    "pid": "the process id of the driver of the attempt",
    "parent_run_id": "for a run made by assign: the run whose model labelled the rows (model:<path> for a saved "
    "KFedModel)",
    "started_at": "when the attempt started (UTC)",
    "finished_at": "when the attempt finished (UTC)",
    "input": "the input table or path",
    "k": "global clusters: as asked for, or as the k sweep chose with k auto (0 while it has not chosen yet)",
    "k_range": "with k auto: the smallest and largest k swept (null: k was given)",
    "k_sweep": "with k auto: every swept k's exact SSE, BIC, silhouette, noise ratio and stability "
    "(kfed_spark.core.k_sweep)",
    "k_per_device": "local clusters per device: a number, a column or auto",
    "seed": "the run seed; every random draw is seeded from it and the device id",
    "seeding": "the server step's seeding rule (kmeanspp or farthest)",
    "robust_min_size": "the server step's outlier filter (0: off); null in rows of older versions",
    "local_restarts": "rough clusterings each device tried in its projection; null in rows of older versions",
    "device_share": "the share of the device's labelled rows that are in the cluster",
    "mean_sq_distance": "mean squared distance of the device's rows in the cluster to the global center",
    "server_refine": "how the server step refines the merged centers (lloyd or none)",
    "label_mode": "how rows get their global cluster (induced from their local center, or nearest)",
    "dim": "number of features",
    "n_input": "input rows",
    "n_labelled": "rows written to labels",
    "n_quarantined": "rows written to quarantine",
    "n_devices": "devices",
    "n_local_centers": "local centers the devices shared",
    "min_center_points": "fewest rows a shared local center stands for; null in rows of older versions",
    "n_rows_held_back": "rows of local clusters too small to share (min_center_points), labelled with the "
    "nearest global center and no local cluster; null for a run that takes a model, and with "
    "privacy_epsilon (the shared counts are noisy)",
    "n_devices_held_back": "devices that shared no local center: their rows took the nearest global center; null "
    "for a run that takes a model",
    "forgotten_devices": "devices `kfed-spark forget` took out of the run up to this attempt (null: none)",
    "privacy_epsilon": "the budget each device spent: its shared local centers and counts are (epsilon, delta)-"
    "differentially private per row (docs: privacy.md); null: no privacy",
    "privacy_delta": "the delta of that guarantee; null: no privacy",
    "clusters_per_device_in_effect": "how many global clusters the rows of one device lie in, in effect (from a "
    "seeded sample of rows, by nearest global center): few (about k_per_device) when the devices differ, near "
    "clusters_in_effect when they look alike (IID); null when the sample holds too few rows of one device",
    "clusters_in_effect": "how many global clusters all the rows lie in, in effect (the same sample); null "
    "when clusters_per_device_in_effect is",
    "cluster_mix_psi": "population stability index of the cluster mix against the reference run, over the kept "
    "clusters: 0 for the same mix, above 0.25 commonly read as a shift; null without a reference run",
    "share_in_new_clusters": "share of the run's rows in clusters the reference run did not have; null without a "
    "reference run",
    "share_in_retired_clusters": "share of the reference run's rows in its clusters this run retired; null without "
    "a reference run",
    "largest_relative_shift": "the largest move of a kept cluster's center, over the cluster's spread; null without "
    "a kept cluster",
    "share_of_devices_moved": "share of the devices in both runs whose largest cluster changed; null without a "
    "device in both",
    "cost": "k-means cost of the labelled rows (sum of squared distances to their global center)",
    "ari": "adjusted Rand index against the truth column, if the input has one",
    "truth_cost": "k-means cost of the truth column's clusters, if the input has one",
    "timings": "seconds spent in each stage",
    "model_run_id": "the run whose model labelled the row (model:<path> for a saved KFedModel)",
    "new_device": "whether the model had not seen the row's device: it took the nearest global center, and the "
    "next run clusters the device",
    "batch_id": "the stream's micro-batch that wrote the row",
    "arrived_at": "when the micro-batch that wrote the row started (UTC)",
    "config": "the run's full configuration, as JSON",
    "identity_mode": "stable (ids matched to the reference run's) or fresh (0..k-1); null in rows of older versions",
    "reference_run_id": "the run whose clusters this run's were matched to (null: none)",
    "reference_attempt_id": "the published attempt of the reference run that was matched",
    "highest_cluster_id": "the highest cluster id used in the location up to this run; null in rows of older versions",
    "center_shift": "distance between the cluster's center and its reference cluster's",
    "relative_shift": "center_shift over the pooled root-mean-square distance of both clusters' rows to their centers",
    "reference_n_points": "rows of the reference cluster",
    "reference_n_devices": "devices with rows in the reference cluster",
    "devices_in": "devices in both runs whose largest share of rows (as their local centers count them) is in this "
    "cluster now and was in another",
    "devices_out": "devices in both runs whose largest share of rows (as their local centers count them) was in "
    "this cluster and is in another now",
    "versions": "versions of kfed-spark, Spark, Delta and the numeric libraries",
    "mlflow_run_id": "with tracking.mlflow: the MLflow run of this attempt",
    "tracking_error": "with tracking.mlflow: why this attempt's MLflow run could not be created (it stays published)",
}
"""Delta comments of the output columns; a column not named here is the input's and says so."""
TABLE_COLUMN_COMMENTS = {
    ("labels", "cluster_id"): "the global cluster of the row",
    ("stream_labels", "cluster_id"): "the global cluster of the row",
    ("stream_labels", "local_cluster_id"): "the device's local cluster the row belongs to (null for a new device)",
    ("centers", "cluster_id"): "the global cluster",
    ("centers", "n_points"): "rows in the cluster",
    ("centers", "n_devices"): "devices with rows in the cluster",
    ("local_centers", "device_id"): "the device",
    ("local_centers", "n_points"): "the device's rows in the local cluster (with privacy_epsilon: its noisy count)",
    ("local_centers", "sse"): "sum of squared distances of the local cluster's rows to its center; NaN with "
    "privacy_epsilon (not shared)",
    ("local_centers", "cluster_id"): "the global cluster the local center joined",
    ("device_clusters", "device_id"): "the device",
    ("device_clusters", "cluster_id"): "a global cluster the device has labelled rows in",
    ("device_clusters", "n_points"): "the device's labelled rows in the cluster",
    ("cluster_changes", "cluster_id"): "the cluster (of this run, or retired from the reference run)",
    ("cluster_changes", "status"): "kept (matched to a reference cluster, whose id it keeps), new (an id never "
    "used before) or retired (a reference cluster no cluster of this run matched)",
    ("cluster_changes", "n_points"): "rows in the cluster (null for a retired one)",
    ("cluster_changes", "n_devices"): "devices with rows in the cluster (null for a retired one)",
    ("cluster_profiles", "cluster_id"): "the global cluster",
    ("cluster_profiles", "n_points"): "labelled rows in the cluster",
}


def column_comment(table: str, column: str) -> str:
    return TABLE_COLUMN_COMMENTS.get((table, column)) or COLUMN_COMMENTS.get(column) or "as in the input table"


def partition_columns(name: str) -> tuple[str, ...]:
    """A table's partition columns: (run_id, attempt_id) for a run's tables, none for a stream's."""
    return () if name in STREAM_TABLES else PARTITION_COLUMNS


RUN_ID_FIELD = StructField("run_id", StringType(), False)

ATTEMPT_FIELDS = [RUN_ID_FIELD, StructField("attempt_id", StringType(), False)]
"""What every row of a run's tables ends with."""

CENTERS_FIELDS = [
    StructField("cluster_id", IntegerType(), False),
    StructField("center", ArrayType(DoubleType(), False), False),
    StructField("n_points", LongType(), False),
    StructField("n_devices", LongType(), False),
]


CLUSTER_PROFILE_FIELDS = [
    StructField("cluster_id", IntegerType(), False),
    StructField("feature", StringType(), False),
    StructField("position", IntegerType(), False),
    StructField("rank", IntegerType(), False),
    StructField("n_points", LongType(), False),
    StructField("share_of_rows", DoubleType(), False),
    StructField("mean", DoubleType(), False),
    StructField("sd", DoubleType(), True),
    StructField("population_mean", DoubleType(), False),
    StructField("population_sd", DoubleType(), True),
    StructField("standardized_difference", DoubleType(), True),
]
"""cluster_profiles before run_id and attempt_id: one row per cluster and feature (core.profiles.profiles_table)."""

CLUSTER_CHANGE_FIELDS = [
    StructField("cluster_id", IntegerType(), False),
    StructField("status", StringType(), False),
    StructField("reference_run_id", StringType(), True),
    StructField("center_shift", DoubleType(), True),
    StructField("relative_shift", DoubleType(), True),
    StructField("n_points", LongType(), True),
    StructField("reference_n_points", LongType(), True),
    StructField("n_devices", LongType(), True),
    StructField("reference_n_devices", LongType(), True),
]
"""cluster_changes before devices_in and devices_out (arrays of the device column's type)."""

DEVICE_CLUSTER_FIELDS = [
    StructField("cluster_id", IntegerType(), False),
    StructField("n_points", LongType(), False),
    StructField("device_share", DoubleType(), False),
    StructField("mean_sq_distance", DoubleType(), False),
]
"""device_clusters after device_id: one row per device and global cluster it has labelled rows in."""


def output_schemas(raw_schema: StructType, device_col: str) -> dict[str, StructType]:
    """The schema of every output table for an input of this schema; each ends with (run_id, attempt_id)."""
    device = StructField("device_id", raw_schema[device_col].dataType, False)
    tagged = ATTEMPT_FIELDS
    return {
        "labels": StructType(labelled_fields(raw_schema) + tagged),
        "centers": StructType(CENTERS_FIELDS + tagged),
        "local_centers": StructType(
            [device, *LOCAL_CENTER_FIELDS, StructField("cluster_id", IntegerType(), False), *tagged]
        ),
        "quarantine": StructType(list(raw_schema.fields) + [StructField("reason", StringType(), False), *tagged]),
        "device_clusters": StructType([device, *DEVICE_CLUSTER_FIELDS, *tagged]),
        "cluster_changes": StructType(
            [
                *CLUSTER_CHANGE_FIELDS,
                *[
                    StructField(name, ArrayType(device.dataType, False), False)
                    for name in ("devices_in", "devices_out")
                ],
                *tagged,
            ]
        ),
        "cluster_profiles": StructType(CLUSTER_PROFILE_FIELDS + tagged),
        "runs": RUNS_SCHEMA,
    }


def stats_columns(device_col: str) -> dict[str, list[str]]:
    """The columns whose statistics Delta keeps in the tables that hold input rows: the ones their
    readers filter on (run_id and attempt_id are partition columns, which need none)."""
    return {"labels": [device_col, "local_cluster_id", "cluster_id"], "quarantine": [device_col, "reason"]}


K_SWEEP_TYPE = StructType(
    [
        StructField("k", IntegerType(), False),
        StructField("sse", DoubleType(), False),
        StructField("bic", DoubleType(), False),
        StructField("silhouette", DoubleType(), False),
        StructField("noise_ratio", DoubleType(), True),
        StructField("stability", DoubleType(), True),
    ]
)
"""One k of a k auto run's sweep (kfed_spark.core.k_sweep.KFigures without its seconds)."""


def _column(spark_type: DataType) -> Any:
    return field(metadata={"spark_type": spark_type})


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One attempt's row of the runs table (kfed_spark.store.ledger writes them). RUNS_SCHEMA is made from
    these fields, in this order: a field's Spark type is its column's, and `| None` makes it nullable."""

    run_id: str = _column(StringType())
    attempt_id: str = _column(StringType())
    status: str = _column(StringType())
    """running, succeeded, superseded, failed, abandoned or retracted (kfed_spark.store.ledger)"""
    error: str | None = _column(StringType())
    publish_seq: int | None = _column(LongType())
    rows_removed: bool = _column(BooleanType())
    host: str = _column(StringType())
    pid: int = _column(LongType())
    parent_run_id: str | None = _column(StringType())
    started_at: datetime = _column(TimestampType())
    finished_at: datetime | None = _column(TimestampType())
    input: str = _column(StringType())
    k: int = _column(IntegerType())
    k_per_device: str = _column(StringType())
    seed: int = _column(LongType())
    seeding: str = _column(StringType())
    server_refine: str = _column(StringType())
    label_mode: str = _column(StringType())
    dim: int | None = _column(IntegerType())
    n_input: int | None = _column(LongType())
    n_labelled: int | None = _column(LongType())
    n_quarantined: int | None = _column(LongType())
    n_devices: int | None = _column(LongType())
    n_local_centers: int | None = _column(LongType())
    cost: float | None = _column(DoubleType())
    ari: float | None = _column(DoubleType())
    truth_cost: float | None = _column(DoubleType())
    timings: dict[str, float] = _column(MapType(StringType(), DoubleType()))
    config: str = _column(StringType())
    versions: dict[str, str] = _column(MapType(StringType(), StringType()))
    # Added after the first release: null in the rows of older versions (output.OutputTables.prepare adds them).
    local_restarts: int | None = _column(IntegerType())
    robust_min_size: float | None = _column(DoubleType())
    identity_mode: str | None = _column(StringType())
    reference_run_id: str | None = _column(StringType())
    reference_attempt_id: str | None = _column(StringType())
    highest_cluster_id: int | None = _column(IntegerType())
    k_range: list[int] | None = _column(ArrayType(IntegerType(), False))
    k_sweep: list[tuple] | None = _column(ArrayType(K_SWEEP_TYPE, False))
    mlflow_run_id: str | None = _column(StringType())
    tracking_error: str | None = _column(StringType())
    min_center_points: int | None = _column(IntegerType())
    n_rows_held_back: int | None = _column(LongType())
    n_devices_held_back: int | None = _column(LongType())
    forgotten_devices: int | None = _column(IntegerType())
    privacy_epsilon: float | None = _column(DoubleType())
    privacy_delta: float | None = _column(DoubleType())
    clusters_per_device_in_effect: float | None = _column(DoubleType())
    clusters_in_effect: float | None = _column(DoubleType())
    cluster_mix_psi: float | None = _column(DoubleType())
    share_in_new_clusters: float | None = _column(DoubleType())
    share_in_retired_clusters: float | None = _column(DoubleType())
    largest_relative_shift: float | None = _column(DoubleType())
    share_of_devices_moved: float | None = _column(DoubleType())
    feature_names: list[str] | None = _column(ArrayType(StringType(), False))

    @classmethod
    def of(cls, row: dict[str, Any]) -> RunRecord:
        """The record of a runs row, None where the row has no value: the columns a new attempt fills
        later, or those an older version's row lacks when read before prepare added them."""
        return cls(**{f.name: row.get(f.name) for f in fields(cls)})

    def values(self) -> tuple:
        """The row's values in RUNS_SCHEMA's order."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def changed(self, **changes: Any) -> RunRecord:
        return replace(self, **changes)


def _nullable(hint: Any) -> bool:
    return type(None) in get_args(hint)


RUNS_SCHEMA = StructType(
    [
        StructField(f.name, f.metadata["spark_type"], _nullable(hint))
        for f, hint in zip(fields(RunRecord), get_type_hints(RunRecord).values(), strict=True)
    ]
)
"""The runs table: one row per attempt, the fields of RunRecord."""


BATCH_FIELDS = [
    StructField("model_run_id", StringType(), False),
    StructField("batch_id", LongType(), False),
    StructField("arrived_at", TimestampType(), False),
]
"""What every row of the stream's tables ends with."""


def stream_schemas(raw_schema: StructType) -> dict[str, StructType]:
    """The schema of the stream's two tables for an input of this schema."""
    return {
        "stream_labels": StructType(
            labelled_fields(raw_schema) + [StructField("new_device", BooleanType(), True), *BATCH_FIELDS]
        ),
        "stream_quarantine": StructType(
            list(raw_schema.fields) + [StructField("reason", StringType(), False), *BATCH_FIELDS]
        ),
    }


def stream_stats_columns(device_col: str) -> dict[str, list[str]]:
    """The columns whose statistics Delta keeps in the stream's tables: the ones their readers filter on."""
    return {
        "stream_labels": [device_col, "cluster_id", "model_run_id", "batch_id", "arrived_at"],
        "stream_quarantine": [device_col, "reason", "batch_id", "arrived_at"],
    }
