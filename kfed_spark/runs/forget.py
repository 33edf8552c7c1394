"""`kfed-spark forget`: take devices back out of the published runs that hold them (an erasure request).

For each run that holds rows or centers of the devices, a new attempt of its run id is published the
way `run` publishes one (kfed_spark.store.ledger: claimed, its rows appended, one commit of its runs row),
so that readers see the earlier attempt whole until that commit and the new one whole after it. The
new attempt is what a run over the input without those devices gives, without reading the input:
- no local step: alg. 1 on a device depends on its own rows, the run seed and its id only, so every
  other device's local centers are its published ones;
- the server step again over those, with the run's own settings (its runs row's config); a run that
  takes a model (assign) takes that model again as it is published now, without the devices;
- the published labels of the other devices labelled again through the new model (a row's stored
  features give its local cluster, global cluster, distance and margin), the pass that also gathers
  the device profiles and the report;
- the quarantine copied without the devices' rows;
- the clusters keep the earlier attempt's ids where they match its clusters (kfed_spark.core.identity), and
  cluster_changes relates them to the reference run's published attempt as it is now.
A published forget attempt keeps its run's start and finish times, so the newest run stays the newest.
The earlier attempts are then superseded and their rows and report files deleted (a tidy-up); their
Parquet files leave the tables' folders at the next VACUUM after the tables' retention period.

Where nothing of a run can be clustered without the devices (no local center left, fewer than k, or the
model it takes is retracted), a run over its input without them would fail: its published attempt is
retracted instead (kfed_spark.store.ledger), and the run id has none published. An erasure is never refused
for what the devices leave behind.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import reduce

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from kfed_spark.config import KFedConfig, build_config
from kfed_spark.core.identity import (
    DRIFT_COLUMNS,
    ClusterSummary,
    ReferenceRun,
    changes_table,
    drift,
    fresh_ids,
    largest_share,
    match_clusters,
    matching_by_ids,
)
from kfed_spark.core.local_centers import LocalCenters
from kfed_spark.core.server_step import GlobalClusters
from kfed_spark.errors import ConfigError, KFedError
from kfed_spark.runs.attempt import AttemptContext, LabelledRows, k_sweep_column, package_versions, write_attempt
from kfed_spark.runs.tracking import delete_run_artifacts
from kfed_spark.runtime import fault_injection
from kfed_spark.runtime.failures import describe
from kfed_spark.spark.columns import ADDED_COLUMNS
from kfed_spark.spark.fitting import REASON_COL, Clustering, StageTimer, choose_k, merged_on_driver, validated
from kfed_spark.store.delta import attempt_filter, concurrently
from kfed_spark.store.ledger import Ledger, new_attempt_id, published_attempts, published_rows
from kfed_spark.store.models import SAVED_MODEL_ORIGIN, StoredModel, attempt_model, finished_model, reference_run
from kfed_spark.store.output import OutputTables
from kfed_spark.store.tables import RunRecord, output_schemas, stats_columns

log = logging.getLogger("kfed_spark")


@dataclass(frozen=True)
class Forgotten:
    """One run's new attempt without the devices, or its retraction."""

    run_id: str
    attempt_id: str | None  # the new attempt, None where the run was retracted
    superseded_attempt_id: str  # the attempt it replaced (or retracted)
    n_devices: int  # of the devices asked for, those the run held
    n_rows_removed: int  # their labelled and quarantined rows (every row of a retracted run)
    k: int
    n_ids_kept: int  # clusters that kept the superseded attempt's id
    mlflow_run_id: str | None  # the superseded attempt's MLflow run
    mlflow_artifacts_deleted: dict[str, str]  # MLflow run id -> its artifacts folder, deleted (the run's attempts')
    retracted: str | None = None  # why nothing of the run is left to publish, where it was retracted


class NothingLeft(Exception):
    """Nothing of a run can be clustered without the devices: a run over its input without them would fail."""


