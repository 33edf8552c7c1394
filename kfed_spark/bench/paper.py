"""The k-FED paper's experiments (Dennis, Li and Smith, ICML 2021, section 4), as `kfed-spark bench-paper`.

- Partitions (the paper's fig. 2): k-FED's k-means cost relative to a centralized k-means on the same rows,
  for a range of k' (each device's k), on the devices as they are (structured) and on an IID shuffle of the
  same rows over devices of the same sizes.
- Rounds (fig. 3): k-FED's cost after its one round of communication (with its default labels and with
  nearest-center labels) against Spark MLlib's distributed Lloyd, from random and from k-means||
  initialization, after 1 to 20 rounds, each round a pass over the rows.
- Synthetic (section 4.1): k Gaussian clusters, each device holding k' = sqrt(k) of them with m0 rows of
  each; accuracy after the best one-to-one matching of clusters to classes, over several seeds, k-FED
  against a centralized k-means++.

k-FED runs as reference.federated_kmeans (the Spark job's kernels, which a test holds equal to the job).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kfed_spark.bench.pages import cell
from kfed_spark.bench.quality import K_PER_DEVICE, Problem, problems
from kfed_spark.bench.synthetic import MEAN_SCALE, median_nearest_mean_distance
from kfed_spark.core.linalg import device_rng
from kfed_spark.core.local_centers import features_array
from kfed_spark.core.metrics import ari_of, clusters_in_effect, contingency, cost_of_labels, matched_accuracy_of
from kfed_spark.core.reference import federated_kmeans, local_clusterings
from kfed_spark.params import LABEL_MODES, AlgorithmParams

K_PRIMES = {"femnist": (2, 4, 8, 16, 32), "shakespeare": (1, 2, 4, 8, 16), "mixture": (1, 2, 4, 8, 16)}
"""The k' each dataset's partition study sweeps (FEMNIST writers hold 3 to 58 classes, a Shakespeare role
speaks in one play, a mixture device holds 4 of 16 clusters)."""

PAPER_DATASETS = ("femnist", "shakespeare")
ROUNDS = (1, 2, 3, 5, 10, 20)
"""MLlib's numbers of rounds (maxIter) the rounds study compares with."""

SYNTHETIC_KS = (16, 25, 36, 64, 100)
SYNTHETIC_SEEDS = 10
ROWS_PER_HELD_CLUSTER = 5
"""m0: the rows a device draws from each cluster it holds."""
DEVICES_PER_CLUSTER = 10
"""The synthetic setting has DEVICES_PER_CLUSTER * k / k' devices: each cluster on about that many."""
SYNTHETIC_DIM = 16
SYNTHETIC_MEAN_SCALES = (MEAN_SCALE, 1.5)
"""The spread of the cluster means (unit noise): well separated (bench's mixtures), then close."""
BEST_OF = 10
CENTRALIZED_RESTARTS = 3
"""k-means++ restarts of the centralized reference (scikit-learn), the best kept."""


@dataclass
class PartitionRow:
    dataset: str
    k: int
    k_per_device: int
    partition: str  # "structured" or "iid"
    classes_per_device: float  # the classes one device's rows spread over, in effect
    cost_ratio: float  # k-FED's k-means cost / the centralized k-means cost on the same rows
    ari: float
    seconds: float


@dataclass
class RoundsRow:
    dataset: str
    method: str
    rounds: int  # rounds of communication: k-FED 1, MLlib the Lloyd iterations it ran
    cost_ratio: float
    seconds: float


@dataclass
class SyntheticRow:
    k: int
    k_per_device: int
    devices: int
    rows: int
    mean_scale: float  # cluster means drawn from N(0, mean_scale^2 I)
    separation: float  # median distance from a mean to its nearest other mean, in noise std (mean over seeds)
    method: str
    accuracy_mean: float
    accuracy_std: float
    accuracy_min: float
    seeds: int


def centralized(x: np.ndarray, k: int, seed: int, restarts: int = CENTRALIZED_RESTARTS) -> np.ndarray:
    """Labels of scikit-learn's k-means++ with Lloyd on all the rows in one place (the best of restarts)."""
    from sklearn.cluster import KMeans

    return KMeans(n_clusters=k, n_init=restarts, random_state=seed).fit(x).labels_


def iid_devices(devices: np.ndarray, seed: int) -> np.ndarray:
    """The same device sizes, the rows dealt to them at random."""
    return devices[device_rng(seed, "iid").permutation(len(devices))]


