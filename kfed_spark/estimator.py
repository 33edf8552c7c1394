"""k-FED as a pyspark.ml estimator, in the style of pyspark.ml.clustering.KMeans.

>>> model = KFed(k=4, kPerDevice=2, deviceCol="device_id", seed=1).fit(df)      # doctest: +SKIP
>>> model.transform(df).select("device_id", "prediction", "local_prediction")  # doctest: +SKIP
>>> model.write().overwrite().save(path); KFedModel.load(path)                 # doctest: +SKIP

It runs the same code as `kfed-spark run` (kfed_spark.pipeline.fit and label_rows); only the
output columns and the persistence differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from pyspark import keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasFeaturesCol, HasMaxIter, HasPredictionCol, HasSeed, HasTol
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from kfed_spark.batches import SQ_DIST_COL, LabelModel
from kfed_spark.config import InputConfig, KFedConfig, validate_algorithm
from kfed_spark.errors import ConfigError
from kfed_spark.kernels import MAX_ITER, TOL
from kfed_spark.pipeline import (
    LOCAL_CENTER_COLUMNS,
    REASON_COL,
    LocalCenters,
    extend_with_new_devices,
    fit,
    label_rows,
    validated,
)

LOCAL_CENTERS_DATA = "data/local_centers"


class _KFedParams(HasFeaturesCol, HasPredictionCol, HasSeed, HasMaxIter, HasTol):
    """Params shared by KFed and KFedModel."""

    k = Param(Params._dummy(), "k", "number of global clusters. Must be >= 1.", typeConverter=TypeConverters.toInt)
    kPerDevice = Param(
        Params._dummy(), "kPerDevice",
        "clusters per device: an integer in [1, k], 'auto' (each device estimates its own), or a column name.",
        typeConverter=lambda value: value if isinstance(value, str) else TypeConverters.toInt(value),
    )
    seeding = Param(
        Params._dummy(), "seeding", "server seeding: 'farthest', 'robust' or 'kmeanspp'.",
        typeConverter=TypeConverters.toString,
    )
    deviceCol = Param(Params._dummy(), "deviceCol", "device id column.", typeConverter=TypeConverters.toString)
    localPredictionCol = Param(
        Params._dummy(), "localPredictionCol", "output column of the local cluster within the device.",
        typeConverter=TypeConverters.toString,
    )
    serverRefine = Param(
        Params._dummy(), "serverRefine", "'lloyd' (count-weighted Lloyd over local centers) or 'none'.",
        typeConverter=TypeConverters.toString,
    )
    labelMode = Param(
        Params._dummy(), "labelMode", "'induced' (device's nearest local center decides) or 'nearest'.",
        typeConverter=TypeConverters.toString,
    )
    maxRowsPerDevice = Param(
        Params._dummy(), "maxRowsPerDevice", "a larger device is clustered on a deterministic sample of this size.",
        typeConverter=TypeConverters.toInt,
    )

    def __init__(self, *args):
        super().__init__(*args)
        self._setDefault(
            k=2, kPerDevice=2, deviceCol="device_id", featuresCol="features", predictionCol="prediction",
            localPredictionCol="local_prediction", serverRefine="lloyd", labelMode="induced", maxIter=MAX_ITER,
            tol=TOL, maxRowsPerDevice=100_000, seed=0, seeding="robust",
        )

    def getK(self) -> int:
        return self.getOrDefault(self.k)

    def getKPerDevice(self) -> int | str:
        return self.getOrDefault(self.kPerDevice)

    def getSeeding(self) -> str:
        return self.getOrDefault(self.seeding)

    def getDeviceCol(self) -> str:
        return self.getOrDefault(self.deviceCol)

    def getLocalPredictionCol(self) -> str:
        return self.getOrDefault(self.localPredictionCol)

    def getServerRefine(self) -> str:
        return self.getOrDefault(self.serverRefine)

    def getLabelMode(self) -> str:
        return self.getOrDefault(self.labelMode)

    def getMaxRowsPerDevice(self) -> int:
        return self.getOrDefault(self.maxRowsPerDevice)

    def _config(self) -> KFedConfig:
        """The params as the job's configuration, so both run one implementation."""
        cfg = KFedConfig(
            input=InputConfig(device_col=self.getDeviceCol(), features_col=self.getFeaturesCol()),
            k=self.getK(),
            k_per_device=self.getKPerDevice(),
            seed=self.getSeed() & 0x7FFFFFFFFFFFFFFF,
            seeding=self.getSeeding(),
            server_refine=self.getServerRefine(),
            label_mode=self.getLabelMode(),
            max_iter=self.getMaxIter(),
            tol=self.getTol(),
            max_rows_per_device=self.getMaxRowsPerDevice(),
        )
        validate_algorithm(cfg)
        return cfg


