"""Delta Lake reads and writes of one output location: a table's path, creation, locked writes and VACUUM,
and the rows and schemas as Delta stores them. kfed_spark.store.output builds the location's checks,
appends, reports and views on these.

Spark writes the tables, through SQL and DataFrames: no delta-spark DeltaTable Python API, which Spark
Connect lacks without Delta's Connect plugin on the server. Tables that hold few rows (runs, one attempt's
model) are read by delta-rs where this process reaches them itself (TableStore.read_few), and there the
rows the driver holds (runs rows, an attempt's centers and profiles) are written by delta-rs too
(TableStore.write_arrow). What the tables hold (names, schemas, comments, partitioning, statistics
columns, the published rule) is kfed_spark.store.tables.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, QueryBuilder, Transaction, write_deltalake
from deltalake.exceptions import DeltaError
from pyspark.errors import AnalysisException
from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import ArrayType, DataType, DoubleType, MapType, StructField, StructType, UserDefinedType

from kfed_spark.config import OutputConfig
from kfed_spark.errors import first_line
from kfed_spark.spark.input import URI_PATTERN, absolute
from kfed_spark.store.tables import (
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
CHECKPOINT_INTERVAL_PROPERTY = "delta.checkpointInterval"
SPARK_CHECKPOINT_INTERVAL = 10
"""Delta's commits between checkpoints unless the table says otherwise, as Spark keeps them; delta-rs's own
default is 100, and a Spark read replays every commit since the last checkpoint."""
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


def rows_table(rows: Sequence[tuple], schema: StructType) -> pa.Table:
    """A few rows made on the driver (a runs row, a run's centers) as Arrow in the types Spark gives schema.
    A naive datetime is local time, as Spark takes it from a list."""
    return pa.Table.from_pylist(
        [
            {
                name: value.astimezone(timezone.utc) if isinstance(value, datetime) else value
                for name, value in zip(schema.names, row, strict=True)
            }
            for row in rows
        ],
        schema=to_arrow_schema(schema, timezone="UTC"),
    )


def rows_frame(spark: SparkSession, rows: Sequence[tuple], schema: StructType) -> DataFrame:
    """rows_table(rows, schema) as a DataFrame, sent to the JVM as Arrow. From a list Spark would make an RDD
    whose every pass runs Python tasks, in a Python daemon of their own beside the one of the job's Arrow
    passes: a fresh run started, and imported into, two."""
    return spark.createDataFrame(rows_table(rows, schema), schema)


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


def filesystem_of(path: str, hadoop_setting: Callable[[str], str | None]) -> tuple[pafs.FileSystem, str] | None:
    """pyarrow's filesystem for a local path or a URI (s3://, gs://, hdfs://, and s3a:// as Spark's S3A
    reaches it: s3a_filesystem) and the path in it; None for a scheme pyarrow does not know (abfss:),
    where the checks that need it are skipped. hadoop_setting(key) gives the session's Hadoop setting."""
    if path.startswith("s3a://"):
        return s3a_filesystem(path, hadoop_setting)
    try:
        return pafs.FileSystem.from_uri(path if URI_PATTERN.match(path) else "file://" + path)
    except Exception:  # pyarrow raises ArrowInvalid or ArrowNotImplementedError for unknown schemes
        return None


def s3a_filesystem(path: str, hadoop_setting: Callable[[str], str | None]) -> tuple[pafs.FileSystem, str]:
    """pyarrow's S3 filesystem with the S3A settings Spark writes the tables with (fs.s3a.endpoint, its
    keys, region and path-style access, a bucket's own fs.s3a.bucket.<name>.* first), so that the report
    files land in the same store; credentials that S3A takes from elsewhere come from pyarrow's own chain
    (AWS_* variables, the instance's role)."""
    where = urlparse(path)
    bucket = where.netloc

    def setting(key: str) -> str | None:
        return hadoop_setting(f"fs.s3a.bucket.{bucket}.{key}") or hadoop_setting(f"fs.s3a.{key}")

    options: dict = {
        "access_key": setting("access.key"),
        "secret_key": setting("secret.key"),
        "session_token": setting("session.token"),
        "region": setting("endpoint.region"),
    }
    endpoint = setting("endpoint")
    if endpoint:
        server = urlparse(endpoint if "://" in endpoint else f"//{endpoint}")
        secure = (setting("connection.ssl.enabled") or "true").lower() != "false"
        options.update(
            endpoint_override=server.netloc,
            scheme=server.scheme or ("https" if secure else "http"),
            force_virtual_addressing=(setting("path.style.access") or "false").lower() != "true",
        )
    return pafs.S3FileSystem(**{k: v for k, v in options.items() if v is not None}), f"{bucket}{where.path}".rstrip("/")


