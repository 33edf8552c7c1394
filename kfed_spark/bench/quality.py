"""Clustering quality side by side: k-FED's combinations of settings, Spark MLlib KMeans and
scikit-learn KMeans on the real datasets, one synthetic mixture partitioned three ways and a
mixture with close means and uneven devices.

k-FED runs as federated_kmeans (the same kernels as the Spark job, which a test holds equal to
it row for row); MLlib runs on Spark. Quality only: for speed see benchmark.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kfed_spark.bench.datasets import DATASETS, load
from kfed_spark.bench.pages import cell
from kfed_spark.bench.synthetic import MEAN_SCALE, close_means_mixture, mixture, uneven_mixture
from kfed_spark.core.k_sweep import k_values, sweep
from kfed_spark.core.linalg import device_rng
from kfed_spark.core.local_centers import LocalCenters, feature_matrix, features_array
from kfed_spark.core.metrics import ari_of, contingency, cost_of_labels, nmi_of
from kfed_spark.core.reference import federated_kmeans, local_clusterings
from kfed_spark.params import DEFAULTS, LABEL_MODES, SEEDING_RULES, AlgorithmParams

SYNTHETIC = dict(k=16, k_per_device=4, devices=100, points_per_device=100, dim=16)
OUTLIER_DEVICES = 10
OUTLIER_ROWS = 3
"""mixture-outliers adds this many devices of this many rows each, far from every cluster."""

SYNTHETIC_PROBLEMS = ("mixture", "mixture-iid", "mixture-outliers", "close-means", "mixture-uneven")
PROBLEMS = (*DATASETS, *SYNTHETIC_PROBLEMS)

K_PER_DEVICE = {
    "femnist": 10,
    "mnist": 2,
    "shakespeare": 1,
    "mixture": 4,
    "mixture-iid": 16,
    "mixture-outliers": 4,
    "close-means": 7,
    "mixture-uneven": 4,
}
"""The fixed k_z each dataset is clustered with: rotated MNIST devices hold 2 digits by
construction, a Shakespeare role speaks in one play, a FEMNIST writer writes most classes
(10 is a budget, not a truth), the IID partition puts every cluster on every device."""

RESTARTS_TRIED = (1, 3, 5)
FILTERS_TRIED = (0.0, DEFAULTS.robust_min_size)
COMBINATIONS = list(itertools.product(RESTARTS_TRIED, FILTERS_TRIED, SEEDING_RULES, LABEL_MODES))
"""(local_restarts, robust_min_size, seeding, label_mode): every k-FED combination the table reports,
all with server_refine=lloyd."""


SHARE_ALL = "k-FED defaults, min_center_points=1 (every local center shared, as in the paper)"

WARM_START = "k-FED defaults, warm-started from the centers of a run with another seed (identity.warm_start)"


DEFAULT_COMBINATION = (DEFAULTS.local_restarts, DEFAULTS.robust_min_size, DEFAULTS.seeding, DEFAULTS.label_mode)


def combination_name(restarts: int, min_size: float, seeding: str, label_mode: str) -> str:
    default = (restarts, min_size, seeding, label_mode) == DEFAULT_COMBINATION
    return f"k-FED restarts={restarts} filter={min_size:g} seeding={seeding} labels={label_mode}" + (
        " (default)" if default else ""
    )


@dataclass
class QualityRow:
    dataset: str
    method: str
    k: int
    k_per_device: str
    ari: float
    nmi: float
    cost: float
    cost_ratio: float  # cost / scikit-learn's cost on the same rows
    seconds: float


@dataclass
class SupportRow:
    """What the default min_center_points holds back on a dataset (the default settings' local step), against
    sharing every local center: the quality cost of minimum support."""

    dataset: str
    rows: int
    rows_held_back: int
    devices: int
    devices_held_back: int
    centers: int  # every local center, min_center_points 1
    centers_held_back: int
    ari: float  # the default settings'
    ari_sharing_all: float
    cost_ratio: float
    cost_ratio_sharing_all: float


EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
"""The privacy budgets the privacy table tries, each with privacy_delta and privacy_rounds at their defaults."""


@dataclass
class PrivacyRow:
    """k-FED with the private local step (privacy_epsilon) at one epsilon, the box being the features' range."""

    dataset: str
    epsilon: float
    bounds: tuple[float, float]
    local_centers: int
    ari_nearest: float  # label_mode nearest
    ari_induced: float
    cost_ratio_nearest: float  # against scikit-learn's cost, as in the main table
    ari_without_privacy: float  # the default settings with label_mode nearest, no privacy


@dataclass
class KChoiceRow:
    """What the k sweep (kfed_spark.core.k_sweep) over a dataset's local centers recommends, against its true k."""

    dataset: str
    true_k: int
    swept: str
    recommended_k: int
    bic_k: int
    silhouette_k: int
    noise_ratio_k: int | None
    seconds: float


def k_choice(problem: Problem, local, params: AlgorithmParams) -> KChoiceRow:
    """The sweep of k = 2..max(2 true k, 20) (below the number of local centers) over the run's local centers."""
    top = min(max(2 * problem.k, 20), len(local.counts) - 1)
    start = time.perf_counter()
    result = sweep(local.centers, local.counts, local.sse, local.devices, local.ids, k_values(2, top), params)
    return KChoiceRow(
        problem.name,
        problem.k,
        f"2..{top}",
        result.recommended_k,
        result.choices["bic"],
        result.choices["silhouette"],
        result.choices["noise_ratio"],
        round(time.perf_counter() - start, 2),
    )


@dataclass(frozen=True)
class Problem:
    name: str
    x: np.ndarray
    devices: np.ndarray
    truth: np.ndarray
    k: int


def problems(names: list[str], data_dir: str | None, max_devices: int | None, seed: int) -> list[Problem]:
    found = []
    for name in names:
        if name in ("close-means", "mixture-uneven"):
            table = close_means_mixture(seed) if name == "close-means" else uneven_mixture(seed)
            devices = table.column("device_id").to_numpy()
            k = len(np.unique(table.column("true_cluster").to_numpy()))
        elif name in SYNTHETIC_PROBLEMS:
            table = mixture(**SYNTHETIC, seed=seed)
            devices = table.column("device_id").to_numpy()
            if name == "mixture-iid":  # the same rows dealt to devices at random
                devices = devices[device_rng(seed, "iid").permutation(len(devices))]
            if name == "mixture-outliers":
                table, devices = with_outlier_devices(table, devices, seed)
            k = SYNTHETIC["k"]
        else:
            table = load(name, data_dir, max_devices, seed)
            devices = table.column("device_id").to_numpy(zero_copy_only=False)
            k = DATASETS[name].k
        x = feature_matrix(table.column("features"))
        truth = table.column("true_cluster").to_numpy()
        found.append(Problem(name, x, devices, truth, min(k, len(np.unique(truth)))))
    return found


def with_outlier_devices(table: pa.Table, devices: np.ndarray, seed: int) -> tuple[pa.Table, np.ndarray]:
    """The mixture plus OUTLIER_DEVICES devices of OUTLIER_ROWS rows, each device at its own far
    point (10 times the spread of the cluster means); each outlier device is its own true class."""
    rng = device_rng(seed, "outliers")
    dim, k = SYNTHETIC["dim"], SYNTHETIC["k"]
    spots = rng.normal(0.0, 10 * MEAN_SCALE, size=(OUTLIER_DEVICES, dim))
    x = np.repeat(spots, OUTLIER_ROWS, axis=0) + rng.standard_normal((OUTLIER_DEVICES * OUTLIER_ROWS, dim))
    extra = pa.table(
        {
            "features": features_array(x),
            "true_cluster": pa.array(np.repeat(np.arange(k, k + OUTLIER_DEVICES), OUTLIER_ROWS), pa.int32()),
        }
    )
    joined = pa.concat_tables([table.select(["features", "true_cluster"]), extra])
    new_devices = np.repeat(np.arange(OUTLIER_DEVICES), OUTLIER_ROWS) + devices.max() + 1
    return joined, np.concatenate([devices, new_devices])


def privacy_rows(problem: Problem, seed: int, k_z: int, sklearn_cost: float, without: float) -> list[PrivacyRow]:
    """The quality cost of privacy: ARI and cost per epsilon in EPSILONS, beside `without`, the ARI of the same
    settings without privacy. The box is the features' range, as if it were known without looking at the rows
    (pixels in [0, 1] are); the noise key is fixed by the seed so that the table repeats (a run draws a
    secret one)."""
    bounds = (float(problem.x.min()), float(problem.x.max()))
    plain_params = AlgorithmParams(k=problem.k, k_per_device=k_z, seed=seed, label_mode="nearest")
    found = []
    for epsilon in EPSILONS:
        params = dataclasses.replace(plain_params, privacy_epsilon=epsilon, privacy_bounds=bounds)
        local = local_clusterings(problem.x, problem.devices, params, noise_key=seed)
        nearest = federated_kmeans(problem.x, problem.devices, params, local).labels
        induced_params = dataclasses.replace(params, label_mode="induced")
        induced = federated_kmeans(problem.x, problem.devices, induced_params, local).labels
        found.append(
            PrivacyRow(
                problem.name,
                epsilon,
                bounds,
                len(local.counts),
                ari_of(contingency(problem.truth, nearest)),
                ari_of(contingency(problem.truth, induced)),
                cost_of_labels(problem.x, nearest) / sklearn_cost if sklearn_cost else float("nan"),
                without,
            )
        )
    return found


Add = Callable[[str, str, np.ndarray, float], None]
"""Records one method's labels of a problem: (method, k_per_device as text, labels, seconds)."""


def evaluate(
    spark, problem: Problem, seed: int, folder: Path
) -> tuple[list[QualityRow], KChoiceRow, SupportRow, list[PrivacyRow]]:
    rows: list[QualityRow] = []

    def add(method: str, k_per_device: str, labels: np.ndarray, seconds: float) -> None:
        cells = contingency(problem.truth, labels)
        cost = cost_of_labels(problem.x, labels)
        rows.append(
            QualityRow(
                problem.name,
                method,
                problem.k,
                k_per_device,
                ari_of(cells),
                nmi_of(cells),
                cost,
                0.0,
                round(seconds, 2),
            )
        )

    k_z = min(K_PER_DEVICE.get(problem.name, 2), problem.k)
    choice, default_local = combinations(problem, k_z, seed, add)
    every_local = defaults_and_variants(problem, k_z, seed, add)
    add("Spark MLlib KMeans (k-means||)", "-", *mllib_labels(spark, problem, seed, folder))
    add("scikit-learn KMeans (k-means++)", "-", *sklearn_labels(problem, seed))
    reference = rows[-1].cost
    for row in rows:
        row.cost_ratio = row.cost / reference if reference else float("nan")
    by_method = {row.method: row for row in rows}
    support = support_row(problem, by_method, default_local, every_local)
    nearest = by_method[combination_name(*DEFAULT_COMBINATION[:3], "nearest")]  # the defaults, nearest labels
    return rows, choice, support, privacy_rows(problem, seed, k_z, reference, nearest.ari)


def combinations(problem: Problem, k_z: int, seed: int, add: Add) -> tuple[KChoiceRow, LocalCenters]:
    """Every combination of COMBINATIONS; the k sweep's choice and the default restarts' local step."""
    for restarts in RESTARTS_TRIED:  # the local step depends on the restarts only: run it once for each
        start = time.perf_counter()
        local_params = AlgorithmParams(k=problem.k, k_per_device=k_z, seed=seed, local_restarts=restarts)
        local = local_clusterings(problem.x, problem.devices, local_params)
        local_seconds = time.perf_counter() - start
        if restarts == DEFAULTS.local_restarts:
            choice = k_choice(problem, local, dataclasses.replace(local_params, k=2))
            default_local = local
        for _, min_size, seeding, label_mode in (c for c in COMBINATIONS if c[0] == restarts):
            start = time.perf_counter()
            params = AlgorithmParams(
                k=problem.k,
                k_per_device=k_z,
                seed=seed,
                local_restarts=restarts,
                robust_min_size=min_size,
                seeding=seeding,
                label_mode=label_mode,
            )
            result = federated_kmeans(problem.x, problem.devices, params, local)
            add(
                combination_name(restarts, min_size, seeding, label_mode),
                str(k_z),
                result.labels,
                local_seconds + time.perf_counter() - start,
            )
    return choice, default_local


def defaults_and_variants(problem: Problem, k_z: int, seed: int, add: Add) -> LocalCenters:
    """The defaults with k_per_device auto, a warm start from the day before, and every local center shared;
    the local step of the last."""
    start = time.perf_counter()
    result = federated_kmeans(problem.x, problem.devices, AlgorithmParams(k=problem.k, k_per_device="auto", seed=seed))
    add("k-FED default settings", "auto", result.labels, time.perf_counter() - start)
    params = AlgorithmParams(k=problem.k, k_per_device=k_z, seed=seed)
    yesterday = federated_kmeans(
        problem.x, problem.devices, AlgorithmParams(k=problem.k, k_per_device=k_z, seed=seed + 1)
    )
    start = time.perf_counter()
    warm = federated_kmeans(problem.x, problem.devices, params, initial=yesterday.server.centers)
    add(WARM_START, str(k_z), warm.labels, time.perf_counter() - start)
    start = time.perf_counter()
    every_params = dataclasses.replace(params, min_center_points=1)
    every_local = local_clusterings(problem.x, problem.devices, every_params)
    every = federated_kmeans(problem.x, problem.devices, every_params, every_local)
    add(SHARE_ALL, str(k_z), every.labels, time.perf_counter() - start)
    return every_local


def support_row(
    problem: Problem, by_method: dict[str, QualityRow], default_local: LocalCenters, every_local: LocalCenters
) -> SupportRow:
    """What minimum support held back with the defaults, against sharing every local center."""
    default, sharing_all = by_method[combination_name(*DEFAULT_COMBINATION)], by_method[SHARE_ALL]
    n_devices = len(np.unique(problem.devices))
    return SupportRow(
        problem.name,
        len(problem.x),
        len(problem.x) - int(default_local.counts.sum()),
        n_devices,
        n_devices - len(np.unique(default_local.devices)),
        len(every_local.counts),
        len(every_local.counts) - len(default_local.counts),
        default.ari,
        sharing_all.ari,
        default.cost_ratio,
        sharing_all.cost_ratio,
    )


def mllib_labels(spark, problem: Problem, seed: int, folder: Path) -> tuple[np.ndarray, float]:
    """MLlib's labels, read through a Parquet file (a DataFrame made from driver memory would
    ship the rows inside its tasks)."""
    from pyspark.ml.clustering import KMeans
    from pyspark.ml.functions import array_to_vector

    path = folder / f"{problem.name}.parquet"
    pq.write_table(pa.table({"row": np.arange(len(problem.x)), "features": features_array(problem.x)}), path)
    frame = spark.read.parquet(str(path)).withColumn("vector", array_to_vector("features")).cache()
    start = time.perf_counter()
    model = KMeans(k=problem.k, seed=seed, featuresCol="vector").fit(frame)
    labels = model.transform(frame).select("row", "prediction").toPandas().sort_values("row").prediction.to_numpy()
    seconds = time.perf_counter() - start
    frame.unpersist()
    return labels, seconds


def sklearn_labels(problem: Problem, seed: int) -> tuple[np.ndarray, float]:
    from sklearn.cluster import KMeans

    start = time.perf_counter()
    labels = KMeans(n_clusters=problem.k, random_state=seed, n_init=1).fit(problem.x).labels_
    return labels, time.perf_counter() - start


def combination_summary(rows: list[QualityRow]) -> tuple[list[str], str]:
    """ARI of every k-FED combination on every dataset (markdown lines), and the combination whose
    largest shortfall from the best combination on any dataset is smallest."""
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    names = [combination_name(*c) for c in COMBINATIONS]
    ari = {(r.dataset, r.method): r.ari for r in rows if r.method in names}
    best = {d: max(ari[d, n] for n in names) for d in datasets}
    shortfall = {n: max(best[d] - ari[d, n] for d in datasets) for n in names}
    lines = [
        "| combination | " + " | ".join(datasets) + " | largest shortfall from the best |",
        "| --- | " + " | ".join("---:" for _ in datasets) + " | ---: |",
    ]
    lines += [
        f"| {n} | " + " | ".join(f"{ari[d, n]:.3f}" for d in datasets) + f" | {shortfall[n]:.3f} |" for n in names
    ]
    return lines, min(names, key=lambda n: shortfall[n])


def markdown(
    rows: list[QualityRow],
    command: str,
    choices: list[KChoiceRow] = (),
    supports: list[SupportRow] = (),
    privacy: list[PrivacyRow] = (),
) -> str:
    summary, most_even = combination_summary(rows)
    lines = [
        f"`{command}`: ARI of every k-FED combination (local restarts, outlier filter robust_min_size, seeding "
        "rule, label mode; server_refine=lloyd); the shortfall is the largest gap to the best combination on "
        "any dataset",
        "",
        *summary,
        "",
        f"Smallest largest shortfall: {most_even}",
        "",
        "All rows; cost ratio = k-means cost / scikit-learn's on the same rows (lower is better)",
        "",
        "| dataset | method | k | k_z | ARI | NMI | cost ratio | seconds |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r.dataset} | {cell(r.method)} | {r.k} | {r.k_per_device} | {r.ari:.3f} | {r.nmi:.3f} | {r.cost_ratio:.3f} "
        f"| {r.seconds:.1f} |"
        for r in rows
    ]
    if choices:
        lines += [
            "",
            "Choosing k: the k sweep over the default settings' local centers (kfed-spark choose-k) against the true k",
            "",
            "| dataset | true k | swept | recommended k | BIC's k | silhouette's k | noise ratio's k | seconds |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {c.dataset} | {c.true_k} | {c.swept} | {c.recommended_k} | {c.bic_k} | {c.silhouette_k} | "
            f"{'-' if c.noise_ratio_k is None else c.noise_ratio_k} | {c.seconds:.1f} |"
            for c in choices
        ]
    if supports:
        lines += [
            "",
            f"Minimum support: what min_center_points = {DEFAULTS.min_center_points} holds back with the default "
            "settings, and their ARI and cost ratio against sharing every local center (min_center_points = 1)",
            "",
            "| dataset | rows held back | devices sharing nothing | local centers held back | ARI | ARI sharing all "
            "| cost ratio | cost ratio sharing all |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {s.dataset} | {s.rows_held_back:,} of {s.rows:,} | {s.devices_held_back:,} of {s.devices:,} | "
            f"{s.centers_held_back:,} of {s.centers:,} | {s.ari:.3f} | {s.ari_sharing_all:.3f} | {s.cost_ratio:.3f} | "
            f"{s.cost_ratio_sharing_all:.3f} |"
            for s in supports
        ]
    if privacy:
        lines += [
            "",
            f"Differential privacy: k-FED's default settings with the private local step (privacy_delta = "
            f"{DEFAULTS.privacy_delta:g}, privacy_rounds = {DEFAULTS.privacy_rounds}, privacy_bounds = the features' "
            "range), per epsilon; ARI with label_mode nearest and induced, cost ratio with nearest",
            "",
            "| dataset | bounds | epsilon | local centers shared | ARI nearest | ARI induced | cost ratio nearest "
            "| ARI without privacy (nearest) |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {p.dataset} | [{p.bounds[0]:.3g}, {p.bounds[1]:.3g}] | {p.epsilon:g} | {p.local_centers:,} | "
            f"{p.ari_nearest:.3f} | {p.ari_induced:.3f} | {p.cost_ratio_nearest:.3f} | {p.ari_without_privacy:.3f} |"
            for p in privacy
        ]
    return "\n".join(lines) + "\n"


def bench_quality(
    spark, names: list[str], out: Path, data_dir: str | None, max_devices: int | None, seed: int, command: str
) -> str:
    """Evaluate every problem; write quality.json, k_choice.json, support.json and privacy.json into out and
    return the tables as markdown."""
    out.mkdir(parents=True, exist_ok=True)
    rows, choices, supports, privacy = [], [], [], []
    for problem in problems(names, data_dir, max_devices, seed):
        found, choice, support, private = evaluate(spark, problem, seed, out)
        rows += found
        choices.append(choice)
        supports.append(support)
        privacy += private
    (out / "quality.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    (out / "k_choice.json").write_text(json.dumps([asdict(c) for c in choices], indent=2))
    (out / "support.json").write_text(json.dumps([asdict(s) for s in supports], indent=2))
    (out / "privacy.json").write_text(json.dumps([asdict(p) for p in privacy], indent=2))
    return markdown(rows, command, choices, supports, privacy)
