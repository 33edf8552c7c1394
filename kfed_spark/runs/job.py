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
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib.metadata import version

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType, FloatType, StructField, StructType

from kfed_spark.config import KFedConfig, as_dict, resolve_run_id
from kfed_spark.core.evaluation import Evaluation, EvaluationSpec
from kfed_spark.core.identity import (
    ClusterSummary,
    Matching,
    ReferenceRun,
    changes_table,
    fresh_ids,
    largest_share,
    match_clusters,
)
from kfed_spark.core.k_sweep import KSweep
from kfed_spark.core.metrics import ari_of
from kfed_spark.core.server_step import ServerClustering
from kfed_spark.errors import ConfigError, InputError, KFedError
from kfed_spark.runs import report
from kfed_spark.runtime import fault_injection
from kfed_spark.runtime.failures import describe
from kfed_spark.spark.columns import labelled_fields
from kfed_spark.spark.fitting import (
    REASON_COL,
    Clustering,
    LocalCenters,
    StageTimer,
    extend_with_new_devices,
    fit_checked,
    label_rows,
    validated,
)
from kfed_spark.spark.input import absolute, read_input
from kfed_spark.spark.session import in_background
from kfed_spark.spark.workers import EVALUATION_COL, SQ_DIST_COL
from kfed_spark.store.delta import OutputTables, rows_frame
from kfed_spark.store.ledger import Attempt, Ledger, highest_cluster_id, new_attempt_id, reference_attempt
from kfed_spark.store.models import StoredModel, finished_model, reference_run
from kfed_spark.store.tables import (
    CENTERS_COLUMNS,
    CENTERS_FIELDS,
    K_SWEEP_TYPE,
    TABLES,
    RunRecord,
    output_schemas,
    stats_columns,
)

log = logging.getLogger("kfed_spark")


@dataclass
class RunResult:
    """What a finished run reports; the same figures are in its row of the runs table."""

    run_id: str
    attempt_id: str
    parent_run_id: str | None
    n_input: int
    n_labelled: int
    n_quarantined: int
    n_devices: int  # devices with labelled rows
    n_local_centers: int
    n_rows_held_back: int | None  # a fitted run's (min_center_points); None for a run that takes a model
    n_devices_held_back: int | None
    dim: int
    cost: float
    ari: float | None
    truth_cost: float | None
    output_path: str
    timings: dict[str, float] = field(default_factory=dict)


