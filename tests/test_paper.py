"""kfed-spark bench-paper: the paper's section 4 settings in numpy, and the command on the mixture."""

import json
import math
import re

import numpy as np
import pytest

from kfed_spark.bench.pages import PROVENANCE_ROW, cell
from kfed_spark.bench.paper import (
    DEVICES_PER_CLUSTER,
    ROWS_PER_HELD_CLUSTER,
    SYNTHETIC_METHODS,
    RoundsRow,
    centralized,
    iid_devices,
    markdown,
    partition_study,
    section_41_mixture,
    synthetic_study,
)
from kfed_spark.bench.quality import problems
from kfed_spark.cli import main
from kfed_spark.core.metrics import cost_of_labels


@pytest.mark.fast
@pytest.mark.parametrize("k", [16, 25, 100])
def test_the_synthetic_setting_gives_each_device_sqrt_k_clusters_of_m0_rows(k):
    x, devices, truth, separation = section_41_mixture(k, seed=3, mean_scale=4.0)
    k_prime = math.isqrt(k)
    assert len(np.unique(devices)) == DEVICES_PER_CLUSTER * k // k_prime
    for device in np.unique(devices):
        held, counts = np.unique(truth[devices == device], return_counts=True)
        assert len(held) == k_prime and set(counts) == {ROWS_PER_HELD_CLUSTER}
    assert x.shape == (len(truth), 16) and separation > 3
    again = section_41_mixture(k, seed=3, mean_scale=4.0)
    assert np.array_equal(again[0], x) and np.array_equal(again[2], truth)  # drawn from the seed alone


@pytest.mark.fast
def test_the_synthetic_study_reports_every_method_over_the_seeds():
    rows = synthetic_study((16,), seeds=1)
    assert [r.method for r in rows] == [*SYNTHETIC_METHODS, *SYNTHETIC_METHODS]  # two spreads of the means
    assert all(r.seeds == 1 and 0 <= r.accuracy_min <= r.accuracy_mean <= 1 for r in rows)
    well_separated = rows[0]
    assert well_separated.method == "k-FED" and well_separated.accuracy_mean == 1.0


@pytest.mark.fast
def test_on_the_mixture_k_fed_is_near_centralized_when_structured_and_far_on_the_iid_shuffle():
    """The paper's point: heterogeneity helps. At the devices' own k' = 4 of 16 clusters, k-FED on the
    structured partition costs what the centralized k-means costs; on an IID shuffle of the same rows it
    costs far more, and each device's rows spread over nearly all 16 classes."""
    (problem,) = problems(["mixture"], None, None, seed=0)
    reference = cost_of_labels(problem.x, centralized(problem.x, problem.k, 0))
    rows = {(r.partition, r.k_per_device): r for r in partition_study(problem, (4,), 0, reference)}
    structured, iid = rows["structured", 4], rows["iid", 4]
    assert structured.cost_ratio < 1.02 and structured.ari > 0.99 and structured.classes_per_device < 4.5
    assert iid.cost_ratio > 2 and iid.classes_per_device > 14
    shuffled = iid_devices(problem.devices, 0)
    assert np.array_equal(np.unique(shuffled, return_counts=True)[1], np.unique(problem.devices, return_counts=True)[1])


@pytest.mark.spark
def test_bench_paper_writes_its_tables_and_figures(spark, tmp_path, capsys):
    out = tmp_path / "paper"
    arguments = ["bench-paper", "--datasets", "mixture", "--synthetic-k", "16", "--seeds", "2", "--rounds", "1,3,20"]
    page = tmp_path / "docs" / "paper.md"
    assert main([*arguments, "--out", str(out), "--page", str(page)]) == 0
    saved = json.loads((out / "paper.json").read_text())
    assert len(saved["partitions"]) == 2 * 5 and len(saved["synthetic"]) == 2 * len(SYNTHETIC_METHODS)
    rounds = saved["rounds"]
    assert [r["method"] for r in rounds[:2]] == ["k-FED (induced labels)", "k-FED (nearest labels)"]
    assert all(r["rounds"] == 1 and r["cost_ratio"] < 1.02 for r in rounds[:2])
    mllib = [r for r in rounds if r["method"].startswith("Spark MLlib")]
    # tol 0: MLlib stops early only where no center moves any more; the table gives the rounds it ran
    assert all(r["rounds"] <= asked for r, asked in zip(mllib, [1, 3, 20] * 2)) and mllib[0]["rounds"] == 1
    assert all(r["cost_ratio"] > 0.99 for r in mllib)  # never below the centralized best of three
    files = ["paper.json", "paper.md", "partitions.png", "rounds.png", "synthetic.png"]
    assert sorted(path.name for path in out.iterdir()) == files  # MLlib's copy of the rows is gone
    for name in files[2:]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "paper.md").read_text()
    assert "| mixture | 16 | 4 | structured |" in markdown and "| 16 | 4 | 40 | 800 |" in markdown
    assert (
        page.read_text() == markdown and (page.parent / "rounds.png").read_bytes() == (out / "rounds.png").read_bytes()
    )
    header = dict(PROVENANCE_ROW.findall(markdown))
    assert header["command"] == "`kfed-spark bench-paper`"  # main() here, not a process: argv is pytest's
    assert len(header) == 7 and re.match(r"[0-9a-f]{12}", header["commit"]) and "cores" in header["machine"]
    assert main(["bench-paper", "--datasets", "cifar", "--out", str(out)]) == 2
    assert "--datasets takes names from femnist, shakespeare, mixture" in capsys.readouterr().err
    assert main(["bench-paper", "--rounds", "0,2", "--out", str(out)]) == 2
    assert "--rounds at least 1" in capsys.readouterr().err


@pytest.mark.fast
def test_a_method_named_with_pipes_stays_in_its_table_cell():
    rows = [RoundsRow("femnist", "Spark MLlib KMeans (k-means|| initialization)", 3, 1.02, 9.0)]
    table = [line for line in markdown([], rows, [], "kfed-spark bench-paper", 60.0).splitlines() if "femnist" in line]
    assert table == ["| femnist | Spark MLlib KMeans (k-means\\|\\| initialization) | 3 | 1.020 | 9.0 |"]
    assert cell("a|b") == "a\\|b"
