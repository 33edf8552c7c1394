"""The functions Spark runs in its Python workers, fed with plain Arrow batches."""

import numpy as np
import pyarrow as pa
import pytest

from kfed_spark.core.labels import LabelModel
from kfed_spark.core.local_step import device_local_step
from kfed_spark.core.sampling import row_hashes, smallest_hashes
from kfed_spark.params import AlgorithmParams
from kfed_spark.spark.workers import LocalStepSpec, label_arrays, local_centers_from_batches

pytestmark = pytest.mark.fast


def rows_batch(devices, x, device_type=pa.int64()):
    offsets = np.arange(0, x.size + 1, x.shape[1], dtype=np.int32)
    return pa.RecordBatch.from_arrays(
        [pa.array(devices, type=device_type), pa.ListArray.from_arrays(offsets, pa.array(x.ravel()))],
        names=["device_id", "features"],
    )


@pytest.mark.parametrize("device_type", [pa.int64(), pa.string()])
def test_devices_spanning_batches_are_clustered_once_on_all_their_rows(device_type):
    rng = np.random.default_rng(0)
    sizes = {3: 250, 8: 40, 11: 130, **{d: 7 for d in range(12, 40)}}
    keys = {d: d for d in sizes} if device_type == pa.int64() else {d: f"d{d:02d}" for d in sizes}
    data = {d: rng.normal(size=(n, 4)) + rng.normal(0, 8, size=(n, 1)) for d, n in sizes.items()}
    devices = np.concatenate([[keys[d]] * n for d, n in sizes.items()])
    x = np.concatenate(list(data.values()))
    # 100-row batches: device 3 spans three batches, batch 3 holds devices 3, 8 and 11, the last ones
    # hold several whole devices of 7 rows each.
    batches = [rows_batch(devices[i : i + 100].tolist(), x[i : i + 100], device_type) for i in range(0, len(x), 100)]
    spec = LocalStepSpec(
        k=3, params=AlgorithmParams(k=3, seed=5, max_rows_per_device=1000), dim=4, device_type=device_type
    )
    out = pa.Table.from_batches(list(local_centers_from_batches(iter(batches), spec)))
    assert out.column("device_id").to_pylist().count(keys[3]) == 3
    for d, rows in data.items():
        expected = device_local_step(rows, 3, keys[d], spec.params)
        shared_first = np.argsort(expected.counts < spec.params.min_center_points, kind="stable")
        mine = out.filter(pa.compute.equal(out.column("device_id"), keys[d]))
        assert mine.column("n_points").to_pylist() == expected.counts[shared_first].tolist()
        np.testing.assert_array_equal(np.array(mine.column("center").to_pylist()), expected.centers[shared_first])
        assert mine.column("local_cluster_id").to_pylist() == list(range(len(expected.counts)))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_local_centers_do_not_depend_on_where_the_batches_and_the_clustering_chunks_cut(seed, monkeypatch):
    """Devices of 1 to 60 rows cut into batches of random sizes (a batch inside one device, a batch that
    ends where a device does) and clustered in chunks of a few hundred rows: the same centers as one
    batch holding everything."""
    import kfed_spark.spark.workers as workers

    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 61, size=80)
    devices = np.repeat(np.arange(80), sizes)
    x = rng.normal(size=(len(devices), 3)) + rng.normal(0, 6, size=(len(devices), 1))
    spec = LocalStepSpec(k=3, params=AlgorithmParams(k=3, seed=seed), dim=3, device_type=pa.int64())
    whole = pa.Table.from_batches(list(local_centers_from_batches(iter([rows_batch(devices, x)]), spec)))
    cuts = np.unique(np.concatenate([rng.integers(1, len(x), size=40), np.cumsum(sizes)[:5], [len(x)]]))
    starts = np.concatenate([[0], cuts[:-1]])
    batches = [rows_batch(devices[s:e], x[s:e]) for s, e in zip(starts, cuts)]
    monkeypatch.setattr(workers, "CLUSTER_ROWS", 300)
    chunked = pa.Table.from_batches(list(local_centers_from_batches(iter(batches), spec)))
    assert chunked.to_pydict() == whole.to_pydict()


def test_a_device_over_the_row_bound_is_clustered_on_a_sample_that_ignores_row_order_and_counted_whole():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(250, 2)) + np.repeat([[0.0, 0.0], [30.0, 0.0]], 125, axis=0)
    spec = LocalStepSpec(k=2, params=AlgorithmParams(k=2, max_rows_per_device=60), dim=2, device_type=pa.int64())

    def centers_from(rows, batch_size):
        batches = [
            rows_batch([4] * len(rows[i : i + batch_size]), rows[i : i + batch_size])
            for i in range(0, len(rows), batch_size)
        ]
        return pa.Table.from_batches(list(local_centers_from_batches(iter(batches), spec)))

    out = centers_from(x, 100)
    sample, _ = smallest_hashes(x, row_hashes(x, 0), 60)
    expected = device_local_step(sample, 2, 4, spec.params)
    np.testing.assert_array_equal(np.array(out.column("center").to_pylist()), expected.centers)
    assert sum(out.column("n_points").to_pylist()) == 250
    np.testing.assert_allclose(out.column("sse").to_pylist(), expected.sse * 250 / 60)
    again = centers_from(x[rng.permutation(250)], 7)  # other order, many small batches: several shrinks
    assert again.column("center").to_pylist() == out.column("center").to_pylist()


