"""The run report (report.json, report.html, `kfed-spark report`) and real datasets prepared as input."""

import base64
import json
import re
from html.parser import HTMLParser

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from helpers import MIXTURE, needs_shared_data, published, report_folder, runs_of
from kfed_spark.bench.datasets import hashed_ngram_tfidf, load
from kfed_spark.bench.synthetic import mixture
from kfed_spark.cli import main
from kfed_spark.core.local_centers import feature_matrix
from kfed_spark.core.reference import federated_kmeans
from kfed_spark.params import AlgorithmParams
from kfed_spark.runs import report
from kfed_spark.runtime.fault_injection import FAULT_ENV


class PageParser(HTMLParser):
    """Collects the tags of a page and fails on tags closed out of order."""

    def __init__(self):
        super().__init__()
        self.open, self.images, self.cells = [], [], []

    def handle_starttag(self, tag, attrs):
        if tag not in ("meta", "img"):
            self.open.append(tag)
        if tag == "img":
            self.images.append(dict(attrs))

    def handle_endtag(self, tag):
        assert self.open.pop() == tag

    def handle_data(self, data):
        self.cells.append(data)


@pytest.mark.spark
def test_every_run_writes_a_report_that_agrees_with_its_tables(spark, published_run, capsys):
    _, out = published_run
    folder = report_folder(out, "first")
    report = json.loads((folder / "report.json").read_text())
    run = runs_of(spark, out)[0]
    assert folder.name == run.attempt_id
    n_rows = MIXTURE["devices"] * MIXTURE["points_per_device"]
    assert (report["n_input"], report["n_labelled"], report["n_devices"]) == (n_rows, n_rows, MIXTURE["devices"])
    assert sum(report["cluster_sizes"]) == n_rows and len(report["cluster_sizes"]) == MIXTURE["k"]
    assert report["truth"]["ari"] == pytest.approx(run.ari)
    assert report["truth"]["nmi"] >= 0.95 and report["truth"]["accuracy"] >= 0.95
    assert report["k_z"]["max"] <= MIXTURE["k_per_device"]
    assert sum(report["k_z"]["devices_by_value"].values()) == MIXTURE["devices"]
    assert 0.3 < report["silhouette"]["value"] <= 1.0  # separated blobs
    labels = published(spark, out, "labels")
    sizes = labels.groupBy("cluster_id").count().orderBy("cluster_id").toPandas()["count"].tolist()
    assert report["cluster_sizes"] == sizes

    page = (folder / "report.html").read_text()
    parser = PageParser()
    parser.feed(page)
    parser.close()
    assert parser.open == []
    assert [image["alt"] for image in parser.images] == [
        *("standardized_differences", "cluster_sizes", "projection", "k_z", "clusters_per_device")
    ]
    for image in parser.images:
        data = base64.b64decode(image["src"].removeprefix("data:image/png;base64,"))
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert any(re.search(r"ARI 0\.9\d+|ARI 1\.0000", cell) for cell in parser.cells)

    capsys.readouterr()
    assert main(["report", "first", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"{n_rows} in, {n_rows} labelled, 0 quarantined" in text and "NMI" in text
    assert main(["report", "missing", "--output", str(out)]) == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1] == f"kfed-spark: error: no published run 'missing' under {out}"
    )


@pytest.mark.spark
def test_with_the_report_off_a_run_on_an_iid_shuffle_of_the_mixture_warns_and_the_generated_one_does_not(
    spark, published_run, tmp_path, caplog
):
    """The heterogeneity check rests on the sample the labelling pass gathers whatever the report setting: runs
    with `report: false`, as production keeps them, warn (once) on the shuffle and record the figures in runs;
    the published run with its report records what its report shows."""
    config, published_out = published_run
    generated_report = json.loads((report_folder(published_out, "first") / "report.json").read_text())
    (published_row,) = runs_of(spark, published_out)
    spread = generated_report["heterogeneity"]
    assert spread["looks_iid"] is False
    assert published_row.clusters_per_device_in_effect == spread["clusters_per_device_in_effect"]
    assert published_row.clusters_in_effect == spread["clusters_in_effect"]

    table = mixture(**MIXTURE)
    shuffled = table.set_column(
        1, "device_id", pa.array(np.random.default_rng(0).permutation(table.column("device_id").to_numpy()))
    )
    rows = {}
    for name, data in (("generated", table), ("iid", shuffled)):
        (tmp_path / name).mkdir()
        pq.write_table(data, tmp_path / name / "part-0.parquet")
        settings = yaml.safe_load(config.read_text())
        settings["input"]["path"], settings["output"]["path"] = str(tmp_path / name), str(tmp_path / f"{name}-out")
        settings["report"] = False
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(settings))
        caplog.clear()
        assert main(["run", "--config", str(tmp_path / f"{name}.yaml"), "--set", f"run_id={name}"]) == 0
        assert not (tmp_path / f"{name}-out" / "reports").exists()
        (rows[name],) = runs_of(spark, tmp_path / f"{name}-out")
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "(IID)" in r.getMessage()]
        assert len(warned) == (name == "iid"), warned

    generated, iid = rows["generated"], rows["iid"]
    assert generated.clusters_per_device_in_effect == pytest.approx(MIXTURE["k_per_device"], rel=0.1)
    assert iid.clusters_per_device_in_effect > report.IID_SHARE * iid.clusters_in_effect
    spread = {
        "clusters_per_device_in_effect": iid.clusters_per_device_in_effect,
        "clusters_in_effect": iid.clusters_in_effect,
        "sqrt_k": np.sqrt(iid.k),
        "looks_iid": True,
    }
    assert warned == [f"run iid: {report.iid_warning(spread)}"]


