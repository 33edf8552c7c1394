"""All reads of the input and all Delta Lake reads and writes."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pyarrow.fs as pafs
from delta.tables import DeltaTable
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from kfed_spark.config import TABLE_NAME_PATTERN, InputConfig, OutputConfig
from kfed_spark.errors import InputError, KFedError

log = logging.getLogger("kfed_spark")

TABLES = ("labels", "centers", "local_centers", "quarantine", "runs")
URI_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
"""A scheme such as s3a:, file: or abfss: (anything else is a local path)."""
REPORTS = "reports"
"""Folder under the output path holding one folder of report files per run."""
CSV_DEFAULTS = {"header": "true", "inferSchema": "true"}
LATEST_LABELS = (
    "SELECT * FROM {labels} WHERE run_id = "
    "(SELECT run_id FROM {runs} WHERE status = 'succeeded' ORDER BY finished_at DESC LIMIT 1)"
)
"""The labels of the newest successful run."""


def read_input(spark: SparkSession, inp: InputConfig) -> DataFrame:
    """The input table as a DataFrame, or an InputError that says what is missing."""
    where = f"table {inp.table}" if inp.table else f"{inp.format} input {inp.path}"
    try:
        if inp.table:
            return spark.read.table(inp.table)
        options = {**(CSV_DEFAULTS if inp.format == "csv" else {}), **inp.options}
        return spark.read.format(inp.format).options(**options).load(inp.path)
    except AnalysisException as exc:
        raise InputError(f"cannot read {where}: {first_line(exc)}") from None


def read_side_table(spark: SparkSession, name: str) -> DataFrame:
    """A small table named by a setting: a catalog table, or a Delta (else Parquet) folder."""
    try:
        if TABLE_NAME_PATTERN.match(name) and spark.catalog.tableExists(name):
            return spark.read.table(name)
        is_delta = DeltaTable.isDeltaTable(spark, absolute(name))
        return spark.read.format("delta" if is_delta else "parquet").load(absolute(name))
    except AnalysisException as exc:
        raise InputError(f"cannot read table {name}: {first_line(exc)}") from None


def _filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem for a local path or a URI (s3://, gs://, hdfs://), and the path in it."""
    return pafs.FileSystem.from_uri(path if URI_PATTERN.match(path) else "file://" + path)


def report_of(output_path: str, run_id: str, name: str = "report.json") -> bytes:
    """A file of a run's report, read without Spark."""
    root = absolute(str(output_path)).rstrip("/")
    filesystem, path = _filesystem(f"{root}/{REPORTS}/{run_id}/{name}")
    try:
        with filesystem.open_input_stream(path) as stream:
            return stream.read()
    except FileNotFoundError:
        raise KFedError(f"no report of run {run_id!r} under {root}/{REPORTS}") from None


def first_line(exc: Exception) -> str:
    """The first line of an exception's message: Spark's own messages carry a JVM trace after it."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def absolute(path: str) -> str:
    """A local path made absolute (Delta's table builder takes a relative location for a table
    name); a URI such as s3a://bucket/x or file:/x is returned unchanged."""
    return path if URI_PATTERN.match(path) else os.path.abspath(path)


def _replace_slice(df: DataFrame, path: str, run_id: str, note: str) -> None:
    """One atomic Delta commit that replaces the rows of run_id with df (which holds only that run);
    it creates the table, partitioned by run_id, if there is none at path."""
    (
        df.write.format("delta")
        .partitionBy("run_id")
        .mode("overwrite")
        .option("replaceWhere", f"run_id = '{run_id}'")
        .option("userMetadata", note)
        .save(path)
    )