def test_labelling_uses_the_devices_nearest_local_center_and_its_cluster():
    arrays = dict(
        devices=np.array([7, 7, 9]),
        local_ids=np.array([0, 1, 0]),
        centers=np.array([[0.0], [10.0], [4.0]]),
        clusters=np.array([1, 0, 1]),
        global_centers=np.array([[10.0], [1.0]]),
    )
    model = LabelModel.build(**arrays, label_mode="induced")
    batch = with_reasons(rows_batch([9, 7, 7], np.array([[9.0], [9.0], [1.0]])), [None, None, None])
    out = labelled(batch, model, 1)
    assert out.column_names == [
        "local_cluster_id",
        "cluster_id",
        "__kfed_sq_dist",
        "margin",
        "non_finite",
        "__kfed_evaluation",
    ]
    assert out.column("local_cluster_id").to_pylist() == [0, 1, 0]
    assert out.column("cluster_id").to_pylist() == [1, 0, 1]  # device 9's only center is in cluster 1
    assert out.column("__kfed_sq_dist").to_pylist() == [64.0, 1.0, 0.0]
    # (d_other - d_own) / (d_other + d_own): the first row is nearer the other center than its own
    np.testing.assert_allclose(out.column("margin").to_pylist(), [-7 / 9, 7 / 9, 1.0])
    nearest = LabelModel.build(**arrays, label_mode="nearest")
    assert labelled(batch, nearest, 1).column("cluster_id").to_pylist() == [0, 0, 1]
    renamed = LabelModel.build(**arrays, label_mode="induced", cluster_ids=np.array([40, 7]))
    assert labelled(batch, renamed, 1).column("cluster_id").to_pylist() == [7, 40, 7]  # positions -> published ids


def test_rows_of_unseen_devices_take_the_nearest_global_center_only_when_the_model_allows():
    args = (np.array([7, 7]), np.array([0, 1]), np.array([[0.0], [10.0]]), np.array([1, 0]), np.array([[10.0], [1.0]]))
    batch = with_reasons(rows_batch([7, 8, 8, 7], np.array([[9.0], [9.0], [2.0], [1.0]])), [None] * 4)
    for mode in ("induced", "nearest"):
        out = labelled(batch, LabelModel.build(*args, mode, label_unseen=True), 1)
        assert out.column("local_cluster_id").to_pylist() == [1, None, None, 0]  # no local center of device 8
        assert out.column("cluster_id").to_pylist() == [0, 0, 1, 1]
        assert out.column("__kfed_sq_dist").to_pylist() == [1.0, 1.0, 1.0, 0.0]
    only_unseen = with_reasons(rows_batch([8], np.array([[3.0]])), [None])
    assert labelled(only_unseen, LabelModel.build(*args, "induced", label_unseen=True), 1).column(
        "cluster_id"
    ).to_pylist() == [1]
    with pytest.raises(ValueError, match="device 8 has no local centers in this model"):
        labelled(batch, LabelModel.build(*args, "induced"), 1)


def with_reasons(batch, reasons):
    return pa.RecordBatch.from_arrays(
        list(batch.columns) + [pa.array(reasons, type=pa.string())], names=batch.schema.names + ["reason"]
    )


def labelled(batch, model, dim):
    """label_arrays over one batch of (device_id, features, reason) rows, as the labelling UDF calls it."""
    labellable = pa.compute.is_null(batch.column("reason"))
    [out] = label_arrays(iter([(labellable, batch.column("device_id"), batch.column("features"))]), model, dim)
    return pa.Table.from_struct_array(out)


def test_rows_with_a_reason_or_non_finite_values_pass_through_unlabelled():
    model = LabelModel.build(
        np.array([1]), np.array([0]), np.array([[0.0, 0.0]]), np.array([0]), np.array([[0.0, 0.0]]), "induced"
    )
    x = np.array([[1.0, 0.0], [np.nan, 0.0], [0.0, np.inf], [2.0, 0.0]])
    batch = with_reasons(rows_batch([1, 1, 1, None], x), [None, None, None, "null_device"])
    out = labelled(batch, model, 2)
    assert out.column("non_finite").to_pylist() == [False, True, True, False]
    assert out.column("cluster_id").to_pylist() == [0, None, None, None]
    assert out.column("__kfed_sq_dist").to_pylist() == [1.0, None, None, None]


def test_local_step_skips_non_finite_rows():
    x = np.array([[0.0], [np.nan], [10.0], [np.inf]])
    spec = LocalStepSpec(
        k=2,
        params=AlgorithmParams(k=2, max_iter=10, tol=0.0, max_rows_per_device=100, min_center_points=1),
        dim=1,
        device_type=pa.int64(),
    )
    out = pa.Table.from_batches(list(local_centers_from_batches(iter([rows_batch([1, 1, 1, 1], x)]), spec)))
    assert out.column("center").to_pylist() == [[0.0], [10.0]]
    assert out.column("n_points").to_pylist() == [1, 1]


def test_labelling_a_device_without_local_centers_fails_clearly():
    model = LabelModel.build(
        np.array([1]), np.array([0]), np.array([[0.0]]), np.array([0]), np.array([[0.0]]), "induced"
    )
    batch = with_reasons(rows_batch([2], np.array([[1.0]])), [None])
    with pytest.raises(ValueError, match="device 2 has no local centers"):
        labelled(batch, model, 1)
