"""Side-by-side benchmark in one process and one SparkSession, on the same input.

Contenders: the k-FED Spark job end to end (read -> Delta labels), Spark MLlib KMeans (fit,
transform, the same Delta write), k-FED without Spark (pyarrow read, numpy kernels, pyarrow
write: the floor), and scikit-learn KMeans on all rows (centralized reference). Ratios are the
headline: the machine is shared and its absolute speed varies.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kfed_spark.config import build_config
from kfed_spark.core.local_centers import feature_matrix
from kfed_spark.core.metrics import adjusted_rand_index, cost_of_labels
from kfed_spark.core.reference import federated_kmeans
from kfed_spark.params import DEFAULTS, AlgorithmParams
from kfed_spark.store.tables import stats_columns

log = logging.getLogger("kfed_spark")


@dataclass
class Entry:
    name: str
    seconds: float
    cost: float
    ari: float
    stages: dict[str, float] = field(default_factory=dict)
    rows_per_second: float = 0.0
    cost_ratio: float = 0.0
    lower_bound: bool = False  # stopped at its time limit: seconds is a lower bound, no cost or ARI


@dataclass
class Report:
    rows: int
    devices: int
    dim: int
    k: int
    k_per_device: int
    planted_cost: float
    entries: list[Entry]
    ratios: dict[str, float]
    peak_memory_mb: dict[str, float]
    command: str
    spark_passes: dict[str, float] = field(default_factory=dict)
    repeats: int = 1

    def markdown(self) -> str:
        lines = [
            f"{self.rows:,} rows, {self.devices:,} devices, d = {self.dim}, k = {self.k}, "
            f"{self.k_per_device} clusters per device; fastest of {self.repeats} runs each; `{self.command}`",
            "",
            "| method | seconds | rows/s | k-means cost | cost / planted | ARI |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for e in self.entries:
            lines.append(
                f"| {e.name} | > {e.seconds:.0f} (stopped) | < {e.rows_per_second:,.0f} | | | |"
                if e.lower_bound
                else f"| {e.name} | {e.seconds:.2f} | {e.rows_per_second:,.0f} | {e.cost:.6g} | "
                f"{e.cost_ratio:.4f} | {e.ari:.4f} |"
            )
        if self.spark_passes:
            lines += ["", "| Spark pass over the same input, no clustering | seconds |", "| --- | ---: |"]
            lines += [f"| {name} | {value:.2f} |" for name, value in self.spark_passes.items()]
        lines += ["", "| ratio | value |", "| --- | ---: |"]
        lines += [f"| {name} | {value:.2f} |" for name, value in self.ratios.items()]
        for e in self.entries:
            if e.stages:
                lines += ["", f"{e.name}, stages (s): " + ", ".join(f"{s} {v:.2f}" for s, v in e.stages.items())]
        if self.peak_memory_mb:
            lines += [
                "",
                "peak resident memory (MB): " + ", ".join(f"{p} {v:,.0f}" for p, v in self.peak_memory_mb.items()),
            ]
        return "\n".join(lines) + "\n"


BENCH_SPARK_CONF = {
    "spark.ui.showConsoleProgress": "false",
    "spark.log.level": "WARN",
}
"""The Spark settings of every benchmark process, the job's included, beyond what every local session
gets (kfed_spark.spark.session.local_sizes): those of conf/local.yaml."""


def bench_session(app_name: str, driver_memory: str, master: str = "local[2]"):
    """A local SparkSession with Delta and BENCH_SPARK_CONF."""
    from kfed_spark.config import SparkConfig
    from kfed_spark.spark.session import build_session

    conf = {"spark.driver.memory": driver_memory, **BENCH_SPARK_CONF}
    return build_session(SparkConfig(master=master, app_name=app_name, conf=conf))


def planted(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(features, device ids, truth) of a generated input, and the planted clusters' cost."""
    table = pq.read_table(path, columns=["device_id", "features", "true_cluster"])
    x = feature_matrix(table.column("features"))
    truth = table.column("true_cluster").to_numpy()
    return x, table.column("device_id").to_numpy(), truth, cost_of_labels(x, truth)


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


