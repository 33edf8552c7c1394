"""The run report: figures a person looks at, as report.json, a self-contained report.html and text.

Everything here works on numpy arrays and dicts already on the driver; the job (kfed_spark.runs.job) gathers them.
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kfed_spark.core.k_sweep import KSweep
from kfed_spark.core.linalg import nearest_center
from kfed_spark.core.metrics import ari_of, clusters_in_effect, matched_accuracy_of, nmi_of, silhouette
from kfed_spark.runs.describe import cluster_line

SAMPLE_ROWS = 2000
"""Rows (a seeded sample that the labelling pass gathers, with the report or without) that the silhouette
and the heterogeneity check work from: the silhouette needs all their pairwise distances."""

SAME_DEVICE_PAIRS_NEEDED = 100
"""Pairs of sampled rows of the same device below which the heterogeneity check says nothing."""

IID_SHARE = 2 / 3
"""A partition looks IID when the rows of one device spread over more than this share of the clusters
that all the rows spread over (in effect): an IID shuffle spreads over all of them (a share near 1), a
mixture whose devices hold half of the clusters each over half."""

PLOTTED_LOCAL_CENTERS = 5000
"""At most this many local centers are drawn in the projection (an even subsample beyond)."""

REPORTED_FEATURES = 10
"""Features per cluster in report.json's clusters (the most distinctive; cluster_profiles holds them all)."""

LABELLED_CLUSTERS = 20
"""Above this many cluster ids, the sizes-over-runs figure's lines go without a legend."""

HEATMAP_FEATURES = 20
"""Features in the heatmap of standardized differences: those that stand furthest from the population in
some cluster."""


@dataclass(frozen=True)
class RunFacts:
    """What a finished run knows, in numpy arrays: the inputs of its report."""

    summary: dict  # counts, settings, cost, timings: the run's row of the runs table
    local_devices: np.ndarray  # (m,) device of each local center
    local_centers: np.ndarray  # (m, d)
    local_counts: np.ndarray  # (m,)
    assignment: np.ndarray  # (m,) global cluster of each local center
    global_centers: np.ndarray  # (k, d)
    sample_x: np.ndarray  # (s, d) sampled rows
    sample_labels: np.ndarray  # (s,) their global clusters
    sample_devices: np.ndarray  # (s,) their devices
    truth_cells: np.ndarray | None  # (classes, clusters) contingency table, if a truth column is set
    changes: list[dict] | None = None  # the run's cluster_changes rows, without their device lists
    clusters: list[dict] | None = None  # kfed_spark.runs.describe.cluster_summaries, if it wrote profiles
    sizes_over_runs: tuple[pd.DataFrame, list[str]] | None = None  # (run_id, cluster_id, n_points), runs in order


def build(facts: RunFacts) -> dict:
    """The report as plain data (what report.json holds)."""
    k = len(facts.global_centers)
    sizes = np.bincount(facts.assignment, weights=facts.local_counts, minlength=k).astype(np.int64)
    _, centers_per_device = np.unique(facts.local_devices, return_counts=True)
    clusters_per_device = _distinct_per_device(facts.local_devices, facts.assignment)
    report = {
        **facts.summary,
        "cluster_sizes": sizes.tolist(),
        "k_z": _distribution(centers_per_device),
        "clusters_per_device": _distribution(clusters_per_device),
        "silhouette": {
            "value": silhouette(facts.sample_x, facts.sample_labels) if len(facts.sample_x) > 1 else None,
            "sample_rows": int(len(facts.sample_x)),
        },
        "heterogeneity": heterogeneity(facts.sample_x, facts.sample_devices, facts.global_centers),
        "truth": None,
        "since_reference": None if facts.changes is None else _since_reference(facts.changes),
        "clusters": None
        if facts.clusters is None
        else [{**c, "features": c["features"][:REPORTED_FEATURES]} for c in facts.clusters],
    }
    if facts.truth_cells is not None:
        cells = facts.truth_cells
        report["truth"] = {
            "column": facts.summary.get("truth_col"),
            "classes": int(cells.shape[0]),
            "ari": ari_of(cells),
            "nmi": nmi_of(cells),
            "accuracy": matched_accuracy_of(cells),
        }
    return report