def run(
    spark: SparkSession,
    cfg: KFedConfig,
    parent_run_id: str | None = None,
    model_path: str | None = None,
    timer: StageTimer | None = None,
) -> RunResult:
    """Cluster the configured input with k-FED as a new attempt of the run id, and publish it.

    Everything that can be checked is checked before anything is written. Then the attempt is
    recorded as running, its rows are appended to every table, and one commit of its `runs` row
    publishes it (kfed_spark.store.ledger). A failure, or SIGTERM, records it as failed instead.

    With parent_run_id (or model_path, a saved KFedModel), nothing is fitted: the input is labelled
    with that published run's model (its local and global centers), devices it has not seen are
    clustered locally and joined to the nearest global centers (the paper's section 3.2), and the new
    run records where its model came from (the run id, or model:<path>) as its parent_run_id.
    """
    run_id = resolve_run_id(cfg)
    if parent_run_id == run_id:
        raise ConfigError(f"run {run_id!r} cannot take its own model: give the new run another run_id")
    started_at = datetime.now(timezone.utc)
    timer = timer or StageTimer()
    tables = OutputTables(spark, cfg.output)
    ledger = Ledger(tables)
    with timer.stage("validate"):
        raw = read_input(spark, cfg.input)
        device_col = cfg.input.device_col
        # The location's checks and the device ids' overlap the input's checks; none writes. Their errors
        # count once the input's checks have passed (a missing device column is the input's error).
        location = in_background(lambda: tables.check(output_schemas(raw.schema, device_col)))
        devices = in_background(check_device_ids, raw, device_col)
        # The runs rows the tidy-up starts from, read beside the input's checks (the first Delta scan
        # in a fresh JVM costs seconds, wherever it runs).
        known_runs = in_background(ledger.rows_if_any)
        applies = parent_run_id is not None or model_path is not None
        parent = finished_model(tables, parent_run_id, model_path) if applies else None
        parent_run_id = None if parent is None else parent.origin
        checked, dim = validated(raw, cfg, None if parent is None else parent.dim)
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
    row = attempt_row(cfg, run_id, new_attempt_id(started_at), parent_run_id, started_at)
    with timer.stage("claim"):
        attempt, row = ledger.begin(row, known)
    # The reference run's clusters are read while the local step runs.
    reference_read = None if reference_row is None else in_background(reference_run, tables, reference_row)
    try:
        fault_injection.point("claimed")
        highest = highest_cluster_id(known, run_id)
        if parent is None:
            clustering, (matching, summary, reference) = fit_with_ids(
                checked, dim, raw.schema[device_col].dataType, cfg, timer, reference_read, highest + 1
            )
        else:  # the model's ids
            clustering, matching, reference = apply_model(checked, dim, cfg, parent, timer), None, None
        row = row.changed(
            k=len(clustering.server.centers),
            k_sweep=k_sweep_column(clustering.k_sweep),
            identity_mode=None if parent is not None else cfg.identity.mode,
            reference_run_id=None if reference is None else reference.run_id,
            reference_attempt_id=None if reference is None else reference.attempt_id,
            highest_cluster_id=max(highest, int(np.max(clustering.cluster_ids))),
        )
        if cfg.on_bad_rows == "fail":
            refuse_bad_rows(label_rows(clustering.checked, clustering.model, raw.schema, device_col, dim))
        local = clustering.local
        changes = (
            None
            if matching is None or cfg.identity.mode == "fresh"
            else changes_table(
                matching,
                summary,
                reference,
                largest_share(local.devices, clustering.cluster_ids[clustering.server.assignment], local.counts),
                local.table.schema.field("device_id").type,
            )
        )
        result, row = write_attempt(
            tables,
            attempt,
            row,
            cfg,
            raw.schema,
            schemas,
            clustering,
            changes,
            timer,
            # a second labelling pass, only for dirty inputs
            lambda labelled, counted: labelled.filter(F.col(REASON_COL).isNotNull()) if counted.n_quarantined else None,
            parent_run_id,
        )
        row = row.changed(timings=dict(timer.seconds), finished_at=datetime.now(timezone.utc))
        fault_injection.point("before_publish")
        with timer.stage("publish"):  # in the RunResult only: the runs row is what it commits
            runs_now = ledger.publish(attempt, row)
    except BaseException as exc:
        ledger.fail(row.changed(timings=dict(timer.seconds)), describe(exc) or f"{type(exc).__name__}: {exc}")
        raise
    fault_injection.point("published")
    with timer.stage("supersede"):
        ledger.supersede_others(attempt, runs_now)
    if cfg.tracking.mlflow is not None:
        from kfed_spark.runs.tracking import track_attempt

        track_attempt(cfg, row, tables, clustering)
    log.info(
        "run %s: %d rows labelled, %d quarantined, cost %.6g",
        run_id,
        result.n_labelled,
        result.n_quarantined,
        result.cost,
    )
    return result


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

    clustering = fit_checked(checked, dim, device_type, cfg, timer, reference_centers)
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


def write_attempt(
    tables: OutputTables,
    attempt: Attempt,
    row: RunRecord,
    cfg: KFedConfig,
    raw_schema: StructType,
    schemas: dict[str, StructType],
    clustering: Clustering,
    changes: pa.Table | None,
    timer: StageTimer,
    quarantined: Callable[[DataFrame, LabelledRows], DataFrame | None],
    parent_run_id: str | None = None,
) -> tuple[RunResult, RunRecord]:
    """Append an attempt's rows to every table and write its report: the labels (the one pass over
    clustering.checked, which also counts and gathers the evaluation), with the centers beside them, then
    the device profiles, `changes` (cluster_changes rows, if any) and the rows quarantined(labelled, counted)
    gives, with the report beside them. Returns the figures and `row` with them, ready to publish; what it
    started in the background is finished (or failed) before it returns or raises."""
    writes: list[Future] = []
    try:
        writes.append(in_background(write_centers, tables, attempt, schemas, clustering))
        with timer.stage("labels"):
            counted, labelled = write_labels(tables, attempt, cfg, raw_schema, clustering)
        evaluation = counted.evaluation
        iid = report.iid_warning(
            report.heterogeneity(evaluation.sample_x, evaluation.sample_devices, clustering.server.centers)
        )
        if iid:
            log.warning("run %s: %s", attempt.run_id, iid)
        result = run_result(attempt, parent_run_id, tables, clustering, counted, timer, cfg.privacy_epsilon is not None)
        row = row.changed(**result_columns(result))
        profiles = device_clusters_table(evaluation, clustering.local.table.schema.field("device_id").type)
        if cfg.report:
            writes.append(
                in_background(
                    timed,
                    timer,
                    "report",
                    write_run_report,
                    tables,
                    attempt,
                    asdict(row),
                    cfg,
                    clustering,
                    evaluation,
                    changes,
                )
            )
        with timer.stage("other_tables"):
            write_other_tables(tables, attempt, schemas, profiles, changes, quarantined(labelled, counted))
            for write in writes:
                write.result()
    except BaseException:
        wait(writes)  # a commit landing after the failed attempt's rows are deleted would stay
        raise
    if cfg.report:
        fault_injection.point("report")
    return result, row