def forget(tables: OutputTables, devices: list[str], run_id: str | None = None) -> list[Forgotten]:
    """Take the devices (ids as text) out of the published run run_id, or of every published run (None):
    one new attempt per run that holds any of them, the runs in the order they finished (a reference
    run before the runs matched to it), a run whose model another takes before that one (models_first).
    Then the superseded attempts' rows are deleted."""
    ledger = Ledger(tables)
    known = ledger.rows_if_any()
    published = published_attempts(known)
    rows = sorted(
        (r for r in published_rows(known) if run_id in (None, r.run_id)),
        key=lambda r: (r.finished_at, r.run_id),
    )
    if run_id is not None and not rows:
        raise tables.unpublished(run_id)
    timer = StageTimer()  # its stages are logged; each attempt's own are in its runs row
    with timer.stage("find"):
        held = devices_held(tables, rows, sorted(set(devices)))
    affected = models_first([r for r in rows if held.get(r.run_id)])
    forgotten_first = {r.run_id for r in affected}
    for row in affected:  # refused before anything is written
        parent = row.parent_run_id
        if parent in (None, *forgotten_first) or not model_published(parent, published):
            continue  # no model, one forgotten first, or one retracted (the run is then retracted too)
        if model_holds(parent_model(tables, row), devices):
            raise KFedError(
                f"run {row.run_id!r} takes the model of {row.parent_run_id}, which holds the devices too: "
                + (
                    "a saved model cannot be changed; `kfed-spark assign` the run again with another model"
                    if row.parent_run_id.startswith(SAVED_MODEL_ORIGIN)
                    else "forget them there too (--all-runs)"
                )
            )
    done = []
    for row in affected:
        logged = sorted({r.mlflow_run_id for r in known if r.run_id == row.run_id and r.mlflow_run_id})
        done.append(forget_in_run(tables, ledger, row, held[row.run_id], logged))
    if done:
        with timer.stage("tidy"):
            ledger.tidy()
    return done


def models_first(rows: list[RunRecord]) -> list[RunRecord]:
    """The runs in their order, except that a run whose model another of them takes (assign) comes first."""
    pending, ordered = list(rows), []
    while pending:
        waiting = {r.run_id for r in pending}
        ready = next((r for r in pending if r.parent_run_id not in waiting), pending[0])  # pending[0]: a cycle
        ordered.append(ready)
        pending.remove(ready)
    return ordered


def parent_model(tables: OutputTables, row: RunRecord) -> StoredModel:
    """The model a run that takes one (assign) took, as it is published now: a run's, or a saved KFedModel."""
    origin = row.parent_run_id
    if origin.startswith(SAVED_MODEL_ORIGIN):
        return finished_model(tables, path=origin.removeprefix(SAVED_MODEL_ORIGIN))
    return finished_model(tables, origin)


def model_published(origin: str, published: dict[str, str]) -> bool:
    """Whether the model a run took (its parent_run_id) is still there: a saved KFedModel's, or a published run's
    (`published`: published_attempts)."""
    return origin.startswith(SAVED_MODEL_ORIGIN) or origin in published


def model_holds(model: StoredModel, devices: list[str] | set[str]) -> bool:
    held = pc.is_in(pc.cast(model.local.column("device_id"), pa.string()), pa.array(sorted(devices)))
    return bool(pc.any(held).as_py())


def with_parent_model(tables: OutputTables, row: RunRecord, local: LocalCenters, devices: set[str]):
    """The model of a run that takes one (assign), without the devices: the parent's model as published now
    (forget has taken them out of it first), with the run's own devices' local centers (those the parent has
    not seen, less the devices) joined to its nearest centers as assign joined them. Returns the local
    centers, the GlobalClusters they stand for and the centers' ids."""
    parent = parent_model(tables, row)
    if model_holds(parent, devices):
        raise KFedError(f"the model of {row.parent_run_id} still holds the devices: forget them there too")
    known = pc.cast(parent.local.column("device_id"), pa.string())
    own = local.table.filter(pc.invert(pc.is_in(pc.cast(local.table.column("device_id"), pa.string()), known)))
    merged, assignment = LocalCenters.from_arrow(parent.local, parent.dim).joined(
        LocalCenters.from_arrow(own, parent.dim), parent.assignment, parent.centers
    )
    return merged, GlobalClusters(parent.centers, assignment, None, 0), parent.cluster_ids


