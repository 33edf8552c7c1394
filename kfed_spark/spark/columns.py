"""The columns the Spark pipeline makes from the input's rows: a local center's fields (what the local
step returns for a device) and a labelled row's. The output tables (kfed_spark.store.tables) are made of
these and the attempt's columns; only pyspark's types are imported.
"""

from __future__ import annotations

from pyspark.sql.types import ArrayType, DoubleType, IntegerType, LongType, StructField, StructType

ATTEMPT_COLUMNS = ("run_id", "attempt_id")
"""What every row a run writes ends with: the run and the attempt it belongs to."""


LOCAL_CENTER_COLUMNS = ["device_id", "local_cluster_id", "center", "n_points", "sse"]

LOCAL_CENTER_FIELDS = [
    StructField("local_cluster_id", IntegerType(), False),
    StructField("center", ArrayType(DoubleType(), False), False),
    StructField("n_points", LongType(), False),
    StructField("sse", DoubleType(), False),
]
"""The fields of a local center after its device_id."""


def labelled_fields(raw_schema: StructType) -> list[StructField]:
    """The input's columns followed by the columns the labels table adds: the row's local and global
    cluster, its distance to the global center and its margin (labels.assigned_with_margin)."""
    return list(raw_schema.fields) + [
        StructField("local_cluster_id", IntegerType(), True),
        StructField("cluster_id", IntegerType(), True),
        StructField("distance", DoubleType(), True),
        StructField("margin", DoubleType(), True),
    ]


ADDED_COLUMNS = (*[f.name for f in labelled_fields(StructType())], *ATTEMPT_COLUMNS)
"""The columns the labels table adds to the input's: an input column of one of these names is refused."""