class OutputTables:
    """The Delta tables of one output location; each run owns the rows with its run_id."""

    def __init__(self, spark: SparkSession, output: OutputConfig):
        self.spark = spark
        self.root = absolute(str(output.path)).rstrip("/")
        self.database = output.database
        self._version_before_run: dict[str, int | None] = {}
        self._report_started = False

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def read(self, name: str) -> DataFrame:
        return self.spark.read.format("delta").load(self.path(name))

    def exists(self, name: str) -> bool:
        return DeltaTable.isDeltaTable(self.spark, self.path(name))

    def check_schema(self, name: str, schema: StructType) -> None:
        """Fail before any work if a table already at the location has another schema."""
        if not self.exists(name):
            return
        existing = {(f.name, f.dataType.simpleString()) for f in self.read(name).schema.fields}
        wanted = {(f.name, f.dataType.simpleString()) for f in schema.fields}
        if existing != wanted:
            extra = sorted(n for n, _ in existing - wanted)
            missing = sorted(n for n, _ in wanted - existing)
            raise KFedError(
                f"output table {self.path(name)} holds another schema (columns only in the table: "
                f"{extra or 'none'}; only in this run: {missing or 'none'}); use another output.path"
            )

    def replace_run(self, name: str, df: DataFrame, run_id: str) -> None:
        """Atomically replace this run's rows of one table (Delta replaceWhere); other runs stay.

        Tables are partitioned by run_id, so the replacement drops whole partitions from the log
        instead of reading the files that may hold the run's rows (seconds per table otherwise).
        """
        path = self.path(name)
        if name not in self._version_before_run:
            self._version_before_run[name] = self._version(name)
        _replace_slice(df, path, run_id, f"kfed-spark run {run_id}")
        log.info("wrote %s for run %s", path, run_id)

    def _version(self, name: str) -> int | None:
        if not self.exists(name):
            return None
        return DeltaTable.forPath(self.spark, self.path(name)).history(1).first()["version"]

    @contextmanager
    def undo_on_failure(self, run_id: str) -> Iterator[None]:
        """If the block fails, put back every table's slice of run_id as it was before the run.

        Delta commits one table at a time; this makes a failed run leave no partial rows: each
        table it wrote gets its previous slice of this run id back (read by time travel, or
        nothing if the run id is new) in one more replaceWhere commit. Other runs' rows, even
        those committed meanwhile by other writers, are not touched. A report the run had begun
        to write is deleted.
        """
        try:
            yield
        except BaseException:
            if self._report_started:
                filesystem, folder = _filesystem(self.report_dir(run_id))
                filesystem.delete_dir(folder)
            for name, version in self._version_before_run.items():
                path = self.path(name)
                current = self.read(name)
                if version is None:
                    previous = self.spark.createDataFrame([], current.schema)
                else:
                    previous = self.spark.read.format("delta").option("versionAsOf", version).load(path)
                _replace_slice(
                    previous.filter(F.col("run_id") == run_id), path, run_id, f"kfed-spark undo of failed run {run_id}"
                )
                log.warning("run %s failed: restored its slice of %s", run_id, path)
            raise

    def report_dir(self, run_id: str) -> str:
        return f"{self.root}/{REPORTS}/{run_id}"

    def write_report(self, run_id: str, files: dict[str, bytes]) -> None:
        """The run's report files under <root>/reports/<run_id>/ (any filesystem pyarrow knows)."""
        filesystem, folder = _filesystem(self.report_dir(run_id))
        self._report_started = True
        filesystem.create_dir(folder, recursive=True)
        for name, data in files.items():
            with filesystem.open_output_stream(f"{folder}/{name}") as out:
                out.write(data)
        log.info("wrote the report of run %s to %s", run_id, self.report_dir(run_id))

    def replace_runs(self, frames: dict[str, DataFrame], run_id: str) -> None:
        """replace_run for several small tables at once: each commit is mostly fixed Delta overhead."""
        with ThreadPoolExecutor(max_workers=len(frames)) as pool:
            for future in [pool.submit(self.replace_run, name, df, run_id) for name, df in frames.items()]:
                future.result()

    def register(self) -> None:
        """Name the tables in the catalog as <database>.<table>, plus the view <database>.latest_labels."""
        if not self.database:
            return
        self.spark.sql(f"CREATE DATABASE IF NOT EXISTS {self.database}")
        for name in TABLES:
            if self.exists(name):
                self.spark.sql(
                    f"CREATE TABLE IF NOT EXISTS {self.database}.{name} USING DELTA LOCATION '{self.path(name)}'"
                )
        self.spark.sql(
            f"CREATE OR REPLACE VIEW {self.database}.latest_labels AS "
            + LATEST_LABELS.format(labels=f"{self.database}.labels", runs=f"{self.database}.runs")
        )

    def register_views(self) -> list[str]:
        """Temporary views named after the tables of this location, plus latest_labels; returns their names."""
        names = [name for name in TABLES if self.exists(name)]
        for name in names:
            self.read(name).createOrReplaceTempView(name)
        if {"labels", "runs"} <= set(names):
            self.spark.sql(
                "CREATE OR REPLACE TEMPORARY VIEW latest_labels AS " + LATEST_LABELS.format(labels="labels", runs="runs")
            )
            names.append("latest_labels")
        return names