def devices_held(tables: OutputTables, rows: list[RunRecord], devices: list[str]) -> dict[str, set[str]]:
    """Of the devices, those each run's published attempt (its runs row in rows) holds a row or a center of, in
    local_centers, its device profiles or its quarantine, by run id. The three tables are read side by side,
    each attempt's partition only."""
    device_cols = {row.run_id: run_config(row, tables).input.device_col for row in rows}

    def hits(name: str) -> list:
        table = tables.read(name)
        wanted = []  # (the attempt's rows of the devices, the device column as text)
        for row in rows:
            column = device_cols[row.run_id] if name == "quarantine" else "device_id"
            if column in table.columns:
                device = F.col(column).cast("string")
                attempt = (F.col("run_id") == row.run_id) & (F.col("attempt_id") == row.attempt_id)
                wanted.append((attempt & device.isin(devices), device))
        if not wanted:
            return []
        held_device = F.coalesce(*[F.when(match, device) for match, device in wanted])
        return (
            table.filter(reduce(lambda a, b: a | b, [match for match, _ in wanted]))
            .select("run_id", held_device.alias("d"))
            .distinct()
            .collect()
        )

    names = [name for name in ("local_centers", "device_clusters", "quarantine") if rows and tables.exists(name)]
    held: dict[str, set[str]] = {}
    for found in concurrently(hits, names).values():
        for hit in found:
            held.setdefault(hit.run_id, set()).add(hit.d)
    return held


def run_config(row: RunRecord, tables: OutputTables) -> KFedConfig:
    """The run's configuration as its runs row recorded it, writing to this location."""
    try:
        raw = json.loads(row.config)
        raw["output"] = {**raw.get("output", {}), "path": tables.root}
        return build_config(raw)
    except (ValueError, ConfigError) as exc:
        raise KFedError(f"the recorded config of run {row.run_id!r} cannot be read: {describe(exc) or exc}") from None


def without(devices: set[str], column: str):
    """True for a row that is not of the devices (a null device is none of them)."""
    return ~F.coalesce(F.col(column).cast("string").isin(sorted(devices)), F.lit(False))


@dataclass(frozen=True)
class Refit:
    """A run's clustering without the devices, before anything of it is written."""

    clustering: Clustering  # over the stored labels of the other devices
    raw_schema: StructType  # the stored rows' columns, as an input's
    changes: pa.Table | None  # its cluster_changes rows (identity.mode stable)
    drift: dict[str, float | None]  # identity.drift's figures (None each without changes)
    reference: ReferenceRun | None  # the reference run's published attempt, as it is now
    n_ids_kept: int  # clusters that kept the superseded attempt's id
    highest_cluster_id: int  # the highest id used in the run's attempts so far, this one's included


