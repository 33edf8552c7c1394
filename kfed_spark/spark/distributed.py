"""The server step (alg. 2) with Spark doing the work, for more local centers than a driver holds.

Each partition of the local centers reduces its (eligible) centers to weighted representatives
(server_step.representatives, in workers.representatives_from_batches); the driver merges only those
with server_step.server_step and the configured seeding and refinement; then every local center takes
the nearest global center in the executors, the k global centers shipped with the function. The
driver holds O(partitions x server_representatives x k) representatives, never the local centers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DoubleType, IntegerType, StructField, StructType

from kfed_spark.core.local_centers import feature_matrix
from kfed_spark.core.server_step import GlobalClusters, server_step
from kfed_spark.params import AlgorithmParams
from kfed_spark.spark.workers import cluster_batches, representatives_from_batches

REPRESENTATIVE_SCHEMA = StructType(
    [
        StructField("center", ArrayType(DoubleType(), False), False),
        StructField("weight", DoubleType(), False),
    ]
)


def global_centers(local: DataFrame, dim: int, params: AlgorithmParams) -> GlobalClusters:
    """The k global centers of the local centers in `local` (center, n_points, ...): the outlier
    filter over all of them (the median count from Spark), each partition's representatives, and
    the server step over those on the driver. The returned assignment is the representatives'."""
    eligible = local
    if params.robust_min_size > 0:
        median = local.agg(F.percentile_approx("n_points", 0.5, 100_000)).first()[0]
        eligible = local.filter(F.col("n_points") >= params.robust_min_size * median)
    m = params.server_representatives * params.k
    found = (
        eligible.select("device_id", "local_cluster_id", "center", "n_points")
        .mapInArrow(lambda batches: representatives_from_batches(batches, m, dim, params.seed), REPRESENTATIVE_SCHEMA)
        .toArrow()
    )
    x = feature_matrix(found.column("center"), dim)
    own_devices = np.arange(len(x))  # a representative belongs to no device: each is its own
    return server_step(
        x,
        found.column("weight").to_numpy(),
        own_devices,
        np.zeros(len(x), dtype=np.int64),
        dataclasses.replace(params, robust_min_size=0.0),
    )


def with_clusters(local: DataFrame, centers: np.ndarray) -> DataFrame:
    """`local` with cluster_id, the nearest global center of each local center, computed in the executors."""
    schema = StructType([*local.schema.fields, StructField("cluster_id", IntegerType(), False)])
    return local.mapInArrow(lambda batches: cluster_batches(batches, centers), schema)
