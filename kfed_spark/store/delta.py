"""All Delta Lake reads and writes of the output location.

Only SQL and DataFrame reads and writes: no DeltaTable Python API, which Spark Connect lacks without
Delta's Connect plugin on the server.

What the tables hold (names, schemas, comments, partitioning, statistics columns, the published rule)
is kfed_spark.store.tables; this module creates, checks, appends to and reads them, and defines the views
readers go through (an attempt's rows count once the `runs` table publishes it: kfed_spark.store.ledger).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
from pyspark.errors import AnalysisException
from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import ArrayType, DataType, DoubleType, MapType, StructField, StructType, UserDefinedType

from kfed_spark.config import OutputConfig
from kfed_spark.errors import AttemptConflict, KFedError, first_line
from kfed_spark.spark.input import URI_PATTERN, absolute
from kfed_spark.store.tables import (
    DATA_TABLES,
    LATEST_ATTEMPT,
    PUBLISHED_ATTEMPTS,
    STREAM_TABLES,
    TABLE_COMMENTS,
    TABLES,
    column_comment,
    partition_columns,
)

log = logging.getLogger("kfed_spark")
T = TypeVar("T")

REPORTS = "reports"
"""Folder under the output path holding reports/<run_id>/<attempt_id>/ for every attempt that wrote one."""
WRITE_LOCKS = "_kfed_write_locks"
"""Folder under a local output path holding one lock file per table (see OutputTables.writing)."""
STATS_COLUMNS_PROPERTY = "delta.dataSkippingStatsColumns"
"""Delta's table property naming the columns whose min, max and null counts each file records.
Delta's default, the first 32 columns, made every write of a wide table twice as slow."""

LOG_ENTRY = re.compile(r"^(\d{20})\.(json|checkpoint(?:\.\d+\.\d+)?\.parquet|crc)$")
"""A commit, checkpoint or checksum file of a Delta log, by version."""
TRANSACTION_CONFLICT = "DELTA_CONCURRENT_TRANSACTION"
"""Delta's error when another writer committed the same txnAppId at the same time."""


VECTOR_STORED_AS = ArrayType(DoubleType(), False)
"""How the tables hold a Spark ML vector column (VectorAssembler's output): VectorUDT is Spark's own
type, which delta-rs, DuckDB, Trino and every other Delta reader refuse."""


def stored_field(table: str, field: StructField) -> StructField:
    """A column as its output table holds it, with its comment: a Spark ML vector as array<double>."""
    comment = column_comment(table, field.name)
    if isinstance(field.dataType, VectorUDT):
        return StructField(
            field.name,
            VECTOR_STORED_AS,
            field.nullable,
            {"comment": f"{comment}, where it is a Spark ML vector; stored as array<double>"},
        )
    return StructField(field.name, field.dataType, field.nullable, {"comment": comment})


def column_ddl(field: StructField) -> str:
    """A column of CREATE TABLE: quoted name, type and comment, nullable at every depth (as the tables have
    always been; Delta refuses a NOT NULL nested in an array). Written here rather than by toDDL, which
    over Spark Connect needs the session active in the calling thread."""
    comment = field.metadata.get("comment")
    return f"{quoted(field.name)} {type_ddl(field.dataType)}" + (f" COMMENT {sql_string(comment)}" if comment else "")


def type_ddl(data_type: DataType) -> str:
    if isinstance(data_type, StructType):
        return f"STRUCT<{', '.join(column_ddl(f) for f in data_type.fields)}>"
    if isinstance(data_type, ArrayType):
        return f"ARRAY<{type_ddl(data_type.elementType)}>"
    if isinstance(data_type, MapType):
        return f"MAP<{type_ddl(data_type.keyType)}, {type_ddl(data_type.valueType)}>"
    if isinstance(data_type, UserDefinedType):
        return type_ddl(data_type.sqlType())
    return data_type.simpleString()


def quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def rows_frame(spark: SparkSession, rows: Sequence[tuple], schema: StructType) -> DataFrame:
    """A DataFrame of a few rows made on the driver (a runs row, a run's centers), sent to the JVM as Arrow.
    From a list Spark would make an RDD whose every pass runs Python tasks, in a Python daemon of their own
    beside the one of the job's Arrow passes: a fresh run started, and imported into, two. A naive datetime
    is local time, as Spark takes it from a list."""
    table = pa.Table.from_pylist(
        [
            {
                name: value.astimezone(timezone.utc) if isinstance(value, datetime) else value
                for name, value in zip(schema.names, row, strict=True)
            }
            for row in rows
        ],
        schema=to_arrow_schema(schema, timezone="UTC"),
    )
    return spark.createDataFrame(table, schema)


