"""What each cluster of a run is, in words: `kfed-spark describe`, and the report's lines per cluster.

A cluster is told by its size, its devices and the features that set it apart: those whose mean stands
furthest from the population's, in the population's standard deviations (cluster_profiles' rank and
standardized_difference), "cluster 17: 412 rows (8.2%) on 38 devices; spend +2.3 sd, visits -1.1 sd".
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kfed_spark.errors import KFedError

TOLD_FEATURES = 3
"""Features a cluster's line names at most (describe --top changes it)."""

NOTABLE_DIFFERENCE = 0.5
"""A feature a cluster's line names stands at least this many of the population's standard deviations from
the population's mean: nearer, the cluster is like everyone else in it."""

FEATURE_FIGURES = ("mean", "sd", "population_mean", "population_sd", "standardized_difference")


def cluster_summaries(profile: pd.DataFrame, n_devices: dict[int, int]) -> list[dict]:
    """One run's cluster_profiles rows as one entry per cluster (by id): its rows, share, devices, and its
    features ranked, most distinctive first."""
    columns = ["feature", "position", "rank", *FEATURE_FIGURES]
    summaries = []
    for cluster_id, rows in profile.sort_values(["cluster_id", "rank"]).groupby("cluster_id", sort=True):
        first = rows.iloc[0]
        summaries.append(
            {
                "cluster_id": int(cluster_id),
                "n_points": int(first.n_points),
                "share_of_rows": float(first.share_of_rows),
                "n_devices": n_devices.get(int(cluster_id)),
                "features": [
                    {name: json_value(value) for name, value in feature.items()}
                    for feature in rows[columns].to_dict("records")
                ],
            }
        )
    return summaries


def json_value(value):
    """A value of a pandas row as JSON holds it: None for a null or NaN, plain numbers, ISO timestamps."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, pd.Timestamp):
        return value.isoformat()
    return value.item() if isinstance(value, np.generic) else value


def cluster_line(summary: dict, top: int = TOLD_FEATURES) -> str:
    """'cluster 17: 412 rows (8.2%) on 38 devices; spend +2.3 sd, visits -1.1 sd': its most distinctive
    features, at most top of them, each NOTABLE_DIFFERENCE or further from the population's mean."""
    devices = "" if summary["n_devices"] is None else f" on {summary['n_devices']} devices"
    told = [
        f"{f['feature']} {f['standardized_difference']:+.1f} sd"
        for f in summary["features"][:top]
        if f["standardized_difference"] is not None and abs(f["standardized_difference"]) >= NOTABLE_DIFFERENCE
    ]
    size = f"cluster {summary['cluster_id']}: {summary['n_points']} rows ({summary['share_of_rows']:.1%}){devices}"
    return f"{size}; " + (", ".join(told) if told else f"within {NOTABLE_DIFFERENCE:g} sd of the population everywhere")


def cluster_table(summary: dict) -> str:
    """Every feature of one cluster, most distinctive first, as aligned text."""
    frame = pd.DataFrame(summary["features"])[["rank", "feature", *FEATURE_FIGURES]]
    return cluster_line(summary) + "\n" + frame.to_string(index=False, float_format=lambda v: f"{v:.6g}")


def chosen_cluster(summaries: list[dict], cluster_id: int) -> dict:
    """The summary of one cluster; a KFedError naming the run's clusters when it has no such cluster."""
    for summary in summaries:
        if summary["cluster_id"] == cluster_id:
            return summary
    ids = ", ".join(str(s["cluster_id"]) for s in summaries)
    raise KFedError(f"the run has no cluster {cluster_id}; its clusters: {ids}")
