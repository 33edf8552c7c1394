"""k-FED as a pyspark.ml estimator, in the style of pyspark.ml.clustering.KMeans (KFed's docstring has
the example).

It runs the same code as `kfed-spark run` (kfed_spark.spark.fitting.fit and label_rows); only the
output columns and the persistence differ. A run's model becomes a KFedModel with from_run, and a
saved KFedModel serves `kfed-spark assign` and `stream` with --model PATH (kfed_spark.store.models).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np
import pyarrow as pa
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Params
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter
from pyspark.sql import DataFrame
from pyspark.sql.types import StringType, StructField, StructType

from kfed_spark.config import FitSettings, InputConfig, OutputConfig, validate_columns
from kfed_spark.core.identity import match_clusters
from kfed_spark.core.k_sweep import KSweep, k_values
from kfed_spark.core.linalg import between_sse
from kfed_spark.core.local_centers import LocalCenters
from kfed_spark.estimator_params import GeneratedParams, GeneratedSetters
from kfed_spark.params import AlgorithmParams, camel
from kfed_spark.spark.fitting import REASON_COL, fit
from kfed_spark.spark.labelling import labelled_plan, profiled_rows
from kfed_spark.spark.workers import SQ_DIST_COL
from kfed_spark.store.delta import attempt_filter, rows_frame
from kfed_spark.store.models import (
    SAVED_LOCAL_CENTERS,
    SAVED_MODEL_ORIGIN,
    StoredModel,
    read_saved,
    saved_cluster_ids,
    stored_model,
)
from kfed_spark.store.output import OutputTables

ALGORITHM_PARAMS = {camel(spec.name): spec for spec in fields(AlgorithmParams)}
"""Estimator Param name -> the row of kfed_spark.params it stands for."""


class _KFedParams(GeneratedParams):
    """Params shared by KFed and KFedModel: one per row of AlgorithmParams, plus the columns it reads and
    writes (kfed_spark.params.ESTIMATOR_COLUMNS), each with a getter (kfed_spark.estimator_params, generated)."""

    def _settings(self) -> FitSettings:
        """The params as fitting takes them (the clustering's parameters and the input's columns), so the
        estimator and the job run one implementation."""
        values = {spec.name: self.getOrDefault(name) for name, spec in ALGORITHM_PARAMS.items()}
        values = {key: tuple(value) if isinstance(value, list) else value for key, value in values.items()}
        algorithm = AlgorithmParams(**{**values, "seed": values["seed"] & 0x7FFFFFFFFFFFFFFF})
        columns = InputConfig(device_col=self.getOrDefault("deviceCol"), features_col=self.getOrDefault("featuresCol"))
        algorithm.check()
        validate_columns(columns)
        return FitSettings(algorithm, columns)


class KFed(Estimator["KFedModel"], GeneratedSetters, _KFedParams, MLReadable["KFed"], MLWritable):
    """One-shot federated k-means (k-FED): each device clusters its rows once, the driver merges.

    Takes every Param as a keyword; each also has a getter and a setter. Six devices, each holding rows of
    two of three clusters (around x = 0, 10 and 20):

    >>> rows = [
    ...     (device, [10.0 * cluster + 0.1 * i + 0.01 * device, 0.1 * i])
    ...     for device in range(6)
    ...     for cluster in (device % 3, (device + 1) % 3)
    ...     for i in range(4)
    ... ]
    >>> df = spark.createDataFrame(rows, "device_id int, features array<double>")
    >>> model = KFed(k=3, kPerDevice=2, seed=1).fit(df)
    >>> model.getK(), model.summary.numDevices, model.summary.clusterSizes
    (3, 6, [16, 16, 16])
    >>> sorted(round(center[0]) for center in model.clusterCenters())
    [0, 10, 20]
    >>> model.transform(df).select("device_id", "prediction", "local_prediction").distinct().count()
    12
    >>> KFed(k="auto", kRange=[2, 5], kPerDevice=2, seed=1).fit(df).getK()  # k from the local centers
    3
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     model.write().overwrite().save(f"{folder}/model")
    ...     loaded = KFedModel.load(f"{folder}/model")
    >>> all(np.array_equal(a, b) for a, b in zip(loaded.clusterCenters(), model.clusterCenters()))
    True
    >>> loaded.transform(df).select("prediction").distinct().count()
    3

    A run's published model is `KFedModel.from_run(output_path, run_id)`.
    """

    _reference: KFedModel | None = None
    _warm_start = False

    def setReferenceModel(self, model: "KFedModel | None", warmStart: bool = False) -> "KFed":
        """Fit with ids matched to an earlier model's (as `identity.mode: stable` matches a run to its
        reference run: kfed_spark.core.identity), new clusters taking ids above the model's; with warmStart,
        the server step is seeded with its centers. Not a Param: like MLlib's initialModel proposals, a
        model is not saved with the estimator. None: ids 0..k-1 again."""
        self._reference, self._warm_start = model, warmStart
        return self

    def _fit(self, dataset: DataFrame) -> "KFedModel":
        reference = None if self._reference is None else self._reference._stored
        clustering = fit(
            dataset, self._settings(), initial=reference.centers if reference and self._warm_start else None
        )
        if reference is not None:
            matching = match_clusters(clustering.clusters(), reference.clusters(), int(reference.cluster_ids.max()) + 1)
            clustering = clustering.with_ids(matching.ids)
        local = clustering.local.table.append_column(
            "cluster_id", pa.array(clustering.cluster_ids[clustering.server.assignment], type=pa.int32())
        )
        stored = StoredModel.of(
            clustering.server.centers, clustering.cluster_ids, local, "fit", held_back=clustering.local.held_back
        )
        model = KFedModel()._with_state(stored)
        model._k_sweep = clustering.k_sweep
        model._profiles = lambda: model._training_profiles(dataset)
        return self._copyValues(model)._set(k=len(clustering.server.centers))

    def write(self) -> MLWriter:
        return _DataFrameWriter(self)

    @classmethod
    def read(cls) -> MLReader["KFed"]:
        return DefaultParamsReader(cls)


@dataclass(frozen=True)
class KFedSummary:
    """Training summary, from the local statistics (no pass over the rows); clusterProfiles makes one pass."""

    trainingCost: float  # k-means cost of the induced labels: local SSE plus n * |local - global|^2 (NaN: privacy)
    clusterSizes: list[int]
    numDevices: int
    numLocalCenters: int
    _profiles: Callable[[], DataFrame] | None = field(default=None, repr=False, compare=False)

    @property
    def clusterProfiles(self) -> DataFrame:
        """What sets each cluster apart, as the cluster_profiles table holds it (kfed_spark.core.profiles):
        for a fitted model, one pass over the training rows, labelled as transform labels them; for a model
        from_run, the run's published profiles. A model read back from a folder has no training rows."""
        if self._profiles is None:
            raise ValueError("no training rows: a model read back with KFedModel.load has no cluster profiles")
        return self._profiles()