def heterogeneity(sample_x: np.ndarray, sample_devices: np.ndarray, centers: np.ndarray) -> dict:
    """Whether the devices hold few of the clusters each, as k-FED needs (the paper's k' against sqrt(k)),
    or look alike, as an IID shuffle of the rows would: from the report's sampled rows, how many global
    clusters the rows of one device spread over in effect, against how many all the rows do.

    A row counts in the cluster of its nearest global center, not in its label: a label follows the
    device's local clusters, at most k_per_device of them, whatever the device holds. The partition looks
    IID when a device spreads over more than IID_SHARE of the clusters in effect; with too few same-device
    pairs in the sample (SAME_DEVICE_PAIRS_NEEDED), nothing is concluded."""
    nearest = nearest_center(sample_x, centers)[0] if len(sample_x) else np.empty(0, np.int64)
    per_device, overall, pairs = clusters_in_effect(sample_devices, nearest)
    return {
        "clusters_per_device_in_effect": per_device,
        "clusters_in_effect": overall,
        "sqrt_k": float(np.sqrt(len(centers))),
        "same_device_pairs": pairs,
        "looks_iid": bool(pairs >= SAME_DEVICE_PAIRS_NEEDED and per_device > IID_SHARE * overall),
    }


def spread_columns(spread: dict) -> dict[str, float | None]:
    """The runs row's figures of the heterogeneity check: null where too few same-device pairs were sampled
    to conclude anything."""
    known = spread["same_device_pairs"] >= SAME_DEVICE_PAIRS_NEEDED
    return {name: spread[name] if known else None for name in ("clusters_per_device_in_effect", "clusters_in_effect")}


def iid_warning(spread: dict) -> str | None:
    """The warning a run logs (and its report shows) when its partition looks IID."""
    if not spread["looks_iid"]:
        return None
    per_device, overall = spread["clusters_per_device_in_effect"], spread["clusters_in_effect"]
    return (
        f"the devices look alike (IID): the rows of one device spread over {per_device:.1f} of the "
        f"{overall:.1f} clusters in effect, where k-FED needs each device to hold few (about "
        f"sqrt(k) = {spread['sqrt_k']:.1f} or fewer): a centralized k-means such as Spark MLlib's "
        "suits this data better"
    )


def _since_reference(changes: list[dict]) -> dict:
    """How the run's clusters relate to its reference run's (the cluster_changes rows)."""
    by_status = {
        status: sorted(c["cluster_id"] for c in changes if c["status"] == status)
        for status in ("kept", "new", "retired")
    }
    kept = [c for c in changes if c["status"] == "kept"]
    moved = max(kept, key=lambda c: c["relative_shift"], default=None)
    return {
        "reference_run_id": changes[0]["reference_run_id"] if changes else None,
        **{status: ids for status, ids in by_status.items()},
        "largest_shift": None
        if moved is None
        else {key: moved[key] for key in ("cluster_id", "center_shift", "relative_shift")},
        "clusters": changes,
    }


def _distinct_per_device(devices: np.ndarray, clusters: np.ndarray) -> np.ndarray:
    _, slot = np.unique(devices, return_inverse=True)
    pairs = np.unique(np.stack([slot, clusters]), axis=1)
    return np.bincount(pairs[0])


def _distribution(values: np.ndarray) -> dict:
    keys, counts = np.unique(values, return_counts=True)
    return {
        "devices_by_value": {str(int(key)): int(count) for key, count in zip(keys, counts)},
        "mean": float(np.mean(values)),
        "min": int(np.min(values)),
        "max": int(np.max(values)),
    }


