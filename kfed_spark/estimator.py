"""k-FED as a pyspark.ml estimator, in the style of pyspark.ml.clustering.KMeans.

>>> from kfed_spark.bench.synthetic import mixture
>>> df = spark.createDataFrame(mixture(k=4, k_per_device=2, devices=20, points_per_device=30, dim=4, seed=1))
>>> model = KFed(k=4, kPerDevice=2, seed=1).fit(df)
>>> model.getK(), len(model.clusterCenters()), model.summary.numDevices
(4, 4, 20)
>>> model.transform(df).select("device_id", "prediction", "local_prediction").distinct().count()
40
>>> model.sweepK((2, 8)).recommended_k  # k from the local centers, no pass over the rows
4
>>> KFed(k="auto", kRange=(2, 8), kPerDevice=2).fit(df).getK()
4
>>> model.write().overwrite().save(path); KFedModel.load(path)                 # doctest: +SKIP
>>> KFedModel.from_run("/data/kfed", "2026-11-29")                             # doctest: +SKIP

It runs the same code as `kfed-spark run` (kfed_spark.spark.fitting.fit and label_rows); only the
output columns and the persistence differ. A run's model becomes a KFedModel with from_run, and a
saved KFedModel serves `kfed-spark assign` and `stream` with --model PATH (kfed_spark.store.models).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
from pyspark import keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter
from pyspark.sql import DataFrame
from pyspark.sql.types import StringType, StructField, StructType

from kfed_spark.config import InputConfig, KFedConfig, OutputConfig, validate_columns
from kfed_spark.core.identity import match_clusters
from kfed_spark.core.k_sweep import KSweep, k_values
from kfed_spark.core.linalg import between_sse
from kfed_spark.params import AlgorithmParams, camel
from kfed_spark.spark.fitting import REASON_COL, LocalCenters, fit, labelled_plan
from kfed_spark.spark.workers import SQ_DIST_COL
from kfed_spark.store.delta import OutputTables, rows_frame
from kfed_spark.store.models import (
    SAVED_LOCAL_CENTERS,
    SAVED_MODEL_ORIGIN,
    StoredModel,
    read_saved,
    saved_cluster_ids,
    stored_model,
)


def _int_or_text(value: object) -> int | str:
    """k and k_per_device: a number, or text ('auto', a column's name)."""
    return value if isinstance(value, str) else TypeConverters.toInt(value)


def _int_pair(value: object) -> tuple[int, int]:
    """k_range: two integers, however the params were saved (a JSON list)."""
    return tuple(TypeConverters.toListInt(value))


def _optional_float(value: object) -> float | None:
    """privacy_epsilon: a number, or None (no privacy)."""
    return None if value is None else TypeConverters.toFloat(value)


def _float_pair(value: object) -> tuple[float, float] | None:
    """privacy_bounds: two numbers, or None."""
    return None if value is None else tuple(TypeConverters.toListFloat(value))


ALGORITHM_PARAMS = {camel(spec.name): spec for spec in fields(AlgorithmParams)}
"""Estimator Param name -> the row of kfed_spark.params it stands for."""


class _KFedParams(Params):
    """Params shared by KFed and KFedModel: one per row of AlgorithmParams, plus the columns it reads and
    writes (kfed_spark.params.ESTIMATOR_COLUMNS), each with a getter; KFed also has a setter for each.
    The declarations between the GENERATED lines are written by kfed_spark.params_codegen."""

    def __init__(self, *args):
        super().__init__(*args)
        self._declared_defaults()

    # BEGIN GENERATED params
    k: Param[int | str] = Param(
        Params._dummy(),
        "k",
        "number of global clusters, or 'auto': after the local step the run sweeps k_range over the local"
        " centers and takes the k the sweep recommends (kfed_spark.core.k_sweep), with no extra pass over"
        " the rows.",
        typeConverter=_int_or_text,
    )

    kRange: Param[tuple[int, int]] = Param(
        Params._dummy(),
        "kRange",
        "with k 'auto': the smallest and largest k swept, both included.",
        typeConverter=_int_pair,
    )

    kPerDevice: Param[int | str] = Param(
        Params._dummy(),
        "kPerDevice",
        "local clusters per device: an integer in [1, k], 'auto' (each device estimates its own), or a "
        "column of the input or a side table (device column + k).",
        typeConverter=_int_or_text,
    )

    kPerDeviceMax: Param[int] = Param(
        Params._dummy(),
        "kPerDeviceMax",
        "with k_per_device 'auto': the largest k a device may estimate.",
        typeConverter=TypeConverters.toInt,
    )

    seeding: Param[str] = Param(
        Params._dummy(),
        "seeding",
        "server seeding rule: kmeanspp (count-weighted greedy k-means++, best of several, on a sample of "
        "the local centers when they are many) or farthest (the paper's farthest-point); robust is an "
        "older name for farthest.",
        typeConverter=TypeConverters.toString,
    )

    robustMinSize: Param[float] = Param(
        Params._dummy(),
        "robustMinSize",
        "outlier filter of the server step: local centers backed by fewer rows than this times the median"
        " center's are left out of seeding and refinement and assigned at the end; 0 turns it off.",
        typeConverter=TypeConverters.toFloat,
    )

    minCenterPoints: Param[int] = Param(
        Params._dummy(),
        "minCenterPoints",
        "fewest rows a local center must stand for to leave its device: a center of fewer is never shared"
        " or published, its rows take the device's nearest shared center, or with none left the nearest "
        "global center.",
        typeConverter=TypeConverters.toInt,
    )

    localRestarts: Param[int] = Param(
        Params._dummy(),
        "localRestarts",
        "rough clusterings each device tries in its projection (alg. 1); it keeps the lowest-cost one.",
        typeConverter=TypeConverters.toInt,
    )

    serverRefine: Param[str] = Param(
        Params._dummy(),
        "serverRefine",
        "lloyd (count-weighted Lloyd over the local centers) or none (the paper).",
        typeConverter=TypeConverters.toString,
    )

    serverStep: Param[str] = Param(
        Params._dummy(),
        "serverStep",
        "where the server step runs: driver (every local center in the driver's memory), distributed "
        "(Spark partitions reduce the local centers to weighted representatives, the driver merges those)"
        " or auto (distributed above server_distributed_above local centers).",
        typeConverter=TypeConverters.toString,
    )

    serverDistributedAbove: Param[int] = Param(
        Params._dummy(),
        "serverDistributedAbove",
        "with server_step auto: the most local centers the driver merges itself.",
        typeConverter=TypeConverters.toInt,
    )

    serverRepresentatives: Param[int] = Param(
        Params._dummy(),
        "serverRepresentatives",
        "distributed server step: weighted representatives each partition keeps, per global cluster.",
        typeConverter=TypeConverters.toInt,
    )

    labelMode: Param[str] = Param(
        Params._dummy(),
        "labelMode",
        "induced (a row takes the global cluster of its device's nearest local center, the paper's "
        "section 3.2) or nearest (the nearest global center).",
        typeConverter=TypeConverters.toString,
    )

    maxIter: Param[int] = Param(
        Params._dummy(),
        "maxIter",
        "most Lloyd rounds, on each device and on the server.",
        typeConverter=TypeConverters.toInt,
    )

    tol: Param[float] = Param(
        Params._dummy(),
        "tol",
        "Lloyd stops when the centers move less than tol times the data's total variance.",
        typeConverter=TypeConverters.toFloat,
    )

    maxRowsPerDevice: Param[int] = Param(
        Params._dummy(),
        "maxRowsPerDevice",
        "a larger device is clustered on a deterministic sample of this many rows (memory: rows x d x 8 "
        "bytes); all its rows are labelled.",
        typeConverter=TypeConverters.toInt,
    )

    seed: Param[int] = Param(
        Params._dummy(),
        "seed",
        "seed of every random draw, with the device id (the privacy noise excepted).",
        typeConverter=TypeConverters.toInt,
    )

    privacyEpsilon: Param[float | None] = Param(
        Params._dummy(),
        "privacyEpsilon",
        "null (no privacy), or the epsilon of the per-row differential privacy of what each device "
        "shares: its local step becomes privacy_rounds noisy Lloyd rounds in the box privacy_bounds "
        "(README: Differential privacy); needs a fixed k and k_per_device.",
        typeConverter=_optional_float,
    )

    privacyDelta: Param[float] = Param(
        Params._dummy(),
        "privacyDelta",
        "with privacy_epsilon: the delta of the guarantee.",
        typeConverter=TypeConverters.toFloat,
    )

    privacyBounds: Param[tuple[float, float] | None] = Param(
        Params._dummy(),
        "privacyBounds",
        "with privacy_epsilon: [LO, HI], the range every feature is clipped into, known without looking "
        "at the rows (the noise grows with HI - LO).",
        typeConverter=_float_pair,
    )

    privacyRounds: Param[int] = Param(
        Params._dummy(),
        "privacyRounds",
        "with privacy_epsilon: the noisy Lloyd rounds of each device, which share the budget.",
        typeConverter=TypeConverters.toInt,
    )

    deviceCol: Param[str] = Param(
        Params._dummy(),
        "deviceCol",
        "device id column.",
        typeConverter=TypeConverters.toString,
    )

    featuresCol: Param[str] = Param(
        Params._dummy(),
        "featuresCol",
        "features column: an array of numbers or a Spark ML vector.",
        typeConverter=TypeConverters.toString,
    )

    predictionCol: Param[str] = Param(
        Params._dummy(),
        "predictionCol",
        "output column of the global cluster.",
        typeConverter=TypeConverters.toString,
    )

    localPredictionCol: Param[str] = Param(
        Params._dummy(),
        "localPredictionCol",
        "output column of the local cluster within the device.",
        typeConverter=TypeConverters.toString,
    )

    distanceCol: Param[str] = Param(
        Params._dummy(),
        "distanceCol",
        "output column of the row's distance to its global center; empty: not added.",
        typeConverter=TypeConverters.toString,
    )

    marginCol: Param[str] = Param(
        Params._dummy(),
        "marginCol",
        "output column of the row's margin, (d_other - d) / (d_other + d); empty: not added.",
        typeConverter=TypeConverters.toString,
    )

    def _declared_defaults(self) -> None:
        self._setDefault(
            k=8,
            kRange=(2, 30),
            kPerDevice=2,
            kPerDeviceMax=16,
            seeding="kmeanspp",
            robustMinSize=0.25,
            minCenterPoints=3,
            localRestarts=3,
            serverRefine="lloyd",
            serverStep="auto",
            serverDistributedAbove=2000000,
            serverRepresentatives=2,
            labelMode="induced",
            maxIter=100,
            tol=1e-08,
            maxRowsPerDevice=100000,
            seed=0,
            privacyEpsilon=None,
            privacyDelta=1e-06,
            privacyBounds=None,
            privacyRounds=3,
            deviceCol="device_id",
            featuresCol="features",
            predictionCol="prediction",
            localPredictionCol="local_prediction",
            distanceCol="",
            marginCol="",
        )

    def getK(self) -> int | str:
        return self.getOrDefault(self.k)

    def getKRange(self) -> tuple[int, int]:
        return self.getOrDefault(self.kRange)

    def getKPerDevice(self) -> int | str:
        return self.getOrDefault(self.kPerDevice)

    def getKPerDeviceMax(self) -> int:
        return self.getOrDefault(self.kPerDeviceMax)

    def getSeeding(self) -> str:
        return self.getOrDefault(self.seeding)

    def getRobustMinSize(self) -> float:
        return self.getOrDefault(self.robustMinSize)

    def getMinCenterPoints(self) -> int:
        return self.getOrDefault(self.minCenterPoints)

    def getLocalRestarts(self) -> int:
        return self.getOrDefault(self.localRestarts)

    def getServerRefine(self) -> str:
        return self.getOrDefault(self.serverRefine)

    def getServerStep(self) -> str:
        return self.getOrDefault(self.serverStep)

    def getServerDistributedAbove(self) -> int:
        return self.getOrDefault(self.serverDistributedAbove)

    def getServerRepresentatives(self) -> int:
        return self.getOrDefault(self.serverRepresentatives)

    def getLabelMode(self) -> str:
        return self.getOrDefault(self.labelMode)

    def getMaxIter(self) -> int:
        return self.getOrDefault(self.maxIter)

    def getTol(self) -> float:
        return self.getOrDefault(self.tol)

    def getMaxRowsPerDevice(self) -> int:
        return self.getOrDefault(self.maxRowsPerDevice)

    def getSeed(self) -> int:
        return self.getOrDefault(self.seed)

    def getPrivacyEpsilon(self) -> float | None:
        return self.getOrDefault(self.privacyEpsilon)

    def getPrivacyDelta(self) -> float:
        return self.getOrDefault(self.privacyDelta)

    def getPrivacyBounds(self) -> tuple[float, float] | None:
        return self.getOrDefault(self.privacyBounds)

    def getPrivacyRounds(self) -> int:
        return self.getOrDefault(self.privacyRounds)

    def getDeviceCol(self) -> str:
        return self.getOrDefault(self.deviceCol)

    def getFeaturesCol(self) -> str:
        return self.getOrDefault(self.featuresCol)

    def getPredictionCol(self) -> str:
        return self.getOrDefault(self.predictionCol)

    def getLocalPredictionCol(self) -> str:
        return self.getOrDefault(self.localPredictionCol)

    def getDistanceCol(self) -> str:
        return self.getOrDefault(self.distanceCol)

    def getMarginCol(self) -> str:
        return self.getOrDefault(self.marginCol)

    # END GENERATED params

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


class KFed(Estimator["KFedModel"], _KFedParams, MLReadable["KFed"], MLWritable):
    """One-shot federated k-means (k-FED): each device clusters its rows once, the driver merges.

    Takes every Param as a keyword; each also has a getter and a setter.
    """

    # BEGIN GENERATED init
    @keyword_only
    def __init__(
        self,
        *,
        k: int | str = 8,
        kRange: tuple[int, int] = (2, 30),
        kPerDevice: int | str = 2,
        kPerDeviceMax: int = 16,
        seeding: str = "kmeanspp",
        robustMinSize: float = 0.25,
        minCenterPoints: int = 3,
        localRestarts: int = 3,
        serverRefine: str = "lloyd",
        serverStep: str = "auto",
        serverDistributedAbove: int = 2000000,
        serverRepresentatives: int = 2,
        labelMode: str = "induced",
        maxIter: int = 100,
        tol: float = 1e-08,
        maxRowsPerDevice: int = 100000,
        seed: int = 0,
        privacyEpsilon: float | None = None,
        privacyDelta: float = 1e-06,
        privacyBounds: tuple[float, float] | None = None,
        privacyRounds: int = 3,
        deviceCol: str = "device_id",
        featuresCol: str = "features",
        predictionCol: str = "prediction",
        localPredictionCol: str = "local_prediction",
        distanceCol: str = "",
        marginCol: str = "",
    ) -> None:
        super().__init__()
        self._reference: KFedModel | None = None
        self._warm_start = False
        self._set(**self._input_kwargs)

    @keyword_only
    def setParams(
        self,
        *,
        k: int | str = 8,
        kRange: tuple[int, int] = (2, 30),
        kPerDevice: int | str = 2,
        kPerDeviceMax: int = 16,
        seeding: str = "kmeanspp",
        robustMinSize: float = 0.25,
        minCenterPoints: int = 3,
        localRestarts: int = 3,
        serverRefine: str = "lloyd",
        serverStep: str = "auto",
        serverDistributedAbove: int = 2000000,
        serverRepresentatives: int = 2,
        labelMode: str = "induced",
        maxIter: int = 100,
        tol: float = 1e-08,
        maxRowsPerDevice: int = 100000,
        seed: int = 0,
        privacyEpsilon: float | None = None,
        privacyDelta: float = 1e-06,
        privacyBounds: tuple[float, float] | None = None,
        privacyRounds: int = 3,
        deviceCol: str = "device_id",
        featuresCol: str = "features",
        predictionCol: str = "prediction",
        localPredictionCol: str = "local_prediction",
        distanceCol: str = "",
        marginCol: str = "",
    ) -> KFed:
        return self._set(**self._input_kwargs)

    # END GENERATED init

    def setReferenceModel(self, model: "KFedModel | None", warmStart: bool = False) -> "KFed":
        """Fit with ids matched to an earlier model's (as `identity.mode: stable` matches a run to its
        reference run: kfed_spark.core.identity), new clusters taking ids above the model's; with warmStart,
        the server step is seeded with its centers. Not a Param: like MLlib's initialModel proposals, a
        model is not saved with the estimator. None: ids 0..k-1 again."""
        self._reference, self._warm_start = model, warmStart
        return self

    # BEGIN GENERATED setters
    def setK(self, value: int | str) -> KFed:
        return self._set(k=value)

    def setKRange(self, value: tuple[int, int]) -> KFed:
        return self._set(kRange=value)

    def setKPerDevice(self, value: int | str) -> KFed:
        return self._set(kPerDevice=value)

    def setKPerDeviceMax(self, value: int) -> KFed:
        return self._set(kPerDeviceMax=value)

    def setSeeding(self, value: str) -> KFed:
        return self._set(seeding=value)

    def setRobustMinSize(self, value: float) -> KFed:
        return self._set(robustMinSize=value)

    def setMinCenterPoints(self, value: int) -> KFed:
        return self._set(minCenterPoints=value)

    def setLocalRestarts(self, value: int) -> KFed:
        return self._set(localRestarts=value)

    def setServerRefine(self, value: str) -> KFed:
        return self._set(serverRefine=value)

    def setServerStep(self, value: str) -> KFed:
        return self._set(serverStep=value)

    def setServerDistributedAbove(self, value: int) -> KFed:
        return self._set(serverDistributedAbove=value)

    def setServerRepresentatives(self, value: int) -> KFed:
        return self._set(serverRepresentatives=value)

    def setLabelMode(self, value: str) -> KFed:
        return self._set(labelMode=value)

    def setMaxIter(self, value: int) -> KFed:
        return self._set(maxIter=value)

    def setTol(self, value: float) -> KFed:
        return self._set(tol=value)

    def setMaxRowsPerDevice(self, value: int) -> KFed:
        return self._set(maxRowsPerDevice=value)

    def setSeed(self, value: int) -> KFed:
        return self._set(seed=value)

    def setPrivacyEpsilon(self, value: float | None) -> KFed:
        return self._set(privacyEpsilon=value)

    def setPrivacyDelta(self, value: float) -> KFed:
        return self._set(privacyDelta=value)

    def setPrivacyBounds(self, value: tuple[float, float] | None) -> KFed:
        return self._set(privacyBounds=value)

    def setPrivacyRounds(self, value: int) -> KFed:
        return self._set(privacyRounds=value)

    def setDeviceCol(self, value: str) -> KFed:
        return self._set(deviceCol=value)

    def setFeaturesCol(self, value: str) -> KFed:
        return self._set(featuresCol=value)

    def setPredictionCol(self, value: str) -> KFed:
        return self._set(predictionCol=value)

    def setLocalPredictionCol(self, value: str) -> KFed:
        return self._set(localPredictionCol=value)

    def setDistanceCol(self, value: str) -> KFed:
        return self._set(distanceCol=value)

    def setMarginCol(self, value: str) -> KFed:
        return self._set(marginCol=value)

    # END GENERATED setters

    def _fit(self, dataset: DataFrame) -> "KFedModel":
        reference = None if self._reference is None else self._reference._stored
        clustering = fit(dataset, self._config(), initial=reference.centers if reference and self._warm_start else None)
        if reference is not None:
            matching = match_clusters(clustering.clusters(), reference.clusters(), int(reference.cluster_ids.max()) + 1)
            clustering = clustering.with_ids(matching.ids)
        local = clustering.local.table.append_column(
            "cluster_id", pa.array(clustering.cluster_ids[clustering.server.assignment], type=pa.int32())
        )
        model = KFedModel()._with_state(StoredModel.of(clustering.server.centers, clustering.cluster_ids, local, "fit"))
        model._k_sweep = clustering.k_sweep
        return self._copyValues(model)._set(k=len(clustering.server.centers))

    def write(self) -> MLWriter:
        return _DataFrameWriter(self)

    @classmethod
    def read(cls) -> MLReader["KFed"]:
        return DefaultParamsReader(cls)


@dataclass(frozen=True)
class KFedSummary:
    """Training summary, from the local statistics (no pass over the rows)."""

    trainingCost: float  # k-means cost of the induced labels: local SSE plus n * |local - global|^2 (NaN: privacy)
    clusterSizes: list[int]
    numDevices: int
    numLocalCenters: int


class KFedModel(Model, _KFedParams, MLReadable["KFedModel"], MLWritable):
    """Global centers plus every training device's local centers and their global clusters."""

    def __init__(self):
        super().__init__()
        self._stored: StoredModel | None = None
        self._k_sweep: KSweep | None = None

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

        stored = stored_model(OutputTables(SparkSession.active(), OutputConfig(path=output_path)), run_id)
        model = cls()._with_state(stored)
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
        return self._stored.sweep(k_values(kRange[0], kRange[1], step), AlgorithmParams.of(self._config()))

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
        return KFedSummary(cost, sizes.tolist(), len(np.unique(local.devices)), len(local.counts))

    def _transform(self, dataset: DataFrame) -> DataFrame:
        """Label rows: a plan, no Spark job, so it works on a streaming DataFrame too. A row of a device
        the model has not seen takes the nearest global center and a null local prediction (its label
        depends on the row alone); `kfed-spark assign` clusters such devices locally instead."""
        cfg = self._config()
        labelled = labelled_plan(
            dataset, cfg, self._stored.label_model(cfg.label_mode, label_unseen=True), self._stored.dim
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
