"""MLflow tracking (the `mlflow` extra): each published attempt logged as an MLflow run.

With `tracking.mlflow` in the config, a run logs its published attempt after the publish: the settings
as parameters, the counts, cost, ARI and stage timings as metrics, the report files, and the model as an
MLflow pyfunc model with a signature (rows of device_id and features in, cluster_id out), which labels
rows with numpy alone, as the job's workers do. Tags link the MLflow run back to the run id, the attempt
and the output location, and the attempt's row of `runs` records the MLflow run id. Tracking can never
unpublish an attempt: a failure is a warning and the row's tracking_error.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kfed_spark.errors import first_line

log = logging.getLogger("kfed_spark")

LOCAL_CENTERS_FILE = "local_centers.parquet"
GLOBAL_FILE = "global.npz"
SETTINGS_FILE = "settings.json"


def track_attempt(cfg, row, tables, clustering) -> None:
    """Log the published attempt (its final runs row `row`) to MLflow and record the outcome in runs.
    Never raises: the attempt is published whatever happens here."""
    try:
        mlflow_run_id, error = log_attempt(cfg, row, tables, clustering), None
        log.info("run %s: attempt %s logged to MLflow as run %s", row.run_id, row.attempt_id, mlflow_run_id)
    except Exception as exc:
        mlflow_run_id, error = None, first_line(exc) or type(exc).__name__
        log.warning(
            "run %s: attempt %s is published, but logging it to MLflow failed: %s", row.run_id, row.attempt_id, error
        )
    try:
        tables.record_tracking(row.run_id, row.attempt_id, mlflow_run_id, error)
    except Exception as exc:
        log.warning("run %s: could not record the MLflow outcome in runs: %s", row.run_id, first_line(exc))


def log_attempt(cfg, row, tables, clustering) -> str:
    """The MLflow run id the attempt was logged as."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    settings = cfg.tracking.mlflow
    client = MlflowClient(tracking_uri=settings.uri)
    experiment = client.get_experiment_by_name(settings.experiment)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(settings.experiment)
    tags = {
        "kfed.run_id": row.run_id,
        "kfed.attempt_id": row.attempt_id,
        "kfed.output": tables.root,
        "kfed.input": row.input,
    }
    run = client.create_run(experiment_id, run_name=row.run_id, tags=tags)
    mlflow_run_id = run.info.run_id
    try:
        now = int(time.time() * 1000)
        params = asdict(cfg.algorithm)
        params.update(k=row.k, identity_mode=row.identity_mode, label_mode=row.label_mode)
        figures = {name: getattr(row, name) for name in ("n_input", "n_labelled", "n_quarantined", "n_devices")}
        figures.update(
            n_local_centers=row.n_local_centers,
            n_rows_held_back=row.n_rows_held_back,
            cost=row.cost,
            ari=row.ari,
            truth_cost=row.truth_cost,
        )
        figures.update({f"seconds_{stage}": seconds for stage, seconds in (row.timings or {}).items()})
        client.log_batch(
            mlflow_run_id,
            metrics=[Metric(name, float(value), now, 0) for name, value in figures.items() if value is not None],
            params=[Param(name, str(value)) for name, value in params.items()],
        )
        with tempfile.TemporaryDirectory(prefix="kfed-mlflow-") as work:
            report = tables.report_files(row.run_id, row.attempt_id)
            if report:
                folder = Path(work, "report")
                folder.mkdir()
                for name, data in report.items():
                    (folder / name).write_bytes(data)
                client.log_artifacts(mlflow_run_id, str(folder), "report")
            model = Path(work, "model")
            save_pyfunc_model(model, clustering, row.label_mode)
            client.log_artifacts(mlflow_run_id, str(model), "model")
    except BaseException:
        client.set_terminated(mlflow_run_id, "FAILED")
        raise
    client.set_terminated(mlflow_run_id)
    return mlflow_run_id


def save_pyfunc_model(path: Path, clustering, label_mode: str) -> None:
    """The clustering as an MLflow pyfunc model at path: its local centers (Parquet), global centers, their
    ids and assignment (npz), loaded by this module's _load_pyfunc."""
    import mlflow.pyfunc
    from mlflow.models import infer_signature

    with tempfile.TemporaryDirectory(prefix="kfed-model-") as work:
        data = Path(work, "data")
        data.mkdir()
        local, server = clustering.local, clustering.server
        pq.write_table(local.table, data / LOCAL_CENTERS_FILE)
        np.savez(data / GLOBAL_FILE, centers=server.centers, assignment=server.assignment, ids=clustering.cluster_ids)
        (data / SETTINGS_FILE).write_text(json.dumps({"label_mode": label_mode, "dim": int(clustering.dim)}))
        example = pa.table({"device_id": local.table.column("device_id"), "features": local.table.column("center")})
        example = example.slice(0, 5).to_pandas()
        model = KFedPyfunc(str(data))
        with warnings.catch_warnings():  # that integer columns cannot hold nulls: device ids never are
            warnings.simplefilter("ignore", UserWarning)
            signature = infer_signature(example, model.predict(example))
        mlflow.pyfunc.save_model(
            str(path),
            loader_module="kfed_spark.runs.tracking",
            data_path=str(data),
            signature=signature,
            input_example=example,
            pip_requirements=["kfed-spark", "numpy", "pandas", "pyarrow"],
        )


class KFedPyfunc:
    """A published clustering as a pyfunc model: predict() takes rows of device_id and features and
    returns their cluster ids, with numpy alone (a device the model has not seen: the nearest global center)."""

    def __init__(self, data_path: str):
        from kfed_spark.core.local_centers import LocalCenters

        folder = Path(data_path)
        settings = json.loads((folder / SETTINGS_FILE).read_text())
        arrays = np.load(folder / GLOBAL_FILE)
        local = LocalCenters.from_arrow(pq.read_table(folder / LOCAL_CENTERS_FILE), settings["dim"])
        self.model = local.label_model(
            arrays["assignment"], arrays["centers"], settings["label_mode"], True, arrays["ids"]
        )

    def predict(self, model_input, params=None):
        import pandas as pd

        x = np.asarray([np.asarray(row, dtype=np.float64) for row in model_input["features"]])
        _, cluster, _, _ = self.model.label(model_input["device_id"].to_numpy(), x)
        return pd.Series(np.asarray(cluster, dtype=np.int64), name="cluster_id")


def _load_pyfunc(data_path: str) -> KFedPyfunc:
    """MLflow's entry point for a model saved with loader_module=kfed_spark.runs.tracking."""
    return KFedPyfunc(data_path)