def figures(report: dict, facts: RunFacts) -> dict[str, bytes]:
    """PNG images: with profiles first the heatmap of standardized differences, then cluster sizes, 2-D
    projection of the centers, k_z histogram, clusters per device, and the changes since the reference run.

    Figure objects, not pyplot: no global state, so a report can be drawn in a thread beside other work."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    images = {} if not facts.clusters else {"standardized_differences": _profile_heatmap(facts.clusters)}
    k = len(facts.global_centers)
    colors = colormaps["turbo"](np.linspace(0, 1, max(k, 2)))

    fig = Figure(figsize=(8, 3.2))
    ax = fig.subplots()
    ax.bar(np.arange(k), report["cluster_sizes"], color=colors[:k], width=0.9)
    ax.set(xlabel="global cluster", ylabel="rows", title="Cluster sizes")
    images["cluster_sizes"] = png(fig)

    fig = Figure(figsize=(6.5, 5.5))
    ax = fig.subplots()
    local_2d, global_2d = _projection(facts.local_centers, facts.local_counts, facts.global_centers)
    shown = np.linspace(0, len(local_2d) - 1, min(len(local_2d), PLOTTED_LOCAL_CENTERS)).astype(int)
    ax.scatter(
        local_2d[shown, 0], local_2d[shown, 1], s=8, alpha=0.5, c=colors[facts.assignment[shown]], label="local centers"
    )
    ax.scatter(
        global_2d[:, 0],
        global_2d[:, 1],
        s=90,
        marker="X",
        c=colors[:k],
        edgecolors="black",
        linewidths=0.8,
        label="global centers",
    )
    ax.set(
        xlabel="principal direction 1",
        ylabel="principal direction 2",
        title="Local and global centers (2-D projection), coloured by global cluster",
    )
    ax.legend(loc="best", fontsize=8)
    images["projection"] = png(fig)

    for name, key, label in (
        ("k_z", "k_z", "local centers on the device (k_z)"),
        ("clusters_per_device", "clusters_per_device", "distinct global clusters on the device"),
    ):
        values = report[key]["devices_by_value"]
        positions = [int(v) for v in values]
        fig = Figure(figsize=(6, 3.2))
        ax = fig.subplots()
        bars = ax.bar(positions, list(values.values()), color="#3b6ea8", width=0.8)
        ax.bar_label(bars, fontsize=8)  # a handful of devices next to thousands is still readable
        ax.set(
            xlabel=label, ylabel="devices", title=f"Devices by {label}", xlim=(min(positions) - 1, max(positions) + 1)
        )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        images[name] = png(fig)
    since = report.get("since_reference")
    if since and since["reference_run_id"] is not None:
        images["since_reference"] = _changes_figure(since)
    if facts.sizes_over_runs is not None:
        images["sizes_over_runs"] = sizes_over_runs_figure(*facts.sizes_over_runs)
    return images


def sizes_over_runs_figure(sizes: pd.DataFrame, run_ids: list[str]) -> bytes:
    """Rows per cluster id (sizes: run_id, cluster_id, n_points) over the runs in run_ids' order, a line per id."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    grid = sizes.pivot_table(index="cluster_id", columns="run_id", values="n_points", aggfunc="sum")
    grid = grid.reindex(columns=run_ids)
    fig = Figure(figsize=(max(7.0, 0.7 * len(run_ids) + 3.5), 4.5))
    ax = fig.subplots()
    colors = colormaps["turbo"](np.linspace(0, 1, max(len(grid), 2)))
    positions = np.arange(len(run_ids))
    for color, (cluster_id, counts) in zip(colors, grid.iterrows()):
        ax.plot(positions, counts.to_numpy(dtype=float), marker="o", markersize=4, color=color, label=str(cluster_id))
    ax.set_xticks(positions, run_ids, rotation=45, ha="right", fontsize=8)
    ax.set(xlabel="run (oldest first)", ylabel="rows", title="Cluster sizes over the runs, by cluster id")
    if len(grid) <= LABELLED_CLUSTERS:
        ax.legend(title="cluster", fontsize=7, ncol=2, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return png(fig)


def _profile_heatmap(clusters: list[dict]) -> bytes:
    """Clusters by features, each cell the cluster's standardized difference (its mean minus the population's,
    in the population's standard deviations); at most HEATMAP_FEATURES features, those that stand furthest
    from the population in some cluster, in their input order."""
    from matplotlib.figure import Figure

    names = [f["feature"] for f in sorted(clusters[0]["features"], key=lambda f: f["position"])]
    values = np.array(
        [
            [np.nan if f["standardized_difference"] is None else f["standardized_difference"] for f in by_position]
            for by_position in (sorted(c["features"], key=lambda f: f["position"]) for c in clusters)
        ]
    )
    furthest = np.nan_to_num(np.abs(values)).max(axis=0)
    shown = np.sort(np.argsort(-furthest, kind="stable")[:HEATMAP_FEATURES])
    names, values = [names[j] for j in shown], values[:, shown]
    limit = max(float(np.nan_to_num(np.abs(values)).max()), 1e-12)
    fig = Figure(figsize=(max(7.0, 0.6 * len(names) + 3.0), max(3.0, 0.32 * len(clusters) + 2.0)))
    ax = fig.subplots()
    image = ax.imshow(values, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    if values.size <= 400:
        for (i, j), value in np.ndenumerate(values):
            if np.isfinite(value):
                shade = "white" if abs(value) > 0.6 * limit else "black"
                ax.text(j, i, f"{value:+.1f}", ha="center", va="center", fontsize=7, color=shade)
    ax.set_xticks(np.arange(len(names)), names, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(np.arange(len(clusters)), [str(c["cluster_id"]) for c in clusters], fontsize=8)
    ax.set(xlabel="feature", ylabel="cluster", title="What sets each cluster apart (mean - population mean) / sd")
    fig.colorbar(image, ax=ax, label="standardized difference")
    return png(fig)


def _changes_figure(since: dict) -> bytes:
    """Each cluster's rows now and in the reference run, by id; kept clusters labelled by their relative shift."""
    from matplotlib.figure import Figure

    clusters = sorted(since["clusters"], key=lambda c: c["cluster_id"])
    positions = np.arange(len(clusters))
    fig = Figure(figsize=(max(6, 0.3 * len(clusters) + 2), 3.6))
    ax = fig.subplots()
    ax.bar(
        positions - 0.2,
        [c["reference_n_points"] or 0 for c in clusters],
        width=0.4,
        color="#9aa9bd",
        label=f"in {since['reference_run_id']}",
    )
    colors = {"kept": "#3b6ea8", "new": "#2e9e5b", "retired": "#c0392b"}
    ax.bar(
        positions + 0.2,
        [c["n_points"] or 0 for c in clusters],
        width=0.4,
        color=[colors[c["status"]] for c in clusters],
        label="in this run (green: new; red marks: retired)",
    )
    for position, cluster in zip(positions, clusters):
        if cluster["status"] == "retired":
            ax.annotate("retired", (position, 0), rotation=90, fontsize=7, ha="center", va="bottom", color="#c0392b")
        elif cluster["status"] == "kept":
            ax.annotate(
                f"{cluster['relative_shift']:.2f}",
                (position + 0.2, cluster["n_points"]),
                fontsize=6,
                ha="center",
                va="bottom",
                rotation=90,
            )
    ax.set_xticks(positions, [str(c["cluster_id"]) for c in clusters], fontsize=7, rotation=90)
    ax.set(
        xlabel="cluster id",
        ylabel="rows",
        title="Rows per cluster since the reference run (numbers: shift over spread)",
    )
    tallest = max([c["n_points"] or 0 for c in clusters] + [c["reference_n_points"] or 0 for c in clusters] + [1])
    ax.set_ylim(0, 1.35 * tallest)  # room for the legend above the bars
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    return png(fig)


def _projection(local: np.ndarray, counts: np.ndarray, global_centers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both center sets projected on the top two count-weighted principal directions of the local centers."""
    mean = np.average(local, axis=0, weights=counts)
    weighted = (local - mean) * np.sqrt(counts / counts.sum())[:, None]
    directions = np.linalg.svd(weighted, full_matrices=False)[2][:2]
    if len(directions) < 2:  # one feature: plot it against zero
        directions = np.vstack([directions, np.zeros_like(directions)])
    return (local - mean) @ directions.T, (global_centers - mean) @ directions.T


def png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


def render_html(report: dict, images: dict[str, bytes]) -> str:
    """One self-contained page: the summary table and the figures inline as data URIs."""
    rows = "".join(
        f"<tr><th>{html.escape(name)}</th><td>{html.escape(value)}</td></tr>" for name, value in _lines(report)
    )
    told = "".join(f"<li>{html.escape(line)}</li>" for line in _cluster_lines(report))
    clusters = f"<h2>What the clusters are</h2><ul>{told}</ul>" if told else ""
    return _page(f"k-FED run {report['run_id']}", f"<table>{rows}</table>{clusters}", images)


def _cluster_lines(report: dict) -> list[str]:
    """A line per cluster: its size, devices and most distinctive features (reports without profiles: none)."""
    return [cluster_line(summary) for summary in report.get("clusters") or []]


def _page(title: str, body: str, images: dict[str, bytes]) -> str:
    pictures = "".join(
        f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'
        f"<figcaption>{html.escape(name.replace('_', ' '))}</figcaption></figure>"
        for name, data in images.items()
    )
    title = html.escape(title)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{title}</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse}"
        "th,td{border:1px solid #ccc;padding:.3em .6em;text-align:left}figure{display:inline-block;margin:1em}"
        f"</style></head><body><h1>{title}</h1>{body}{pictures}</body></html>\n"
    )


K_SWEEP_FILES = ("k_sweep.json", "k_sweep.png", "k_sweep.html")
"""What a k sweep writes beside its run's report (choose-k, and a run with k 'auto')."""


def k_sweep_files(sweep: KSweep, run_id: str, attempt_id: str) -> dict[str, bytes]:
    """The sweep as JSON, a figure of its criteria by k, and a page with both, for the run's report folder."""
    content = {"run_id": run_id, "attempt_id": attempt_id, **sweep.as_dict()}
    image = _k_sweep_figure(sweep)
    header = ["k", "sse", "bic", "silhouette", "noise ratio", "stability"]
    bold = ' style="font-weight:bold"'
    cells = "".join(
        f"<tr{bold if f.k == sweep.recommended_k else ''}><td>{f.k}</td><td>{f.sse:.6g}</td>"
        f"<td>{f.bic:.8g}</td><td>{f.silhouette:.4f}</td>"
        f"<td>{'' if f.noise_ratio is None else f'{f.noise_ratio:.3f}'}</td>"
        f"<td>{'' if f.stability is None else f'{f.stability:.3f}'}</td></tr>"
        for f in sweep.figures
    )
    said = "".join(f"<li>{html.escape(line)}</li>" for line in sweep.disagreements)
    body = (
        f"<p>Recommended k = <b>{sweep.recommended_k}</b>: {html.escape(sweep.rule)}.</p>"
        + (f"<ul>{said}</ul>" if said else "<p>Every criterion agrees.</p>")
        + f"<p>{sweep.n_local_centers} local centers, {sweep.n_rows} rows, dimension {sweep.dim}.</p>"
        + "<table><tr>"
        + "".join(f"<th>{name}</th>" for name in header)
        + f"</tr>{cells}</table>"
    )
    return {
        "k_sweep.json": (json.dumps(content, indent=2) + "\n").encode(),
        "k_sweep.png": image,
        "k_sweep.html": _page(f"k-FED k sweep of run {run_id}", body, {"k_sweep": image}).encode(),
    }


def _k_sweep_figure(sweep: KSweep) -> bytes:
    """The criteria by k, one panel each, the recommended k marked."""
    from matplotlib.figure import Figure

    ks = [f.k for f in sweep.figures]
    panels = [
        ("sse", "within-cluster SSE"),
        ("bic", "BIC (higher is better)"),
        ("silhouette", "silhouette of the local centers"),
        ("noise_ratio", "between SSE / sampling noise"),
    ]
    fig = Figure(figsize=(10, 6.5))
    for ax, (key, label) in zip(fig.subplots(2, 2).ravel(), panels):
        values = [np.nan if getattr(f, key) is None else getattr(f, key) for f in sweep.figures]
        ax.plot(ks, values, marker="o", markersize=3, color="#3b6ea8")
        ax.axvline(sweep.recommended_k, color="#c0392b", linestyle="--", linewidth=1)
        if key == "noise_ratio":
            ax.set_yscale("log")
        ax.set(xlabel="k", title=label)
    fig.suptitle(f"k sweep: recommended k = {sweep.recommended_k} (dashed)")
    return png(fig)


def _lines(report: dict) -> list[tuple[str, str]]:
    """(name, value) pairs of the summary, in reading order: what the HTML table and the terminal show."""
    lines = [
        ("run", f"{report['run_id']} (attempt {report['attempt_id']})"),
        ("input", str(report["input"])),
        ("rows", f"{report['n_input']} in, {report['n_labelled']} labelled, {report['n_quarantined']} quarantined"),
        (
            "devices",
            f"{report['n_devices']} devices, {report['n_local_centers']} local centers"
            + (  # a fitted run's, from this version on
                f" ({report['n_rows_held_back']} rows in local clusters under {report['min_center_points']} rows "
                f"held back, {report['n_devices_held_back']} devices sharing no center)"
                if report.get("n_rows_held_back")
                else ""
            ),
        ),
        (
            "settings",
            f"k = {report['k']}, k_per_device = {report['k_per_device']}, "
            + "".join(
                f"{name} = {report[name]}, " for name in ("local_restarts", "robust_min_size") if name in report
            )  # reports of older versions lack them
            + f"seeding = {report['seeding']}, server_refine = {report['server_refine']}, "
            f"label_mode = {report['label_mode']}, seed = {report['seed']}, d = {report['dim']}",
        ),
        *(
            [("privacy", f"epsilon = {report['privacy_epsilon']:g}, delta = {report['privacy_delta']:g} per row")]
            if report.get("privacy_epsilon") is not None
            else []
        ),
        ("k-means cost", f"{report['cost']:.6g} ({report['cost'] / max(report['n_labelled'], 1):.4g} per row)"),
        ("k_z per device", _describe(report["k_z"])),
        ("global clusters per device", _describe(report["clusters_per_device"])),
        *_heterogeneity_lines(report.get("heterogeneity")),  # reports of older versions lack it
        (
            "cluster sizes",
            f"min {min(report['cluster_sizes'])}, max {max(report['cluster_sizes'])}, "
            f"empty {sum(1 for size in report['cluster_sizes'] if size == 0)}",
        ),
    ]
    sil = report["silhouette"]
    if sil["value"] is not None:
        lines.append(("silhouette", f"{sil['value']:.4f} (on {sil['sample_rows']} sampled rows)"))
    since = report.get("since_reference")  # reports of older versions lack it
    if since and since["reference_run_id"] is not None:
        moved = since["largest_shift"]
        lines.append(
            (
                f"since {since['reference_run_id']}",
                f"{len(since['kept'])} kept, new {since['new'] or 'none'}, retired {since['retired'] or 'none'}"
                + (
                    ""
                    if moved is None
                    else f"; moved most: {moved['cluster_id']} ({moved['relative_shift']:.3f} of its spread)"
                )
                + _drift_text(report),
            )
        )
    truth = report["truth"]
    if truth:
        lines.append(
            (
                f"against {truth['column']} ({truth['classes']} classes)",
                f"ARI {truth['ari']:.4f}, NMI {truth['nmi']:.4f}, accuracy {truth['accuracy']:.4f} "
                "(Hungarian matching)",
            )
        )
    return lines


def _drift_text(report: dict) -> str:
    """The run's drift figures (runs' cluster_mix_psi, ...), as the since-reference line ends; reports of older
    versions lack them."""
    figures = [
        ("cluster mix PSI {:.3f}", report.get("cluster_mix_psi")),
        ("{:.1%} of rows in new clusters", report.get("share_in_new_clusters")),
        ("{:.1%} of the reference's rows in retired ones", report.get("share_in_retired_clusters")),
        ("{:.1%} of devices moved", report.get("share_of_devices_moved")),
    ]
    shown = [text.format(value) for text, value in figures if value is not None]
    return "; " + ", ".join(shown) if shown else ""


def _heterogeneity_lines(spread: dict | None) -> list[tuple[str, str]]:
    if not spread or spread["same_device_pairs"] < SAME_DEVICE_PAIRS_NEEDED:
        return []
    line = (
        f"{spread['clusters_per_device_in_effect']:.1f} per device of {spread['clusters_in_effect']:.1f} in effect "
        f"(sqrt(k) = {spread['sqrt_k']:.1f}; from {spread['same_device_pairs']} same-device pairs of sampled rows)"
    )
    warning = iid_warning(spread)
    return [("clusters a device's rows lie in", line + (f"; WARNING: {warning}" if warning else ""))]


def _describe(distribution: dict) -> str:
    values = ", ".join(f"{value}: {count}" for value, count in distribution["devices_by_value"].items())
    return (
        f"mean {distribution['mean']:.2f}, min {distribution['min']}, max {distribution['max']} "
        f"(value: devices = {values})"
    )


def terminal_text(report: dict) -> str:
    width = max(len(name) for name, _ in _lines(report))
    summary = [f"{name:<{width}}  {value}" for name, value in _lines(report)]
    told = _cluster_lines(report)
    return "\n".join(summary + (["", "What the clusters are:", *told] if told else []))


def to_json(report: dict) -> str:
    return json.dumps(report, indent=2, sort_keys=True, default=str)