class KFed(Estimator["KFedModel"], _KFedParams, MLReadable["KFed"], MLWritable):
    """One-shot federated k-means (k-FED): each device clusters its rows once, the driver merges."""

    @keyword_only
    def __init__(
        self, *, k: int = 2, kPerDevice: int | str = 2, deviceCol: str = "device_id", featuresCol: str = "features",
        predictionCol: str = "prediction", localPredictionCol: str = "local_prediction", seed: int = 0,
        serverRefine: str = "lloyd", labelMode: str = "induced", maxIter: int = MAX_ITER, tol: float = TOL,
        maxRowsPerDevice: int = 100_000, seeding: str = "robust",
    ):
        super().__init__()
        self._set(**self._input_kwargs)

    @keyword_only
    def setParams(
        self, *, k: int = 2, kPerDevice: int | str = 2, deviceCol: str = "device_id", featuresCol: str = "features",
        predictionCol: str = "prediction", localPredictionCol: str = "local_prediction", seed: int = 0,
        serverRefine: str = "lloyd", labelMode: str = "induced", maxIter: int = MAX_ITER, tol: float = TOL,
        maxRowsPerDevice: int = 100_000, seeding: str = "robust",
    ) -> "KFed":
        return self._set(**self._input_kwargs)

    def setK(self, value: int) -> "KFed":
        return self._set(k=value)

    def setKPerDevice(self, value: int | str) -> "KFed":
        return self._set(kPerDevice=value)

    def setSeeding(self, value: str) -> "KFed":
        return self._set(seeding=value)

    def setDeviceCol(self, value: str) -> "KFed":
        return self._set(deviceCol=value)

    def setFeaturesCol(self, value: str) -> "KFed":
        return self._set(featuresCol=value)

    def setPredictionCol(self, value: str) -> "KFed":
        return self._set(predictionCol=value)

    def setLocalPredictionCol(self, value: str) -> "KFed":
        return self._set(localPredictionCol=value)

    def setSeed(self, value: int) -> "KFed":
        return self._set(seed=value)

    def setServerRefine(self, value: str) -> "KFed":
        return self._set(serverRefine=value)

    def setLabelMode(self, value: str) -> "KFed":
        return self._set(labelMode=value)

    def setMaxIter(self, value: int) -> "KFed":
        return self._set(maxIter=value)

    def setTol(self, value: float) -> "KFed":
        return self._set(tol=value)

    def setMaxRowsPerDevice(self, value: int) -> "KFed":
        return self._set(maxRowsPerDevice=value)

    def _fit(self, dataset: DataFrame) -> "KFedModel":
        clustering = fit(dataset, self._config())
        model = KFedModel()._with_state(clustering.local, clustering.server.assignment, clustering.server.centers)
        return self._copyValues(model)

    def write(self) -> MLWriter:
        return _DataFrameWriter(self)

    @classmethod
    def read(cls) -> MLReader["KFed"]:
        return DefaultParamsReader(cls)


@dataclass(frozen=True)
class KFedSummary:
    """Training summary, from the local statistics (no pass over the rows)."""

    trainingCost: float  # k-means cost of the induced labels: local SSE plus n * |local - global|^2
    clusterSizes: list[int]
    numDevices: int
    numLocalCenters: int


