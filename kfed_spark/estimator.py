"""k-FED as a pyspark.ml estimator, in the style of pyspark.ml.clustering.KMeans.

>>> model = KFed(k=4, kPerDevice=2, deviceCol="device_id", seed=1).fit(df)      # doctest: +SKIP
>>> model.transform(df).select("device_id", "prediction", "local_prediction")  # doctest: +SKIP
>>> model.write().overwrite().save(path); KFedModel.load(path)                 # doctest: +SKIP
>>> KFedModel.from_run("/data/kfed", "2026-11-29")                             # doctest: +SKIP

It runs the same code as `kfed-spark run` (kfed_spark.fitting.fit and label_rows); only the
output columns and the persistence differ. A run's model becomes a KFedModel with from_run, and a
saved KFedModel serves `kfed-spark assign` and `stream` with --model PATH (kfed_spark.models).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter
from pyspark.sql import DataFrame

from kfed_spark.config import InputConfig, KFedConfig, OutputConfig, validate_columns
from kfed_spark.fitting import LOCAL_CENTER_COLUMNS, REASON_COL, LocalCenters, fit, labelled_plan
from kfed_spark.io import OutputTables
from kfed_spark.models import SAVED_LOCAL_CENTERS, read_saved, stored_model
from kfed_spark.params import AlgorithmParams
from kfed_spark.workers import SQ_DIST_COL


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _converter(kind: str):
    """The Param type converter for an AlgorithmParams field's annotation."""
    if kind == "int | str":
        return lambda value: value if isinstance(value, str) else TypeConverters.toInt(value)
    return {"int": TypeConverters.toInt, "float": TypeConverters.toFloat, "str": TypeConverters.toString}[kind]


ALGORITHM_PARAMS = {_camel(spec.name): spec for spec in fields(AlgorithmParams)}
"""Estimator Param name -> the row of kfed_spark.params it stands for."""

COLUMN_PARAMS = {
    "deviceCol": ("device_id", "device id column."),
    "featuresCol": ("features", "features column: an array of numbers or a Spark ML vector."),
    "predictionCol": ("prediction", "output column of the global cluster."),
    "localPredictionCol": ("local_prediction", "output column of the local cluster within the device."),
}
"""Param name -> (default, meaning) of the columns the estimator reads and writes."""


class _KFedParams(Params):
    """Params shared by KFed and KFedModel: one per row of AlgorithmParams, plus the column names.

    Each Param has a getter (getK, getKPerDevice, ...); KFed also has a setter for each.
    """

    def __init__(self, *args):
        super().__init__(*args)
        self._setDefault(
            **{name: spec.default for name, spec in ALGORITHM_PARAMS.items()},
            **{name: default for name, (default, _) in COLUMN_PARAMS.items()},
        )

    def _config(self) -> KFedConfig:
        """The params as the job's configuration, so both run one implementation."""
        values = {spec.name: self.getOrDefault(name) for name, spec in ALGORITHM_PARAMS.items()}
        cfg = KFedConfig(
            input=InputConfig(device_col=self.getOrDefault("deviceCol"), features_col=self.getOrDefault("featuresCol")),
            **{**values, "seed": values["seed"] & 0x7FFFFFFFFFFFFFFF},
        )
        cfg.check()
        validate_columns(cfg.input)
        return cfg


def _declare(params: dict[str, tuple[Param, object]], with_setters: type) -> None:
    """Put each Param and its getter on _KFedParams, and its setter on with_setters."""
    for name, (param, _) in params.items():
        accessor = name[0].upper() + name[1:]
        setattr(_KFedParams, name, param)
        setattr(_KFedParams, f"get{accessor}", lambda self, name=name: self.getOrDefault(name))
        setattr(with_setters, f"set{accessor}", lambda self, value, name=name: self._set(**{name: value}))


