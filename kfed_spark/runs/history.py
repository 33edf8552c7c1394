"""A location's published runs over time: `kfed-spark history`.

Each run's counts, k and cost with its drift figures against its reference run (kfed_spark.core.identity's
DRIFT_COLUMNS), as text or JSON, and a figure of the cluster sizes over the last runs, by stable id: a
cluster id keeps its meaning from run to run, so a line is one cluster's life, from the run that made it
new to the run that retired it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from kfed_spark.core.identity import DRIFT_COLUMNS
from kfed_spark.runs.describe import json_value

if TYPE_CHECKING:
    from kfed_spark.store.tables import RunRecord

HISTORY_COLUMNS = (
    "run_id",
    "attempt_id",
    "finished_at",
    "n_labelled",
    "n_devices",
    "k",
    "cost",
    "reference_run_id",
    *DRIFT_COLUMNS,
)
"""What history shows of each published run (columns of runs)."""

REPORTED_RUNS = 10
"""Runs a run's report draws the cluster sizes of: itself and the newest published runs before it."""


def published_runs(tables, last: int) -> pd.DataFrame:
    """The newest `last` published runs' HISTORY_COLUMNS (those the location has: an older version's runs
    table lacks the newest), newest first."""
    from pyspark.sql import functions as F

    runs = tables.published("runs")
    runs = runs.select(*[name for name in HISTORY_COLUMNS if name in runs.columns])
    return runs.orderBy(F.col("finished_at").desc(), F.col("run_id").desc()).limit(last).toPandas()


def cluster_sizes(tables, attempts: list[tuple[str, str]]) -> pd.DataFrame:
    """The cluster sizes (run_id, cluster_id, n_points) of these attempts (run id, attempt id), read from their
    partitions of centers alone: a plan without the runs table's published-attempt join, which a run's report
    would otherwise pay for in seconds."""
    from kfed_spark.store.delta import attempt_filter

    if not attempts:
        return pd.DataFrame({"run_id": [], "cluster_id": [], "n_points": []})
    where = " OR ".join(f"({attempt_filter(run_id, attempt_id)})" for run_id, attempt_id in attempts)
    return tables.read("centers").filter(where).select("run_id", "cluster_id", "n_points").toPandas()


def reported_attempts(rows: list[RunRecord], run_id: str) -> list[RunRecord]:
    """Of the location's runs rows, the published attempts whose cluster sizes a run's report draws before its
    own: those of the newest REPORTED_RUNS - 1 other run ids, oldest first."""
    from kfed_spark.store.ledger import published_rows

    chosen = [row for row in published_rows(rows) if row.run_id != run_id]
    return sorted(chosen, key=lambda row: (row.finished_at, row.run_id))[-(REPORTED_RUNS - 1) :]


def history_rows(runs: pd.DataFrame) -> list[dict]:
    """The published runs' rows (HISTORY_COLUMNS), oldest first, as plain values (None for a missing figure,
    and for the columns a location of an older version has not got yet)."""
    ordered = runs.sort_values(["finished_at", "run_id"])
    return [{name: json_value(row.get(name)) for name in HISTORY_COLUMNS} for _, row in ordered.iterrows()]


def history_text(rows: list[dict]) -> str:
    """One line per run: when, its size and k, and how far it moved from its reference run."""
    header = [
        "run_id",
        "finished_at",
        "rows",
        "devices",
        "k",
        "reference",
        "psi",
        "in new",
        "in retired",
        "shift",
        "moved",
    ]

    def share(value) -> str:
        return "" if value is None else f"{value:.1%}"

    def number(value, form: str) -> str:
        return "" if value is None else format(value, form)

    table = [
        [
            row["run_id"],
            (row["finished_at"] or "")[:19],
            str(row["n_labelled"]),
            str(row["n_devices"]),
            str(row["k"]),
            row["reference_run_id"] or "",
            number(row["cluster_mix_psi"], ".4f"),
            share(row["share_in_new_clusters"]),
            share(row["share_in_retired_clusters"]),
            number(row["largest_relative_shift"], ".3f"),
            share(row["share_of_devices_moved"]),
        ]
        for row in rows
    ]
    widths = [max(len(line[j]) for line in [header, *table]) for j in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in [header, *table])
