"""Reading what a run clusters: the input table (batch or stream) and the small side tables that
settings name; and the one rule for local paths against URIs.

A classic session fails a missing path when it loads it, Spark Connect only when the plan is first
analysed: every read here is analysed at once (resolved), inside the caller's error handling.
"""

from __future__ import annotations

import os
import re

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession

from kfed_spark.config import TABLE_NAME_PATTERN, InputConfig
from kfed_spark.errors import InputError, first_line

URI_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
"""A scheme such as s3a:, file: or abfss: (anything else is a local path)."""

CSV_DEFAULTS = {"header": "true", "inferSchema": "true"}


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
                raise InputError(
                    f"cannot stream {where}: it holds no files to take the schema from yet; set input.schema"
                ) from None
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


def absolute(path: str) -> str:
    """A local path made absolute (Delta's table builder takes a relative location for a table
    name); a URI such as s3a://bucket/x or file:/x is returned unchanged."""
    return path if URI_PATTERN.match(path) else os.path.abspath(path)