def timed(timer: StageTimer, stage: str, work, *args):
    with timer.stage(stage):
        return work(*args)


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
            valid, cfg, dim, LocalCenters.from_arrow(parent.local, dim), parent.assignment, parent.centers
        )
    server = ServerClustering(parent.centers, assignment, seed_device=None, refine_iterations=0)
    model = local.label_model(
        assignment, parent.centers, cfg.label_mode, label_unseen=True, cluster_ids=parent.cluster_ids
    )
    return Clustering(checked, dim, local, server, model, parent.cluster_ids)


@dataclass(frozen=True)
class LabelledRows:
    """What the labelling pass counted and gathered while it wrote the labels."""

    n_input: int
    n_labelled: int
    n_quarantined: int
    cost: float
    evaluation: Evaluation


def write_labels(
    tables: OutputTables, attempt: Attempt, cfg: KFedConfig, raw_schema: StructType, clustering: Clustering
) -> tuple[LabelledRows, DataFrame]:
    """Append the attempt's labelled rows: the one pass over the input after the local step.

    Observations count the rows going into the labelling function and coming out of it (they must
    agree: no row lost), and collect what each partition gathered for the evaluation and the report
    (kfed_spark.core.evaluation). Returns those figures and the labelled rows, for the quarantine.
    """
    spec = EvaluationSpec.of(
        cfg.input.truth_col,
        report.SILHOUETTE_SAMPLE_ROWS if cfg.report else 0,
        int(clustering.local.counts.sum()),
        cfg.seed,
    )
    read, labelled_out = Observation("kfed_input_rows"), Observation("kfed_labelled_rows")
    rows_in = clustering.checked.observe(read, F.count(F.lit(1)).alias("rows"))
    labelled = label_rows(rows_in, clustering.model, raw_schema, cfg.input.device_col, clustering.dim, spec)
    labels = (
        labelled.observe(
            labelled_out,
            F.count(F.lit(1)).alias("rows"),
            F.count(REASON_COL).alias("bad"),
            F.sum(SQ_DIST_COL).alias("cost"),
            F.collect_list(EVALUATION_COL).alias("evaluation"),
        )
        .filter(F.col(REASON_COL).isNull())
        .select(*[F.col(f.name) for f in labelled_fields(raw_schema)], *attempt_columns(attempt))
    )
    tables.append({"labels": labels}, attempt.run_id, attempt.attempt_id)
    fault_injection.point("labels")
    n_input, out = int(read.get["rows"]), labelled_out.get
    n_quarantined = int(out["bad"])
    if n_input != int(out["rows"]):
        raise KFedError(f"row accounting failed: {n_input} input rows but {out['rows']} came out of labelling")
    counted = LabelledRows(
        n_input,
        n_input - n_quarantined,
        n_quarantined,
        float(out["cost"] or 0.0),
        Evaluation.merge(out["evaluation"], report.SILHOUETTE_SAMPLE_ROWS, clustering.dim),
    )
    return counted, labelled


def write_centers(
    tables: OutputTables, attempt: Attempt, schemas: dict[str, StructType], clustering: Clustering
) -> None:
    """Append the attempt's local centers, each with the global cluster it joined, and its global centers."""
    spark, local, server = clustering.checked.sparkSession, clustering.local, clustering.server
    tag = attempt_columns(attempt)
    local_with_cluster = local.table.append_column(
        "cluster_id", pa.array(clustering.cluster_ids[server.assignment], type=pa.int32())
    )
    tables.append(
        {
            "local_centers": conform(
                spark.createDataFrame(local_with_cluster), schemas["local_centers"].fields[:-2]
            ).select("*", *tag),
            "centers": centers_frame(spark, server, local, clustering.cluster_ids).select(*CENTERS_COLUMNS, *tag),
        },
        attempt.run_id,
        attempt.attempt_id,
    )