def refit(tables: OutputTables, ledger: Ledger, row: RunRecord, cfg: KFedConfig, devices: set[str], timer) -> Refit:
    """The server step again over the run's published local centers of the other devices, with the run's
    settings; the clusters' ids (the superseded attempt's where they match) and cluster_changes; the stored
    labels of the other devices prepared to be labelled again. Creates what an older location lacks."""
    run_id, device_col = row.run_id, cfg.input.device_col
    with timer.stage("validate"):
        old = attempt_model(tables, run_id, row.attempt_id)
        gone = pc.is_in(pc.cast(old.local.column("device_id"), pa.string()), pa.array(sorted(devices)))
        local = LocalCenters.from_arrow(old.local.filter(pc.invert(gone)), old.dim)
        stored = tables.read("labels").filter(attempt_filter(run_id, row.attempt_id))
        raw = stored.filter(without(devices, device_col)).select(*[c for c in stored.columns if c not in ADDED_COLUMNS])
        # The rows were checked when they were labelled; validated() only prepares their features here
        # (k_per_device is not read again: it may name a side table that has changed since).
        checked, dim = validated(raw, cfg.with_algorithm(k_per_device=1).fitting, old.dim)
        schemas = output_schemas(raw.schema, device_col)
        tables.prepare(schemas, stats_columns(device_col), tables.check(schemas))
        tables.register()
        fault_injection.point("created")
    if row.parent_run_id is not None:  # no server step: the model it takes
        if not model_published(row.parent_run_id, published_attempts(ledger.rows())):
            raise NothingLeft(f"the model it takes, run {row.parent_run_id}'s, is no longer published")
        local, server, ids = with_parent_model(tables, row, local, devices)
        model = local.label_model(
            server.assignment, server.centers, cfg.algorithm.label_mode, label_unseen=True, cluster_ids=ids
        )
        return Refit(
            Clustering(checked, dim, local, server, model, ids),
            raw.schema,
            None,
            dict.fromkeys(DRIFT_COLUMNS),
            None,
            int(np.isin(ids, old.cluster_ids).sum()),
            max(row.highest_cluster_id or -1, int(ids.max())),
        )
    stable = row.identity_mode == "stable"
    with timer.stage("server_step"):
        try:
            fitting, chosen = choose_k(local, cfg.fitting, timer)
        except KFedError as exc:  # the sweep: k_range above the local centers left
            raise NothingLeft(str(exc).split(";")[0]) from None
        cfg = dataclasses.replace(cfg, algorithm=fitting.algorithm)
        reference = current_reference(tables, ledger, row) if stable else None
        initial = reference.clusters.centers if reference is not None and cfg.identity.warm_start else None
        try:
            local, server = merged_on_driver(local, cfg.algorithm, initial)
        except ValueError as exc:  # k above the local centers left
            raise NothingLeft(str(exc).split(";")[0]) from None
        if server is None:
            raise NothingLeft("no device is left with a local center to share")
    k = len(server.centers)
    summary = ClusterSummary.of(
        np.arange(k), server.centers, server.assignment, local.centers, local.counts, local.sse, local.devices
    )
    next_id = max(int(old.cluster_ids.max()), row.highest_cluster_id or -1) + 1
    ids = match_clusters(summary, old.clusters(), next_id).ids if stable else fresh_ids(k, 0).ids
    summary = dataclasses.replace(summary, ids=ids)
    changes = None
    if stable:
        matching = (
            dataclasses.replace(fresh_ids(k, 0), ids=ids)
            if reference is None
            else matching_by_ids(summary, reference.clusters)
        )
        now = largest_share(local.devices, ids[server.assignment], local.counts)
        changes = changes_table(matching, summary, reference, now, local.table.schema.field("device_id").type)
    model = local.label_model(
        server.assignment, server.centers, cfg.algorithm.label_mode, label_unseen=True, cluster_ids=ids
    )
    return Refit(
        Clustering(checked, dim, local, server, model, ids, chosen),
        raw.schema,
        changes,
        drift(changes, now, reference) if stable else dict.fromkeys(DRIFT_COLUMNS),
        reference,
        int(np.isin(ids, old.cluster_ids).sum()) if stable else 0,
        max(next_id - 1, int(ids.max())),
    )


