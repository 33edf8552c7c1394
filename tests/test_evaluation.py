"""The evaluation a labelling pass gathers per partition, merged on the driver: the same figures as
computing them over all rows at once, however the rows are split."""

import numpy as np
import pyarrow as pa
import pytest

from kfed_spark.core.evaluation import Evaluation, EvaluationSpec
from kfed_spark.core.labels import LabelModel
from kfed_spark.core.local_centers import features_array
from kfed_spark.core.metrics import adjusted_rand_index, ari_of, cost_of_labels
from kfed_spark.spark.workers import EVALUATION_COL, label_arrays

pytestmark = pytest.mark.fast


def batch_of(devices, x, truth, reasons):
    return pa.RecordBatch.from_arrays(
        [pa.array(devices), features_array(x), pa.array(truth), pa.array(reasons, type=pa.string())],
        names=["device_id", "features", "truth", "reason"],
    )


def labelled_partitions(partitions, spec, model):
    """label_arrays over each partition (a list of batches), as the labelling UDF calls it."""

    def arrays(batch):
        return (
            pa.compute.is_null(batch.column("reason")),
            batch.column("device_id"),
            batch.column("features"),
            batch.column("truth"),
        )

    return [
        pa.Table.from_batches(
            [
                pa.RecordBatch.from_struct_array(out)
                for out in label_arrays(map(arrays, batches), model, 2, evaluation=spec)
            ]
        )
        for batches in partitions
    ]


def test_figures_and_sample_do_not_depend_on_the_partitioning():
    rng = np.random.default_rng(3)
    n = 3000
    devices = rng.integers(0, 4, n)
    truth = rng.integers(0, 3, n)
    x = rng.normal(size=(n, 2)) + truth[:, None] * 5.0
    truth_values = [None if i % 97 == 0 else f"class-{t}" for i, t in enumerate(truth)]
    reasons = [None if i % 50 else "null_features" for i in range(n)]
    model = LabelModel.build(
        np.repeat(np.arange(4), 3),
        np.tile(np.arange(3), 4),
        np.tile([[0.0, 0], [5, 5], [10, 10]], (4, 1)),
        np.tile([0, 1, 2], 4),
        np.array([[0.0, 0], [5, 5], [10, 10]]),
        "induced",
    )
    spec = EvaluationSpec.of("truth", sample_rows=100, expected_rows=n, seed=7)

    def evaluation(bounds):
        batches = [batch_of(devices[a:b], x[a:b], truth_values[a:b], reasons[a:b]) for a, b in zip(bounds, bounds[1:])]
        tables = labelled_partitions([batches[:1], batches[1:3], batches[3:]], spec, model)
        for table in tables:  # one blob per partition, on its last row
            assert table.column(EVALUATION_COL).null_count == table.num_rows - 1
            assert table.column(EVALUATION_COL)[-1].is_valid
        blobs = [blob for table in tables for blob in table.column(EVALUATION_COL).to_pylist() if blob is not None]
        return Evaluation.merge(blobs, 100, 2), pa.concat_tables(tables)

    one, labelled = evaluation([0, 10, 20, 30, n])  # batches of a few rows per device, then of hundreds
    other, labelled_other = evaluation([0, 1000, 1700, 2900, n])
    for name in ("local_cluster_id", "cluster_id", "__kfed_sq_dist", "margin"):  # bit for bit
        assert labelled.column(name).equals(labelled_other.column(name)), name
    pairs, pairs_other = one.device_clusters.sort_index(), other.device_clusters.sort_index()
    assert pairs.index.equals(pairs_other.index) and pairs.n_points.sum() == sum(r is None for r in reasons)
    np.testing.assert_array_equal(pairs.n_points, pairs_other.n_points)
    np.testing.assert_allclose(pairs.sum_sq_dist, pairs_other.sum_sq_dist, rtol=1e-12)
    rows = np.array([r is None for r in reasons])
    clusters = labelled.column("cluster_id").to_numpy(zero_copy_only=False)[rows].astype(int)
    classes = np.array([str(t) for t in truth_values], dtype=object)[rows]
    assert one.truth_cost == pytest.approx(other.truth_cost, rel=1e-12)  # floating sums in another order
    np.testing.assert_allclose(one.truth_cost, cost_of_labels(x[rows], classes))
    assert ari_of(one.cells) == ari_of(other.cells) == adjusted_rand_index(classes, clusters)
    assert one.cells.sum() == rows.sum()
    assert len(one.sample_x) == 100
    np.testing.assert_array_equal(one.sample_x, other.sample_x)
    np.testing.assert_array_equal(one.sample_labels, other.sample_labels)
    np.testing.assert_array_equal(one.sample_devices, other.sample_devices)
    sampled = {row.tobytes(): device for row, device in zip(x, devices)}  # each row's own device
    assert [sampled[row.tobytes()] for row in one.sample_x] == list(one.sample_devices)


def test_without_truth_or_sample_there_is_nothing_to_merge_but_counts():
    model = LabelModel.build(
        np.array([1]), np.array([0]), np.array([[0.0, 0.0]]), np.array([0]), np.array([[0.0, 0.0]]), "induced"
    )
    spec = EvaluationSpec.of(None, sample_rows=0, expected_rows=10, seed=0)
    [table] = labelled_partitions([[batch_of([1, 1], np.ones((2, 2)), [0, 0], [None, None])]], spec, model)
    merged = Evaluation.merge([b for b in table.column(EVALUATION_COL).to_pylist() if b], 0, 2)
    assert merged.cells is None and merged.truth_cost is None and merged.sample_x.shape == (0, 2)


def test_a_sample_larger_than_the_rows_takes_every_row():
    spec = EvaluationSpec.of(None, sample_rows=100, expected_rows=10, seed=0)
    model = LabelModel.build(
        np.array([1]), np.array([0]), np.array([[0.0, 0.0]]), np.array([0]), np.array([[0.0, 0.0]]), "induced"
    )
    x = np.arange(20.0).reshape(10, 2)
    [table] = labelled_partitions([[batch_of([1] * 10, x, [0] * 10, [None] * 10)]], spec, model)
    merged = Evaluation.merge([b for b in table.column(EVALUATION_COL).to_pylist() if b], 100, 2)
    assert len(merged.sample_x) == 10
