"""Clustering quality measures that work from counts, so Spark can aggregate first."""

from __future__ import annotations

import numpy as np


def _pairs(counts: np.ndarray) -> float:
    counts = np.asarray(counts, dtype=np.float64)
    return float(np.sum(counts * (counts - 1.0)) / 2.0)


def contingency(truth: np.ndarray, labels: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
    """(truth classes, labels) matrix of counts from (truth, label, count) cells (count 1 if omitted)."""
    counts = np.ones(len(truth)) if counts is None else np.asarray(counts, dtype=np.float64)
    _, t = np.unique(np.asarray(truth), return_inverse=True)
    _, c = np.unique(np.asarray(labels), return_inverse=True)
    cells = np.zeros((t.max() + 1, c.max() + 1))
    np.add.at(cells, (t, c), counts)
    return cells


def clusters_in_effect(groups: np.ndarray, labels: np.ndarray) -> tuple[float, float, int]:
    """How many clusters the rows of one group spread over, in effect, and how many all the rows do: the
    inverse of the chance that two rows of the same group (of all the rows) have the same label, c for
    rows spread evenly over c clusters. Also the number of same-group pairs the first figure rests on
    (with none of them alike, the first figure is that number: the chance is below its inverse)."""
    if len(labels) < 2:
        return 0.0, 0.0, 0
    cells = contingency(groups, labels)
    group_pairs, alike_in_group = _pairs(cells.sum(axis=1)), _pairs(cells)
    all_pairs, alike = _pairs(np.array([cells.sum()])), _pairs(cells.sum(axis=0))
    return group_pairs / max(alike_in_group, 1.0), all_pairs / max(alike, 1.0), int(group_pairs)


def adjusted_rand_index(truth: np.ndarray, labels: np.ndarray, counts: np.ndarray | None = None) -> float:
    """Adjusted Rand index (Hubert and Arabie 1985) of two labelings given as (truth, label, count) cells.

    With counts omitted every (truth, label) pair counts once, as in scikit-learn's
    adjusted_rand_score.
    """
    return ari_of(contingency(truth, labels, counts))


def ari_of(cells: np.ndarray) -> float:
    index = _pairs(cells)
    rows, cols = _pairs(cells.sum(axis=1)), _pairs(cells.sum(axis=0))
    total = _pairs(np.array([cells.sum()]))
    expected = rows * cols / total if total else 0.0
    maximum = (rows + cols) / 2.0
    if maximum == expected:
        return 1.0
    return (index - expected) / (maximum - expected)


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-np.sum(p * np.log(p)))


def nmi_of(cells: np.ndarray) -> float:
    """Normalized mutual information, arithmetic-mean normalisation (scikit-learn's default)."""
    total = cells.sum()
    rows, cols = cells.sum(axis=1), cells.sum(axis=0)
    nonzero = cells > 0
    outer = np.outer(rows, cols)[nonzero]
    mutual = float(np.sum(cells[nonzero] / total * np.log(cells[nonzero] * total / outer)))
    h_truth, h_labels = _entropy(rows), _entropy(cols)
    if h_truth == 0.0 and h_labels == 0.0:
        return 1.0
    return mutual / ((h_truth + h_labels) / 2.0) if (h_truth + h_labels) > 0 else 0.0


def matched_accuracy_of(cells: np.ndarray) -> float:
    """Share of rows whose cluster maps to their class under the best one-to-one matching
    (Hungarian algorithm); clusters left without a class count as wrong."""
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(cells, maximize=True)
    return float(cells[rows, cols].sum() / cells.sum())


def silhouette(x: np.ndarray, labels: np.ndarray) -> float:
    """Mean silhouette coefficient of the rows x (use a sample: this is O(n^2) memory).

    A row alone in its cluster scores 0, as in scikit-learn.
    """
    keys, index = np.unique(labels, return_inverse=True)
    if len(keys) < 2:
        return 0.0
    x = x - x.mean(axis=0)  # the expanded distances below are accurate to the spread only near the origin
    sq = np.einsum("ij,ij->i", x, x)
    dist = np.sqrt(np.maximum(sq[:, None] - 2.0 * x @ x.T + sq[None, :], 0.0))
    sums = np.zeros((len(x), len(keys)))
    np.add.at(sums.T, index, dist)
    sizes = np.bincount(index).astype(np.float64)
    own = sizes[index] - 1.0
    a = np.divide(sums[np.arange(len(x)), index], own, out=np.zeros(len(x)), where=own > 0)
    other = sums / sizes[None, :]
    other[np.arange(len(x)), index] = np.inf
    b = other.min(axis=1)
    score = np.where(own > 0, (b - a) / np.maximum(a, b), 0.0)
    return float(np.mean(score))


def within_cluster_cost(counts: np.ndarray, sums: np.ndarray, squared_norms: np.ndarray) -> float:
    """k-means cost of clusters around their own means, from per-cluster moments.

    counts (c,), sums (c, d) and squared_norms (c,) are each cluster's row count, sum of rows
    and sum of squared row norms: cost = sum(squared_norms) - sum(|sums|^2 / counts).
    """
    counts = np.asarray(counts, dtype=np.float64)
    sums = np.asarray(sums, dtype=np.float64)
    return float(np.sum(squared_norms) - np.sum(np.einsum("ij,ij->i", sums, sums) / counts))


def cost_of_labels(x: np.ndarray, labels: np.ndarray) -> float:
    """k-means cost of the clusters a labelling of the rows x defines, around their own means."""
    x = x - x.mean(axis=0)  # moments about a point near the rows: within_cluster_cost's difference stays accurate
    _, index = np.unique(labels, return_inverse=True)
    sums = np.zeros((index.max() + 1, x.shape[1]))
    np.add.at(sums, index, x)
    return within_cluster_cost(np.bincount(index), sums, np.bincount(index, weights=np.einsum("ij,ij->i", x, x)))
