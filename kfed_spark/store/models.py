"""A finished model, from either of its two homes: a published run's tables, or a folder where the
estimator saved a KFedModel. `assign`, `stream` and KFedModel.from_run read models through here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from pyspark.ml.util import DefaultParamsReader
from pyspark.sql import SparkSession

from kfed_spark.core.identity import ClusterSummary, ReferenceRun, largest_share
from kfed_spark.core.k_sweep import KSweep
from kfed_spark.core.labels import LabelModel
from kfed_spark.core.local_centers import LocalCenters
from kfed_spark.errors import ConfigError, KFedError
from kfed_spark.params import AlgorithmParams
from kfed_spark.spark.columns import LOCAL_CENTER_COLUMNS
from kfed_spark.spark.input import absolute
from kfed_spark.store.delta import concurrently
from kfed_spark.store.output import OutputTables
from kfed_spark.store.tables import RunRecord

SAVED_MODEL_ORIGIN = "model:"
"""A saved KFedModel's origin (and a run's parent_run_id when it took one) is this, then the folder."""
SAVED_LOCAL_CENTERS = "data/local_centers"
"""Where under a saved KFedModel's folder its local centers are (Parquet); the rest is its metadata."""


@dataclass(frozen=True)
class StoredModel:
    """A finished model: global centers, every device's local centers and the global cluster each joined.

    origin says where it came from: the run id, or `model:<folder>` for a saved KFedModel. config is
    the run's configuration (its runs row); None for a saved KFedModel, whose params are its own.
    held_back: the local centers the fit held back (LocalCenters.held_back), kept by a model fitted in
    this session and never written: a model read from a run or a folder labels the rows they stood for
    through their device's nearest shared center.
    """

    centers: np.ndarray
    cluster_ids: np.ndarray  # the published id of each center
    local: pa.Table
    assignment: np.ndarray  # position in `centers` of each local center's global cluster
    origin: str
    config: dict | None = None
    attempt_id: str | None = None  # the run's attempt the model is of; None for a saved KFedModel
    held_back: LocalCenters | None = None

    @classmethod
    def of(
        cls,
        centers: np.ndarray,
        cluster_ids: np.ndarray,
        local: pa.Table,
        origin: str,
        config: dict | None = None,
        attempt_id: str | None = None,
        held_back: LocalCenters | None = None,
    ) -> "StoredModel":
        """From centers with their ids and local centers (LOCAL_CENTER_COLUMNS plus their cluster_id)."""
        order = np.argsort(cluster_ids, kind="stable")
        cluster_ids = np.asarray(cluster_ids, dtype=np.int64)[order]
        assignment = np.searchsorted(cluster_ids, local.column("cluster_id").to_numpy())
        return cls(
            np.asarray(centers, dtype=np.float64)[order],
            cluster_ids,
            local.select(LOCAL_CENTER_COLUMNS),
            assignment,
            origin,
            config,
            attempt_id,
            held_back,
        )

    @property
    def dim(self) -> int:
        return self.centers.shape[1]

    def clusters(self) -> ClusterSummary:
        """The model's global clusters as identity matching knows them."""
        local = LocalCenters.from_arrow(self.local, self.dim)
        return ClusterSummary.of(
            self.cluster_ids, self.centers, self.assignment, local.centers, local.counts, local.sse, local.devices
        )

    def sweep(self, ks: list[int], params: AlgorithmParams | None = None) -> KSweep:
        """The k sweep over the model's local centers (kfed_spark.core.k_sweep), with params or the run's own."""
        params = params or AlgorithmParams.of_config(self.config or {})
        return LocalCenters.from_arrow(self.local, self.dim).sweep(ks, params)

    def label_model(self, label_mode: str, label_unseen: bool = False) -> LabelModel:
        local = dataclasses.replace(LocalCenters.from_arrow(self.local, self.dim), held_back=self.held_back)
        return local.label_model(self.assignment, self.centers, label_mode, label_unseen, self.cluster_ids)


def stored_model(tables: OutputTables, run_id: str | None = None) -> StoredModel:
    """The model of a published run (by default the newest succeeded one), or a one-line error."""
    row = published_run(tables, run_id)
    return attempt_model(tables, row.run_id, row.attempt_id, json.loads(row.config))


