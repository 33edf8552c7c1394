"""kfed-spark bench-quality on small slices: the table's shape and what it must show."""

import json

from kfed_spark.cli import main

from helpers import needs_shared_data


@needs_shared_data
def test_bench_quality_table_on_a_real_slice_and_the_outlier_mixture(spark, tmp_path, capsys):
    out = tmp_path / "quality"
    assert main(["bench-quality", "--datasets", "mnist,mixture-outliers", "--max-devices", "20",
                 "--out", str(out)]) == 0
    rows = json.loads((out / "quality.json").read_text())
    assert {row["dataset"] for row in rows} == {"mnist", "mixture-outliers"}
    methods = {row["method"] for row in rows}
    assert "Spark MLlib KMeans (k-means||)" in methods and "scikit-learn KMeans (k-means++)" in methods
    assert sum(1 for row in rows if row["dataset"] == "mnist") == 9  # 6 fixed-k_z k-FED, 1 auto, MLlib, sklearn
    for row in rows:
        assert -1.0 <= row["ari"] <= 1.0 and 0.0 <= row["nmi"] <= 1.0 and row["cost_ratio"] > 0
    outliers = {row["method"]: row for row in rows if row["dataset"] == "mixture-outliers" and row["k_per_device"] == "4"}
    # Outlier devices take farthest-point seeds; robust seeding ignores them.
    assert outliers["k-FED seeding=robust refine=lloyd labels=induced"]["ari"] >= 0.95
    assert outliers["k-FED seeding=farthest refine=lloyd labels=induced"]["ari"] < 0.8
    markdown = (out / "quality.md").read_text()
    assert markdown.count("\n| mnist |") == 9 and "| dataset | method |" in markdown
    assert main(["bench-quality", "--datasets", "cifar", "--out", str(out)]) == 2
    assert "--datasets takes names from" in capsys.readouterr().err


@needs_shared_data
def test_prepare_suggests_the_readme_s_known_k_per_device(tmp_path, capsys):
    """The README advises the known k_z (2 on rotated MNIST) over `auto`, which saturates on images."""
    assert main(["prepare", "mnist", "--out", str(tmp_path / "mnist")]) == 0
    hint = capsys.readouterr().out.splitlines()[-1]
    assert hint.endswith("--set k=40 --set k_per_device=2")