class KFedModel(Model, _KFedParams, MLReadable["KFedModel"], MLWritable):
    """Global centers plus every training device's local centers and their global clusters."""

    def __init__(self):
        super().__init__()
        self._local: pa.Table | None = None
        self._centers: np.ndarray | None = None

    def _with_state(self, local: LocalCenters, assignment: np.ndarray, centers: np.ndarray) -> "KFedModel":
        self._local = local.table.append_column("cluster_id", pa.array(assignment, type=pa.int32()))
        self._centers = np.asarray(centers, dtype=np.float64)
        return self

    def setPredictionCol(self, value: str) -> "KFedModel":
        return self._set(predictionCol=value)

    def setLocalPredictionCol(self, value: str) -> "KFedModel":
        return self._set(localPredictionCol=value)

    def clusterCenters(self) -> list[np.ndarray]:
        """The k global centers, as MLlib's KMeansModel gives them."""
        return [center.copy() for center in self._centers]

    @property
    def localCenters(self) -> DataFrame:
        """device_id, local_cluster_id, center, n_points, sse, cluster_id of every training device."""
        from pyspark.sql import SparkSession

        return SparkSession.active().createDataFrame(self._local)

    @property
    def summary(self) -> KFedSummary:
        local = self._local_centers()
        clusters = self._local.column("cluster_id").to_numpy()
        gap = local.centers - self._centers[clusters]
        sse = self._local.column("sse").to_numpy()
        cost = float(np.sum(sse) + np.sum(local.counts * np.einsum("ij,ij->i", gap, gap)))
        sizes = np.bincount(clusters, weights=local.counts, minlength=len(self._centers)).astype(int)
        return KFedSummary(cost, sizes.tolist(), len(np.unique(local.devices)), len(local.counts))

    def _local_centers(self) -> LocalCenters:
        return LocalCenters.from_arrow(self._local.select(LOCAL_CENTER_COLUMNS), self._centers.shape[1])

    def _transform(self, dataset: DataFrame) -> DataFrame:
        """Label rows; devices the model has not seen are clustered locally and their centers joined to
        the nearest global centers (the paper's section 3.2), without touching anyone else."""
        cfg = self._config()
        dim = self._centers.shape[1]
        checked, _ = validated(dataset, cfg, dim)
        local, clusters = extend_with_new_devices(
            checked.filter(F.col(REASON_COL).isNull()), cfg, dim, self._local_centers(),
            self._local.column("cluster_id").to_numpy(), self._centers,
        )
        model = LabelModel.build(local.devices, local.ids, local.centers, clusters, self._centers, cfg.label_mode)
        return (
            label_rows(checked, model, dataset.schema, cfg.input.device_col, dim)
            .drop(SQ_DIST_COL, REASON_COL)
            .withColumnRenamed("local_cluster_id", self.getLocalPredictionCol())
            .withColumnRenamed("cluster_id", self.getPredictionCol())
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
            spark.createDataFrame([(metadata,)], schema=["value"]).coalesce(1).write.mode(mode).text(f"{path}/metadata")
        except AnalysisException as exc:
            if exc.getCondition() != "PATH_ALREADY_EXISTS":
                raise
            raise FileExistsError(f"{path} already holds a saved instance: use write().overwrite().save(path)") from None
        if self.data is not None:
            spark.createDataFrame(self.data).write.mode(mode).parquet(f"{path}/{LOCAL_CENTERS_DATA}")


def _model_writer(model: KFedModel) -> _DataFrameWriter:
    """Params and global centers as metadata; the local centers as Parquet under data/."""
    centers = [[float(v) for v in center] for center in model._centers]
    return _DataFrameWriter(model, {"centers": centers}, model._local)


class _KFedModelReader(MLReader["KFedModel"]):
    def __init__(self, cls: type):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> KFedModel:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        model = self.cls()
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        table = self.sparkSession.read.parquet(f"{path}/{LOCAL_CENTERS_DATA}").toArrow()
        if "centers" not in metadata:
            raise ConfigError(f"{path} holds no k-FED model (no centers in its metadata)")
        model._local = table.sort_by([("device_id", "ascending"), ("local_cluster_id", "ascending")])
        model._centers = np.asarray(metadata["centers"], dtype=np.float64)
        return model
