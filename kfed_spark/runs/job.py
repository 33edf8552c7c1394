"""The k-FED job's stages: check the input, fit or apply a model, write a run, publish it.

run() is the job: validate (the location's checks and the runs rows read beside the input's) --> claim
(the reference run's clusters read beside the local step) --> fit (kfed_spark.spark.fitting) --> the clusters'
ids (kfed_spark.core.identity) --> labels (one pass over the input, which also gathers the evaluation and
the report's sample; the centers are written beside it) --> device profiles, cluster changes and
quarantine (the report drawn beside them) --> publish (one commit of the attempt's runs row;
kfed_spark.store.ledger). Delta I/O is in kfed_spark.store.delta. `kfed-spark forget`
(kfed_spark.runs.forget) appends and publishes its attempts through write_attempt too.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType, FloatType

from kfed_spark.config import KFedConfig, as_dict, resolve_run_id
from kfed_spark.core.identity import (
    ClusterSummary,
    Matching,
    ReferenceRun,
    changes_table,
    drift,
    fresh_ids,
    largest_share,
    match_clusters,
)
from kfed_spark.core.local_centers import LocalCenters
from kfed_spark.core.server_step import GlobalClusters
from kfed_spark.errors import ConfigError, InputError
from kfed_spark.runs.attempt import (
    AttemptContext,
    RunResult,
    k_sweep_column,
    package_versions,
    write_attempt,
)
from kfed_spark.runs.tracking import AttemptTracking
from kfed_spark.runtime import fault_injection
from kfed_spark.runtime.failures import describe
from kfed_spark.spark.fitting import REASON_COL, Clustering, StageTimer, fit_checked, validated
from kfed_spark.spark.input import read_input
from kfed_spark.spark.labelling import extend_with_new_devices, label_rows
from kfed_spark.spark.session import in_background
from kfed_spark.store.delta import attempt_filter
from kfed_spark.store.ledger import Ledger, highest_cluster_id, new_attempt_id, reference_attempt
from kfed_spark.store.models import StoredModel, finished_model, reference_run
from kfed_spark.store.output import OutputTables
from kfed_spark.store.tables import (
    TABLES,
    RunRecord,
    output_schemas,
    stats_columns,
)

log = logging.getLogger("kfed_spark")


def run(
    spark: SparkSession,
    cfg: KFedConfig,
    parent_run_id: str | None = None,
    model_path: str | None = None,
    timer: StageTimer | None = None,
    own_session: bool = False,
) -> RunResult:
    """Cluster the configured input with k-FED as a new attempt of the run id, and publish it.

    Everything that can be checked is checked before anything is written. Then the attempt is
    recorded as running, its rows are appended to every table, and one commit of its `runs` row
    publishes it (kfed_spark.store.ledger). A failure, or SIGTERM, records it as failed instead.

    With parent_run_id (or model_path, a saved KFedModel), nothing is fitted: the input is labelled
    with that published run's model (its local and global centers), devices it has not seen are
    clustered locally and joined to the nearest global centers (the paper's section 3.2), and the new
    run records where its model came from (the run id, or model:<path>) as its parent_run_id.

    With tracking.mlflow the attempt is logged to MLflow (kfed_spark.runs.tracking); own_session says the
    caller started `spark` for this run alone, and it is stopped before the MLflow logging that follows
    the publish, so that no executor waits on MLflow.
    """
    run_id = resolve_run_id(cfg)
    if parent_run_id == run_id:
        raise ConfigError(f"run {run_id!r} cannot take its own model: give the new run another run_id")
    started_at = datetime.now(timezone.utc)
    timer = timer or StageTimer()
    tables = OutputTables(spark, cfg.output)
    ledger = Ledger(tables)
    with timer.stage("validate"):
        found = validate(spark, tables, ledger, cfg, run_id, started_at, parent_run_id, model_path)
    row = attempt_row(cfg, run_id, new_attempt_id(started_at), found.parent_run_id, started_at)
    with timer.stage("claim"):
        attempt, row = ledger.begin(row, found.known)
    tracking = None if cfg.tracking.mlflow is None else AttemptTracking(cfg.tracking.mlflow, row, tables.root)
    # The reference run's clusters are read while the local step runs.
    reference_read = None if found.reference_row is None else in_background(reference_run, tables, found.reference_row)
    try:
        fault_injection.point("claimed")
        clustering, changes, row = cluster(found, cfg, row, timer, reference_read)
        context = AttemptContext(tables, attempt, cfg, found.raw.schema, timer, found.parent_run_id)
        result, row = write_attempt(
            context,
            row,
            clustering,
            changes,
            # a second labelling pass, only for dirty inputs
            lambda labelled, counted: labelled.filter(F.col(REASON_COL).isNotNull()) if counted.n_quarantined else None,
        )
        row = row.changed(timings=dict(timer.seconds), finished_at=datetime.now(timezone.utc))
        if tracking is not None:
            row = row.changed(**tracking.columns())
        fault_injection.point("before_publish")
        with timer.stage("publish"):  # in the RunResult only: the runs row is what it commits
            runs_now = ledger.publish(attempt, row)
    except BaseException as exc:
        ledger.fail(row.changed(timings=dict(timer.seconds)), describe(exc) or f"{type(exc).__name__}: {exc}")
        if tracking is not None:
            tracking.fail()
        raise
    fault_injection.point("published")
    with timer.stage("supersede"):
        ledger.supersede_others(attempt, runs_now)
    if tracking is not None:
        report = tables.report_files(row.run_id, row.attempt_id)
        profiles = tables.read("cluster_profiles").filter(attempt_filter(row.run_id, row.attempt_id))
        profiles = profiles.drop("run_id", "attempt_id").orderBy("cluster_id", "rank").toArrow()
        artifacts_store = tables.filesystem(tracking.artifacts_folder)  # the session's settings, read before it stops
        if own_session:
            spark.stop()
        tracking.finish(cfg, row, report, profiles, clustering, artifacts_store)
    log.info(
        "run %s: %d rows labelled, %d quarantined, cost %.6g",
        run_id,
        result.n_labelled,
        result.n_quarantined,
        result.cost,
    )
    return result


@dataclass(frozen=True)
class Validated:
    """What a run's checks found, before anything is written."""

    raw: DataFrame  # the input as read
    checked: DataFrame  # its rows with their checked features (validated)
    dim: int
    known: list  # the location's runs rows, read beside the checks
    parent: StoredModel | None  # the model an `assign` applies
    parent_run_id: str | None  # where that model came from (a run id, or model:<path>)
    reference_row: object | None  # the runs row of the run whose cluster ids this run continues


def validate(
    spark: SparkSession,
    tables: OutputTables,
    ledger: Ledger,
    cfg: KFedConfig,
    run_id: str,
    started_at: datetime,
    parent_run_id: str | None,
    model_path: str | None,
) -> Validated:
    """Every check a run makes before it writes: the input, the device ids, the location's tables, the
    model it applies; then the tables are created where missing. The location's checks, the device ids and
    the runs rows are read beside the input's checks; their errors count once the input's have passed (a
    missing device column is the input's error)."""
    raw = read_input(spark, cfg.input)
    device_col = cfg.input.device_col
    location = in_background(lambda: tables.check(output_schemas(raw.schema, device_col)))
    devices = in_background(check_device_ids, raw, device_col)
    known_runs = in_background(ledger.rows_if_any)
    applies = parent_run_id is not None or model_path is not None
    parent = finished_model(tables, parent_run_id, model_path) if applies else None
    checked, dim = validated(raw, cfg.fitting, None if parent is None else parent.dim)
    devices.result()
    checked_location = location.result()
    known = known_runs.result()
    reference_row = (
        reference_attempt(known, run_id, started_at, cfg.identity.reference)
        if parent is None and cfg.identity.mode == "stable"
        else None
    )
    fault_injection.point("checked")
    schemas = output_schemas(raw.schema, device_col)
    tables.prepare(schemas, stats_columns(device_col), checked_location)
    tables.register()
    fault_injection.point("created")
    return Validated(raw, checked, dim, known, parent, None if parent is None else parent.origin, reference_row)


def cluster(
    found: Validated, cfg: KFedConfig, row: RunRecord, timer: StageTimer, reference_read
) -> tuple[Clustering, pa.Table | None, RunRecord]:
    """The attempt's clustering (fitted, with ids continued from the reference run, or the applied model's),
    its cluster changes against the reference run, and its runs row with what the clustering decided."""
    device_col = cfg.input.device_col
    highest = highest_cluster_id(found.known, row.run_id)
    if found.parent is None:
        clustering, (matching, summary, reference) = fit_with_ids(
            found.checked, found.dim, found.raw.schema[device_col].dataType, cfg, timer, reference_read, highest + 1
        )
    else:  # the model's ids
        clustering = apply_model(found.checked, found.dim, cfg, found.parent, timer)
        matching, summary, reference = None, None, None
    row = row.changed(
        k=len(clustering.server.centers),
        k_sweep=k_sweep_column(clustering.k_sweep),
        identity_mode=None if found.parent is not None else cfg.identity.mode,
        reference_run_id=None if reference is None else reference.run_id,
        reference_attempt_id=None if reference is None else reference.attempt_id,
        highest_cluster_id=max(highest, int(np.max(clustering.cluster_ids))),
    )
    if cfg.on_bad_rows == "fail":
        refuse_bad_rows(label_rows(clustering.checked, clustering.model, found.raw.schema, device_col, found.dim))
    if matching is None or cfg.identity.mode == "fresh":
        return clustering, None, row
    local = clustering.local
    now = largest_share(local.devices, clustering.cluster_ids[clustering.server.assignment], local.counts)
    changes = changes_table(matching, summary, reference, now, local.table.schema.field("device_id").type)
    return clustering, changes, row.changed(**drift(changes, now, reference))


def fit_with_ids(
    checked: DataFrame,
    dim: int,
    device_type,
    cfg: KFedConfig,
    timer: StageTimer,
    reference_read: Future | None,
    next_id: int,
) -> tuple[Clustering, tuple[Matching, ClusterSummary, ReferenceRun | None]]:
    """fit_checked, warm-started from the reference run's centers with identity.warm_start, and the
    clustering under its ids (cluster_identity), with what the cluster_changes table is drawn from.
    reference_read: the reference run being read (models.reference_run), None without one."""

    def reference_centers() -> np.ndarray | None:
        return reference_read.result().clusters.centers if cfg.identity.warm_start and reference_read else None

    clustering = fit_checked(checked, dim, device_type, cfg.fitting, timer, reference_centers)
    with timer.stage("identity"):
        reference = None if reference_read is None else reference_read.result()
        matching, summary = cluster_identity(cfg, clustering, reference, next_id)
    return clustering.with_ids(matching.ids), (matching, summary, reference)


def cluster_identity(
    cfg: KFedConfig, clustering: Clustering, reference: ReferenceRun | None, next_id: int
) -> tuple[Matching, ClusterSummary]:
    """The ids of a fitted run's clusters (kfed_spark.core.identity), and what matching knew of them: matched
    to the reference run's with identity.mode stable, 0..k-1 with fresh; from next_id without a reference."""
    k = len(clustering.server.centers)
    summary = clustering.clusters()
    if cfg.identity.mode == "fresh":
        return fresh_ids(k, 0), summary
    if reference is None:
        return fresh_ids(k, next_id), summary
    matching = match_clusters(summary, reference.clusters, next_id)
    log.info(
        "identity: %d clusters kept the ids of run %s, %d new, %d retired",
        int(np.sum(matching.reference >= 0)),
        reference.run_id,
        int(np.sum(matching.reference < 0)),
        len(matching.retired),
    )
    return matching, summary


def check_device_ids(checked: DataFrame, device_col: str) -> None:
    """Refuse device ids that are NaN (a floating-point device column) or null in every row."""
    device = F.col(device_col)
    if isinstance(checked.schema[device_col].dataType, (DoubleType, FloatType)):
        n_nan = checked.filter(F.isnan(device)).count()
        if n_nan:
            raise InputError(
                f"device column {device_col!r} is NaN in {n_nan} rows; device ids must be strings or whole numbers"
            )
    if checked.filter(device.isNotNull()).isEmpty():
        raise InputError(f"the device column {device_col!r} is null in every row")


def apply_model(checked: DataFrame, dim: int, cfg: KFedConfig, parent: StoredModel, timer: StageTimer) -> Clustering:
    """A published run's model, extended by the input's devices that it has not seen."""
    valid = checked.filter(F.col(REASON_COL).isNull())
    with timer.stage("local_step"):
        local, assignment = extend_with_new_devices(
            valid, cfg.fitting, dim, LocalCenters.from_arrow(parent.local, dim), parent.assignment, parent.centers
        )
    server = GlobalClusters(parent.centers, assignment, seed_device=None, refine_iterations=0)
    model = local.label_model(
        assignment, parent.centers, cfg.algorithm.label_mode, label_unseen=True, cluster_ids=parent.cluster_ids
    )
    return Clustering(checked, dim, local, server, model, parent.cluster_ids)


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


def attempt_row(
    cfg: KFedConfig, run_id: str, attempt_id: str, parent_run_id: str | None, started_at: datetime
) -> RunRecord:
    """The attempt's row of the runs table with its settings (the ledger sets its status, publish number
    and process when it begins); result_columns() adds the figures."""
    inp = cfg.input
    return RunRecord.of(
        {
            "run_id": run_id,
            "attempt_id": attempt_id,
            "parent_run_id": parent_run_id,
            "started_at": started_at,
            "input": inp.table or f"{inp.format}:{inp.path}",
            "k": 0 if cfg.algorithm.k == "auto" else cfg.algorithm.k,  # a k auto run's, once its sweep has chosen
            "k_range": list(cfg.algorithm.k_range) if cfg.algorithm.k == "auto" else None,
            "k_per_device": str(cfg.algorithm.k_per_device),
            "seed": cfg.algorithm.seed,
            "seeding": cfg.algorithm.seeding,
            "server_refine": cfg.algorithm.server_refine,
            "label_mode": cfg.algorithm.label_mode,
            "local_restarts": cfg.algorithm.local_restarts,
            "robust_min_size": float(cfg.algorithm.robust_min_size),
            "min_center_points": cfg.algorithm.min_center_points,
            "privacy_epsilon": None if cfg.algorithm.privacy_epsilon is None else float(cfg.algorithm.privacy_epsilon),
            "privacy_delta": None if cfg.algorithm.privacy_epsilon is None else float(cfg.algorithm.privacy_delta),
            "timings": {},
            "config": json.dumps(as_dict(cfg), sort_keys=True),
            "versions": package_versions(),
        }
    )


def plan(spark: SparkSession, cfg: KFedConfig) -> str:
    """What `run` would do, checked against the input's schema and the output tables; writes nothing."""
    raw = read_input(spark, cfg.input)
    tables = OutputTables(spark, cfg.output)
    _, dim = validated(raw, cfg.fitting)
    existing = []
    for name, schema in output_schemas(raw.schema, cfg.input.device_col).items():
        if tables.check_log(name):
            added = tables.check_schema(name, schema)
            existing.append(name + (f" (would add {', '.join(f.name for f in added)})" if added else ""))
    params = cfg.algorithm
    lo, hi = params.k_range
    k_setting = (
        f"k = auto (after the local step, a sweep of k = {lo}..{hi} over the local centers chooses it)"
        if params.k == "auto"
        else f"k = {params.k}"
    )
    return "\n".join(
        [
            f"input: {cfg.input.table or cfg.input.format + ' ' + str(cfg.input.path)}",
            f"  columns: {', '.join(f'{f.name} {f.dataType.simpleString()}' for f in raw.schema.fields)}",
            f"  device column: {cfg.input.device_col}; features: {cfg.input.features_col} (dimension {dim})",
            f"k-FED: {k_setting}, k_per_device = {params.k_per_device}, seed = {params.seed}, "
            f"local_restarts = {params.local_restarts}, seeding = {params.seeding}, robust_min_size = "
            f"{params.robust_min_size}, server_refine = {params.server_refine}, server_step = {params.server_step}, "
            f"label_mode = {params.label_mode}, max_rows_per_device = {params.max_rows_per_device}, "
            f"on_bad_rows = {cfg.on_bad_rows}",
            f"run id: {cfg.run_id or '(from the start time)'}",
            f"cluster ids: {cfg.identity.mode}"
            + (
                ""
                if cfg.identity.mode == "fresh"
                else f", matched to run {cfg.identity.reference!r}"
                if cfg.identity.reference
                else ", matched to the newest published run of another run id"
            )
            + (", warm start from its centers" if cfg.identity.warm_start else ""),
            f"output: {tables.root}/{{{','.join(TABLES)}}}"
            + (f" (existing: {', '.join(existing)})" if existing else " (new)")
            + (f"; published views in {cfg.output.database}.*" if cfg.output.database else ""),
            "dry run: nothing was written",
        ]
    )