def write_other_tables(
    tables: OutputTables,
    attempt: Attempt,
    schemas: dict[str, StructType],
    profiles: pa.Table,
    changes: pa.Table | None,
    quarantined: DataFrame | None,
) -> None:
    """Append the attempt's device profiles (device_clusters_table), its cluster changes (with identity.mode
    stable; kfed_spark.core.identity.changes_table) and its quarantined rows (the input's columns and their
    reason, in REASON_COL) if it has any."""
    tag = attempt_columns(attempt)
    spark = tables.spark
    frames = {
        name: conform(spark.createDataFrame(table), schemas[name].fields[:-2]).select("*", *tag)
        for name, table in (("device_clusters", profiles), ("cluster_changes", changes))
        if table is not None
    }
    if quarantined is not None:
        frames["quarantine"] = quarantined.withColumnRenamed(REASON_COL, "reason").select(
            *schemas["quarantine"].names[:-2], *tag
        )
    tables.append(frames, attempt.run_id, attempt.attempt_id)
    fault_injection.point("tables")


def device_clusters_table(evaluation: Evaluation, device_type: pa.DataType) -> pa.Table:
    """The device_clusters rows from what the labelling pass added up per (device, cluster)."""
    pairs = evaluation.device_clusters
    n_points = pairs["n_points"].to_numpy().astype(np.int64)
    per_device = pairs["n_points"].groupby(level=0).transform("sum").to_numpy()
    return pa.table(
        {
            "device_id": pa.array(pairs.index.get_level_values(0), type=device_type),
            "cluster_id": pa.array(pairs.index.get_level_values(1), type=pa.int32()),
            "n_points": pa.array(n_points, type=pa.int64()),
            "device_share": pa.array(n_points / per_device, type=pa.float64()),
            "mean_sq_distance": pa.array(pairs["sum_sq_dist"].to_numpy() / n_points, type=pa.float64()),
        }
    )


def run_result(
    attempt: Attempt,
    parent_run_id: str | None,
    tables: OutputTables,
    clustering: Clustering,
    counted: LabelledRows,
    timer: StageTimer,
    private: bool,
) -> RunResult:
    """The run's figures; with private (privacy_epsilon) the shared counts are noisy, so the rows held back are
    not known."""
    evaluation = counted.evaluation
    n_devices = evaluation.device_clusters.index.get_level_values(0).nunique()
    fitted = parent_run_id is None
    return RunResult(
        run_id=attempt.run_id,
        attempt_id=attempt.attempt_id,
        parent_run_id=parent_run_id,
        n_input=counted.n_input,
        n_labelled=counted.n_labelled,
        n_quarantined=counted.n_quarantined,
        n_devices=n_devices,
        n_local_centers=len(clustering.local.counts),
        n_rows_held_back=counted.n_labelled - int(clustering.local.counts.sum()) if fitted and not private else None,
        n_devices_held_back=n_devices - len(np.unique(clustering.local.devices)) if fitted else None,
        dim=clustering.dim,
        cost=counted.cost,
        ari=None if evaluation.cells is None else ari_of(evaluation.cells),
        truth_cost=evaluation.truth_cost,
        output_path=tables.root,
        timings=timer.seconds,
    )


def attempt_columns(attempt: Attempt) -> list:
    """The (run_id, attempt_id) columns every output row ends with."""
    return [F.lit(attempt.run_id).alias("run_id"), F.lit(attempt.attempt_id).alias("attempt_id")]


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


def conform(df: DataFrame, fields: list[StructField]) -> DataFrame:
    """df's columns in the order of `fields`, cast where the type differs (an Arrow table built on the
    driver holds int64 where a table holds int; nullability is left as it is)."""
    return df.select(
        *[
            F.col(f.name)
            if df.schema[f.name].dataType.simpleString() == f.dataType.simpleString()
            else F.col(f.name).cast(f.dataType)
            for f in fields
        ]
    )


def centers_frame(
    spark: SparkSession, server: ServerClustering, local: LocalCenters, cluster_ids: np.ndarray
) -> DataFrame:
    k = len(server.centers)
    n_points = np.bincount(server.assignment, weights=local.counts, minlength=k).astype(np.int64)
    device_index = np.unique(local.devices, return_inverse=True)[1]
    cluster_device_pairs = np.unique(np.stack([server.assignment, device_index]), axis=1)
    n_devices = np.bincount(cluster_device_pairs[0], minlength=k)
    rows = [(int(cluster_ids[c]), server.centers[c].tolist(), int(n_points[c]), int(n_devices[c])) for c in range(k)]
    return rows_frame(spark, rows, StructType(CENTERS_FIELDS))


def write_run_report(
    tables: OutputTables,
    attempt: Attempt,
    summary: dict,
    cfg: KFedConfig,
    clustering: Clustering,
    evaluation: Evaluation,
    changes: pa.Table | None = None,
) -> None:
    files = run_report(summary, cfg, clustering, evaluation, changes)
    if clustering.k_sweep is not None:
        files.update(report.k_sweep_files(clustering.k_sweep, attempt.run_id, attempt.attempt_id))
    tables.write_report(attempt.run_id, attempt.attempt_id, files)


