"""All reads of the input and all Delta Lake reads and writes.

Only SQL and DataFrame reads and writes: no DeltaTable Python API, which Spark Connect lacks without
Delta's Connect plugin on the server.

Every output table is partitioned by (run_id, attempt_id). An attempt appends its own rows; the
`runs` table says which attempt of each run id is published (see kfed_spark.attempts), and readers
go through the published views that this module defines.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import pyarrow.fs as pafs
from pyspark.errors import AnalysisException
from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DoubleType, StructField, StructType

from kfed_spark.config import TABLE_NAME_PATTERN, InputConfig, OutputConfig
from kfed_spark.errors import AttemptConflict, InputError, KFedError, first_line

log = logging.getLogger("kfed_spark")
T = TypeVar("T")

TABLES = ("labels", "centers", "local_centers", "quarantine", "device_clusters", "cluster_changes", "runs")
DATA_TABLES = TABLES[:-1]
"""The tables whose rows belong to one attempt of a run; `runs` says which attempts are published."""
STREAM_TABLES = ("stream_labels", "stream_quarantine")
"""The tables `kfed-spark stream` appends each micro-batch to, exactly once; not partitioned by attempt:
every row in them is final."""
PARTITION_COLUMNS = ("run_id", "attempt_id")
URI_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
"""A scheme such as s3a:, file: or abfss: (anything else is a local path)."""
REPORTS = "reports"
"""Folder under the output path holding reports/<run_id>/<attempt_id>/ for every attempt that wrote one."""
WRITE_LOCKS = "_kfed_write_locks"
"""Folder under a local output path holding one lock file per table (see OutputTables.writing)."""
STATS_COLUMNS_PROPERTY = "delta.dataSkippingStatsColumns"
"""Delta's table property naming the columns whose min, max and null counts each file records.
Delta's default, the first 32 columns, made every write of a wide table twice as slow."""

CSV_DEFAULTS = {"header": "true", "inferSchema": "true"}
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
    "distance": "the row's Euclidean distance to its global cluster's center (the squares add up to the run's cost)",
    "margin": "(d_other - d) / (d_other + d), d the row's distance to its cluster's center and d_other to the "
              "nearest other center: 1 on its center, 0 half-way, negative nearer another center",
    "sse": "sum of squared distances of the local cluster's rows to its center",
    "reason": "why the row was not clustered",
    "status": "running, succeeded, failed, abandoned or superseded",
    "error": "the one-line error of a failed or abandoned attempt",
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
    "k_sweep": "with k auto: every swept k's exact SSE, BIC, silhouette, noise ratio and stability (kfed_spark.k_sweep)",
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
    "highest_cluster_id": "the highest cluster id used in the location up to this run; null in rows of older "
                          "versions",
    "center_shift": "distance between the cluster's center and its reference cluster's",
    "relative_shift": "center_shift over the pooled root-mean-square distance of both clusters' rows to their "
                      "centers",
    "reference_n_points": "rows of the reference cluster",
    "reference_n_devices": "devices with rows in the reference cluster",
    "devices_in": "devices in both runs whose largest share of rows (as their local centers count them) is in this "
                  "cluster now and was in another",
    "devices_out": "devices in both runs whose largest share of rows (as their local centers count them) was in "
                   "this cluster and is in another now",
    "versions": "versions of kfed-spark, Spark, Delta and the numeric libraries",
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
    ("local_centers", "n_points"): "the device's rows in the local cluster",
    ("local_centers", "cluster_id"): "the global cluster the local center joined",
    ("device_clusters", "device_id"): "the device",
    ("device_clusters", "cluster_id"): "a global cluster the device has labelled rows in",
    ("device_clusters", "n_points"): "the device's labelled rows in the cluster",
    ("cluster_changes", "cluster_id"): "the cluster (of this run, or retired from the reference run)",
    ("cluster_changes", "status"): "kept (matched to a reference cluster, whose id it keeps), new (an id never "
                                   "used before) or retired (a reference cluster no cluster of this run matched)",
    ("cluster_changes", "n_points"): "rows in the cluster (null for a retired one)",
    ("cluster_changes", "n_devices"): "devices with rows in the cluster (null for a retired one)",
}
LOG_ENTRY = re.compile(r"^(\d{20})\.(json|checkpoint(?:\.\d+\.\d+)?\.parquet|crc)$")
"""A commit, checkpoint or checksum file of a Delta log, by version."""
TRANSACTION_CONFLICT = "DELTA_CONCURRENT_TRANSACTION"
"""Delta's error when another writer committed the same txnAppId at the same time."""


