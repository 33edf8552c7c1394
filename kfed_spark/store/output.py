"""The output location as the job uses it: its checks before any work, an attempt's appends and its runs
row, the run reports beside the tables, and the views readers go through (an attempt's rows count once the
`runs` table publishes it: kfed_spark.store.ledger). OutputTables is all of these over one location.
"""

from __future__ import annotations

import uuid
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
from deltalake.exceptions import DeltaError
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.types import StructField, StructType

from kfed_spark.errors import AttemptConflict, KFedError, first_line
from kfed_spark.store.delta import (
    LOG_ENTRY,
    REPORTS,
    TRANSACTION_CONFLICT,
    TableStore,
    attempt_filter,
    column_ddl,
    concurrently,
    log,
    stored_field,
)
from kfed_spark.store.tables import (
    DATA_TABLES,
    LATEST_ATTEMPT,
    PUBLISHED_ATTEMPTS,
    RETRACTED,
    RUNS_SCHEMA,
    STREAM_TABLES,
)

S3_SCHEMES = ("s3", "s3a", "s3n")
MULTI_DRIVER_S3_LOG_STORE = "io.delta.storage.S3DynamoDBLogStore"
"""Delta's log store whose commits exclude each other across drivers on S3 (delta-storage-s3-dynamodb)."""


def attempt_note(run_id: str, attempt_id: str) -> str:
    """The userMetadata of an attempt's commits: which run and attempt wrote them (DESCRIBE HISTORY)."""
    return f"kfed-spark run {run_id} attempt {attempt_id}"


class LocationChecks(TableStore):
    """The checks made before any work (intact logs, the same schemas, a writable folder), and
    preparing the location: adding the columns an older version lacks, creating missing tables."""

    def check_writable(self) -> None:
        """The output location is a folder this process can create files in (a probe file is made
        and removed), or a one-line error. Skipped for schemes pyarrow does not know."""
        located = self.filesystem(self.root)
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

    def warn_of_single_driver_commits(self) -> None:
        """One warning where the location is on S3 and Delta's log store for it is not the multi-driver one
        (MULTI_DRIVER_S3_LOG_STORE): the default keeps the commits of one Spark driver apart only, so two
        attempts of a run from two processes at once (an Airflow retry beside a slow first try) can both
        commit the same table version, and the second overwrites the first."""
        scheme = urlparse(self.root).scheme
        if scheme not in S3_SCHEMES:
            return
        key = f"spark.delta.logStore.{scheme}.impl"
        store = self.spark.conf.get(key, None) or self.spark.conf.get("spark.delta.logStore.class", None)
        if store != MULTI_DRIVER_S3_LOG_STORE:
            log.warning(
                "output.path %s is on S3, where Delta's default log store keeps apart the commits of one Spark "
                "driver only: overlapping runs from two processes can lose a commit; set %s=%s (see the "
                "deployment docs, Object storage)",
                self.root,
                key,
                MULTI_DRIVER_S3_LOG_STORE,
            )

    def check_log(self, name: str) -> bool:
        """Whether a Delta table is at the table's path; a folder there that is not an intact Delta
        table (files but no _delta_log, or a log missing commits) is refused with a one-line error."""
        located = self.filesystem(self.path(name))
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
            existing_schema = self.stored_schema(name)
        except (AnalysisException, DeltaError) as exc:
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
        self.warn_of_single_driver_commits()
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
            self._write(frames[name], name, "append", attempt_note(run_id, attempt_id))
            log.info("wrote %s for run %s (attempt %s)", self.path(name), run_id, attempt_id)

        concurrently(write, list(frames))

    def append_arrow(self, held: dict[str, tuple[pa.Table, StructType]], run_id: str, attempt_id: str) -> None:
        """Append an attempt's rows that the driver holds to several tables (name -> the rows, without the
        attempt's columns, and the table's schema), each one commit (write_arrow), the commits made
        concurrently. The rows stay invisible until the attempt is published."""
        self.attempts_begun.add((run_id, attempt_id))

        def write(name: str) -> None:
            rows, schema = held[name]
            tagged = rows.append_column("run_id", pa.array([run_id] * len(rows), pa.string())).append_column(
                "attempt_id", pa.array([attempt_id] * len(rows), pa.string())
            )
            self.write_arrow(name, tagged, schema, attempt_note(run_id, attempt_id))
            log.info("wrote %s for run %s (attempt %s)", self.path(name), run_id, attempt_id)

        concurrently(write, list(held))

    def append_batch(self, frames: dict[str, DataFrame], app_id: str, batch_id: int, note: str) -> None:
        """Append a stream's micro-batch to its tables, each write idempotent: it carries Delta's marker
        (txnAppId = app_id, txnVersion = batch_id), and Delta skips it if the table has committed that
        batch of that app already, as when a batch is replayed after its process was killed. `note` is
        the commits' userMetadata."""

        def write(name: str) -> None:
            self._write(frames[name], name, "append", note, txnAppId=app_id, txnVersion=str(batch_id))

        concurrently(write, list(frames))

    def add_attempt_row(self, row: pa.Table, run_id: str, attempt_id: str) -> None:
        """Append a new attempt's first row (rows_table of RUNS_SCHEMA) to `runs`."""
        self.write_arrow("runs", row, RUNS_SCHEMA, attempt_note(run_id, attempt_id))

    def write_attempt_row(self, row: pa.Table, run_id: str, attempt_id: str, fence: int | None = None) -> None:
        """Replace an attempt's row of `runs` (rows_table of RUNS_SCHEMA) in one commit.

        With `fence`, the commit carries Delta's idempotent-write marker (txnAppId per run id,
        txnVersion = fence): it is skipped if that run id already committed this or a higher fence,
        and fails if another writer commits the same marker at the same moment. That makes the
        publish of a run id first-come-first-served; the caller reads the row back to learn which.
        """
        marker = None if fence is None else (f"kfed-spark-publish:{run_id}", fence)
        note = attempt_note(run_id, attempt_id)
        try:
            self.write_arrow("runs", row, RUNS_SCHEMA, note, attempt=(run_id, attempt_id), fence=marker)
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
        located = self.filesystem(self.report_dir(run_id, attempt_id))
        if located is not None:
            filesystem, folder = located
            if filesystem.get_file_info(folder).type == pafs.FileType.Directory:
                filesystem.delete_dir(folder)


