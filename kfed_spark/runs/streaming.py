"""`kfed-spark stream`: label rows as they arrive, with a finished model, exactly once.

A Structured Streaming query reads new rows of the input (files of a folder, a Delta table or a
catalog table), validates and labels them as a plan on the streaming DataFrame (the same
fitting.validated and label_rows as `run` and KFedModel.transform), and foreachBatch appends each
micro-batch to stream_labels and its bad rows to stream_quarantine. Each append carries Delta's
idempotent-write marker (txnAppId of the query's checkpoint, txnVersion = the batch id): a batch
that Spark replays from the checkpoint after a crash is skipped by every table that has it already.

A row of a device the model has not seen takes the nearest global center (labels.LabelModel,
label_unseen): its label depends on that row alone, not on which rows of its device came in the
same micro-batch, so replays and any trigger give the same labels. new_device marks those rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from kfed_spark.config import KFedConfig
from kfed_spark.runtime import fault_injection
from kfed_spark.spark.fitting import REASON_COL
from kfed_spark.spark.input import absolute, read_input
from kfed_spark.spark.labelling import labelled_plan
from kfed_spark.store.models import StoredModel
from kfed_spark.store.output import OutputTables
from kfed_spark.store.tables import STREAM_TABLES, stream_schemas, stream_stats_columns

log = logging.getLogger("kfed_spark")


def locations(cfg: KFedConfig) -> dict[str, str]:
    """The stream's tables that stream.labels and stream.quarantine put elsewhere than under output.path."""
    configured = {"stream_labels": cfg.stream.labels, "stream_quarantine": cfg.stream.quarantine}
    return {name: path for name, path in configured.items() if path}


def checkpoint_location(cfg: KFedConfig) -> str:
    return absolute(cfg.stream.checkpoint or f"{str(cfg.output.path).rstrip('/')}/_checkpoints/stream")


@dataclass
class StreamResult:
    """What the micro-batches of one start of a stream wrote (a restart counts again from zero; a
    replayed batch that every table had already is not counted again)."""

    model_run_id: str
    batches: int
    n_labelled: int
    n_quarantined: int
    n_new_devices: int
    """Devices the model had not seen, among the rows labelled: the next run clusters them."""
    labels_table: str
    quarantine_table: str


@dataclass(frozen=True)
class Stream:
    """A started stream. Its micro-batches may run in another process (the Spark Connect server runs
    foreachBatch), so what they wrote is read back from the tables: every commit of this start names
    `tag` in its userMetadata."""

    query: StreamingQuery
    tables: OutputTables
    model_run_id: str
    device_col: str
    tag: str

    def result(self) -> StreamResult:
        written: dict[str, int] = {}
        batches: set[int] = set()
        for name in STREAM_TABLES:
            commits = (
                self.tables.spark.sql(f"DESCRIBE HISTORY {self.tables.source(name)}")
                .filter(F.col("userMetadata").contains(f" {self.tag} batch "))
                .select("userMetadata", F.col("operationMetrics")["numOutputRows"].cast("long").alias("rows"))
                .collect()
            )
            written[name] = sum(commit.rows for commit in commits)
            batches |= {int(commit.userMetadata.rsplit(" ", 1)[1]) for commit in commits}
        new = (
            (
                self.tables.read("stream_labels")
                .filter(
                    F.col("new_device")
                    & F.col("batch_id").isin(sorted(batches))
                    & (F.col("model_run_id") == self.model_run_id)
                )
                .select(self.device_col)
                .distinct()
                .count()
            )
            if batches
            else 0
        )
        return StreamResult(
            self.model_run_id,
            len(batches),
            written["stream_labels"],
            written["stream_quarantine"],
            new,
            self.tables.path("stream_labels"),
            self.tables.path("stream_quarantine"),
        )


def start(spark: SparkSession, cfg: KFedConfig, model: StoredModel, available_now: bool) -> Stream:
    """Start the query that labels what arrives in cfg.input with the model."""
    inp = cfg.input
    if cfg.stream.max_files_per_trigger is not None:
        inp = dataclasses.replace(
            inp, options={**inp.options, "maxFilesPerTrigger": str(cfg.stream.max_files_per_trigger)}
        )
    source = read_input(spark, inp, streaming=True)
    schemas = stream_schemas(source.schema)
    tables = OutputTables(spark, cfg.output, locations(cfg))
    tables.prepare(schemas, stream_stats_columns(cfg.input.device_col))
    checkpoint = checkpoint_location(cfg)
    app_id = "kfed-spark-stream:" + hashlib.sha256(checkpoint.encode()).hexdigest()[:16]
    device_col = cfg.input.device_col
    tag = f"start {uuid.uuid4().hex[:12]}"

    def write_batch(batch: DataFrame, batch_id: int) -> None:
        started = time.perf_counter()
        tagged = batch.select(
            "*",
            F.lit(model.origin).alias("model_run_id"),
            F.lit(batch_id).cast("long").alias("batch_id"),
            F.lit(datetime.now(timezone.utc)).alias("arrived_at"),
        ).persist()
        try:
            bad = F.col(REASON_COL).isNotNull()
            new_device = F.col("local_cluster_id").isNull()
            [counts] = tagged.agg(
                F.count(F.lit(1)).alias("rows"),
                F.count(REASON_COL).alias("bad"),
                F.collect_set(F.when(~bad & new_device, F.col(device_col))).alias("new"),
            ).collect()
            n_bad, n_good, new = counts.bad, counts.rows - counts.bad, counts.new
            good = tagged.filter(~bad).withColumn("new_device", new_device)
            frames = {}
            if n_good:
                frames["stream_labels"] = good.select(*schemas["stream_labels"].names)
            if n_bad:
                frames["stream_quarantine"] = (
                    tagged.filter(bad)
                    .withColumnRenamed(REASON_COL, "reason")
                    .select(*schemas["stream_quarantine"].names)
                )
            # The batch's own session: over Spark Connect this function runs in the server, not where start ran.
            OutputTables(batch.sparkSession, cfg.output, locations(cfg)).append_batch(
                frames, app_id, batch_id, f"kfed-spark stream {app_id} {tag} batch {batch_id}"
            )
            fault_injection.point("stream_batch")
        finally:
            tagged.unpersist()
        log.info(
            "stream batch %d: %d rows labelled, %d quarantined, %d devices the model has not seen, in %.2f s",
            batch_id,
            n_good,
            n_bad,
            len(new),
            time.perf_counter() - started,
        )

    writer = (
        labelled_plan(source, cfg.fitting, model.label_model(cfg.algorithm.label_mode, label_unseen=True), model.dim)
        .writeStream.foreachBatch(write_batch)
        .option("checkpointLocation", checkpoint)
        .queryName("kfed_stream")
    )
    if available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{cfg.stream.trigger_seconds} seconds")
    query = writer.start()
    log.info(
        "stream %s started with the model of %s: %s -> %s (checkpoint %s)",
        query.id,
        model.origin,
        cfg.input.table or cfg.input.path,
        tables.path("stream_labels"),
        checkpoint,
    )
    return Stream(query, tables, model.origin, device_col, tag)
