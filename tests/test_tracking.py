"""MLflow tracking against a real tracking server (`mlflow server`, SQLite store, on 127.0.0.1, stopped by
pid), read back with MLflow's client; and a tracking server that cannot be reached, which must leave the
attempt published."""

import os

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from helpers import N_ROWS, free_port, published, run_cli, runs_of, servers, tool_python, wait_for_port

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


def test_a_published_attempt_is_logged_with_its_figures_report_and_model(
    spark, config, tmp_path, tracking_server, monkeypatch
):
    out = tmp_path / "out"
    assert run_cli(config, f"tracking.mlflow.uri={tracking_server}", "tracking.mlflow.experiment=kfed-test") == 0
    (row,) = runs_of(spark, out)
    assert row.status == "succeeded" and row.mlflow_run_id and row.tracking_error is None

    client = MlflowClient(tracking_server)
    run = client.get_run(row.mlflow_run_id)
    assert client.get_experiment(run.info.experiment_id).name == "kfed-test" and run.info.status == "FINISHED"
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

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server)  # where runs:/ URIs are looked up
    model = mlflow.pyfunc.load_model(f"runs:/{row.mlflow_run_id}/model")
    assert model.metadata.get_input_schema().input_names() == ["device_id", "features"]
    labels = published(spark, out, "labels").orderBy("row_id").limit(300).toPandas()
    rows = pd.DataFrame({"device_id": labels.device_id, "features": labels.features.map(np.asarray)})
    assert list(model.predict(rows)) == list(labels.cluster_id)


def test_an_unreachable_tracking_server_leaves_the_attempt_published_with_a_warning(
    spark, config, tmp_path, caplog, monkeypatch
):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries take minutes
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert run_cli(config, f"tracking.mlflow.uri={nowhere}") == 0
    (row,) = runs_of(spark, tmp_path / "out")
    assert (row.status, row.mlflow_run_id) == ("succeeded", None) and row.tracking_error
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "MLflow" in r.getMessage()]
    assert warned == [
        f"run first: attempt {row.attempt_id} is published, but logging it to MLflow failed: {row.tracking_error}"
    ]
