"""The labelling pass: every row's local center, global cluster, distance and margin, by a scalar Arrow UDF
over (device, features) with the model broadcast in its closure, so that every other column of a row stays
in the JVM; and a model's extension to devices it has not seen (the paper's section 3.2).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.functions import arrow_udf
from pyspark.sql.types import (
    BooleanType,
    DoubleType,
    IntegerType,
    StringType,
    StructField,
    StructType,
)

from kfed_spark.config import FitSettings
from kfed_spark.core.evaluation import Evaluation, EvaluationSpec
from kfed_spark.core.labels import LabelModel
from kfed_spark.core.local_centers import LocalCenters
from kfed_spark.core.profiles import profiles_table
from kfed_spark.errors import InputError
from kfed_spark.spark.fitting import (
    FEATURES_COL,
    FEATURES_SOURCE,
    REASON_COL,
    collect_local_centers,
    feature_names,
    validated,
)
from kfed_spark.spark.workers import EVALUATION_COL, LABEL_FIELDS, NON_FINITE, SQ_DIST_COL, label_arrays

LABELS_COL = "__kfed_labels"
"""Internal column: what workers.label_arrays returns for the row, a struct of LABELS_TYPE."""

log = logging.getLogger("kfed_spark")


LABELS_TYPE = StructType(
    [
        StructField(name, kind, True)
        for name, kind in zip(
            LABEL_FIELDS, [IntegerType(), IntegerType(), DoubleType(), DoubleType(), BooleanType(), StringType()]
        )
    ]
)


def extend_with_new_devices(
    valid: DataFrame, settings: FitSettings, dim: int, local: LocalCenters, assignment: np.ndarray, centers: np.ndarray
) -> tuple[LocalCenters, np.ndarray]:
    """Run alg. 1 on the devices of `valid` that `local` does not hold, and give each of their local
    centers the nearest global center: O(k_z k) distance work per new device, no other device touched."""
    device_col = settings.input.device_col
    device_type = valid.schema[device_col].dataType
    known = valid.sparkSession.createDataFrame(
        pa.table({"known_device": pa.array(np.unique(local.devices).tolist())})
    ).select(F.col("known_device").cast(device_type))
    new_rows = valid.join(F.broadcast(known), valid[device_col] == known["known_device"], "left_anti")
    if new_rows.isEmpty():
        return local, assignment
    new = collect_local_centers(new_rows, settings, dim, device_type)
    log.info("%d devices the model had not seen: %d local centers", len(np.unique(new.devices)), len(new.counts))
    return local.joined(new, assignment, centers)


def labelled_plan(rows: DataFrame, settings: FitSettings, model: LabelModel, dim: int) -> DataFrame:
    """The rows (streaming or not) checked and labelled with a finished model: a plan, no Spark job
    (the dimension is the model's). What KFedModel.transform and `kfed-spark stream` run."""
    checked, _ = validated(rows, settings, dim)
    return label_rows(checked, model, rows.schema, settings.input.device_col, dim)


def profiled_rows(rows: DataFrame, settings: FitSettings, model: LabelModel, dim: int) -> pa.Table:
    """The cluster_profiles rows (kfed_spark.core.profiles) of rows labelled with a finished model: one pass,
    the labelling of labelled_plan with each cluster's moments gathered as a run's labelling pass gathers them."""
    checked, _ = validated(rows, settings, dim)
    spec = EvaluationSpec.of(None, 0, 1, settings.algorithm.seed, profiles=True)
    labelled = label_rows(checked, model, rows.schema, settings.input.device_col, dim, spec)
    blobs = [row[0] for row in labelled.select(EVALUATION_COL).where(F.col(EVALUATION_COL).isNotNull()).collect()]
    moments = Evaluation.merge(blobs, 0, dim).cluster_moments
    if moments is None:
        raise InputError("no row could be labelled, so no cluster has a profile")
    return profiles_table(moments, feature_names(rows.schema, settings.input.features_col, dim))


def label_rows(
    rows: DataFrame,
    model: LabelModel,
    raw_schema: StructType,
    device_col: str,
    dim: int,
    evaluation: EvaluationSpec | None = None,
) -> DataFrame:
    """Every row with its local and global cluster, its squared distance and its reason (null if labelled);
    with an evaluation spec also EVALUATION_COL, which each partition's last row fills.

    Only the device, the features (and the truth, for the evaluation) cross to Python, in a scalar
    Arrow UDF (workers.label_arrays); every other column stays in the JVM. The UDF is marked
    nondeterministic so that Spark calls it once per row, never once per field it returns (and the
    evaluation it gathers depends on how the rows are partitioned).
    """
    truth = [] if evaluation is None or evaluation.truth_col is None else [F.col(evaluation.truth_col)]

    def label_partition(batches: Iterator[tuple[pa.Array, ...]]) -> Iterator[pa.Array]:
        return label_arrays(batches, model, dim, evaluation)

    labeller = arrow_udf(label_partition, LABELS_TYPE).asNondeterministic()  # type hints: a SCALAR_ITER UDF
    labelled = rows.withColumn(
        LABELS_COL, labeller(F.col(REASON_COL).isNull(), F.col(device_col), F.col(FEATURES_COL), *truth)
    )
    keep_as = rows.schema[FEATURES_COL].metadata.get(FEATURES_SOURCE)
    label = F.col(LABELS_COL)
    reason = F.coalesce(F.col(REASON_COL), F.when(label["non_finite"], F.lit(NON_FINITE)))
    gathered = [] if evaluation is None else [label[EVALUATION_COL].alias(EVALUATION_COL)]
    return labelled.select(
        *[
            F.col(FEATURES_COL).alias(f.name, metadata={}) if f.name == keep_as else F.col(f.name)
            for f in raw_schema.fields
        ],
        label["local_cluster_id"].alias("local_cluster_id"),
        label["cluster_id"].alias("cluster_id"),
        F.sqrt(label[SQ_DIST_COL]).alias("distance"),
        label["margin"].alias("margin"),
        label[SQ_DIST_COL].alias(SQ_DIST_COL),
        *gathered,
        reason.alias(REASON_COL),
    )