VECTOR_STORED_AS = ArrayType(DoubleType(), False)
"""How the tables hold a Spark ML vector column (VectorAssembler's output): VectorUDT is Spark's own
type, which delta-rs, DuckDB, Trino and every other Delta reader refuse."""


def column_comment(table: str, column: str) -> str:
    return TABLE_COLUMN_COMMENTS.get((table, column)) or COLUMN_COMMENTS.get(column) or "as in the input table"


def stored_field(table: str, field: StructField) -> StructField:
    """A column as its output table holds it, with its comment: a Spark ML vector as array<double>."""
    comment = column_comment(table, field.name)
    if isinstance(field.dataType, VectorUDT):
        return StructField(field.name, VECTOR_STORED_AS, field.nullable,
                           {"comment": f"{comment}, where it is a Spark ML vector; stored as array<double>"})
    return StructField(field.name, field.dataType, field.nullable, {"comment": comment})


def stored_columns(df: DataFrame) -> DataFrame:
    """df with its Spark ML vector columns as array<double> (stored_field), the others as they are."""
    if not any(isinstance(f.dataType, VectorUDT) for f in df.schema.fields):
        return df
    return df.select(*[
        F.when(F.col(f.name).isNotNull(), vector_to_array(F.col(f.name))).alias(f.name)
        if isinstance(f.dataType, VectorUDT) else F.col(f.name)
        for f in df.schema.fields
    ])


def sql_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def read_input(spark: SparkSession, inp: InputConfig, streaming: bool = False) -> DataFrame:
    """The input table as a DataFrame (a streaming one that reads what arrives, with streaming), or an
    InputError that says what is missing. A stream over files takes input.schema, else the schema
    of the files already there."""
    where = f"table {inp.table}" if inp.table else f"{inp.format} input {inp.path}"
    reader = spark.readStream if streaming else spark.read
    try:
        if inp.table:
            return resolved(reader.table(inp.table))
        options = {**(CSV_DEFAULTS if inp.format == "csv" else {}), **inp.options}
        schema = inp.schema
        if streaming and schema is None and inp.format != "delta":
            try:
                schema = read_input(spark, inp).schema
            except InputError:
                raise InputError(f"cannot stream {where}: it holds no files to take the schema from yet; set "
                                 "input.schema") from None
        if schema is not None:
            reader = reader.schema(schema)
        return resolved(reader.format(inp.format).options(**options).load(inp.path))
    except AnalysisException as exc:
        raise InputError(f"cannot read {where}: {first_line(exc)}") from None


def read_side_table(spark: SparkSession, name: str) -> DataFrame:
    """A small table named by a setting: a catalog table, or a Delta (else Parquet) folder."""
    try:
        if TABLE_NAME_PATTERN.match(name) and spark.catalog.tableExists(name):
            return resolved(spark.read.table(name))
        try:
            return resolved(spark.read.format("delta").load(absolute(name)))
        except AnalysisException:
            return resolved(spark.read.format("parquet").load(absolute(name)))
    except AnalysisException as exc:
        raise InputError(f"cannot read table {name}: {first_line(exc)}") from None


def resolved(df: DataFrame) -> DataFrame:
    """The DataFrame, analysed now: a classic session fails a missing path at load(), Spark Connect only
    when the plan is first analysed, which would be outside the caller's error handling."""
    df.schema
    return df


def _filesystem(path: str) -> tuple[pafs.FileSystem, str] | None:
    """pyarrow's filesystem for a local path or a URI (s3://, gs://, hdfs://) and the path in it;
    None for a scheme pyarrow does not know (s3a:, abfss:), where the checks that need it are skipped."""
    try:
        return pafs.FileSystem.from_uri(path if URI_PATTERN.match(path) else "file://" + path)
    except Exception:  # pyarrow raises ArrowInvalid or ArrowNotImplementedError for unknown schemes
        return None


def absolute(path: str) -> str:
    """A local path made absolute (Delta's table builder takes a relative location for a table
    name); a URI such as s3a://bucket/x or file:/x is returned unchanged."""
    return path if URI_PATTERN.match(path) else os.path.abspath(path)