ONE_RESTART = "k-FED on Spark, end to end, one local restart (before local_restarts)"


def run_kfed_spark(
    spark,
    data: str,
    out: Path,
    k: int,
    k_per_device: int,
    seed: int,
    run_id: str,
    local_restarts: int = DEFAULTS.local_restarts,
) -> tuple[Entry, np.ndarray]:
    from pyspark.sql import functions as F

    from kfed_spark.runs.job import run
    from kfed_spark.store.output import OutputTables

    cfg = build_config(
        {
            "input": {"path": data},
            "output": {"path": str(out / "kfed")},
            "k": k,
            "k_per_device": k_per_device,
            "seed": seed,
            "local_restarts": local_restarts,
            "run_id": run_id,
            "report": False,  # timed here: read -> labels in Delta; the report is extra work
        }
    )
    result, seconds = timed(lambda: run(spark, cfg))
    labels = (
        OutputTables(spark, cfg.output)
        .published("labels")
        .filter(F.col("run_id") == run_id)
        .select("row_id", "cluster_id")
        .toPandas()
        .sort_values("row_id")
        .cluster_id.to_numpy()
    )
    name = "k-FED on Spark, end to end" if local_restarts == DEFAULTS.local_restarts else ONE_RESTART
    return Entry(name, seconds, result.cost, 0.0, result.timings), labels


SHAPE_OF_KFED = "the two passes k-FED makes, together"


SHUFFLE_PASS = "read -> shuffle by device -> Python function (returns nothing)"
UDF_PASS = "read -> Python UDF over (device, features), one int per row -> Delta write"


def shuffle_by_device(rows) -> None:
    """k-FED's first pass with no local step in it: the rows shuffled by device through a Python function
    that returns nothing."""
    from pyspark.sql import functions as F

    partitions = int(rows.sparkSession.conf.get("spark.sql.shuffle.partitions"))
    (
        rows.repartition(partitions, "device_id")
        .sortWithinPartitions("device_id")
        .mapInArrow(lambda batches: (b.slice(0, 0) for b in batches), rows.schema)
        .agg(F.count("*"))
        .collect()
    )


def with_one_int_per_row(rows):
    """k-FED's labelling pass with no labelling in it: an Arrow UDF over (device, features) that gives
    every row a cluster_id of 0."""
    from pyspark.sql.functions import arrow_udf

    @arrow_udf("int")
    def one_int_per_row(devices: pa.Array, features: pa.Array) -> pa.Array:
        return pa.array(np.zeros(len(devices), dtype=np.int32))

    return rows.withColumn("cluster_id", one_int_per_row("device_id", "features"))


def labels_like_stats() -> dict[str, str]:
    """The table property that keeps Delta statistics on the columns the labels table keeps them on."""
    from kfed_spark.store.delta import STATS_COLUMNS_PROPERTY

    return {STATS_COLUMNS_PROPERTY: ",".join(stats_columns("device_id")["labels"][:1] + ["cluster_id"])}


def time_spark_passes(spark, data: str, out: Path) -> dict[str, float]:
    """Seconds of Spark passes that do no clustering: what any job of k-FED's shape pays on Spark.

    k-FED reads the input twice: once shuffled by device through a Python function (the local
    step; only a few rows come back), once through a Python UDF over the device and the features
    into a Delta write (labels; the Delta table keeps statistics on the columns the labels table
    keeps them on, tables.stats_columns).
    """
    rows = spark.read.parquet(data)
    labelled = with_one_int_per_row(rows)
    new_delta_table(spark, out / "pass_copy", rows.schema)
    new_delta_table(spark, out / "pass_python", labelled.schema, labels_like_stats())
    passes = {}
    _, passes["read -> Delta write"] = timed(
        lambda: rows.write.format("delta").mode("append").save(str(out / "pass_copy"))
    )
    _, passes[SHUFFLE_PASS] = timed(lambda: shuffle_by_device(rows))
    _, passes[UDF_PASS] = timed(lambda: labelled.write.format("delta").mode("append").save(str(out / "pass_python")))
    passes[SHAPE_OF_KFED] = passes[SHUFFLE_PASS] + passes[UDF_PASS]
    return passes


