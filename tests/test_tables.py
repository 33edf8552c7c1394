"""The table contract (kfed_spark.store.tables): what every output table holds, says and is partitioned by."""

from dataclasses import fields

import pytest
from pyspark.sql.types import ArrayType, DoubleType, LongType, StringType, StructField, StructType

from kfed_spark.core.k_sweep import KFigures
from kfed_spark.spark.columns import ADDED_COLUMNS
from kfed_spark.store.tables import (
    DATA_TABLES,
    K_SWEEP_TYPE,
    PARTITION_COLUMNS,
    RUNS_SCHEMA,
    STREAM_TABLES,
    TABLES,
    RunRecord,
    column_comment,
    output_schemas,
    partition_columns,
    stream_schemas,
)

pytestmark = pytest.mark.fast

INPUT = StructType(
    [
        StructField("user", StringType(), True),
        StructField("features", ArrayType(DoubleType(), False), True),
        StructField("row_id", LongType(), True),
    ]
)


def test_every_table_is_named_and_a_run_s_tables_end_with_the_attempt_they_belong_to():
    schemas = output_schemas(INPUT, "user")
    assert tuple(schemas) == TABLES and tuple(stream_schemas(INPUT)) == STREAM_TABLES
    for name in DATA_TABLES:
        assert tuple(schemas[name].names[-2:]) == PARTITION_COLUMNS == partition_columns(name), name
        assert not schemas[name]["run_id"].nullable and not schemas[name]["attempt_id"].nullable
    assert all(partition_columns(name) == () for name in STREAM_TABLES)
    assert schemas["local_centers"]["device_id"].dataType == StringType()  # the device column's type
    assert schemas["labels"].names[: len(INPUT.names)] == INPUT.names  # the input's columns come first, as they are


def test_every_column_a_table_adds_carries_a_comment_of_its_own():
    schemas = {**output_schemas(INPUT, "user"), **stream_schemas(INPUT)}
    for name, schema in schemas.items():
        added = [column for column in schema.names if column not in INPUT.names]
        assert added and all(column_comment(name, column) != "as in the input table" for column in added), name
    assert column_comment("labels", "user") == "as in the input table"


def test_the_labels_added_columns_and_the_runs_k_sweep_are_what_the_code_fills():
    assert set(ADDED_COLUMNS) == set(output_schemas(INPUT, "user")["labels"].names) - set(INPUT.names)
    assert set(K_SWEEP_TYPE.names) <= {field.name for field in fields(KFigures)}
    assert RUNS_SCHEMA.names[:2] == list(PARTITION_COLUMNS)


def test_the_runs_schema_is_the_run_record_s_fields_nullable_where_they_may_be_none():
    assert RUNS_SCHEMA.names == [f.name for f in fields(RunRecord)]
    assert not RUNS_SCHEMA["run_id"].nullable and RUNS_SCHEMA["error"].nullable and RUNS_SCHEMA["k_sweep"].nullable
    record = RunRecord.of({"run_id": "day1", "attempt_id": "a", "status": "running"})  # a row of an older version
    assert record.values()[:3] == ("day1", "a", "running") and record.k_sweep is None
    assert record.changed(status="failed").status == "failed" and record.status == "running"