def run_report(
    summary: dict, cfg: KFedConfig, clustering: Clustering, evaluation: Evaluation, changes: pa.Table | None = None
) -> dict[str, bytes]:
    """report.json and report.html of a run, from what the driver holds and the labelling pass gathered."""
    local, server = clustering.local, clustering.server
    facts = report.RunFacts(
        summary={**summary, "truth_col": cfg.input.truth_col, "output": absolute(str(cfg.output.path))},
        local_devices=local.devices,
        local_centers=local.centers,
        local_counts=local.counts,
        assignment=server.assignment,
        global_centers=server.centers,
        sample_x=evaluation.sample_x,
        sample_labels=evaluation.sample_labels,
        sample_devices=evaluation.sample_devices,
        truth_cells=evaluation.cells,
        changes=None if changes is None else changes.drop_columns(["devices_in", "devices_out"]).to_pylist(),
    )
    content = report.build(facts)
    return {
        "report.json": report.to_json(content).encode(),
        "report.html": report.render_html(content, report.figures(content, facts)).encode(),
    }


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
            "k": 0 if cfg.k == "auto" else cfg.k,  # a k auto run's, once its sweep has chosen
            "k_range": list(cfg.k_range) if cfg.k == "auto" else None,
            "k_per_device": str(cfg.k_per_device),
            "seed": cfg.seed,
            "seeding": cfg.seeding,
            "server_refine": cfg.server_refine,
            "label_mode": cfg.label_mode,
            "local_restarts": cfg.local_restarts,
            "robust_min_size": float(cfg.robust_min_size),
            "min_center_points": cfg.min_center_points,
            "privacy_epsilon": None if cfg.privacy_epsilon is None else float(cfg.privacy_epsilon),
            "privacy_delta": None if cfg.privacy_epsilon is None else float(cfg.privacy_delta),
            "timings": {},
            "config": json.dumps(as_dict(cfg), sort_keys=True),
            "versions": package_versions(),
        }
    )


def package_versions() -> dict[str, str]:
    return {name: version(name) for name in ("kfed-spark", "pyspark", "delta-spark", "numpy")}


RESULT_COLUMNS = (
    "dim",
    "n_input",
    "n_labelled",
    "n_quarantined",
    "n_devices",
    "n_local_centers",
    "n_rows_held_back",
    "n_devices_held_back",
    "cost",
    "ari",
    "truth_cost",
)


def k_sweep_column(sweep: KSweep | None) -> list[tuple] | None:
    """The runs row's k_sweep (tables.K_SWEEP_TYPE), None for a run whose k was given."""
    if sweep is None:
        return None
    return [tuple(getattr(f, name) for name in K_SWEEP_TYPE.names) for f in sweep.figures]


def result_columns(result: RunResult) -> dict:
    return {name: getattr(result, name) for name in RESULT_COLUMNS}


def plan(spark: SparkSession, cfg: KFedConfig) -> str:
    """What `run` would do, checked against the input's schema and the output tables; writes nothing."""
    raw = read_input(spark, cfg.input)
    tables = OutputTables(spark, cfg.output)
    _, dim = validated(raw, cfg)
    existing = []
    for name, schema in output_schemas(raw.schema, cfg.input.device_col).items():
        if tables.check_log(name):
            added = tables.check_schema(name, schema)
            existing.append(name + (f" (would add {', '.join(f.name for f in added)})" if added else ""))
    lo, hi = cfg.k_range
    k_setting = (
        f"k = auto (after the local step, a sweep of k = {lo}..{hi} over the local centers chooses it)"
        if cfg.k == "auto"
        else f"k = {cfg.k}"
    )
    return "\n".join(
        [
            f"input: {cfg.input.table or cfg.input.format + ' ' + str(cfg.input.path)}",
            f"  columns: {', '.join(f'{f.name} {f.dataType.simpleString()}' for f in raw.schema.fields)}",
            f"  device column: {cfg.input.device_col}; features: {cfg.input.features_col} (dimension {dim})",
            f"k-FED: {k_setting}, k_per_device = {cfg.k_per_device}, seed = {cfg.seed}, "
            f"local_restarts = {cfg.local_restarts}, seeding = {cfg.seeding}, robust_min_size = {cfg.robust_min_size}, "
            f"server_refine = {cfg.server_refine}, server_step = {cfg.server_step}, label_mode = {cfg.label_mode}, "
            f"max_rows_per_device = {cfg.max_rows_per_device}, on_bad_rows = {cfg.on_bad_rows}",
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