class KFedModel(Model, _KFedParams, MLReadable["KFedModel"], MLWritable):
    """Global centers plus every training device's local centers and their global clusters."""

    def __init__(self):
        super().__init__()
        self._stored: StoredModel | None = None
        self._k_sweep: KSweep | None = None
        self._profiles: Callable[[], DataFrame] | None = None
        """The summary's cluster profiles: of the training rows (fit) or the run's (from_run)."""

    def _with_state(self, stored: StoredModel) -> "KFedModel":
        self._stored = stored
        return self

    @property
    def _local(self) -> pa.Table:
        """The local centers with the id of the global cluster each joined."""
        stored = self._stored
        return stored.local.append_column(
            "cluster_id", pa.array(stored.cluster_ids[stored.assignment], type=pa.int32())
        )

    @classmethod
    def from_run(cls, output_path: str, run_id: str | None = None) -> "KFedModel":
        """The model of a published run of `kfed-spark run` (by default the newest succeeded one) under
        output_path, with the run's parameters and column names."""
        from pyspark.sql import SparkSession

        tables = OutputTables(SparkSession.active(), OutputConfig(path=output_path))
        stored = stored_model(tables, run_id)
        model = cls()._with_state(stored)
        model._profiles = lambda: (
            tables.read("cluster_profiles")
            .filter(attempt_filter(stored.origin, stored.attempt_id))
            .drop("run_id", "attempt_id")
            .orderBy("cluster_id", "rank")
        )
        settings = {
            name: stored.config[spec.name] for name, spec in ALGORITHM_PARAMS.items() if spec.name in stored.config
        }
        settings["k"] = len(stored.centers)  # a k auto run's chosen k
        columns = {
            "deviceCol": stored.config["input"]["device_col"],
            "featuresCol": stored.config["input"]["features_col"],
        }
        return model._set(**settings, **{name: value for name, value in columns.items() if isinstance(value, str)})

    def setPredictionCol(self, value: str) -> "KFedModel":
        return self._set(predictionCol=value)

    def setLocalPredictionCol(self, value: str) -> "KFedModel":
        return self._set(localPredictionCol=value)

    def setDistanceCol(self, value: str) -> "KFedModel":
        return self._set(distanceCol=value)

    def setMarginCol(self, value: str) -> "KFedModel":
        return self._set(marginCol=value)

    def clusterCenters(self) -> list[np.ndarray]:
        """The k global centers, as MLlib's KMeansModel gives them, in the order of clusterIds."""
        return [center.copy() for center in self._stored.centers]

    @property
    def clusterIds(self) -> list[int]:
        """The id of each global center: what predictionCol holds (0..k-1 for a model fitted here; a run's
        stable ids for a model from_run)."""
        return self._stored.cluster_ids.tolist()

    @property
    def kSweep(self) -> KSweep | None:
        """With k="auto": the sweep of kRange that chose this model's k (kfed_spark.core.k_sweep); else None."""
        return self._k_sweep

    def sweepK(self, kRange: tuple[int, int], step: int = 1) -> KSweep:
        """The server step for every k of kRange (both ends included, every step-th) over this model's local
        centers, with each k's exact SSE, BIC, silhouette, noise ratio and, for the candidates, stability, and
        the recommended k (kfed_spark.core.k_sweep): no pass over the rows. Refit with that k, or with k="auto"."""
        return self._stored.sweep(k_values(kRange[0], kRange[1], step), self._settings().algorithm)

    @property
    def localCenters(self) -> DataFrame:
        """device_id, local_cluster_id, center, n_points, sse, cluster_id of every training device."""
        from pyspark.sql import SparkSession

        return SparkSession.active().createDataFrame(self._local)

    @property
    def summary(self) -> KFedSummary:
        """clusterSizes in the order of clusterIds."""
        stored = self._stored
        local = LocalCenters.from_arrow(stored.local, stored.dim)
        cost = float(
            np.sum(local.sse) + np.sum(between_sse(local.centers, local.counts, stored.centers, stored.assignment))
        )
        sizes = np.bincount(stored.assignment, weights=local.counts, minlength=len(stored.centers)).astype(int)
        return KFedSummary(cost, sizes.tolist(), len(np.unique(local.devices)), len(local.counts), self._profiles)

    def _training_profiles(self, dataset: DataFrame) -> DataFrame:
        settings = self._settings()
        model = self._stored.label_model(settings.algorithm.label_mode, label_unseen=True)
        table = profiled_rows(dataset, settings, model, self._stored.dim)
        return dataset.sparkSession.createDataFrame(table).orderBy("cluster_id", "rank")

    def _transform(self, dataset: DataFrame) -> DataFrame:
        """Label rows: a plan, no Spark job, so it works on a streaming DataFrame too. A row of a device
        the model has not seen takes the nearest global center and a null local prediction (its label
        depends on the row alone); `kfed-spark assign` clusters such devices locally instead."""
        settings = self._settings()
        labelled = labelled_plan(
            dataset,
            settings,
            self._stored.label_model(settings.algorithm.label_mode, label_unseen=True),
            self._stored.dim,
        ).drop(SQ_DIST_COL, REASON_COL)
        renamed = {
            "local_cluster_id": self.getLocalPredictionCol(),
            "cluster_id": self.getPredictionCol(),
            "distance": self.getOrDefault("distanceCol"),
            "margin": self.getOrDefault("marginCol"),
        }
        return labelled.drop(*[column for column, name in renamed.items() if not name]).withColumnsRenamed(
            {column: name for column, name in renamed.items() if name}
        )

    def write(self) -> MLWriter:
        return _model_writer(self)

    @classmethod
    def read(cls) -> MLReader["KFedModel"]:
        return _KFedModelReader(cls)