def forget_in_run(
    tables: OutputTables, ledger: Ledger, row: RunRecord, devices: set[str], mlflow_run_ids: list[str]
) -> Forgotten:
    """The run's new attempt without the devices (refit), appended and published like a run's attempt; or,
    where nothing of it is left to cluster, its published attempt retracted.

    First, the artifacts that the MLflow runs of the run id's attempts (mlflow_run_ids) keep under the output
    location are deleted (a model holds every device's local centers), so that a forget stopped midway has
    removed them already; their params and metrics, figures of all rows, stay in MLflow."""
    run_id, timer = row.run_id, StageTimer()
    deleted = {mlflow_run_id: delete_run_artifacts(tables, mlflow_run_id) for mlflow_run_id in mlflow_run_ids}
    artifacts = {mlflow_run_id: folder for mlflow_run_id, folder in deleted.items() if folder}
    cfg = run_config(row, tables)
    try:
        found = refit(tables, ledger, row, cfg, devices, timer)
    except NothingLeft as exc:
        forgotten = (row.forgotten_devices or 0) + len(devices)
        ledger.retract(row.changed(forgotten_devices=forgotten), f"retracted by forget: {exc}")
        return Forgotten(
            run_id,
            attempt_id=None,
            superseded_attempt_id=row.attempt_id,
            n_devices=len(devices),
            n_rows_removed=row.n_input or 0,
            k=0,
            n_ids_kept=0,
            mlflow_run_id=row.mlflow_run_id,
            mlflow_artifacts_deleted=artifacts,
            retracted=str(exc),
        )
    clustering = found.clustering
    started_at = datetime.now(timezone.utc)
    new_row = row.changed(
        attempt_id=new_attempt_id(started_at),
        started_at=started_at,
        finished_at=None,
        k=len(clustering.cluster_ids),
        k_sweep=k_sweep_column(clustering.k_sweep),
        reference_attempt_id=None if found.reference is None else found.reference.attempt_id,
        highest_cluster_id=found.highest_cluster_id,
        timings={},
        versions=package_versions(),
        mlflow_run_id=None,
        tracking_error=None,
        forgotten_devices=(row.forgotten_devices or 0) + len(devices),
        **found.drift,
    )
    with timer.stage("claim"):
        attempt, new_row = ledger.begin(new_row)
    try:
        fault_injection.point("claimed")
        quarantine = tables.read("quarantine").filter(attempt_filter(run_id, row.attempt_id))
        quarantined = quarantine.filter(without(devices, cfg.input.device_col)).drop("run_id", "attempt_id")
        result, new_row = write_attempt(
            AttemptContext(tables, attempt, cfg, found.raw_schema, timer),
            new_row,
            clustering,
            found.changes,
            lambda labelled, counted: copied_quarantine(quarantined, counted),
        )
        n_quarantined = quarantined.count()
        new_row = new_row.changed(
            n_input=result.n_labelled + n_quarantined,
            n_quarantined=n_quarantined,
            timings=dict(timer.seconds),
            # The run's own times: a forget attempt stands for its run, which must not become the newest.
            started_at=row.started_at,
            finished_at=row.finished_at,
        )
        fault_injection.point("before_publish")
        with timer.stage("publish"):
            runs_now = ledger.publish(attempt, new_row)
    except BaseException as exc:
        ledger.fail(new_row.changed(timings=dict(timer.seconds)), describe(exc) or f"{type(exc).__name__}: {exc}")
        raise
    fault_injection.point("published")
    ledger.supersede_others(attempt, runs_now)
    log.info("run %s: attempt %s published without %d device(s)", run_id, attempt.attempt_id, len(devices))
    return Forgotten(
        run_id,
        attempt.attempt_id,
        row.attempt_id,
        len(devices),
        (row.n_input or 0) - new_row.n_input,
        len(clustering.cluster_ids),
        found.n_ids_kept,
        row.mlflow_run_id,
        artifacts,
    )


def current_reference(tables: OutputTables, ledger: Ledger, row: RunRecord) -> ReferenceRun | None:
    """The published attempt of the run's reference run as it is now (a forget may have replaced the one
    it was matched to), None without one."""
    if row.reference_run_id is None:
        return None
    rows = ledger.rows()
    attempt = published_attempts(rows).get(row.reference_run_id)
    found = [r for r in rows if (r.run_id, r.attempt_id) == (row.reference_run_id, attempt)]
    return reference_run(tables, found[0]) if found else None


def copied_quarantine(quarantined: DataFrame, counted: LabelledRows) -> DataFrame:
    """The quarantine rows the new attempt copies; the stored labels were valid rows once, so labelling
    them again must quarantine none."""
    if counted.n_quarantined:
        raise KFedError(
            f"row accounting failed: {counted.n_quarantined} stored labelled rows could not be labelled again"
        )
    return quarantined.withColumnRenamed("reason", REASON_COL)
