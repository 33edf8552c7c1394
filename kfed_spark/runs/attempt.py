"""Writing one attempt of a run: its labels (the one pass over the input after the local step, which also
counts the rows and gathers the evaluation), its centers, device profiles, cluster changes and quarantine, and its
report, into the output location's tables. The job and `kfed-spark forget` write their attempts through it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import asdict, dataclass, field
from functools import cached_property
from importlib.metadata import version

import numpy as np
import pandas as pd
import pyarrow as pa
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from kfed_spark.config import KFedConfig
from kfed_spark.core.evaluation import Evaluation, EvaluationSpec
from kfed_spark.core.k_sweep import KSweep
from kfed_spark.core.local_centers import LocalCenters
from kfed_spark.core.metrics import ari_of
from kfed_spark.core.profiles import profiles_table
from kfed_spark.core.server_step import GlobalClusters
from kfed_spark.errors import KFedError
from kfed_spark.runs import report
from kfed_spark.runs.describe import cluster_summaries
from kfed_spark.runs.history import cluster_sizes, reported_attempts
from kfed_spark.runtime import fault_injection
from kfed_spark.spark.columns import labelled_fields
from kfed_spark.spark.fitting import REASON_COL, Clustering, StageTimer, feature_names
from kfed_spark.spark.input import absolute
from kfed_spark.spark.labelling import label_rows
from kfed_spark.spark.session import in_background
from kfed_spark.spark.workers import EVALUATION_COL, SQ_DIST_COL
from kfed_spark.store.delta import rows_table
from kfed_spark.store.ledger import Attempt, Ledger
from kfed_spark.store.output import OutputTables
from kfed_spark.store.tables import (
    CENTERS_FIELDS,
    K_SWEEP_TYPE,
    RunRecord,
    output_schemas,
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
    clusters_per_device_in_effect: float | None  # the heterogeneity check's (report.heterogeneity)
    clusters_in_effect: float | None
    output_path: str
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class AttemptContext:
    """Where one attempt writes and what with: the output location, the attempt, the run's settings, the
    input's schema, the stage timer, and where an applied model came from (a run id, or model:<path>)."""

    tables: OutputTables
    attempt: Attempt
    cfg: KFedConfig
    raw_schema: StructType
    timer: StageTimer
    parent_run_id: str | None = None

    @cached_property
    def schemas(self) -> dict[str, StructType]:
        """Every output table's schema for this input."""
        return output_schemas(self.raw_schema, self.cfg.input.device_col)


def write_attempt(
    context: AttemptContext,
    row: RunRecord,
    clustering: Clustering,
    changes: pa.Table | None,
    quarantined: Callable[[DataFrame, LabelledRows], DataFrame | None],
) -> tuple[RunResult, RunRecord]:
    """Append an attempt's rows to every table and write its report: the labels (the one pass over
    clustering.checked, which also counts and gathers the evaluation), with the centers beside them, then
    the device profiles, `changes` (cluster_changes rows, if any) and the rows quarantined(labelled, counted)
    gives, with the report beside them. Returns the figures and `row` with them, ready to publish; what it
    started in the background is finished (or failed) before it returns or raises."""
    tables, attempt, cfg, timer, schemas = context.tables, context.attempt, context.cfg, context.timer, context.schemas
    writes: list[Future] = []
    try:
        writes.append(in_background(write_centers, tables, attempt, schemas, clustering))
        with timer.stage("labels"):
            counted, labelled = write_labels(tables, attempt, cfg, context.raw_schema, clustering)
        evaluation = counted.evaluation
        spread = report.heterogeneity(evaluation.sample_x, evaluation.sample_devices, clustering.server.centers)
        iid = report.iid_warning(spread)
        if iid:
            log.warning("run %s: %s", attempt.run_id, iid)
        result = run_result(
            attempt,
            context.parent_run_id,
            tables,
            clustering,
            counted,
            spread,
            timer,
            cfg.algorithm.privacy_epsilon is not None,
        )
        # A run's new attempt (forget's) keeps its names: its stored rows no longer carry a vector's attributes.
        names = row.feature_names or feature_names(context.raw_schema, cfg.input.features_col, clustering.dim)
        row = row.changed(**result_columns(result), feature_names=names)
        device_profiles = device_clusters_table(evaluation, clustering.local.table.schema.field("device_id").type)
        moments = evaluation.cluster_moments
        cluster_profiles = None if moments is None else profiles_table(moments, names)
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
                    cluster_profiles,
                )
            )
        with timer.stage("other_tables"):
            write_other_tables(
                tables, attempt, schemas, device_profiles, changes, cluster_profiles, quarantined(labelled, counted)
            )
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
        report.SAMPLE_ROWS,
        int(clustering.local.counts.sum()),
        cfg.algorithm.seed,
        cfg.writes_profiles,
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
        Evaluation.merge(out["evaluation"], report.SAMPLE_ROWS, clustering.dim),
    )
    return counted, labelled


def write_centers(
    tables: OutputTables, attempt: Attempt, schemas: dict[str, StructType], clustering: Clustering
) -> None:
    """Append the attempt's local centers, each with the global cluster it joined, and its global centers."""
    local, server = clustering.local, clustering.server
    local_with_cluster = local.table.append_column(
        "cluster_id", pa.array(clustering.cluster_ids[server.assignment], type=pa.int32())
    )
    tables.append_arrow(
        {
            "local_centers": (local_with_cluster, schemas["local_centers"]),
            "centers": (centers_table(server, local, clustering.cluster_ids), schemas["centers"]),
        },
        attempt.run_id,
        attempt.attempt_id,
    )


