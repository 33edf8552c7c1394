"""The clustering metrics (kfed_spark.core.metrics) against scikit-learn's, on labellings of their own."""

import numpy as np
import pytest
from sklearn import metrics as sk

from kfed_spark.core.metrics import (
    adjusted_rand_index,
    clusters_in_effect,
    contingency,
    cost_of_labels,
    matched_accuracy_of,
    nmi_of,
    silhouette,
)

pytestmark = pytest.mark.fast


def labellings(seed: int, n: int = 300):
    rng = np.random.default_rng(seed)
    truth = rng.integers(0, 5, n)
    noisy = np.where(rng.random(n) < 0.3, rng.integers(0, 7, n), truth)
    return truth, noisy


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ari_nmi_and_silhouette_are_scikit_learn_s(seed):
    truth, labels = labellings(seed)
    assert adjusted_rand_index(truth, labels) == pytest.approx(sk.adjusted_rand_score(truth, labels), abs=1e-12)
    assert nmi_of(contingency(truth, labels)) == pytest.approx(
        sk.normalized_mutual_info_score(truth, labels), abs=1e-12
    )
    x = np.random.default_rng(seed).normal(size=(len(truth), 3)) + truth[:, None] * 3.0 + 1e6  # far from the origin
    assert silhouette(x, labels) == pytest.approx(sk.silhouette_score(x, labels), abs=1e-6)


def test_counted_rows_weigh_as_repeated_rows():
    truth, labels = np.array([0, 0, 1, 1, 2]), np.array([0, 1, 1, 1, 2])
    counts = np.array([3, 1, 2, 5, 4])
    repeated = np.repeat(truth, counts), np.repeat(labels, counts)
    assert adjusted_rand_index(truth, labels, counts) == pytest.approx(adjusted_rand_index(*repeated), abs=1e-12)


def test_matched_accuracy_pairs_clusters_with_classes_one_to_one():
    truth = np.array([0, 0, 0, 1, 1, 2])
    labels = np.array([5, 5, 7, 7, 7, 7])  # 5 -> class 0 (2 rows), 7 -> class 1 (2 rows); class 2 unmatched
    assert matched_accuracy_of(contingency(truth, labels)) == pytest.approx(4 / 6)


def test_the_cost_of_a_labelling_is_its_sum_of_squares_about_each_cluster_s_mean_far_from_the_origin():
    rng = np.random.default_rng(3)
    x, labels = rng.normal(size=(200, 4)), rng.integers(0, 6, 200)
    expected = sum(float(((x[labels == c] - x[labels == c].mean(axis=0)) ** 2).sum()) for c in np.unique(labels))
    assert cost_of_labels(x, labels) == pytest.approx(expected, rel=1e-12)
    assert cost_of_labels(x + 1e9, labels) == pytest.approx(expected, rel=1e-6)


def test_clusters_in_effect_counts_what_a_group_spreads_over():
    rng = np.random.default_rng(4)
    groups = np.repeat(np.arange(200), 30)
    held = np.array([rng.choice(16, size=4, replace=False) for _ in range(200)])  # 4 of 16 per group
    labels = held[groups, rng.integers(0, 4, size=len(groups))]
    per_group, overall, pairs = clusters_in_effect(groups, labels)
    assert pairs == 200 * 30 * 29 // 2
    assert per_group == pytest.approx(4, rel=0.1) and overall == pytest.approx(16, rel=0.1)
    per_group, overall, _ = clusters_in_effect(rng.permutation(groups), labels)  # the same rows shuffled
    assert per_group == pytest.approx(overall, rel=0.1)
    assert clusters_in_effect(groups[:1], labels[:1]) == (0.0, 0.0, 0)
