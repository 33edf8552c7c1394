"""The job where users start it: tested with processes whose environment is not the developer's."""

import json
import subprocess
from pathlib import Path

import pytest

from helpers import MIXTURE, N_ROWS, bare_environment, clean_environment, cli_process, published, run_cli_process
from kfed_spark.cli import main
from kfed_spark.runtime.packaging import delta_package

pytestmark = pytest.mark.integration  # processes of their own: spark-submit, servers, the CLI


def test_the_cli_started_by_its_absolute_path_needs_no_activated_environment(spark, config, tmp_path):
    """cron, systemd or a BashOperator start /path/to/env/bin/kfed-spark with a PATH whose python3 has
    no numpy: local-mode workers must run the CLI's own interpreter, not `python3` from PATH.

    Its Spark event log also shows the passes over the input of a run with truth and report: the
    dimension sample (the first 10,000 rows: here all 6,000), the local step and the labelling pass
    read every row; counting, evaluation and the report's sample add no pass of their own."""
    env = bare_environment(tmp_path / "bare")  # asserts that its python3 has no numpy
    events = tmp_path / "events"
    events.mkdir()
    event_log = {"enabled": "true", "compress": "false", "dir": events.as_uri()}
    settings = [
        arg for key, value in event_log.items() for arg in ("--set", f"spark.conf.spark.eventLog.{key}={value}")
    ]
    result = run_cli_process("run", "--config", str(config), "--set", "report=true", *settings, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert published(spark, tmp_path / "out", "labels").count() == N_ROWS
    read_by_stage = records_read_by_stage(events)
    assert sum(read >= N_ROWS for read in read_by_stage.values()) == 3, read_by_stage
    assert sum(read_by_stage.values()) < 4 * N_ROWS  # the rest: one Arrow batch for the device check, Delta logs
    # Delta's jars, resolved once (by the test session), are named directly: no Ivy report on every start.
    assert ":: retrieving ::" not in result.stderr and "Ivy Default Cache" not in result.stderr

    # --quiet: no stage lines, and the one-line error is the last line on stderr.
    failed = run_cli_process(
        "run", "--config", str(config), "--quiet", "--set", "input.truth_col=nope", env=env, cwd=tmp_path
    )
    lines = [line for line in failed.stderr.splitlines() if line.strip()]
    assert failed.returncode == 2 and lines[-1].startswith("kfed-spark: error: input has no truth column 'nope'")
    assert not [line for line in lines if " INFO kfed_spark" in line]


def records_read_by_stage(events: Path) -> dict[int, int]:
    """Input records read per stage, from the Spark event logs under `events`."""
    read_by_stage = {}
    for log in events.rglob("events_*"):  # Spark 4 writes rolling logs, in a folder per application
        for line in log.read_text().splitlines():
            event = json.loads(line)
            if event["Event"] == "SparkListenerTaskEnd":
                read = (event.get("Task Metrics") or {}).get("Input Metrics", {}).get("Records Read", 0)
                read_by_stage[event["Stage ID"]] = read_by_stage.get(event["Stage ID"], 0) + read
    return read_by_stage


def test_run_prints_its_figures_as_json(spark, config, capsys):
    assert main(["run", "--config", str(config), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert (figures["run_id"], figures["n_labelled"], figures["n_quarantined"]) == (
        "first",
        MIXTURE["devices"] * MIXTURE["points_per_device"],
        0,
    )
    assert figures["attempt_id"] and figures["ari"] >= 0.95 and "labels" in figures["timings"]


def test_without_delta_on_the_classpath_the_last_line_says_so(config, tmp_path):
    """Spark's own jars only (KFED_DELTA_JARS names one that is not Delta): one error line, last, with the
    --packages coordinate, and no traceback."""
    from pyspark.find_spark_home import _find_spark_home

    not_delta = next((Path(_find_spark_home()) / "jars").glob("slf4j-api-*.jar"))
    result = run_cli_process(
        "run",
        "--config",
        str(config),
        "--quiet",
        cwd=tmp_path,
        env={**clean_environment(), "KFED_DELTA_JARS": str(not_delta)},
    )
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and last.startswith("kfed-spark: error: Delta Lake is not on Spark's classpath")
    assert last.endswith(f"pass --packages {delta_package()}") and "Traceback" not in result.stderr


def test_the_local_template_runs_on_a_table_without_a_truth_column(spark, mixture_path, tmp_path, capsys):
    """conf/local.yaml is the template users start from: it must name no column their table may lack."""
    import pyarrow.parquet as pq

    table = pq.read_table(mixture_path).drop_columns(["true_cluster"])
    (tmp_path / "mine").mkdir()
    pq.write_table(table, tmp_path / "mine" / "part-0.parquet")
    template = Path(__file__).resolve().parents[1] / "conf" / "local.yaml"
    assert (
        main(
            [
                "run",
                "--config",
                str(template),
                "--set",
                f"input.path={tmp_path / 'mine'}",
                "--set",
                f"output.path={tmp_path / 'out'}",
                "--set",
                f"k={MIXTURE['k']}",
                "--set",
                f"k_per_device={MIXTURE['k_per_device']}",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["n_labelled"] == table.num_rows


def test_a_failing_run_logs_no_progress_bar_to_a_file(mixture_path, tmp_path):
    """The local template run as cron or Airflow runs it, stderr to a file: no carriage return (Spark's
    progress bar is off), and the error is the last line, of its own."""
    env = bare_environment(tmp_path / "bare")
    template = Path(__file__).resolve().parents[1] / "conf" / "local.yaml"
    with open(tmp_path / "stderr.log", "wb") as log_file:
        failed = cli_process(
            "run",
            "--config",
            str(template),
            "--set",
            f"input.path={mixture_path}",
            "--set",
            "k=100000",
            "--set",
            "spark.conf.spark.sql.shuffle.partitions=2",
            env=env,
            cwd=tmp_path / "bare",
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
        failed.wait(timeout=600)
    logged = (tmp_path / "stderr.log").read_bytes()
    assert failed.returncode == 2 and b"\r" not in logged and b"[Stage" not in logged
    assert logged.decode().rstrip("\n").splitlines()[-1].startswith("kfed-spark: error: k = 100000 is more than the ")
