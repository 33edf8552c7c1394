"""The benchmark's Spark contenders other than the job, each run as a process of its own (as spark-submit
would run it): `python -m kfed_spark.bench.contenders mllib|passes|setup --data PARQUET --out DIR`.

Each prints one JSON object on stdout: the seconds of its stages (session start included), and for
MLlib the fit's cost. kfed_spark.bench.processes starts them and times the whole process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kfed_spark.bench.benchmark import (
    SHUFFLE_PASS,
    UDF_PASS,
    bench_session,
    labels_like_stats,
    new_delta_table,
    shuffle_by_device,
    with_one_int_per_row,
)

PASSES_TABLE = "passes_labels"
"""The Delta table (under --out) the bare passes' second pass appends to; setup creates it."""
MLLIB_LABELS = "mllib_labels"
"""The Delta table (under --out) MLlib's labelled rows are written to, replaced at every run."""


class Stages:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 3)
        self._last = now


def mllib(spark, data: str, out: Path, k: int, seed: int, stages: Stages) -> dict:
    """MLlib KMeans (k-means||, default maxIter) fit on the Parquet input, then transform and a Delta write
    of every row with its cluster; the input is not cached by hand, as a user's script would not."""
    from pyspark.ml.clustering import KMeans
    from pyspark.ml.functions import array_to_vector

    rows = spark.read.parquet(data).withColumn("features_vector", array_to_vector("features"))
    model = KMeans(k=k, seed=seed, featuresCol="features_vector", predictionCol="cluster_id").fit(rows)
    stages.done("read and fit")
    (
        model.transform(rows)
        .drop("features_vector")
        .write.format("delta")
        .mode("overwrite")
        .save(str(out / MLLIB_LABELS))
    )
    stages.done("transform and Delta write")
    return {"cost": model.summary.trainingCost}


def passes(spark, data: str, out: Path, stages: Stages) -> dict:
    """Spark's passes of k-FED's shape with no clustering in them (those the warm benchmark times): read ->
    shuffle by device -> a Python function that returns nothing; read -> an Arrow UDF over (device,
    features), one int per row -> Delta append (to a table with statistics where the labels keep them)."""
    rows = spark.read.parquet(data)
    shuffle_by_device(rows)
    stages.done(SHUFFLE_PASS)
    with_one_int_per_row(rows).write.format("delta").mode("append").save(str(out / PASSES_TABLE))
    stages.done(UDF_PASS)
    return {}


def setup(spark, data: str, out: Path, kfed_config: str, stages: Stages) -> dict:
    """What exists before a scheduled run, made in one process, untimed: the bare passes' Delta table, empty,
    and k-FED's output location, from a run (id bench-setup) of kfed_config in this session."""
    from kfed_spark.config import load_config
    from kfed_spark.runs.job import run

    schema = with_one_int_per_row(spark.read.parquet(data)).schema
    new_delta_table(spark, out / PASSES_TABLE, schema, labels_like_stats())
    stages.done("create table")
    run(spark, load_config(kfed_config, ["run_id=bench-setup"]))
    stages.done("k-FED setup run")
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kfed_spark.bench.contenders")
    parser.add_argument("contender", choices=["mllib", "passes", "setup"])
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="2g")
    parser.add_argument("--kfed-config", help="setup: the config of k-FED's setup run")
    args = parser.parse_args(argv)
    stages = Stages()
    spark = bench_session(f"kfed-bench-{args.contender}", args.driver_memory, args.master)
    stages.done("session")
    out = Path(args.out)
    if args.contender == "mllib":
        figures = mllib(spark, args.data, out, args.k, args.seed, stages)
    elif args.contender == "passes":
        figures = passes(spark, args.data, out, stages)
    else:
        figures = setup(spark, args.data, out, args.kfed_config, stages)
    print(json.dumps({"stages": stages.seconds, **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