class KFed(Estimator["KFedModel"], _KFedParams, MLReadable["KFed"], MLWritable):
    """One-shot federated k-means (k-FED): each device clusters its rows once, the driver merges.

    Takes every Param as a keyword (see the signature); each also has a getter and a setter.
    """

    def __init__(self, **params):
        super().__init__()
        self.setParams(**params)

    def setParams(self, **params) -> "KFed":
        unknown = sorted(set(params) - set(_ALL_PARAMS))
        if unknown:
            raise TypeError(f"KFed has no param {unknown[0]!r}; params: {', '.join(_ALL_PARAMS)}")
        return self._set(**params)

    def _fit(self, dataset: DataFrame) -> "KFedModel":
        clustering = fit(dataset, self._config())
        model = KFedModel()._with_state(clustering.local.table, clustering.server.assignment, clustering.server.centers)
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

    def _with_state(self, local: pa.Table, assignment: np.ndarray, centers: np.ndarray) -> "KFedModel":
        self._local = local.append_column("cluster_id", pa.array(assignment, type=pa.int32()))
        self._centers = np.asarray(centers, dtype=np.float64)
        return self

    @classmethod
    def from_run(cls, output_path: str, run_id: str | None = None) -> "KFedModel":
        """The model of a published run of `kfed-spark run` (by default the newest succeeded one) under
        output_path, with the run's parameters and column names."""
        from pyspark.sql import SparkSession

        stored = stored_model(OutputTables(SparkSession.active(), OutputConfig(path=output_path)), run_id)
        model = cls()._with_state(stored.local, stored.assignment, stored.centers)
        settings = {name: stored.config[spec.name] for name, spec in ALGORITHM_PARAMS.items() if spec.name in stored.config}
        columns = {"deviceCol": stored.config["input"]["device_col"], "featuresCol": stored.config["input"]["features_col"]}
        return model._set(**settings, **{name: value for name, value in columns.items() if isinstance(value, str)})

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
        """Label rows: a plan, no Spark job, so it works on a streaming DataFrame too. A row of a device
        the model has not seen takes the nearest global center and a null local prediction (its label
        depends on the row alone); `kfed-spark assign` clusters such devices locally instead."""
        cfg = self._config()
        model = self._local_centers().label_model(self._local.column("cluster_id").to_numpy(), self._centers,
                                                  cfg.label_mode, label_unseen=True)
        return (
            labelled_plan(dataset, cfg, model, self._centers.shape[1])
            .drop(SQ_DIST_COL, REASON_COL)
            .withColumnRenamed("local_cluster_id", self.getLocalPredictionCol())
            .withColumnRenamed("cluster_id", self.getPredictionCol())
        )

    def write(self) -> MLWriter:
        return _model_writer(self)

    @classmethod
    def read(cls) -> MLReader["KFedModel"]:
        return _KFedModelReader(cls)


_ALL_PARAMS = {
    **{
        name: (Param(Params._dummy(), name, spec.metadata["doc"] + ".", _converter(spec.type)), spec.default)
        for name, spec in ALGORITHM_PARAMS.items()
    },
    **{
        name: (Param(Params._dummy(), name, doc, TypeConverters.toString), default)
        for name, (default, doc) in COLUMN_PARAMS.items()
    },
}
"""Every Param of KFed and KFedModel with its default."""
_declare(_ALL_PARAMS, KFed)
KFed.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
       for name, (_, default) in _ALL_PARAMS.items()]
)


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
            spark.createDataFrame(self.data).write.mode(mode).parquet(f"{path}/{SAVED_LOCAL_CENTERS}")


def _model_writer(model: KFedModel) -> _DataFrameWriter:
    """Params and global centers as metadata; the local centers as Parquet under data/."""
    centers = [[float(v) for v in center] for center in model._centers]
    return _DataFrameWriter(model, {"centers": centers}, model._local)


class _KFedModelReader(MLReader["KFedModel"]):
    def __init__(self, cls: type):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> KFedModel:
        metadata, centers, local = read_saved(self.sparkSession, path)
        model = self.cls()
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        model._local, model._centers = local, centers
        return model
