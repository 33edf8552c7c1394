"""The benchmark's reports on a tiny mixture: every contender measured, fresh processes and one warm session."""

import json
import sys

import pytest

from kfed_spark.bench.benchmark import ONE_RESTART, SPARK_JVM, benchmark, run_mllib
from kfed_spark.bench.processes import KFED, MLLIB, PASSES, SWEEP
from kfed_spark.bench.synthetic import write_mixture


@pytest.mark.integration  # the benchmark end to end: the job, MLlib with a Delta write, the floor, scikit-learn
def test_benchmark_reports_every_method_with_costs_and_ratios(spark, tmp_path):
    data = tmp_path / "input"
    write_mixture(data, k=6, k_per_device=2, devices=30, points_per_device=40, dim=3, seed=2)
    report = benchmark(spark, str(data), tmp_path / "bench", k=6, k_per_device=2, seed=2, command="test", repeats=1)

    names = [e.name for e in report.entries]
    assert names == [
        "k-FED on Spark, end to end",
        ONE_RESTART,
        "k-FED without Spark (floor): pyarrow + numpy",
        "Spark MLlib KMeans, fit only",
        "Spark MLlib KMeans, fit + transform + Delta write",
        "scikit-learn KMeans, all rows in one process",
    ]
    kfed, one_restart, floor = report.entries[:3]
    assert kfed.ari == floor.ari and abs(kfed.cost - floor.cost) <= 1e-9 * floor.cost  # same kernels, same seeds
    assert kfed.ari > 0.95 and kfed.cost_ratio < 1.05
    assert set(kfed.stages) >= {"validate", "local_step", "server_step", "labels", "other_tables"}
    assert all(e.seconds > 0 and e.rows_per_second > 0 for e in report.entries)
    assert one_restart.ari > 0.95 and "local_step" in one_restart.stages
    assert len(report.ratios) == 8
    passes = report.spark_passes
    assert all(seconds > 0 for seconds in passes.values()) and len(passes) == 4
    fit, total, labels = run_mllib(spark, str(data), tmp_path / "capped", k=6, seed=2, limit=0.001)
    assert fit.lower_bound and total.lower_bound and fit.seconds == 0.001 and labels is None
    markdown = report.markdown()
    assert "| k-FED on Spark, end to end |" in markdown and "MLlib fit time / k-FED end-to-end time" in markdown
    assert "| read -> Delta write |" in markdown


@pytest.mark.integration  # five processes of their own, each with its JVM
def test_the_fresh_process_benchmark_times_each_contender_as_its_own_process(tmp_path, capsys):
    from kfed_spark.cli import main

    data = tmp_path / "input"
    write_mixture(data, k=6, k_per_device=2, devices=30, points_per_device=40, dim=3, seed=2)
    assert (
        main(
            [
                "bench",
                "--data",
                str(data),
                "--out",
                str(tmp_path / "bench"),
                "--k",
                "6",
                "--k-per-device",
                "2",
                "--seed",
                "2",
                "--no-warm",
            ]
        )
        == 0
    )

    saved = json.loads((tmp_path / "bench" / "benchmark.json").read_text())
    assert set(saved) == {"given"}  # --data: the table given, not the generated shapes
    saved = saved["given"]
    assert set(saved) == {"fresh"}
    fresh = saved["fresh"]
    assert fresh["rows"] == 1200 and [run["name"] for run in fresh["runs"]] == [
        KFED,
        f"{SWEEP}, k = 2..60",
        MLLIB,
        PASSES,
    ]  # 30 devices x 2 local centers cap the sweep at 60
    kfed, sweep, mllib, passes = fresh["runs"]
    assert list(kfed["stages"])[:3] == ["session", "validate", "claim"] and "publish" in kfed["stages"]
    for run in fresh["runs"]:  # the stages and the rest add up to the wall time
        assert run["seconds"] > 0 and abs(sum(run["stages"].values()) - run["seconds"]) < 0.01
        assert (
            run["peak_memory_mb"]["python driver"] > 0
            and run["peak_memory_mb"]["spark JVM (driver and executors in local mode)"] > 100
        )
    assert kfed["ari"] > 0.95 and mllib["ari"] > 0.5 and passes["cost"] is None
    assert kfed["peak_memory_mb"]["largest python worker"] > 0  # the sampler sees the job's workers
    for run in fresh["runs"]:  # the sampler sees each process's CPU time, by role
        assert run["cpu_seconds"]["python driver"] > 0 and run["cpu_seconds"][SPARK_JVM] > 1
    assert kfed["cpu_seconds"]["python workers"] > 0
    assert "| CPU s: driver, JVM, workers |" in (tmp_path / "bench" / "benchmark.md").read_text()
    assert set(fresh["ratios"]) == {
        "MLlib / k-FED, wall time",
        "k-FED / Spark's bare passes, wall time",
        "k-FED cost / MLlib cost",
        "k sweep of 59 ks / one MLlib read and fit at k = 6, wall time",
    }
    assert sweep["stages"]["server steps and figures"] > 0 and "the input's true k is 6" in fresh["notes"][-1]
    assert "### Fresh processes" in capsys.readouterr().out
    runs = tmp_path / "bench" / "given" / "fresh" / "kfed" / "runs"
    assert runs.is_dir()  # the setup run created the location the timed run wrote into