def partition_study(problem: Problem, k_primes: tuple[int, ...], seed: int, reference: float) -> list[PartitionRow]:
    """k-FED at each k' on the structured and the IID partition; reference: the centralized cost."""
    rows = []
    for partition, devices in (("structured", problem.devices), ("iid", iid_devices(problem.devices, seed))):
        classes, _, _ = clusters_in_effect(devices, problem.truth)
        for k_prime in k_primes:
            start = time.perf_counter()
            params = AlgorithmParams(k=problem.k, k_per_device=min(k_prime, problem.k), seed=seed)
            labels = federated_kmeans(problem.x, devices, params).labels
            rows.append(
                PartitionRow(
                    problem.name,
                    problem.k,
                    k_prime,
                    partition,
                    round(classes, 2),
                    cost_of_labels(problem.x, labels) / reference,
                    ari_of(contingency(problem.truth, labels)),
                    round(time.perf_counter() - start, 2),
                )
            )
    return rows


def rounds_study(
    spark, problem: Problem, k_prime: int, seed: int, reference: float, rounds: tuple[int, ...], folder: Path
) -> list[RoundsRow]:
    """k-FED's one round against MLlib KMeans (random and k-means|| initialization, tolerance 0) after each
    number of rounds (maxIter); reference: the centralized cost. MLlib reads the rows from a Parquet file
    (a DataFrame made from driver memory would ship the rows inside its tasks), removed afterwards."""
    from pyspark.ml.clustering import KMeans
    from pyspark.ml.functions import array_to_vector

    params = AlgorithmParams(k=problem.k, k_per_device=min(k_prime, problem.k), seed=seed)
    local = local_clusterings(problem.x, problem.devices, params)
    rows = []
    for label_mode in LABEL_MODES:  # the same one round; nearest-center labels take a pass without communication
        start = time.perf_counter()
        fed = federated_kmeans(problem.x, problem.devices, dataclasses.replace(params, label_mode=label_mode), local)
        cost = cost_of_labels(problem.x, fed.labels) / reference
        seconds = round(time.perf_counter() - start, 2)
        rows.append(RoundsRow(problem.name, f"k-FED ({label_mode} labels)", 1, cost, seconds))

    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        path = Path(scratch) / "rows.parquet"
        pq.write_table(pa.table({"row": np.arange(len(problem.x)), "features": features_array(problem.x)}), path)
        frame = spark.read.parquet(str(path)).withColumn("vector", array_to_vector("features")).cache()
        frame.count()
        for init_mode, max_iter in itertools.product(("random", "k-means||"), rounds):
            start = time.perf_counter()
            kmeans = KMeans(k=problem.k, seed=seed, featuresCol="vector", initMode=init_mode, maxIter=max_iter, tol=0.0)
            model = kmeans.fit(frame)
            seconds = round(time.perf_counter() - start, 2)
            predicted = model.transform(frame).select("row", "prediction").toPandas().sort_values("row")
            cost = cost_of_labels(problem.x, predicted.prediction.to_numpy()) / reference
            method = f"Spark MLlib KMeans ({init_mode} initialization)"
            rows.append(RoundsRow(problem.name, method, model.summary.numIter, cost, seconds))
        frame.unpersist()
    return rows


