"""`kfed-spark bench-server`: the server step (alg. 2) alone, timed on many generated local centers, in the
driver's numpy or distributed in Spark.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from kfed_spark.bench.benchmark import peak_memory_mb, timed
from kfed_spark.core.server_step import server_step
from kfed_spark.params import AlgorithmParams


def benchmark_server(devices: int, per_device: int, k: int, dim: int, seed: int) -> dict[str, float]:
    """Time alg. 2 alone on devices x per_device local centers drawn around k means (no Spark), with
    each seeding rule and refinement, and the ratio of each k-means++ time to the farthest-point one."""
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, 4.0, size=(k, dim))
    centers = means[rng.integers(0, k, size=devices * per_device)] + 0.1 * rng.standard_normal(
        (devices * per_device, dim)
    )
    counts = rng.integers(50, 150, size=devices * per_device)
    device_ids = np.repeat(np.arange(devices), per_device)
    local_ids = np.tile(np.arange(per_device), devices)
    timings = {"local_centers": float(devices * per_device), "k": float(k)}
    for refine in ("none", "lloyd"):
        seconds = {}
        for seeding in ("farthest", "kmeanspp"):
            params = AlgorithmParams(k=k, seeding=seeding, server_refine=refine)
            result, seconds[seeding] = timed(lambda: server_step(centers, counts, device_ids, local_ids, params))
            timings[f"seconds, seeding={seeding} server_refine={refine}"] = round(seconds[seeding], 3)
            timings[f"refine rounds, seeding={seeding} server_refine={refine}"] = float(result.refine_iterations)
            assigned = centers - result.centers[result.assignment]
            timings[f"weighted cost, seeding={seeding} server_refine={refine}"] = float(
                np.einsum("ij,ij->i", assigned, assigned) @ counts
            )
        timings[f"kmeanspp / farthest seconds, server_refine={refine}"] = round(
            seconds["kmeanspp"] / seconds["farthest"], 3
        )  # from the unrounded times: small runs take < 1 ms
    return timings


def generated_local_centers(spark, path: str, devices: int, per_device: int, k: int, dim: int, seed: int) -> None:
    """Write devices x per_device local centers drawn around k means as Parquet, generated in the
    executors (the driver never holds them), with the mean each one was drawn around (true_cluster)."""
    from kfed_spark.bench.synthetic import MEAN_SCALE
    from kfed_spark.core.linalg import device_rng
    from kfed_spark.core.local_centers import features_array

    means = np.random.default_rng([seed, 0x5E]).normal(0.0, MEAN_SCALE, size=(k, dim))

    def draw(batches):
        for batch in batches:
            ids = batch.column(0).to_numpy()
            rng = device_rng(seed, int(ids[0]))
            truth = rng.integers(0, k, size=len(ids))
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array(ids // per_device),
                    pa.array((ids % per_device).astype(np.int32)),
                    features_array(means[truth] + 0.1 * rng.standard_normal((len(ids), dim))),
                    pa.array(rng.integers(50, 150, size=len(ids))),
                    pa.array(truth.astype(np.int32)),
                ],
                names=["device_id", "local_cluster_id", "center", "n_points", "true_cluster"],
            )

    schema = "device_id long, local_cluster_id int, center array<double>, n_points long, true_cluster int"
    partitions = max(2, devices * per_device // 250_000)
    spark.range(0, devices * per_device, numPartitions=partitions).mapInArrow(draw, schema).write.mode(
        "overwrite"
    ).parquet(path)


def benchmark_distributed_server(
    spark, out: Path, devices: int, per_device: int, k: int, dim: int, seed: int
) -> dict[str, float]:
    """Time the distributed server step (kfed_spark.spark.distributed) on generated local centers read from
    Parquet: the merge, then every local center's cluster written back as Parquet; with the ARI of
    those clusters against the means the centers were drawn around, and the peak memory."""
    from kfed_spark.core.metrics import ari_of
    from kfed_spark.spark.distributed import global_centers, with_clusters

    data = str(out / "local_centers")
    generated_local_centers(spark, data, devices, per_device, k, dim, seed)
    params = AlgorithmParams(k=k, seed=seed)
    local = spark.read.parquet(data)
    merged, merge_seconds = timed(lambda: global_centers(local, dim, params))
    _, assign_seconds = timed(
        lambda: with_clusters(local, merged.centers).write.mode("overwrite").parquet(str(out / "clustered"))
    )
    cells = spark.read.parquet(str(out / "clustered")).groupBy("true_cluster", "cluster_id").count().toPandas()
    table = cells.pivot(index="true_cluster", columns="cluster_id", values="count").fillna(0).to_numpy()
    return {
        "local_centers": float(devices * per_device),
        "k": float(k),
        "representatives merged on the driver": float(len(merged.assignment)),
        "seconds, representatives and merge": round(merge_seconds, 3),
        "seconds, every local center's cluster (Parquet write)": round(assign_seconds, 3),
        "seconds, distributed server step": round(merge_seconds + assign_seconds, 3),
        "ARI against the generating means": round(ari_of(table), 6),
        **{f"peak memory MB, {role}": round(mb) for role, mb in peak_memory_mb().items()},
    }