@pytest.mark.fast
def test_server_benchmark_times_both_seeding_rules_and_refinements(capsys):
    from kfed_spark.cli import main

    assert main(["bench-server", "--devices", "200", "--per-device", "3", "--k", "10", "--dim", "4"]) == 0
    lines = dict(line.split(": ") for line in capsys.readouterr().out.strip().splitlines())
    assert float(lines["local_centers"]) == 600 and float(lines["k"]) == 10
    for seeding in ("farthest", "kmeanspp"):
        assert float(lines[f"refine rounds, seeding={seeding} server_refine=none"]) == 0
        assert float(lines[f"refine rounds, seeding={seeding} server_refine=lloyd"]) >= 1
        assert float(lines[f"weighted cost, seeding={seeding} server_refine=lloyd"]) <= float(
            lines[f"weighted cost, seeding={seeding} server_refine=none"]
        )
    assert float(lines["kmeanspp / farthest seconds, server_refine=lloyd"]) > 0


@pytest.mark.spark
def test_distributed_server_benchmark_merges_generated_centers_in_spark(spark, tmp_path, capsys):
    from kfed_spark.cli import main

    assert (
        main(
            [
                "bench-server",
                "--distributed",
                "--devices",
                "2000",
                "--per-device",
                "3",
                "--k",
                "10",
                "--dim",
                "4",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    lines = dict(line.split(": ") for line in capsys.readouterr().out.strip().splitlines())
    assert float(lines["local_centers"]) == 6000 and float(lines["ARI against the generating means"]) == 1.0
    assert 0 < float(lines["representatives merged on the driver"]) < 6000
    assert float(lines["seconds, distributed server step"]) > 0 and float(lines["peak memory MB, python driver"]) > 0


@pytest.mark.fast
def test_benchmarks_without_scikit_learn_say_so_before_any_work(tmp_path, monkeypatch, capsys):
    """A plain install has no scikit-learn; the benchmarks refuse in one line instead of failing at the end."""
    from kfed_spark.cli import main

    monkeypatch.setitem(sys.modules, "sklearn", None)  # as if not installed: find_spec and import say so
    hints = {"bench": "or pass --no-sklearn", "bench-quality": "(its centralized baseline)"}
    hints["bench-paper"] = "(its centralized k-means)"
    for name, hint in hints.items():
        assert main([name, "--out", str(tmp_path / name)]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"kfed-spark: error: {name} needs scikit-learn: pip install 'kfed-spark[bench]' {hint}"
        )
        assert not (tmp_path / name).exists()