def published_run(tables: OutputTables, run_id: str | None = None) -> RunRecord:
    """The runs row of the run id's published attempt (by default the newest succeeded run's), or a one-line
    error. Which attempt is published is found from the runs rows as read (ledger.published_rows), not by a query
    of the published views, which aggregates over runs, a plan that costs seconds in a fresh JVM; callers then
    read that attempt's own partitions (TableStore.read_few). A named run's rows are read alone: runs keeps a file
    per attempt the location ever ran."""
    from kfed_spark.store.ledger import Ledger, newest, published_rows  # here: the estimator imports this module

    found = published_rows(Ledger(tables).rows_if_any(run_id)) if tables.check_log("centers") else []
    row = newest(found) if run_id is None else next(iter(found), None)
    if row is None:
        if run_id is None:
            raise KFedError(f"no succeeded run under {tables.root} to take a model from")
        raise tables.unpublished(run_id)
    return row


def attempt_model(tables: OutputTables, run_id: str, attempt_id: str, config: dict | None = None) -> StoredModel:
    """The model an attempt of a run wrote (its centers and local centers), read beside each other."""
    columns = {"centers": ["cluster_id", "center"], "local_centers": [*LOCAL_CENTER_COLUMNS, "cluster_id"]}
    tables_read = concurrently(lambda name: tables.read_few(name, columns[name], run_id, attempt_id), list(columns))
    centers = tables_read["centers"]
    return StoredModel.of(
        np.array(centers.column("center").to_pylist(), dtype=np.float64).reshape(len(centers), -1),
        centers.column("cluster_id").to_numpy(),
        tables_read["local_centers"],
        run_id,
        config,
        attempt_id,
    )


def read_saved(spark: SparkSession, path: str) -> tuple[dict, np.ndarray, pa.Table]:
    """(metadata, global centers, local centers with their cluster_id) of a KFedModel saved at path."""
    try:
        metadata = DefaultParamsReader.loadMetadata(path, spark)
    except Exception as exc:  # a missing folder fails in the JVM or in Spark Connect's client
        raise ConfigError(f"cannot read a saved KFedModel at {path}: {str(exc).splitlines()[0]}") from None
    if "centers" not in metadata:
        raise ConfigError(f"{path} holds no k-FED model (no centers in its metadata)")
    local = spark.read.parquet(f"{path}/{SAVED_LOCAL_CENTERS}").toArrow()
    local = local.sort_by([("device_id", "ascending"), ("local_cluster_id", "ascending")])
    return metadata, np.asarray(metadata["centers"], dtype=np.float64), local


def finished_model(tables: OutputTables, run_id: str | None = None, path: str | None = None) -> StoredModel:
    """The saved KFedModel at path if given, else the published run's model (by default the newest)."""
    return saved_model(tables.spark, path) if path is not None else stored_model(tables, run_id)


def saved_model(spark: SparkSession, path: str) -> StoredModel:
    """The model a KFedModel saved at path holds, as `assign` and `stream` take it (--model PATH)."""
    metadata, centers, local = read_saved(spark, absolute(path))
    return StoredModel.of(
        centers, saved_cluster_ids(metadata, len(centers)), local, f"{SAVED_MODEL_ORIGIN}{absolute(path)}"
    )


def saved_cluster_ids(metadata: dict, k: int) -> np.ndarray:
    """The ids of a saved KFedModel's centers: its clusterIds, or their positions (saved before it had them)."""
    return np.asarray(metadata.get("clusterIds", range(k)), dtype=np.int64)


def reference_run(tables: OutputTables, row: RunRecord) -> ReferenceRun:
    """The clusters of a published attempt (its runs row), for identity matching."""
    model = attempt_model(tables, row.run_id, row.attempt_id)
    local = model.local
    share = largest_share(
        local.column("device_id").to_numpy(zero_copy_only=False),
        model.cluster_ids[model.assignment],
        local.column("n_points").to_numpy(),
    )
    return ReferenceRun(row.run_id, row.attempt_id, model.clusters(), share)