def stored_columns(df: DataFrame) -> DataFrame:
    """df with its Spark ML vector columns as array<double> (stored_field), the others as they are."""
    if not any(isinstance(f.dataType, VectorUDT) for f in df.schema.fields):
        return df
    return df.select(
        *[
            F.when(F.col(f.name).isNotNull(), vector_to_array(F.col(f.name))).alias(f.name)
            if isinstance(f.dataType, VectorUDT)
            else F.col(f.name)
            for f in df.schema.fields
        ]
    )


def sql_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _filesystem(path: str) -> tuple[pafs.FileSystem, str] | None:
    """pyarrow's filesystem for a local path or a URI (s3://, gs://, hdfs://) and the path in it;
    None for a scheme pyarrow does not know (s3a:, abfss:), where the checks that need it are skipped."""
    try:
        return pafs.FileSystem.from_uri(path if URI_PATTERN.match(path) else "file://" + path)
    except Exception:  # pyarrow raises ArrowInvalid or ArrowNotImplementedError for unknown schemes
        return None


def attempt_filter(run_id: str, attempt_id: str) -> str:
    """The SQL predicate of one attempt's partition (both ids are checked against strict patterns)."""
    return f"run_id = '{run_id}' AND attempt_id = '{attempt_id}'"


class TableStore:
    """The tables of one output location by path: reading them, and the locked, one-commit writes
    every other part of OutputTables makes."""

    def __init__(self, spark: SparkSession, output: OutputConfig, locations: dict[str, str] | None = None):
        self.spark = spark
        self.root = absolute(str(output.path)).rstrip("/")
        self.database = output.database
        self.locations = {name: absolute(path) for name, path in (locations or {}).items()}
        """Tables that are somewhere else than <root>/<name> (stream.labels and stream.quarantine)."""
        self.attempts_begun: set[tuple[str, str]] = set()
        """(run id, attempt id) of the attempts whose rows or report files this process began to write:
        an attempt not among them has nothing to delete when it fails here."""

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
        """Create a table, empty, with its comments and partitioning (partition_columns), in one commit;
        columns as stored_field holds them (column_ddl). A CREATE TABLE that lists its columns commits
        metadata only: a new location's seven tables took 3.8 s in a fresh process, against 7.3 s as
        CREATE TABLE AS SELECT from an empty view, which runs a write job per table."""
        properties = (
            ""
            if stats_columns is None
            else (
                f"TBLPROPERTIES ('{STATS_COLUMNS_PROPERTY}' = "
                f"{sql_string(','.join(quoted(c) for c in stats_columns))}) "
            )
        )
        columns = ", ".join(column_ddl(stored_field(name, f)) for f in schema.fields)
        partitioned = f"PARTITIONED BY ({', '.join(partition_columns(name))}) " if partition_columns(name) else ""
        with self.writing(name):
            self.spark.sql(
                f"CREATE TABLE IF NOT EXISTS delta.`{self.path(name)}` ({columns}) USING delta {partitioned}"
                f"COMMENT {sql_string(TABLE_COMMENTS[name])} {properties}"
            )

    def _write(self, df: DataFrame, name: str, mode: str, note: str, **options: str) -> None:
        writer = stored_columns(df).write.format("delta").mode(mode).option("userMetadata", note)
        if partition_columns(name):
            writer = writer.partitionBy(*partition_columns(name))
        with self.writing(name):
            writer.options(**options).save(self.path(name))

    def report_dir(self, run_id: str, attempt_id: str) -> str:
        return f"{self.root}/{REPORTS}/{run_id}/{attempt_id}"

    def vacuum(self) -> list[str]:
        """VACUUM every table of the location (each with its own retention, delta.deletedFileRetentionDuration,
        7 days unless set): the files of deleted rows older than that leave the folders. Returns the tables."""
        names = [name for name in (*TABLES, *STREAM_TABLES) if self.exists(name)]

        def vacuum(name: str) -> None:
            with self.writing(name):
                self.spark.sql(f"VACUUM {self.source(name)}")

        # Delta lists a table's files in as many tasks as this says: 10,000 by default, minutes of empty tasks
        # on a small machine; the session's shuffle partitions are sized to its cluster.
        listing = "spark.sql.sources.parallelPartitionDiscovery.parallelism"
        before = self.spark.conf.get(listing, None)
        self.spark.conf.set(listing, self.spark.conf.get("spark.sql.shuffle.partitions"))
        try:
            concurrently(vacuum, names)
        finally:
            if before is None:
                self.spark.conf.unset(listing)
            else:
                self.spark.conf.set(listing, before)
        return names


