"""Clustering quality measures that work from counts, so Spark can aggregate first."""

from __future__ import annotations

import numpy as np


def _pairs(counts: np.ndarray) -> float:
    counts = np.asarray(counts, dtype=np.float64)
    return float(np.sum(counts * (counts - 1.0)) / 2.0)


def adjusted_rand_index(truth: np.ndarray, labels: np.ndarray, counts: np.ndarray | None = None) -> float:
    """Adjusted Rand index (Hubert and Arabie 1985) of two labelings given as (truth, label, count) cells.

    With counts omitted every (truth, label) pair counts once, as in scikit-learn's
    adjusted_rand_score.
    """
    truth = np.asarray(truth)
    labels = np.asarray(labels)
    counts = np.ones(len(truth)) if counts is None else np.asarray(counts, dtype=np.float64)
    _, t = np.unique(truth, return_inverse=True)
    _, c = np.unique(labels, return_inverse=True)
    cells = np.zeros((t.max() + 1, c.max() + 1))
    np.add.at(cells, (t, c), counts)
    index = _pairs(cells)
    rows, cols = _pairs(cells.sum(axis=1)), _pairs(cells.sum(axis=0))
    total = _pairs(np.array([cells.sum()]))
    expected = rows * cols / total if total else 0.0
    maximum = (rows + cols) / 2.0
    if maximum == expected:
        return 1.0
    return (index - expected) / (maximum - expected)


def within_cluster_cost(counts: np.ndarray, sums: np.ndarray, squared_norms: np.ndarray) -> float:
    """k-means cost of clusters around their own means, from per-cluster moments.

    counts (c,), sums (c, d) and squared_norms (c,) are each cluster's row count, sum of rows
    and sum of squared row norms: cost = sum(squared_norms) - sum(|sums|^2 / counts).
    """
    counts = np.asarray(counts, dtype=np.float64)
    sums = np.asarray(sums, dtype=np.float64)
    return float(np.sum(squared_norms) - np.sum(np.einsum("ij,ij->i", sums, sums) / counts))