def delta_rs_rows(
    path: str, columns: Sequence[str], run_id: str | None, attempt_id: str | None, large: bool
) -> pa.Table:
    """The rows of the Delta table at a local path (of the run id's and attempt's partitions, where given) in
    the columns named (or all), with the Arrow types Spark's toArrow() gives them (`large`: Spark's
    spark.sql.execution.arrow.useLargeVarTypes), read by delta-rs's own query engine (a pyarrow dataset
    over delta-rs's filesystem can abort the process as it exits)."""
    table = DeltaTable(path)
    stored = spark_schema(table)
    schema = to_arrow_schema(
        StructType([stored[name] for name in columns]) if columns else stored,
        timezone="UTC",
        prefers_large_types=large,
    )
    where = partitions_where(run_id, attempt_id)
    names = ", ".join(standard_sql(name, '"') for name in schema.names)
    query = f"SELECT {names} FROM few" + (f" WHERE {where}" if where else "")
    return pa.table(QueryBuilder().register("few", table).execute(query).read_all()).cast(schema)


def spark_schema(table: DeltaTable) -> StructType:
    """A table's schema as delta-rs reads it, as Spark's StructType: Delta stores it as that type's JSON."""
    return StructType.fromJson(json.loads(table.schema().to_json()))


def partitions_where(run_id: str | None, attempt_id: str | None) -> str:
    """The standard-SQL predicate of a run id's partitions, or an attempt's ("" for every partition)."""
    ids = (("run_id", run_id), ("attempt_id", attempt_id))
    return " AND ".join(column + " = " + standard_sql(value, "'") for column, value in ids if value is not None)