def write_other_tables(
    tables: OutputTables,
    attempt: Attempt,
    schemas: dict[str, StructType],
    device_profiles: pa.Table,
    changes: pa.Table | None,
    cluster_profiles: pa.Table | None,
    quarantined: DataFrame | None,
) -> None:
    """Append the attempt's device profiles (device_clusters_table), its cluster changes (with identity.mode
    stable; kfed_spark.core.identity.changes_table), its cluster profiles (unless the run writes none:
    kfed_spark.core.profiles.profiles_table), then its quarantined rows (the input's columns and their reason,
    in REASON_COL) if it has any."""
    held = {
        name: (table, schemas[name])
        for name, table in (
            ("device_clusters", device_profiles),
            ("cluster_changes", changes),
            ("cluster_profiles", cluster_profiles),
        )
        if table is not None
    }
    tables.append_arrow(held, attempt.run_id, attempt.attempt_id)
    if quarantined is not None:
        quarantine = quarantined.withColumnRenamed(REASON_COL, "reason").select(
            *schemas["quarantine"].names[:-2], *attempt_columns(attempt)
        )
        tables.append({"quarantine": quarantine}, attempt.run_id, attempt.attempt_id)
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
    spread: dict,
    timer: StageTimer,
    private: bool,
) -> RunResult:
    """The run's figures, with the heterogeneity check's (spread: report.heterogeneity); with private
    (privacy_epsilon) the shared counts are noisy, so the rows held back are not known."""
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
        **report.spread_columns(spread),
        output_path=tables.root,
        timings=timer.seconds,
    )


def attempt_columns(attempt: Attempt) -> list:
    """The (run_id, attempt_id) columns every output row ends with."""
    return [F.lit(attempt.run_id).alias("run_id"), F.lit(attempt.attempt_id).alias("attempt_id")]


def centers_table(server: GlobalClusters, local: LocalCenters, cluster_ids: np.ndarray) -> pa.Table:
    """The centers rows: each global cluster's id, center, rows and devices."""
    k = len(server.centers)
    n_points = np.bincount(server.assignment, weights=local.counts, minlength=k).astype(np.int64)
    device_index = np.unique(local.devices, return_inverse=True)[1]
    cluster_device_pairs = np.unique(np.stack([server.assignment, device_index]), axis=1)
    n_devices = np.bincount(cluster_device_pairs[0], minlength=k)
    rows = [(int(cluster_ids[c]), server.centers[c].tolist(), int(n_points[c]), int(n_devices[c])) for c in range(k)]
    return rows_table(rows, StructType(CENTERS_FIELDS))


def write_run_report(
    tables: OutputTables,
    attempt: Attempt,
    summary: dict,
    cfg: KFedConfig,
    clustering: Clustering,
    evaluation: Evaluation,
    changes: pa.Table | None = None,
    cluster_profiles: pa.Table | None = None,
) -> None:
    past = None if summary.get("reference_run_id") is None else past_sizes(tables, attempt.run_id)
    files = run_report(summary, cfg, clustering, evaluation, changes, cluster_profiles, past)
    if clustering.k_sweep is not None:
        files.update(report.k_sweep_files(clustering.k_sweep, attempt.run_id, attempt.attempt_id))
    tables.write_report(attempt.run_id, attempt.attempt_id, files)


def past_sizes(tables: OutputTables, run_id: str) -> tuple[pd.DataFrame, list[str]]:
    """The cluster sizes (run_id, cluster_id, n_points) of the published runs the run's report draws before its
    own (history.reported_attempts), and their run ids oldest first."""
    before = reported_attempts(Ledger(tables).rows(), run_id)
    return cluster_sizes(tables, [(row.run_id, row.attempt_id) for row in before]), [row.run_id for row in before]


def run_report(
    summary: dict,
    cfg: KFedConfig,
    clustering: Clustering,
    evaluation: Evaluation,
    changes: pa.Table | None = None,
    cluster_profiles: pa.Table | None = None,
    past: tuple[pd.DataFrame, list[str]] | None = None,
) -> dict[str, bytes]:
    """report.json and report.html of a run, from what the driver holds and the labelling pass gathered, and
    with a reference run the cluster sizes of the runs before it (past_sizes) followed by its own."""
    local, server = clustering.local, clustering.server
    clusters = clustering.clusters()
    sizes_over_runs = None
    if past is not None:
        own = pd.DataFrame(
            {"run_id": summary["run_id"], "cluster_id": clustering.cluster_ids, "n_points": clusters.n_points}
        )
        sizes_over_runs = pd.concat([past[0], own], ignore_index=True), [*past[1], summary["run_id"]]
    n_devices = dict(zip(clustering.cluster_ids.tolist(), clusters.n_devices.tolist(), strict=True))
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
        clusters=None if cluster_profiles is None else cluster_summaries(cluster_profiles.to_pandas(), n_devices),
        sizes_over_runs=sizes_over_runs,
    )
    content = report.build(facts)
    return {
        "report.json": report.to_json(content).encode(),
        "report.html": report.render_html(content, report.figures(content, facts)).encode(),
    }


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
    "clusters_per_device_in_effect",
    "clusters_in_effect",
)


def k_sweep_column(sweep: KSweep | None) -> list[tuple] | None:
    """The runs row's k_sweep (tables.K_SWEEP_TYPE), None for a run whose k was given."""
    if sweep is None:
        return None
    return [tuple(getattr(f, name) for name in K_SWEEP_TYPE.names) for f in sweep.figures]


def result_columns(result: RunResult) -> dict:
    return {name: getattr(result, name) for name in RESULT_COLUMNS}