def section_41_mixture(
    k: int, seed: int, mean_scale: float, rows_per_cluster: int = ROWS_PER_HELD_CLUSTER, dim: int = SYNTHETIC_DIM
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(features, devices, truth, separation): k clusters with means drawn from N(0, mean_scale^2 I) and unit
    noise, DEVICES_PER_CLUSTER * k / k' devices, each holding k' = floor(sqrt(k)) clusters drawn evenly and
    rows_per_cluster rows of each. separation: the median distance from a mean to its nearest other mean, in
    noise standard deviations."""
    k_prime = math.isqrt(k)
    devices = DEVICES_PER_CLUSTER * k // k_prime
    means = np.random.default_rng([seed, 0x41]).normal(0.0, mean_scale, size=(k, dim))
    truths = []
    for device in range(devices):
        held = device_rng(seed, ("section-4.1", device)).choice(k, size=k_prime, replace=False)
        truths.append(np.repeat(held, rows_per_cluster))
    truth = np.concatenate(truths)
    noise = np.random.default_rng([seed, 0x41, 1]).standard_normal((len(truth), dim))
    owners = np.repeat(np.arange(devices), k_prime * rows_per_cluster)
    return means[truth] + noise, owners, truth, median_nearest_mean_distance(means)


SYNTHETIC_METHODS = ("k-FED", "centralized k-means++, 1 restart", f"centralized k-means++, best of {BEST_OF}")
"""k-FED against scikit-learn's k-means++ with Lloyd on all the rows at once."""


def synthetic_study(ks: tuple[int, ...], seeds: int) -> list[SyntheticRow]:
    rows = []
    for mean_scale in SYNTHETIC_MEAN_SCALES:
        for k in ks:
            accuracy: dict[str, list[float]] = {method: [] for method in SYNTHETIC_METHODS}
            separations = []
            for seed in range(seeds):
                x, devices, truth, separation = section_41_mixture(k, seed, mean_scale)
                separations.append(separation)
                present = len(np.unique(truth))
                params = AlgorithmParams(k=present, k_per_device=math.isqrt(k), seed=seed)
                found = (
                    federated_kmeans(x, devices, params).labels,
                    centralized(x, present, seed, restarts=1),
                    centralized(x, present, seed, restarts=BEST_OF),
                )
                for method, labels in zip(SYNTHETIC_METHODS, found):
                    accuracy[method].append(matched_accuracy_of(contingency(truth, labels)))
            for method, values in accuracy.items():
                rows.append(
                    SyntheticRow(
                        k,
                        math.isqrt(k),
                        DEVICES_PER_CLUSTER * k // math.isqrt(k),
                        len(truth),
                        mean_scale,
                        round(float(np.mean(separations)), 2),
                        method,
                        float(np.mean(values)),
                        float(np.std(values)),
                        float(np.min(values)),
                        seeds,
                    )
                )
    return rows


def figures(partitions: list[PartitionRow], rounds: list[RoundsRow], synthetic: list[SyntheticRow]) -> dict:
    """PNG bytes of the three figures, by file name."""
    from matplotlib.figure import Figure

    from kfed_spark.runs.report import png

    images = {}
    datasets = list(dict.fromkeys(r.dataset for r in partitions))
    fig = Figure(figsize=(4.2 * max(len(datasets), 1), 3.4))
    for i, dataset in enumerate(datasets):
        ax = fig.add_subplot(1, len(datasets), i + 1)
        for partition, style in (("structured", "o-"), ("iid", "s--")):
            points = [r for r in partitions if r.dataset == dataset and r.partition == partition]
            ax.plot([r.k_per_device for r in points], [r.cost_ratio for r in points], style, label=partition)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dataset} (k = {points[0].k})")
        ax.set_xlabel("k' (clusters per device)")
        ax.set_ylabel("k-FED cost / centralized cost")
        ax.legend()
    images["partitions.png"] = png(fig)

    datasets = list(dict.fromkeys(r.dataset for r in rounds))
    fig = Figure(figsize=(4.2 * max(len(datasets), 1), 3.4))
    for i, dataset in enumerate(datasets):
        ax = fig.add_subplot(1, len(datasets), i + 1)
        for method in dict.fromkeys(r.method for r in rounds if r.method.startswith("Spark")):
            points = [r for r in rounds if r.dataset == dataset and r.method == method]
            ax.plot([r.rounds for r in points], [r.cost_ratio for r in points], "o-", label=method)
        one_shot = [r for r in rounds if r.dataset == dataset and r.method.startswith("k-FED")]
        for row, color in zip(one_shot, ("tab:red", "tab:purple")):
            ax.axhline(row.cost_ratio, color=color, linestyle="--", label=f"{row.method}, one round")
        ax.set_title(dataset)
        ax.set_xlabel("rounds over the rows")
        ax.set_ylabel("cost / centralized cost")
        ax.legend(fontsize="small")
    images["rounds.png"] = png(fig)

    scales = list(dict.fromkeys(r.mean_scale for r in synthetic))
    fig = Figure(figsize=(4.6 * max(len(scales), 1), 3.4))
    for i, scale in enumerate(scales):
        ax = fig.add_subplot(1, len(scales), i + 1)
        for method in SYNTHETIC_METHODS:
            points = [r for r in synthetic if r.method == method and r.mean_scale == scale]
            ax.errorbar(
                [r.k for r in points],
                [r.accuracy_mean for r in points],
                yerr=[r.accuracy_std for r in points],
                marker="o",
                capsize=3,
                label=method,
            )
        ax.set_title(f"means from N(0, {scale:g}^2 I), unit noise")
        ax.set_xlabel("k (k' = sqrt(k))")
        ax.set_ylabel("matched accuracy")
        ax.legend(fontsize="small")
    images["synthetic.png"] = png(fig)
    return images


