"""MLflow tracking against a real tracking server (`mlflow server`, SQLite store, on 127.0.0.1, stopped by
pid), read back with MLflow's client; and tracking servers that refuse connections or never answer, which
must leave the attempt published and hold the run seconds at most, with MLflow's own settings untouched."""

import os
import socket
import time
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from helpers import (
    MIXTURE,
    N_ROWS,
    clean_environment,
    duckdb_published,
    free_port,
    published,
    run_cli,
    run_cli_process,
    runs_of,
    servers,
    tool_python,
    wait_for_port,
)

pytestmark = pytest.mark.integration  # the MLflow server is a process of its own

SERVER_REQUIREMENTS = ["mlflow>=3.17,<4"]
"""The tracking server, in an environment of its own: MLflow's server pins a pyarrow below the job's."""


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    command = [
        str(tool_python("mlflow", SERVER_REQUIREMENTS)),
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination",
        str(folder / "artifacts"),
    ]
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYSPARK", "VIRTUAL_ENV"))}
    # Without MLflow's job runner (huey consumers for its GenAI jobs), which tracking does not use and whose
    # consumers only take CPU from the other tests.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    with servers(folder) as start:
        wait_for_port(port, start(command, env))
        yield f"http://127.0.0.1:{port}"


def user_environment() -> dict[str, str]:
    """The CLI's environment as a user has it: no MLflow setting, so MLflow's client keeps its defaults."""
    return {key: value for key, value in clean_environment().items() if not key.startswith("MLFLOW_")}


def mlflow_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " WARNING " in line and "MLflow" in line]


def test_a_published_attempt_is_logged_with_its_figures_report_and_model(
    spark, config, tmp_path, tracking_server, monkeypatch
):
    """The CLI as a process of its own, which stops its Spark session before it logs the published attempt;
    into an experiment made before, which keeps its artifacts where the server does."""
    out = tmp_path / "out"
    client = MlflowClient(tracking_server)
    client.create_experiment("kfed-test")
    tracking = ["--set", f"tracking.mlflow.uri={tracking_server}", "--set", "tracking.mlflow.experiment=kfed-test"]
    ran = run_cli_process("run", "--config", str(config), *tracking, env=user_environment(), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert not mlflow_warnings(ran.stderr)
    (row,) = runs_of(spark, out)
    assert row.status == "succeeded" and row.mlflow_run_id and row.tracking_error is None

    run = client.get_run(row.mlflow_run_id)
    assert client.get_experiment(run.info.experiment_id).name == "kfed-test" and run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/") and not (out / "mlflow").exists()
    assert {key: run.data.tags[key] for key in ("kfed.run_id", "kfed.attempt_id", "kfed.output")} == {
        "kfed.run_id": "first",
        "kfed.attempt_id": row.attempt_id,
        "kfed.output": str(out),
    }
    assert (run.data.params["k"], run.data.params["seed"]) == (str(row.k), str(row.seed))
    metrics = run.data.metrics
    assert metrics["n_labelled"] == N_ROWS and metrics["cost"] == pytest.approx(row.cost)
    assert metrics["ari"] == pytest.approx(row.ari) and metrics["seconds_local_step"] > 0
    assert {a.path for a in client.list_artifacts(row.mlflow_run_id, "report")} == {
        "report/report.json",
        "report/report.html",
    }
    assert metrics["clusters_per_device_in_effect"] == pytest.approx(row.clusters_per_device_in_effect)
    profiles = pd.read_csv(client.download_artifacts(row.mlflow_run_id, "profiles/cluster_profiles.csv", str(tmp_path)))
    assert len(profiles) == MIXTURE["k"] * MIXTURE["dim"] and set(profiles.feature) == {f"f{j}" for j in range(8)}

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server)  # where runs:/ URIs are looked up
    model = mlflow.pyfunc.load_model(f"runs:/{row.mlflow_run_id}/model", dst_path=str(tmp_path))  # not into /tmp
    assert model.metadata.get_input_schema().input_names() == ["device_id", "features"]
    labels = published(spark, out, "labels").orderBy("row_id").limit(300).toPandas()
    rows = pd.DataFrame({"device_id": labels.device_id, "features": labels.features.map(np.asarray)})
    assert list(model.predict(rows)) == list(labels.cluster_id)