@pytest.mark.spark
def test_report_can_be_turned_off(config, tmp_path):
    assert main(["run", "--config", str(config), "--set", "report=false"]) == 0
    assert not (tmp_path / "out" / "reports").exists()


@pytest.mark.spark
def test_a_failed_report_fails_the_attempt_and_a_failed_attempt_leaves_no_report(
    config_after_first_run, tmp_path, monkeypatch, capsys
):
    """The report is written before the publish commit: a failure there (or later, before the
    publish) fails the attempt, deletes its report and publishes nothing; the earlier report stays."""
    config, out = config_after_first_run, tmp_path / "out"
    published_report = (report_folder(out, "first") / "report.json").read_bytes()
    monkeypatch.setenv(FAULT_ENV, "fail:report")
    assert main(["run", "--config", str(config), "--set", "seed=5"]) == 2
    assert [p.name for p in (out / "reports" / "first").iterdir()] == [report_folder(out, "first").name]
    monkeypatch.delenv(FAULT_ENV)
    capsys.readouterr()
    assert main(["report", "first", "--output", str(out), "--json"]) == 0
    assert capsys.readouterr().out.strip() == published_report.decode().strip()


@pytest.mark.fast
@needs_shared_data
def test_real_datasets_load_as_device_tables():
    mnist = load("mnist", max_devices=8)
    rotation = mnist.column("rotation").to_numpy()
    devices = mnist.column("device_id").to_numpy()
    assert len(np.unique(devices)) == 8 and len(mnist.column("features")[0]) == 784
    for device in np.unique(devices):
        assert len(np.unique(rotation[devices == device])) == 1  # one rotation per device
    assert np.array_equal(mnist.column("true_cluster").to_numpy(), 10 * rotation + mnist.column("digit").to_numpy())
    femnist = load("femnist", max_devices=3)
    pixels = np.asarray(femnist.column("features")[0].as_py())
    assert len(set(femnist.column("device_id").to_pylist())) == 3
    assert len(pixels) == 784 and pixels.min() >= 0.0 and np.median(pixels) == 0.0  # ink = 1 on 0
    shakespeare = load("shakespeare", max_devices=12)
    assert len(set(shakespeare.column("device_id").to_pylist())) == 12
    assert len(shakespeare.column("features")[0]) == 32
    assert load("mnist", max_devices=8).equals(mnist)  # seeded


@pytest.mark.fast
def test_hashed_ngram_tfidf_rows_are_unit_length_and_stable():
    x = hashed_ngram_tfidf(["To be or not to be", "to be or not TO BE", "Now is the winter"], buckets=64)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0)
    np.testing.assert_allclose(x[0], x[1])  # case does not matter
    assert not np.allclose(x[0], x[2])
    np.testing.assert_array_equal(
        x, hashed_ngram_tfidf(["To be or not to be", "to be or not TO BE", "Now is the winter"], buckets=64)
    )


HALF_HELD = dict(k=16, k_per_device=8, devices=200, points_per_device=50, dim=8, seed=3)
"""Devices holding half of the clusters each: beyond the paper's sqrt(k), but not IID."""


@pytest.mark.fast
@pytest.mark.parametrize(
    ("generated", "k_per_device"), [(MIXTURE, 2), (MIXTURE, 3), (HALF_HELD, 8)], ids=["mixture-2", "mixture-3", "half"]
)
def test_the_heterogeneity_check_tells_a_mixture_from_an_iid_shuffle_of_its_rows(generated, k_per_device):
    """Shuffled, each device holds every cluster. A run with k_per_device 2 (the default) labels at most 2
    clusters per device either way: the check must not rest on the labels."""
    table = mixture(**generated)
    x, devices = feature_matrix(table.column("features")), table.column("device_id").to_numpy()
    rng = np.random.default_rng(1)
    sample = rng.choice(len(x), report.SAMPLE_ROWS, replace=False)
    for partition, iid in ((devices, False), (rng.permutation(devices), True)):
        fitted = federated_kmeans(x, partition, AlgorithmParams(k=generated["k"], k_per_device=k_per_device, seed=1))
        spread = report.heterogeneity(x[sample], partition[sample], fitted.server.centers)
        assert spread["looks_iid"] is iid and (report.iid_warning(spread) is not None) is iid, spread
        ((_, shown),) = report._heterogeneity_lines(spread)  # the report's line, warning included
        assert ("WARNING: the devices look alike (IID)" in shown) is iid
        assert spread["sqrt_k"] == pytest.approx(np.sqrt(generated["k"]))
        held = spread["clusters_per_device_in_effect"]
        assert held == pytest.approx(spread["clusters_in_effect"] if iid else generated["k_per_device"], rel=0.15)