def new_delta_table(spark, path: Path, schema, properties: dict[str, str] | None = None) -> None:
    """An empty Delta table at path (replacing what was there), with the given table properties."""
    shutil.rmtree(path, ignore_errors=True)
    columns = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in schema.fields)
    settings = ", ".join(f"'{key}' = '{value}'" for key, value in (properties or {}).items())
    properties_clause = f" TBLPROPERTIES ({settings})" if settings else ""
    spark.sql(f"CREATE TABLE delta.`{path}` ({columns}) USING delta{properties_clause}")


def run_mllib(
    spark, data: str, out: Path, k: int, seed: int, limit: float | None = None
) -> tuple[Entry, Entry, np.ndarray | None]:
    """MLlib KMeans fit, then transform and the same Delta write; with a limit (seconds), the fit's
    Spark jobs are cancelled once it has run that long, and both entries report the limit as a lower
    bound (no cost, no labels)."""
    import threading

    from pyspark.ml.clustering import KMeans
    from pyspark.ml.functions import array_to_vector

    start = time.perf_counter()
    rows = spark.read.parquet(data).withColumn("features_vector", array_to_vector("features"))
    estimator = KMeans(k=k, seed=seed, featuresCol="features_vector", predictionCol="cluster_id")
    fitted: dict = {}

    def fit() -> None:
        spark.sparkContext.setJobGroup(MLLIB_JOB_GROUP, "the benchmark's MLlib fit", interruptOnCancel=True)
        try:
            fitted["model"] = estimator.fit(rows)
        except Exception as exc:  # cancelled at the limit
            fitted["error"] = exc

    worker = threading.Thread(target=fit)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        spark.sparkContext.cancelJobGroup(MLLIB_JOB_GROUP)
        worker.join()
        log.warning("MLlib's fit passed the %.0f s limit and was stopped: its times are lower bounds", limit)
        capped = [Entry(name, float(limit), float("nan"), float("nan"), lower_bound=True) for name in MLLIB_ENTRIES]
        return capped[0], capped[1], None
    if "error" in fitted:
        raise fitted["error"]
    model, fit_seconds = fitted["model"], time.perf_counter() - start
    (
        model.transform(rows)
        .drop("features_vector")
        .write.format("delta")
        .mode("overwrite")
        .save(str(out / "mllib_labels"))
    )
    total = time.perf_counter() - start
    labels = (
        spark.read.format("delta")
        .load(str(out / "mllib_labels"))
        .select("row_id", "cluster_id")
        .toPandas()
        .sort_values("row_id")
        .cluster_id.to_numpy()
    )
    cost = model.summary.trainingCost
    return Entry(MLLIB_ENTRIES[0], fit_seconds, cost, 0.0), Entry(MLLIB_ENTRIES[1], total, cost, 0.0), labels


MLLIB_JOB_GROUP = "kfed-bench-mllib"

MLLIB_ENTRIES = ("Spark MLlib KMeans, fit only", "Spark MLlib KMeans, fit + transform + Delta write")


