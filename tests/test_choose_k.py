"""Choosing k: runs with k: auto, and `kfed-spark choose-k` over a published run's local centers."""

import json

import pytest
from pyspark.sql import functions as F

from helpers import MIXTURE, published, run_cli, runs_of
from kfed_spark.cli import main
from kfed_spark.config import OutputConfig
from kfed_spark.runs.report import K_SWEEP_FILES
from kfed_spark.runtime.fault_injection import FAULT_ENV
from kfed_spark.store.output import OutputTables

pytestmark = pytest.mark.spark

TRUE_K = MIXTURE["k"]


def test_k_auto_runs_and_choose_k_sweep_published_attempts_only(spark, config, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main(["choose-k", "--output", str(out), "--k", "2:20"]) != 0
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("kfed-spark: error: no succeeded run under")

    # k: auto sweeps after the local step, chooses, records; the same input chooses the same k again.
    auto = ("k=auto", "k_range=[3, 20]")
    assert main(["run", "--config", str(config), "--dry-run", *[a for item in auto for a in ("--set", item)]]) == 0
    assert "k = auto (after the local step, a sweep of k = 3..20 over the local centers chooses it)" in (
        capsys.readouterr().out
    )
    assert run_cli(config, *auto) == 0
    assert run_cli(config, *auto, "run_id=again") == 0
    rows = {row.run_id: row for row in runs_of(spark, out)}
    for row in rows.values():
        assert row.status == "succeeded" and row.k == TRUE_K and row.k_range == [3, 20]
        assert [entry.k for entry in row.k_sweep] == list(range(3, 21))
        assert json.loads(row.config)["k"] == "auto"
    assert rows["first"].k_sweep == rows["again"].k_sweep  # the same input, the same sweep to the last bit
    labels = published(spark, out, "labels").filter(F.col("run_id") == "first")
    assert labels.select("cluster_id").distinct().count() == TRUE_K and labels.count() == 6000
    assert published(spark, out, "centers").filter(F.col("run_id") == "first").count() == TRUE_K
    swept = json.loads(OutputTables(spark, OutputConfig(path=str(out))).read_report("first", "k_sweep.json"))
    assert swept["recommended_k"] == TRUE_K and swept["attempt_id"] == rows["first"].attempt_id

    # A failed attempt's local centers may be written; it is never swept.
    monkeypatch.setenv(FAULT_ENV, "fail:labels")
    assert run_cli(config, "run_id=broken") == 2
    monkeypatch.delenv(FAULT_ENV)
    capsys.readouterr()
    assert main(["choose-k", "--output", str(out), "--k", "2:20", "--run", "broken"]) != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"kfed-spark: error: no published run 'broken' under {out}"

    # choose-k sweeps the newest published run by default, and stores the sweep beside its report.
    assert main(["choose-k", "--output", str(out), "--k", "2:24:2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    again = rows["again"]
    assert (result["run_id"], result["attempt_id"]) == ("again", again.attempt_id)
    assert result["recommended_k"] == TRUE_K and [f["k"] for f in result["figures"]] == list(range(2, 25, 2))
    assert result["n_local_centers"] == again.n_local_centers and result["n_rows"] == again.n_labelled
    for name in K_SWEEP_FILES:
        assert (out / "reports" / "again" / again.attempt_id / name).stat().st_size > 0
    assert main(["choose-k", "--output", str(out), "--k", "10:14", "--run", "first"]) == 0
    text = capsys.readouterr().out
    assert f"recommended k = {TRUE_K}:" in text and "<- recommended" in text