def markdown(
    partitions: list[PartitionRow], rounds: list[RoundsRow], synthetic: list[SyntheticRow], command: str, seconds: float
) -> str:
    lines = [
        f"`{command}` ({seconds / 60:.1f} min)",
        "",
        "Partitions (fig. 2): k-FED's k-means cost over a centralized k-means++'s "
        f"(scikit-learn, best of {CENTRALIZED_RESTARTS}) on the same rows; classes per device = the classes one "
        "device's rows spread over, in effect",
        "",
        "| dataset | k | k' | partition | classes per device | cost ratio | ARI | seconds |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r.dataset} | {r.k} | {r.k_per_device} | {r.partition} | {r.classes_per_device:.1f} | "
        f"{r.cost_ratio:.3f} | {r.ari:.3f} | {r.seconds:.1f} |"
        for r in partitions
    ]
    lines += [
        "",
        "Rounds (fig. 3): cost over the centralized cost after each number of rounds over the rows "
        "(k-FED: its one round, with bench-quality's k' of the dataset)",
        "",
        "| dataset | method | rounds | cost ratio | seconds |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {r.dataset} | {cell(r.method)} | {r.rounds} | {r.cost_ratio:.3f} | {r.seconds:.1f} |" for r in rounds]
    if synthetic:
        lines += [
            "",
            f"Synthetic (section 4.1): k clusters in {SYNTHETIC_DIM} dimensions, unit noise, each device holding "
            f"k' = sqrt(k) of them with m0 = {ROWS_PER_HELD_CLUSTER} rows of each, about {DEVICES_PER_CLUSTER} "
            f"devices per cluster; separation = the median distance from a mean to its nearest other mean, in noise "
            f"standard deviations; matched accuracy (Hungarian) over {synthetic[0].seeds} seeds",
            "",
            "| k | k' | devices | rows | separation | method | accuracy (mean) | std | min |",
            "| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {r.k} | {r.k_per_device} | {r.devices} | {r.rows} | {r.separation:.1f} | {cell(r.method)} | "
            f"{r.accuracy_mean:.3f} | {r.accuracy_std:.3f} | {r.accuracy_min:.3f} |"
            for r in synthetic
        ]
    lines += [
        "",
        "![k-FED's cost over the centralized cost by k', structured and IID](partitions.png)",
        "![cost by rounds over the rows: MLlib against k-FED's one round](rounds.png)",
    ]
    if synthetic:
        lines.append("![matched accuracy by k at k' = sqrt(k)](synthetic.png)")
    return "\n".join(lines) + "\n"


def progress(message: str) -> None:
    print(f"bench-paper: {message}", file=sys.stderr, flush=True)


def bench_paper(
    spark,
    names: list[str],
    out: Path,
    data_dir: str | None,
    max_devices: int | None,
    seed: int,
    synthetic_ks: tuple[int, ...],
    seeds: int,
    rounds: tuple[int, ...],
    command: str,
) -> tuple[str, dict[str, bytes]]:
    """Run the three studies, write paper.json and the figures into out; return the markdown and the figures."""
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    partitions, compared = [], []
    for problem in problems(names, data_dir, max_devices, seed):
        progress(f"{problem.name}: {len(problem.x):,} rows; the centralized k-means, then the partitions")
        reference = cost_of_labels(problem.x, centralized(problem.x, problem.k, seed))
        partitions += partition_study(problem, K_PRIMES[problem.name], seed, reference)
        progress(f"{problem.name}: the rounds (MLlib)")
        compared += rounds_study(spark, problem, K_PER_DEVICE[problem.name], seed, reference, rounds, out)
    progress(f"the synthetic setting, k = {', '.join(map(str, synthetic_ks))}, {seeds} seeds")
    synthetic = synthetic_study(synthetic_ks, seeds)
    images = figures(partitions, compared, synthetic)
    for name, data in images.items():
        (out / name).write_bytes(data)
    saved = {
        "partitions": [asdict(r) for r in partitions],
        "rounds": [asdict(r) for r in compared],
        "synthetic": [asdict(r) for r in synthetic],
    }
    (out / "paper.json").write_text(json.dumps(saved, indent=2))
    return markdown(partitions, compared, synthetic, command, time.perf_counter() - started), images