class PublishedViews(TableStore):
    """What readers see: the published attempts' rows, as DataFrames and as SQL views."""

    def published_row(self, run_id: str) -> Row | None:
        """The runs row of the run id's published attempt here, None without one."""
        if not self.exists("runs"):
            return None
        found = self.published("runs").filter(F.col("run_id") == run_id).collect()
        return found[0] if found else None

    def unpublished(self, run_id: str) -> KFedError:
        """The one-line error for a run id without a published attempt here, saying why where forget retracted it."""
        retracted = (
            self.read("runs").filter((F.col("run_id") == run_id) & (F.col("status") == RETRACTED)).collect()
            if self.exists("runs")
            else []
        )
        why = f" ({retracted[0].error})" if retracted else ""
        return KFedError(f"no published run {run_id!r} under {self.root}{why}")

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


class RunReports(PublishedViews):
    """The report files of an attempt, beside the tables under <root>/reports; a run's are read from its
    published attempt."""

    def write_report(self, run_id: str, attempt_id: str, files: dict[str, bytes]) -> None:
        """The attempt's report files under <root>/reports/<run_id>/<attempt_id>/ (any filesystem pyarrow knows)."""
        self.attempts_begun.add((run_id, attempt_id))
        located = self.filesystem(self.report_dir(run_id, attempt_id))
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
        published = self.published_row(run_id)
        if published is None:
            raise self.unpublished(run_id)
        located = self.filesystem(f"{self.report_dir(run_id, published.attempt_id)}/{name}")
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
        located = self.filesystem(self.report_dir(run_id, attempt_id))
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


class OutputTables(LocationChecks, AttemptWrites, RunReports):
    """The Delta tables of one output location: every read and write of the job's tables, each role a
    class of its own above."""