def test_an_experiment_that_tracking_creates_keeps_its_artifacts_where_the_tables_are(
    spark, config, mixture_path, s3, tmp_path, tracking_server, monkeypatch
):
    """Tables on the bucket: the new experiment's artifacts go to <output>/mlflow in the bucket, written with
    the config's S3A settings alone (the CLI has no AWS or MLflow variable), and MLflow reads the model there.
    `forget` then deletes them (the model holds every device's local centers), with the same settings."""
    out = s3.url("tracked-out")
    on_bucket = s3.config(config, s3.upload(Path(mixture_path), "tracked-in"), out, tmp_path / "bucket.yaml")
    tracking = ["--set", f"tracking.mlflow.uri={tracking_server}", "--set", "tracking.mlflow.experiment=kfed-bucket"]
    ran = run_cli_process("run", "--config", str(on_bucket), *tracking, env=user_environment(), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert not mlflow_warnings(ran.stderr)
    (row,) = duckdb_published(out, "runs", s3.storage_options).to_pylist()

    run = MlflowClient(tracking_server).get_run(row["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri == f"s3://kfed/tracked-out/mlflow/{row['mlflow_run_id']}/artifacts"
    artifacts = f"tracked-out/mlflow/{row['mlflow_run_id']}/artifacts"
    assert {f"{artifacts}/report/report.json", f"{artifacts}/model/MLmodel"} <= set(s3.keys(artifacts))

    for key, value in s3.storage_options.items():  # MLflow reads S3 with boto3, which takes the AWS_* variables
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server)
    model = mlflow.pyfunc.load_model(f"runs:/{row['mlflow_run_id']}/model", dst_path=str(tmp_path))
    labels = duckdb_published(out, "labels", s3.storage_options).sort_by("row_id").slice(0, 300).to_pandas()
    rows = pd.DataFrame({"device_id": labels.device_id, "features": labels.features.map(np.asarray)})
    assert list(model.predict(rows)) == list(labels.cluster_id)

    forget = ["forget", "--config", str(on_bucket), "--device", "3", "--run", "first"]
    forgot = run_cli_process(*forget, env=user_environment(), cwd=tmp_path)
    assert forgot.returncode == 0, forgot.stderr[-3000:]
    assert (
        "run first: the artifacts of its attempts' MLflow runs, the devices' local centers among them, are deleted "
        f"({out}/mlflow/{row['mlflow_run_id']}); their params and metrics stay in MLflow"
    ) in forgot.stdout.splitlines()
    assert s3.keys(artifacts) == [] and s3.keys("tracked-out/labels")


def test_a_tracking_server_that_refuses_connections_costs_a_run_seconds_not_minutes(spark, config, tmp_path):
    """Each run a process of its own, as cron or Airflow starts it, with no MLflow environment variable: the
    run with tracking (first, so it also creates the tables) ends within 30 s of the same run without."""
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    walls, ran = {}, {}
    for run_id, settings in (("tracked", ["--set", f"tracking.mlflow.uri={nowhere}"]), ("untracked", [])):
        start = time.monotonic()
        ran[run_id] = run_cli_process(
            "run", "--config", str(config), "--set", f"run_id={run_id}", *settings, env=user_environment(), cwd=tmp_path
        )
        walls[run_id] = time.monotonic() - start
        assert ran[run_id].returncode == 0, ran[run_id].stderr[-3000:]
    assert walls["tracked"] < walls["untracked"] + 30, walls
    rows = {row.run_id: row for row in runs_of(spark, tmp_path / "out")}
    tracked = rows["tracked"]
    assert (tracked.status, tracked.mlflow_run_id) == ("succeeded", None)
    assert tracked.tracking_error.startswith(f"cannot connect to the MLflow server at {nowhere}")
    (warned,) = mlflow_warnings(ran["tracked"].stderr)
    failed = f"attempt {tracked.attempt_id} is published, but logging it to MLflow failed: {tracked.tracking_error}"
    assert warned.endswith(f"run tracked: {failed}")
    assert not mlflow_warnings(ran["untracked"].stderr) and rows["untracked"].tracking_error is None


def test_a_tracking_server_that_never_answers_is_given_timeout_s(spark, config, tmp_path, caplog):
    """A server that accepts the connection and never answers (MLflow's client would wait two minutes a
    request): the attempt is published, with one warning, as soon as timeout_s has passed."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # its backlog takes the connection; nobody answers
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        assert run_cli(config, f"tracking.mlflow.uri={uri}", "tracking.mlflow.timeout_s=3") == 0
        took = time.monotonic() - start
    (row,) = runs_of(spark, tmp_path / "out")
    assert (row.status, row.mlflow_run_id) == ("succeeded", None)
    assert row.tracking_error == "no answer within 3 s (tracking.mlflow.timeout_s)"
    assert took < 60, took  # the run itself; MLflow's own timeout alone is 120 s
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "MLflow" in r.getMessage()]
    assert warned == [
        f"run first: attempt {row.attempt_id} is published, but logging it to MLflow failed: {row.tracking_error}"
    ]