def by_name(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """rows in schema's columns, order and types, matched by name; a column the rows lack is null (as Spark
    appends by name)."""
    return pa.table(
        {f.name: rows[f.name] if f.name in rows.column_names else pa.nulls(len(rows), f.type) for f in schema}
    ).cast(schema)


def standard_sql(text: str, quote: str) -> str:
    """A string literal (quote ') or a name (quote ") in standard SQL, as delta-rs's engine takes it: the quote
    doubled inside (Spark SQL's own literals escape with backslashes instead: sql_string)."""
    return quote + text.replace(quote, quote * 2) + quote


def collected(table: pa.Table) -> list[dict]:
    """Arrow rows as the values Spark's collect() gives (Row.asDict()): timestamps as naive local times,
    maps as dicts, structs as Rows."""
    kinds = {field.name: field.type for field in table.schema}
    return [{name: _collected(value, kinds[name]) for name, value in row.items()} for row in table.to_pylist()]


def _collected(value, kind: pa.DataType):
    if value is None:
        return None
    if pa.types.is_timestamp(kind):
        return value.astimezone().replace(tzinfo=None) if value.tzinfo else value
    if pa.types.is_map(kind):
        return {key: _collected(item, kind.item_type) for key, item in value}
    if pa.types.is_struct(kind):
        return Row(**{field.name: _collected(value[field.name], field.type) for field in kind})
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return [_collected(item, kind.value_type) for item in value]
    return value


def attempt_filter(run_id: str, attempt_id: str) -> str:
    """The SQL predicate of one attempt's partition (both ids are checked against strict patterns)."""
    return f"{run_filter(run_id)} AND attempt_id = '{attempt_id}'"


def run_filter(run_id: str) -> str:
    """The SQL predicate of a run id's partitions, one per attempt (the id is checked against a strict pattern)."""
    return f"run_id = '{run_id}'"


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

    def filesystem(self, path: str) -> tuple[pafs.FileSystem, str] | None:
        """filesystem_of(path), with this session's Hadoop settings."""
        return filesystem_of(path, lambda key: self.spark.conf.get(f"spark.hadoop.{key}", None))

    def source(self, name: str) -> str:
        """The table in SQL, by path."""
        return f"delta.`{self.path(name)}`"

    def read(self, name: str) -> DataFrame:
        """Every row of a table, of every attempt, published or not."""
        return self.spark.read.format("delta").load(self.path(name))

    def read_few(
        self, name: str, columns: Sequence[str] = (), run_id: str | None = None, attempt_id: str | None = None
    ) -> pa.Table:
        """The rows of a table that holds few (every attempt's, a run id's or an attempt's partitions; the
        columns named, or all) as Arrow, with the types Spark's toArrow() gives them.

        Where this process reaches the table as Spark does (a path on its own filesystem, a classic
        session), delta-rs reads them in this process, in about a tenth of a second. Spark's first read of
        a Delta table in a fresh JVM replays the table's log through plans it compiles and warms up for
        seconds; a run reads its runs rows and the model it continues before anything else, and would wait
        for that. Elsewhere (object storage, whose credentials are the session's; Spark Connect, whose
        tables are the server's) and where delta-rs cannot read the table, Spark reads them."""
        local = self.local_path(name)
        if local is not None:
            large = self.spark.conf.get("spark.sql.execution.arrow.useLargeVarTypes", "false") == "true"
            try:
                return delta_rs_rows(local, columns, run_id, attempt_id, large)
            except DeltaError as exc:
                log.warning("delta-rs cannot read %s, Spark reads it: %s", self.path(name), first_line(exc))
        frame = self.read(name)
        if columns:
            frame = frame.select(*columns)
        if run_id is not None:
            frame = frame.filter(F.col("run_id") == F.lit(run_id))
        if attempt_id is not None:
            frame = frame.filter(F.col("attempt_id") == F.lit(attempt_id))
        return frame.toArrow()

    def write_arrow(
        self,
        name: str,
        rows: pa.Table,
        schema: StructType,
        note: str,
        attempt: tuple[str, str] | None = None,
        fence: tuple[str, int] | None = None,
    ) -> None:
        """Append rows that the driver holds (a runs row, an attempt's centers, its device profiles) to a table
        whose Spark schema is `schema`, or replace an attempt's rows (`attempt`: run id, attempt id) with them,
        in one commit whose userMetadata is `note`; the rows' columns are matched to the table's by name
        (by_name).

        With fence (app id, number) the commit carries Delta's idempotent-write marker (txnAppId, txnVersion),
        and is skipped, as Delta skips it, where the table has committed that number or a higher one for the app.

        Where this process reaches the table as Spark does (local_path), delta-rs commits them in this process
        (delta_rs_wrote): Spark would ship them to the JVM in one task, run a write job, and in a fresh JVM
        compile and warm up its write path for seconds first (a replacing commit also replays the table's log
        to find the attempt's files). Elsewhere Spark commits them."""
        local = self.local_path(name)
        if local is not None and self.delta_rs_wrote(local, name, rows, note, attempt, fence):
            return
        mode, options = ("append", {}) if attempt is None else ("overwrite", {"replaceWhere": attempt_filter(*attempt)})
        if fence is not None:
            options.update(txnAppId=fence[0], txnVersion=str(fence[1]))
        frame = self.spark.createDataFrame(by_name(rows, to_arrow_schema(schema, timezone="UTC")), schema)
        self._write(frame, name, mode, note, **options)

    def delta_rs_wrote(
        self,
        local: str,
        name: str,
        rows: pa.Table,
        note: str,
        attempt: tuple[str, str] | None,
        fence: tuple[str, int] | None,
    ) -> bool:
        """write_arrow by delta-rs, under the table's write lock (writing), the rows matched to the table's columns
        by name, with a checkpoint where Spark would make one (every delta.checkpointInterval commits). False,
        having written nothing, where the table's protocol is not the one kfed-spark creates (reader 1, writer 2):
        delta-rs then leaves a table someone gave other features to, to Spark."""
        with self.writing(name):
            table = DeltaTable(local)
            protocol = table.protocol()
            if protocol.min_reader_version > 1 or protocol.min_writer_version > 2:
                return False
            committed = None if fence is None else table.transaction_version(fence[0])
            if fence is None or committed is None or committed < fence[1]:
                write_deltalake(
                    table,
                    by_name(rows, pa.schema(table.schema().to_arrow())),
                    mode="append" if attempt is None else "overwrite",
                    predicate=None if attempt is None else partitions_where(*attempt),
                    commit_properties=CommitProperties(
                        custom_metadata={"userMetadata": note},
                        app_transactions=None if fence is None else [Transaction(*fence)],
                    ),
                )
                interval = table.metadata().configuration.get(CHECKPOINT_INTERVAL_PROPERTY) or SPARK_CHECKPOINT_INTERVAL
                if table.version() % int(interval) == 0:
                    table.create_checkpoint()
        return True

    def stored_schema(self, name: str) -> StructType:
        """A table's schema as Delta stores it: read by delta-rs where this process reaches the table
        (local_path), by Spark elsewhere."""
        local = self.local_path(name)
        if local is None:
            return self.read(name).schema
        return spark_schema(DeltaTable(local))

    def local_path(self, name: str) -> str | None:
        """The table's path on this process's filesystem, where its session is a classic one (under Spark
        Connect the paths are the server's); None for object storage and other remote filesystems."""
        if type(self.spark).__module__.startswith("pyspark.sql.connect"):
            return None
        located = self.filesystem(self.path(name))
        return located[1] if located is not None and isinstance(located[0], pafs.LocalFileSystem) else None

    def exists(self, name: str) -> bool:
        try:
            self.read(name).schema
        except AnalysisException:
            return False
        return True

    @contextmanager
    def writing(self, name: str) -> Iterator[None]:
        """Hold the table's write lock while writing it, when the output is on a local disk.

        Delta needs its log store to let only one writer create each commit file. On HDFS, ADLS and
        GCS the log store does (on S3 only within one driver, or across drivers with the DynamoDB log
        store: LocationChecks.warn_of_single_driver_commits); on a local disk it renames a temporary
        file into place, and that rename overwrites, so two processes committing the same version at
        once both "succeed" and one commit is lost. An exclusive OS lock per table makes the writes of
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
        metadata only, where CREATE TABLE AS SELECT from an empty view runs a write job per table."""
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


def concurrently(work: Callable[[str], T], names: list[str]) -> dict[str, T]:
    """work(name) for every table name (a check, creation, append or delete), in threads: a Delta log
    read or commit is mostly fixed overhead (about a second in local mode), so those of different tables
    overlap well. Returns each name's result; the first failure is raised."""
    if len(names) <= 1:
        return {name: work(name) for name in names}
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        futures = {name: pool.submit(work, name) for name in names}
        return {name: future.result() for name, future in futures.items()}