def attempt_filter(run_id: str, attempt_id: str) -> str:
    """The SQL predicate of one attempt's partition (both ids are checked against strict patterns)."""
    return f"run_id = '{run_id}' AND attempt_id = '{attempt_id}'"


class OutputTables:
    """The Delta tables of one output location."""

    def __init__(self, spark: SparkSession, output: OutputConfig, locations: dict[str, str] | None = None):
        self.spark = spark
        self.root = absolute(str(output.path)).rstrip("/")
        self.database = output.database
        self.locations = {name: absolute(path) for name, path in (locations or {}).items()}
        """Tables that are somewhere else than <root>/<name> (stream.labels and stream.quarantine)."""

    def path(self, name: str) -> str:
        return self.locations.get(name) or f"{self.root}/{name}"

    def source(self, name: str) -> str:
        """The table in SQL, by path."""
        return f"delta.`{self.path(name)}`"

    def read(self, name: str) -> DataFrame:
        """Every row of a table, of every attempt, published or not."""
        return self.spark.read.format("delta").load(self.path(name))

    def exists(self, name: str) -> bool:
        try:
            self.read(name).schema
        except AnalysisException:
            return False
        return True

    def published(self, name: str) -> DataFrame:
        """The rows of a table that belong to published attempts (what readers see)."""
        return self.spark.sql(self.published_query(self.source(name), self.source("runs")))

    @staticmethod
    def published_query(table: str, runs: str, latest: bool = False) -> str:
        attempts = (LATEST_ATTEMPT if latest else PUBLISHED_ATTEMPTS).format(runs=runs)
        return f"SELECT * FROM {table} WHERE (run_id, attempt_id) IN ({attempts})"

    # -- checks made before any work --------------------------------------------------------------

    def check_writable(self) -> None:
        """The output location is a folder this process can create files in (a probe file is made
        and removed), or a one-line error. Skipped for schemes pyarrow does not know."""
        located = _filesystem(self.root)
        if located is None:
            return
        filesystem, root = located
        if filesystem.get_file_info(root).type == pafs.FileType.File:
            raise KFedError(f"output.path {self.root} is a file, not a folder")
        probe = f"{root}/.kfed-write-check-{uuid.uuid4().hex}"
        try:
            filesystem.create_dir(root, recursive=True)
            with filesystem.open_output_stream(probe) as out:
                out.write(b"")
            filesystem.delete_file(probe)
        except OSError as exc:
            raise KFedError(f"cannot write under output.path {self.root}: {first_line(exc)}") from None

    def check_log(self, name: str) -> bool:
        """Whether a Delta table is at the table's path; a folder there that is not an intact Delta
        table (files but no _delta_log, or a log missing commits) is refused with a one-line error."""
        located = _filesystem(self.path(name))
        if located is None:
            return self.exists(name)
        filesystem, path = located
        kind = filesystem.get_file_info(path).type
        if kind == pafs.FileType.NotFound:
            return False
        if kind != pafs.FileType.Directory:
            raise KFedError(f"output table path {self.path(name)} is a file, not a Delta table")
        entries = filesystem.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        if not any(e.base_name == "_delta_log" for e in entries):
            if entries:
                raise KFedError(f"output table path {self.path(name)} holds files but no Delta log; use another "
                                "output.path")
            return False
        versions: dict[str, set[int]] = {"json": set(), "checkpoint": set(), "crc": set()}
        for entry in filesystem.get_file_info(pafs.FileSelector(f"{path}/_delta_log")):
            match = LOG_ENTRY.match(entry.base_name)
            if match:
                versions[match.group(2).split(".")[0]].add(int(match.group(1)))
        commits, checkpoints = versions["json"], versions["checkpoint"]
        newest = max(commits | checkpoints | versions["crc"], default=None)
        first = max(checkpoints) + 1 if checkpoints else 0
        missing = [] if newest is None else [v for v in range(first, newest + 1) if v not in commits]
        if newest is None or missing:
            lacking = f"version(s) {', '.join(map(str, missing[:5]))}" if missing else "any commit"
            raise KFedError(
                f"output table {self.path(name)} is damaged: its Delta log lacks {lacking}; restore the log "
                "or use another output.path (nothing was written)"
            )
        return True

    def check_schema(self, name: str, schema: StructType) -> list[StructField]:
        """Fail before any work if a table already at the location has another schema. Returns the
        nullable columns this version added that the table lacks (an older version wrote it), which
        prepare adds."""
        try:
            existing_schema = self.read(name).schema
        except AnalysisException as exc:
            raise KFedError(f"cannot read output table {self.path(name)}: {first_line(exc)}") from None
        stored = [stored_field(name, f) for f in schema.fields]
        existing = {(f.name, f.dataType.simpleString()) for f in existing_schema.fields}
        wanted = {(f.name, f.dataType.simpleString()) for f in stored}
        added = [f for f in stored if (f.name, f.dataType.simpleString()) in wanted - existing]
        if existing != wanted and not (existing < wanted and all(f.nullable for f in added)):
            extra = sorted(n for n, _ in existing - wanted)
            missing = sorted(n for n, _ in wanted - existing)
            raise KFedError(
                f"output table {self.path(name)} holds another schema (columns only in the table: "
                f"{extra or 'none'}; only in this run: {missing or 'none'}); use another output.path"
            )
        return added

    def _add_columns(self, name: str, added: list[StructField]) -> None:
        columns = ", ".join(f"{f.name} {f.dataType.simpleString()} COMMENT {sql_string(column_comment(name, f.name))}"
                            for f in added)
        try:
            with self.writing(name):
                self.spark.sql(f"ALTER TABLE delta.`{self.path(name)}` ADD COLUMNS ({columns})")
            log.info("added %s to %s", ", ".join(f.name for f in added), self.path(name))
        except AnalysisException:  # another run may have added them at the same moment
            if not {f.name for f in added} <= set(self.read(name).schema.names):
                raise

    def check(self, schemas: dict[str, StructType]) -> dict[str, list[StructField] | None]:
        """Check every table of the location (intact log, same schema), reading only. Returns, per table,
        None if it is not there yet, else the nullable columns this version added that it lacks (an
        older version wrote it). The tables' logs are read at once."""
        present = concurrently(self.check_log, list(schemas))
        added = concurrently(lambda name: self.check_schema(name, schemas[name]), [n for n in schemas if present[n]])
        return {name: added.get(name) for name in schemas}

    def prepare(self, schemas: dict[str, StructType], stats_columns: dict[str, list[str]] | None = None,
                checked: dict[str, list[StructField] | None] | None = None) -> None:
        """check() the location (unless `checked` holds its result) and that its folder is writable (the
        first write: a probe file), then add the columns an older version's tables lack and create the
        missing tables, empty, partitioned by (run_id, attempt_id).
        A table named in stats_columns is created with Delta statistics on those columns only
        (delta.dataSkippingStatsColumns); others on Delta's default (the first 32 columns).

        Two first runs may create a table at once: Delta lets one commit version 0 and the other
        fails with a protocol or metadata conflict; the loser finds the table there and goes on.
        """
        checked = self.check(schemas) if checked is None else checked
        self.check_writable()
        for name, fields in checked.items():
            if fields:
                self._add_columns(name, fields)

        def create(name: str) -> None:
            try:
                self._create(name, schemas[name], (stats_columns or {}).get(name))
                log.info("created %s", self.path(name))
            except Exception:
                if not self.exists(name):
                    raise
                self.check_schema(name, schemas[name])

        concurrently(create, [name for name, fields in checked.items() if fields is None])

    # -- writes -----------------------------------------------------------------------------------

    @contextmanager
    def writing(self, name: str) -> Iterator[None]:
        """Hold the table's write lock while writing it, when the output is on a local disk.

        Delta needs its log store to let only one writer create each commit file. On object stores
        and HDFS the log store does; on a local disk it renames a temporary file into place, and
        that rename overwrites, so two processes committing the same version at once both
        "succeed" and one commit is lost. An exclusive OS lock per table makes the writes of
        this machine's processes to that table take turns; Delta's conflict checks do the rest.
        """
        if URI_PATTERN.match(self.root) and not self.root.startswith("file:"):
            yield
            return
        folder = os.path.join(self.root.removeprefix("file:"), WRITE_LOCKS)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, or the process dies
            yield

    def _create(self, name: str, schema: StructType, stats_columns: list[str] | None = None) -> None:
        """Create a table, empty, with its comments and partitioning (partition_columns), in one commit
        (CREATE TABLE AS SELECT from an empty view carries the column types and the comments); columns
        as stored_field holds them."""
        view = f"kfed_create_{name}_{uuid.uuid4().hex[:8]}"
        properties = "" if stats_columns is None else (
            f"TBLPROPERTIES ('{STATS_COLUMNS_PROPERTY}' = "
            f"{sql_string(','.join('`' + c.replace('`', '``') + '`' for c in stats_columns))}) "
        )
        commented = StructType([stored_field(name, f) for f in schema.fields])
        self.spark.createDataFrame([], commented).createOrReplaceTempView(view)
        try:
            with self.writing(name):
                partitioned = f"PARTITIONED BY ({', '.join(partition_columns(name))}) " if partition_columns(name) else ""
                self.spark.sql(
                    f"CREATE TABLE IF NOT EXISTS delta.`{self.path(name)}` USING delta {partitioned}"
                    f"COMMENT {sql_string(TABLE_COMMENTS[name])} {properties}AS SELECT * FROM {view}"
                )
        finally:
            self.spark.catalog.dropTempView(view)

    def _write(self, df: DataFrame, name: str, mode: str, note: str, **options: str) -> None:
        writer = stored_columns(df).write.format("delta").mode(mode).option("userMetadata", note)
        if partition_columns(name):
            writer = writer.partitionBy(*partition_columns(name))
        with self.writing(name):
            writer.options(**options).save(self.path(name))

    def append(self, frames: dict[str, DataFrame], run_id: str, attempt_id: str) -> None:
        """Append an attempt's rows to several tables, each one commit, the commits made concurrently.
        The rows stay invisible until the attempt is published."""

        def write(name: str) -> None:
            self._write(frames[name], name, "append", f"kfed-spark run {run_id} attempt {attempt_id}")
            log.info("wrote %s for run %s (attempt %s)", self.path(name), run_id, attempt_id)

        concurrently(write, list(frames))

    def append_batch(self, frames: dict[str, DataFrame], app_id: str, batch_id: int, note: str) -> None:
        """Append a stream's micro-batch to its tables, each write idempotent: it carries Delta's marker
        (txnAppId = app_id, txnVersion = batch_id), and Delta skips it if the table has committed that
        batch of that app already, as when a batch is replayed after its process was killed. `note` is
        the commits' userMetadata."""

        def write(name: str) -> None:
            self._write(frames[name], name, "append", note, txnAppId=app_id, txnVersion=str(batch_id))

        concurrently(write, list(frames))

    def add_attempt_row(self, row: DataFrame, run_id: str, attempt_id: str) -> None:
        """Append a new attempt's first row to `runs`: a plain append, about a third of a replacing commit."""
        self._write(row, "runs", "append", f"kfed-spark run {run_id} attempt {attempt_id}")

    def write_attempt_row(self, row: DataFrame, run_id: str, attempt_id: str, fence: int | None = None) -> None:
        """Replace an attempt's row of `runs` in one commit.

        With `fence`, the commit carries Delta's idempotent-write marker (txnAppId per run id,
        txnVersion = fence): Delta skips it if that run id already committed this or a higher fence,
        and fails it if another writer commits the same marker at the same moment. That makes the
        publish of a run id first-come-first-served; the caller reads the row back to learn which.
        """
        options = {"replaceWhere": attempt_filter(run_id, attempt_id)}
        if fence is not None:
            options.update(txnAppId=f"kfed-spark-publish:{run_id}", txnVersion=str(fence))
        try:
            self._write(row, "runs", "overwrite", f"kfed-spark run {run_id} attempt {attempt_id}", **options)
        except Exception as exc:
            if TRANSACTION_CONFLICT in str(exc):
                raise AttemptConflict(
                    f"another attempt of run {run_id!r} was published at the same moment as attempt {attempt_id}"
                ) from None
            raise

    def delete_attempt(self, run_id: str, attempt_id: str) -> None:
        """Remove an unpublished attempt's rows from every data table (metadata-only: whole
        partitions) and its report files."""
        def delete(name: str) -> None:
            with self.writing(name):
                self.spark.sql(f"DELETE FROM {self.source(name)} WHERE {attempt_filter(run_id, attempt_id)}")

        concurrently(delete, list(DATA_TABLES))
        located = _filesystem(self.report_dir(run_id, attempt_id))
        if located is not None:
            filesystem, folder = located
            if filesystem.get_file_info(folder).type == pafs.FileType.Directory:
                filesystem.delete_dir(folder)

    # -- reports ----------------------------------------------------------------------------------

    def report_dir(self, run_id: str, attempt_id: str) -> str:
        return f"{self.root}/{REPORTS}/{run_id}/{attempt_id}"

    def write_report(self, run_id: str, attempt_id: str, files: dict[str, bytes]) -> None:
        """The attempt's report files under <root>/reports/<run_id>/<attempt_id>/ (any filesystem pyarrow knows)."""
        located = _filesystem(self.report_dir(run_id, attempt_id))
        if located is None:
            log.warning("no report written: pyarrow cannot write to %s", self.root)
            return
        filesystem, folder = located
        filesystem.create_dir(folder, recursive=True)
        for name, data in files.items():
            with filesystem.open_output_stream(f"{folder}/{name}") as out:
                out.write(data)
        log.info("wrote the report of run %s to %s", run_id, folder)

    def read_report(self, run_id: str, name: str = "report.json") -> bytes:
        """A file of the report of a run's published attempt."""
        rows = self.spark.sql(
            f"SELECT attempt_id FROM ({PUBLISHED_ATTEMPTS.format(runs=self.source('runs'))}) WHERE run_id = '{run_id}'"
        ).collect() if self.exists("runs") else []
        located = _filesystem(f"{self.report_dir(run_id, rows[0].attempt_id)}/{name}") if rows else None
        if located is None:
            raise KFedError(f"no report of a published run {run_id!r} under {self.root}/{REPORTS}")
        filesystem, path = located
        try:
            with filesystem.open_input_stream(path) as stream:
                return stream.read()
        except FileNotFoundError:
            raise KFedError(f"no report of a published run {run_id!r} under {self.root}/{REPORTS}") from None

    # -- readers' views ---------------------------------------------------------------------------

    def _views(self, names: list[str], runs: str, table_of) -> dict[str, str]:
        """View name -> query: every data table's published rows under its own name, and latest_<table>
        for the newest succeeded run; runs itself as it is (every attempt, with its status)."""
        views = {"runs": f"SELECT * FROM {runs}"}
        for name in names:
            views[name] = self.published_query(table_of(name), runs)
            views[f"latest_{name}"] = self.published_query(table_of(name), runs, latest=True)
        return views

    def register(self) -> None:
        """With output.database: views <database>.labels, ..., <database>.latest_labels, ... over the
        published attempts, and <database>.runs. The tables themselves stay unnamed (by path only),
        so that nothing in the catalog shows an unpublished row."""
        if not self.database:
            return
        self.spark.sql(f"CREATE DATABASE IF NOT EXISTS {self.database}")
        for view, query in self._views(list(DATA_TABLES), self.source("runs"), self.source).items():
            self.spark.sql(f"CREATE OR REPLACE VIEW {self.database}.{view} AS {query}")

    def register_views(self) -> list[str]:
        """Temporary views of this location (as register() names them); returns their names."""
        if not self.exists("runs"):
            return []
        names = [name for name in DATA_TABLES if self.exists(name)]
        views = self._views(names, self.source("runs"), self.source)
        views.update({name: f"SELECT * FROM {self.source(name)}" for name in STREAM_TABLES if self.exists(name)})
        for view, query in views.items():
            self.spark.sql(f"CREATE OR REPLACE TEMPORARY VIEW {view} AS {query}")
        return list(views)


def partition_columns(name: str) -> tuple[str, ...]:
    """A table's partition columns: (run_id, attempt_id) for a run's tables, none for a stream's."""
    return () if name in STREAM_TABLES else PARTITION_COLUMNS


def concurrently(work: Callable[[str], T], names: list[str]) -> dict[str, T]:
    """work(name) for every table name (a check, creation, append or delete), in threads: a Delta log
    read or commit is mostly fixed overhead (about a second in local mode), so those of different tables
    overlap well. Returns each name's result; the first failure is raised."""
    if len(names) <= 1:
        return {name: work(name) for name in names}
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        futures = {name: pool.submit(work, name) for name in names}
        return {name: future.result() for name, future in futures.items()}