def run_floor(data: str, out: Path, k: int, k_per_device: int, seed: int) -> tuple[Entry, np.ndarray]:
    """k-FED in this process without Spark: pyarrow read, numpy kernels, pyarrow write."""
    stages = {}
    start = time.perf_counter()
    table = pq.read_table(data)
    x = feature_matrix(table.column("features"))
    stages["read"] = time.perf_counter() - start
    result, stages["cluster"] = timed(
        lambda: federated_kmeans(
            x, table.column("device_id").to_numpy(), AlgorithmParams(k=k, k_per_device=k_per_device, seed=seed)
        )
    )
    _, stages["write"] = timed(
        lambda: pq.write_table(
            table.append_column("local_cluster_id", pa.array(result.local_labels, type=pa.int32())).append_column(
                "cluster_id", pa.array(result.labels, type=pa.int32())
            ),
            out / "floor_labels.parquet",
        )
    )
    seconds = time.perf_counter() - start
    cost = float(np.sum((x - result.server.centers[result.labels]) ** 2))
    return Entry(
        "k-FED without Spark (floor): pyarrow + numpy", seconds, cost, 0.0, {s: round(v, 3) for s, v in stages.items()}
    ), result.labels[np.argsort(table.column("row_id").to_numpy())]


def run_sklearn(x: np.ndarray, k: int, seed: int) -> tuple[Entry, np.ndarray]:
    from sklearn.cluster import KMeans

    model, seconds = timed(lambda: KMeans(n_clusters=k, random_state=seed, n_init=1).fit(x))
    return Entry("scikit-learn KMeans, all rows in one process", seconds, float(model.inertia_), 0.0), model.labels_


def peak_memory_mb() -> dict[str, float]:
    """Peak resident memory (VmHWM) of this Python driver, the Spark JVM and the largest Python worker."""
    return memory_roles({int(p.name) for p in Path("/proc").glob("[0-9]*")}, os.getpid())


def memory_roles(pids: set[int], driver_pid: int) -> dict[str, float]:
    """The largest peak resident memory (MB) among pids of each role (process_role), under memory_label:
    the Python driver, the Spark JVM and the largest Python worker; other processes are left out."""
    peaks: dict[str, float] = {}
    for pid in pids:
        role, megabytes = process_role(pid, driver_pid), peak_resident_mb(pid)
        if role is not None and megabytes is not None:
            peaks[memory_label(role)] = max(peaks.get(memory_label(role), 0.0), megabytes)
    return peaks


def peak_resident_mb(pid: int) -> float | None:
    """A process's peak resident memory so far (VmHWM, MB), None once it is gone or for a kernel thread."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = [line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")]
    return int(found[0]) / 1024 if found else None


def memory_label(role: str) -> str:
    """A role's name in the peak-memory figures: a role's largest process, so the workers' is the largest one."""
    return "largest python worker" if role == PYTHON_WORKER else role


PYTHON_DRIVER, SPARK_JVM, PYTHON_WORKER = (
    "python driver",
    "spark JVM (driver and executors in local mode)",
    "python workers",
)