class _DataFrameWriter(MLWriter):
    """Saves params (and any extra metadata) in DefaultParamsReader's layout, and optional data as Parquet
    under data/, with DataFrame writes only: MLWriter's own overwrite deletes the folder through the JVM,
    which a Spark Connect session does not have."""

    def __init__(self, instance: Params, extra_metadata: dict | None = None, data: pa.Table | None = None):
        super().__init__()
        self.instance, self.extra_metadata, self.data = instance, extra_metadata, data

    def save(self, path: str) -> None:
        from pyspark.errors import AnalysisException

        spark, mode = self.sparkSession, "overwrite" if self.shouldOverwrite else "errorifexists"
        metadata = DefaultParamsWriter._get_metadata_to_save(self.instance, spark, self.extra_metadata)
        try:
            metadata_frame = rows_frame(spark, [(metadata,)], StructType([StructField("value", StringType())]))
            metadata_frame.coalesce(1).write.mode(mode).text(f"{path}/metadata")
        except AnalysisException as exc:
            if exc.getCondition() != "PATH_ALREADY_EXISTS":
                raise
            raise FileExistsError(
                f"{path} already holds a saved instance: use write().overwrite().save(path)"
            ) from None
        if self.data is not None:
            spark.createDataFrame(self.data).write.mode(mode).parquet(f"{path}/{SAVED_LOCAL_CENTERS}")


def _model_writer(model: KFedModel) -> _DataFrameWriter:
    """Params, global centers and their ids as metadata; the local centers as Parquet under data/."""
    centers = [[float(v) for v in center] for center in model._stored.centers]
    return _DataFrameWriter(model, {"centers": centers, "clusterIds": model.clusterIds}, model._local)


class _KFedModelReader(MLReader["KFedModel"]):
    def __init__(self, cls: type):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> KFedModel:
        metadata, centers, local = read_saved(self.sparkSession, path)
        model = self.cls()
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        return model._with_state(
            StoredModel.of(centers, saved_cluster_ids(metadata, len(centers)), local, f"{SAVED_MODEL_ORIGIN}{path}")
        )