class LocationChecks(TableStore):
    """The checks made before any work (intact logs, the same schemas, a writable folder), and
    preparing the location: adding the columns an older version lacks, creating missing tables."""

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
                raise KFedError(
                    f"output table path {self.path(name)} holds files but no Delta log; use another output.path"
                )
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
        columns = ", ".join(column_ddl(f) for f in added)  # check_schema's fields: stored_field's, with comments
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

    def prepare(
        self,
        schemas: dict[str, StructType],
        stats_columns: dict[str, list[str]] | None = None,
        checked: dict[str, list[StructField] | None] | None = None,
    ) -> None:
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


class AttemptWrites(TableStore):
    """An attempt's rows: appended to the data tables, its runs row written (fenced to publish), its
    rows deleted; a stream's micro-batches, appended exactly once."""

    def append(self, frames: dict[str, DataFrame], run_id: str, attempt_id: str) -> None:
        """Append an attempt's rows to several tables, each one commit, the commits made concurrently.
        The rows stay invisible until the attempt is published."""
        self.attempts_begun.add((run_id, attempt_id))

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

    def record_tracking(self, run_id: str, attempt_id: str, mlflow_run_id: str | None, error: str | None) -> None:
        """Set a published attempt's mlflow_run_id and tracking_error in runs: an UPDATE of those two
        columns only, so that a status another process set meanwhile (superseded) stays as it is."""
        values = ", ".join(
            f"{column} = {'NULL' if value is None else sql_string(value)}"
            for column, value in (("mlflow_run_id", mlflow_run_id), ("tracking_error", error))
        )
        with self.writing("runs"):
            self.spark.sql(f"UPDATE {self.source('runs')} SET {values} WHERE {attempt_filter(run_id, attempt_id)}")

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


class RunReports(TableStore):
    """The report files of an attempt, beside the tables under <root>/reports."""

    def write_report(self, run_id: str, attempt_id: str, files: dict[str, bytes]) -> None:
        """The attempt's report files under <root>/reports/<run_id>/<attempt_id>/ (any filesystem pyarrow knows)."""
        self.attempts_begun.add((run_id, attempt_id))
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
        rows = (
            self.spark.sql(
                f"SELECT attempt_id FROM ({PUBLISHED_ATTEMPTS.format(runs=self.source('runs'))}) "
                f"WHERE run_id = '{run_id}'"
            ).collect()
            if self.exists("runs")
            else []
        )
        located = _filesystem(f"{self.report_dir(run_id, rows[0].attempt_id)}/{name}") if rows else None
        if located is None:
            raise KFedError(f"no report of a published run {run_id!r} under {self.root}/{REPORTS}")
        filesystem, path = located
        try:
            with filesystem.open_input_stream(path) as stream:
                return stream.read()
        except FileNotFoundError:
            raise KFedError(f"no report of a published run {run_id!r} under {self.root}/{REPORTS}") from None

    def report_files(self, run_id: str, attempt_id: str) -> dict[str, bytes]:
        """Every file of an attempt's report by name; none where it wrote none (or pyarrow cannot read there)."""
        located = _filesystem(self.report_dir(run_id, attempt_id))
        if located is None:
            return {}
        filesystem, folder = located
        found = filesystem.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
        files = {}
        for info in found:
            if info.type == pafs.FileType.File:
                with filesystem.open_input_stream(info.path) as stream:
                    files[info.base_name] = stream.read()
        return files


class PublishedViews(TableStore):
    """What readers see: the published attempts' rows, as DataFrames and as SQL views."""

    def published(self, name: str) -> DataFrame:
        """The rows of a table that belong to published attempts (what readers see)."""
        return self.spark.sql(self.published_query(self.source(name), self.source("runs")))

    @staticmethod
    def published_query(table: str, runs: str, latest: bool = False) -> str:
        attempts = (LATEST_ATTEMPT if latest else PUBLISHED_ATTEMPTS).format(runs=runs)
        return f"SELECT * FROM {table} WHERE (run_id, attempt_id) IN ({attempts})"

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


class OutputTables(LocationChecks, AttemptWrites, RunReports, PublishedViews):
    """The Delta tables of one output location: every read and write of the job's tables, each role a
    class of its own above."""


def concurrently(work: Callable[[str], T], names: list[str]) -> dict[str, T]:
    """work(name) for every table name (a check, creation, append or delete), in threads: a Delta log
    read or commit is mostly fixed overhead (about a second in local mode), so those of different tables
    overlap well. Returns each name's result; the first failure is raised."""
    if len(names) <= 1:
        return {name: work(name) for name in names}
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        futures = {name: pool.submit(work, name) for name in names}
        return {name: future.result() for name, future in futures.items()}