def process_role(pid: int, driver_pid: int) -> str | None:
    """What a process of a run's tree is: the Python driver (driver_pid), the Spark JVM (driver and executors
    in local mode), a Python worker, or None for anything else (a shell, or a process already gone)."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    if pid == driver_pid:
        return PYTHON_DRIVER
    if name == "java" and "pyspark" in cmdline:
        return SPARK_JVM
    if "pyspark.daemon" in cmdline or "pyspark.worker" in cmdline:
        return PYTHON_WORKER
    return None


def warm_up(spark, data: str, out: Path, k: int, k_per_device: int, seed: int) -> None:
    """Run both Spark contenders once on a slice, untimed, so that neither pays the JVM's warm-up
    (class loading, JIT, Python workers) inside its timing; and bring the input into the file cache.
    k-FED's warm-up run creates the output tables, so the timed runs add a run to existing tables,
    as a scheduled job does."""
    from pyspark.sql import functions as F

    rows = spark.read.parquet(data)
    rows.select(F.sum(F.size("features"))).collect()
    enough = max(50, -(-2 * k // k_per_device))  # devices whose local centers can cover k twice
    devices = [r.device_id for r in rows.select("device_id").distinct().orderBy("device_id").limit(enough).collect()]
    rows.filter(F.col("device_id").isin(devices)).write.mode("overwrite").parquet(str(out / "warm_up_input"))
    run_kfed_spark(spark, str(out / "warm_up_input"), out, k, k_per_device, seed, "warm-up")
    run_mllib(spark, str(out / "warm_up_input"), out / "warm_up", k, seed)


def fastest(repeats: int, run, seconds_of=lambda result: result[0].seconds):
    """The result of the fastest of `repeats` runs (noise on a shared machine only ever adds time)."""
    return min((run() for _ in range(repeats)), key=seconds_of)


def benchmark(
    spark,
    data: str,
    out: Path,
    k: int,
    k_per_device: int,
    seed: int,
    command: str,
    with_sklearn: bool = True,
    repeats: int = 3,
    mllib_limit: float | None = None,
) -> Report:
    out.mkdir(parents=True, exist_ok=True)
    x, devices, truth, planted_cost = planted(data)
    shutil.rmtree(out / "kfed", ignore_errors=True)
    warm_up(spark, data, out, k, k_per_device, seed)
    kfed, kfed_labels = min(
        (run_kfed_spark(spark, data, out, k, k_per_device, seed, f"bench-{attempt}") for attempt in range(repeats)),
        key=lambda result: result[0].seconds,
    )
    one_restart, one_restart_labels = min(
        (
            run_kfed_spark(spark, data, out, k, k_per_device, seed, f"bench-one-restart-{attempt}", local_restarts=1)
            for attempt in range(repeats)
        ),
        key=lambda result: result[0].seconds,
    )
    runs_of_passes = [time_spark_passes(spark, data, out) for _ in range(repeats)]
    spark_passes = {name: min(passes[name] for passes in runs_of_passes) for name in runs_of_passes[0]}
    floor, floor_labels = fastest(repeats, lambda: run_floor(data, out, k, k_per_device, seed))
    fit, mllib_total, mllib_labels = fastest(
        repeats, lambda: run_mllib(spark, data, out, k, seed, mllib_limit), lambda result: result[1].seconds
    )
    measured = [
        (kfed, kfed_labels),
        (one_restart, one_restart_labels),
        (floor, floor_labels),
        (fit, mllib_labels),
        (mllib_total, mllib_labels),
    ]
    if with_sklearn:
        sklearn, sklearn_labels = fastest(repeats, lambda: run_sklearn(x, k, seed))
        measured.append((sklearn, sklearn_labels))
    for entry, found in measured:
        if found is not None:
            entry.ari = adjusted_rand_index(truth, found)
        entry.cost_ratio = entry.cost / planted_cost
        entry.rows_per_second = len(x) / entry.seconds
    at_least = " (lower bound: MLlib stopped at its limit)" if fit.lower_bound else ""
    ratios = {
        f"MLlib end-to-end time / k-FED end-to-end time (target >= 8 at 2M rows, >= 3 at 500k){at_least}": (
            mllib_total.seconds / kfed.seconds
        ),
        f"MLlib fit time / k-FED end-to-end time{at_least}": fit.seconds / kfed.seconds,
        f"k-FED end-to-end time / Spark passes without clustering ({SHAPE_OF_KFED}) (target <= 1.2)": kfed.seconds
        / spark_passes[SHAPE_OF_KFED],
        "k-FED end-to-end time / no-Spark floor time (target <= 2.5)": kfed.seconds / floor.seconds,
        f"Spark passes without clustering ({SHAPE_OF_KFED}) / no-Spark floor time": spark_passes[SHAPE_OF_KFED]
        / floor.seconds,
        "k-FED cost / MLlib cost (target <= 1)": kfed.cost / fit.cost,
        f"k-FED local step, {DEFAULTS.local_restarts} local restarts / one (target <= 1.5)": kfed.stages["local_step"]
        / one_restart.stages["local_step"],
    }
    if with_sklearn:
        ratios["k-FED cost / scikit-learn cost (target <= 1)"] = kfed.cost / sklearn.cost
    return Report(
        len(x),
        len(np.unique(devices)),
        x.shape[1],
        k,
        k_per_device,
        planted_cost,
        [entry for entry, _ in measured],
        ratios,
        peak_memory_mb(),
        command,
        spark_passes,
        repeats,
    )
