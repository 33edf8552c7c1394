"""kfed-spark bench-quality on small slices: the table's shape and what it must show."""

import json

import pytest

from helpers import needs_shared_data
from kfed_spark.bench.quality import EPSILONS, SHARE_ALL, WARM_START
from kfed_spark.cli import main


def bench_quality_rows(out, datasets):
    assert main(["bench-quality", "--datasets", datasets, "--max-devices", "20", "--out", str(out)]) == 0
    return json.loads((out / "quality.json").read_text())


@pytest.mark.spark
def test_bench_quality_table_on_the_mixtures(spark, tmp_path, capsys):
    out = tmp_path / "quality"
    rows = bench_quality_rows(out, "mixture,mixture-outliers")
    assert {row["dataset"] for row in rows} == {"mixture", "mixture-outliers"}
    methods = {row["method"] for row in rows}
    assert "Spark MLlib KMeans (k-means||)" in methods and "scikit-learn KMeans (k-means++)" in methods
    # 24 combinations, auto, warm, sharing every local center, MLlib, scikit-learn
    assert sum(1 for row in rows if row["dataset"] == "mixture") == 29
    for row in rows:
        assert -1.0 <= row["ari"] <= 1.0 and 0.0 <= row["nmi"] <= 1.0 and row["cost_ratio"] > 0
    outliers = {
        row["method"]: row for row in rows if row["dataset"] == "mixture-outliers" and row["k_per_device"] == "4"
    }
    # The outlier devices' rows (3 each) are held back by min_center_points: no setting is misled by them, and
    # when every local center is shared the outlier filter leaves them out (kernels' test: they would seed).
    assert min(row["ari"] for row in outliers.values()) >= 0.95 and outliers[SHARE_ALL]["ari"] >= 0.95
    support = {s["dataset"]: s for s in json.loads((out / "support.json").read_text())}
    assert (support["mixture-outliers"]["rows_held_back"], support["mixture-outliers"]["devices_held_back"]) == (30, 10)
    assert (
        support["mixture"]["rows_held_back"] == 0 and support["mixture"]["ari"] == support["mixture"]["ari_sharing_all"]
    )
    for dataset in ("mixture", "mixture-outliers"):  # a warm start is no worse than cold seeding
        ari = {row["method"]: row["ari"] for row in rows if row["dataset"] == dataset}
        assert ari[WARM_START] >= ari["k-FED restarts=3 filter=0.25 seeding=kmeanspp labels=induced (default)"] - 0.005
    markdown = (out / "quality.md").read_text()
    assert markdown.count("\n| mixture |") == 29 + 2 + len(EPSILONS)  # and k, support, privacy
    assert "| dataset | method |" in markdown
    assert "| combination | mixture | mixture-outliers | largest shortfall from the best |" in markdown
    assert "(default)" in markdown and "Smallest largest shortfall: k-FED " in markdown
    choices = {c["dataset"]: c for c in json.loads((out / "k_choice.json").read_text())}
    assert choices["mixture"]["true_k"] == 16 and choices["mixture"]["recommended_k"] == 16
    assert choices["mixture"]["swept"] == "2..32" and "| mixture | 16 | 2..32 | 16 |" in markdown
    privacy = [p for p in json.loads((out / "privacy.json").read_text()) if p["dataset"] == "mixture"]
    assert [p["epsilon"] for p in privacy] == list(EPSILONS)
    assert privacy[-1]["ari_nearest"] > privacy[0]["ari_nearest"]  # more budget, less noise
    assert privacy[-1]["ari_without_privacy"] == 1.0 and "| mixture | [" in markdown
    assert main(["bench-quality", "--datasets", "cifar", "--out", str(out)]) == 2
    assert "--datasets takes names from" in capsys.readouterr().err


@pytest.mark.spark
@needs_shared_data
def test_bench_quality_on_a_real_slice(spark, tmp_path):
    rows = bench_quality_rows(tmp_path / "quality", "mnist")
    assert len(rows) == 29 and all(0.0 <= row["nmi"] <= 1.0 and row["cost_ratio"] > 0 for row in rows)


@pytest.mark.fast
@needs_shared_data
def test_prepare_suggests_the_readme_s_known_k_per_device(tmp_path, capsys):
    """The docs advise the known k_z (2 on rotated MNIST) over `auto`, which saturates on images."""
    assert main(["prepare", "mnist", "--out", str(tmp_path / "mnist")]) == 0
    hint = capsys.readouterr().out.splitlines()[-1]
    assert hint.endswith("--set k=40 --set k_per_device=2")
