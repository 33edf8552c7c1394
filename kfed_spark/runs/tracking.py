"""MLflow tracking (the `mlflow` extra): each published attempt logged as an MLflow run.

With `tracking.mlflow` in the config, an attempt's MLflow run is created as the attempt starts, and after
the publish it gets the settings as parameters, the counts, cost, ARI and stage timings as metrics, the
report files, and the model as an MLflow pyfunc model with a signature (rows of device_id and features in,
cluster_id out), which labels rows with numpy alone, as the job's workers do. An experiment that tracking
creates keeps its artifacts where the tables are (<output>/mlflow), written with the tables' own filesystem
settings, so that a run on a bucket needs no second set of credentials for MLflow. Tags link the MLflow run back
to the run id, the attempt and the output location, and the attempt's row of `runs` records the MLflow run
id. Each moment is bounded (AttemptTracking). Tracking can never unpublish an attempt or change the exit
code: a failure is a warning (and the row's tracking_error, when the MLflow run could not be created).
"""

from __future__ import annotations

import json
import logging
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Generic, TypeVar
from urllib.parse import urlparse
from urllib.request import getproxies, proxy_bypass

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from kfed_spark.config import MlflowTracking
from kfed_spark.core.identity import DRIFT_COLUMNS
from kfed_spark.errors import first_line
from kfed_spark.spark.input import URI_PATTERN
from kfed_spark.store.output import OutputTables

log = logging.getLogger("kfed_spark")

T = TypeVar("T")

LOCAL_CENTERS_FILE = "local_centers.parquet"
GLOBAL_FILE = "global.npz"
SETTINGS_FILE = "settings.json"
ARTIFACTS_FOLDER = "mlflow"
"""Under the output location: the artifacts of the MLflow runs in experiments that tracking created."""


class Bounded(Generic[T]):
    """work(*args) in a daemon thread, waited for until `seconds` after it started: a neighbour that does
    not answer (MLflow's client retries a refused request for minutes) costs the run that long at most,
    and a process that is done does not wait for it to give up."""

    def __init__(self, seconds: float, work: Callable[..., T], *args):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.done = threading.Event()
        self.value: T | None = None
        self.error: str | None = None

        def bounded() -> None:
            try:
                self.value = work(*args)
            except BaseException as exc:
                self.error = first_line(exc) or type(exc).__name__
            finally:
                self.done.set()

        threading.Thread(target=bounded, name="kfed-mlflow", daemon=True).start()

    def outcome(self) -> tuple[T | None, str | None]:
        """(its value, None), or (None, why not): its error, or that it did not end in time."""
        if not self.done.wait(max(0.0, self.deadline - time.monotonic())):
            return None, f"no answer within {self.seconds:g} s (tracking.mlflow.timeout_s)"
        return self.value, self.error


class AttemptTracking:
    """An attempt's MLflow run, in two bounded moments (tracking.mlflow.timeout_s each).

    As the attempt starts, its MLflow run is created in the background, beside the attempt's own work, so
    that the runs row it publishes already holds mlflow_run_id (or tracking_error): nothing is written to
    the tables after the publish. After the publish (and after the Spark session that the run started is
    stopped: no executor waits on MLflow), the figures, the report and the model are logged to that run,
    which is then set FINISHED. An attempt that fails sets its MLflow run FAILED. Whatever MLflow does,
    the attempt's outcome and the process's exit code stay as they are: one warning says what failed.
    """

    def __init__(self, settings: MlflowTracking, row, output_root: str):
        self.settings = settings
        self.artifacts_folder = artifacts_folder(output_root)
        self.created = Bounded(settings.timeout_s, create_mlflow_run, settings, row, output_root)

    def columns(self) -> dict[str, str | None]:
        """The runs row's mlflow_run_id and tracking_error (waits for the MLflow run until its deadline)."""
        mlflow_run_id, error = self.created.outcome()
        return {"mlflow_run_id": mlflow_run_id, "tracking_error": error}

    def finish(
        self, cfg, row, report: dict[str, bytes], profiles: pa.Table, clustering, artifacts_store: Located | None
    ) -> None:
        """Log the published attempt (its final runs row `row`, its report files, its cluster_profiles rows) to
        its MLflow run.
        artifacts_store: the filesystem of artifacts_folder, with the tables' settings. Never raises."""
        mlflow_run_id, error = row.mlflow_run_id, row.tracking_error
        if mlflow_run_id is not None:
            artifacts = Artifacts(self.artifacts_folder, artifacts_store)
            _, error = Bounded(
                self.settings.timeout_s,
                log_attempt,
                self.settings,
                mlflow_run_id,
                cfg,
                row,
                report,
                profiles,
                clustering,
                artifacts,
            ).outcome()
        if error is None:
            log.info("run %s: attempt %s logged to MLflow as run %s", row.run_id, row.attempt_id, mlflow_run_id)
        else:
            log.warning(
                "run %s: attempt %s is published, but logging it to MLflow failed: %s",
                row.run_id,
                row.attempt_id,
                error,
            )

    def fail(self) -> None:
        """The attempt failed: its MLflow run, once created (within its deadline), is set FAILED. Never raises."""
        mlflow_run_id, _ = self.created.outcome()
        if mlflow_run_id is not None:
            Bounded(self.settings.timeout_s, terminated, self.settings, mlflow_run_id, "FAILED").outcome()


Located = tuple[pafs.FileSystem, str]
"""A filesystem and a path in it."""


@dataclass(frozen=True)
class Artifacts:
    """Where the experiments that tracking creates keep their artifacts: folder (under the output location),
    reached through store, the tables' filesystem for it (None where pyarrow does not know its scheme)."""

    folder: str
    store: Located | None

    def upload(self, client, mlflow_run_id: str, folder: Path) -> None:
        """Every file under folder to the MLflow run's artifacts: with the tables' filesystem where the run
        keeps them under this folder, through MLflow's client elsewhere (an experiment created before)."""
        artifact_uri = client.get_run(mlflow_run_id).info.artifact_uri
        ours = mlflow_uri(self.folder)
        if self.store is None or not artifact_uri.startswith(ours + "/"):
            client.log_artifacts(mlflow_run_id, str(folder))
            return
        filesystem, base = self.store
        pafs.copy_files(str(folder), base + artifact_uri.removeprefix(ours), destination_filesystem=filesystem)


def artifacts_folder(output_root: str) -> str:
    """Where an experiment that tracking creates keeps its runs' artifacts: beside the tables, each run's in a
    folder named by its MLflow run id."""
    return f"{output_root}/{ARTIFACTS_FOLDER}"


def delete_run_artifacts(tables: OutputTables, mlflow_run_id: str) -> str | None:
    """Delete the artifacts an MLflow run keeps under the output location (<output>/mlflow/<its id>, where an
    experiment that tracking created keeps them), with the tables' filesystem and without asking MLflow;
    their folder, or None where there is none there (its experiment keeps them elsewhere)."""
    if not mlflow_run_id.isalnum():
        return None
    folder = f"{artifacts_folder(tables.root)}/{mlflow_run_id}"
    located = tables.filesystem(folder)
    if located is None:
        return None
    filesystem, path = located
    if filesystem.get_file_info(path).type != pafs.FileType.Directory:
        return None
    filesystem.delete_dir(path)
    return folder


def mlflow_uri(folder: str) -> str:
    """A folder as MLflow names it: s3a:// is MLflow's s3://, a local folder a file: URI."""
    if folder.startswith("s3a://"):
        return "s3://" + folder.removeprefix("s3a://")
    return folder if URI_PATTERN.match(folder) else Path(folder).as_uri()


def client_of(settings: MlflowTracking):
    """MLflow's client for the tracking URI; an HTTP server that refuses connections (reached without a
    proxy) is refused here, at once, instead of by MLflow's retries."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=settings.uri)
    where = urlparse(client.tracking_uri)
    proxied = where.scheme in getproxies() and not proxy_bypass(where.hostname or "")
    if where.scheme in ("http", "https") and where.hostname and not proxied:
        port = where.port or (443 if where.scheme == "https" else 80)
        try:
            socket.create_connection((where.hostname, port), timeout=settings.timeout_s).close()
        except OSError as exc:
            raise ConnectionError(f"cannot connect to the MLflow server at {client.tracking_uri}: {exc}") from None
    return client


def create_mlflow_run(settings: MlflowTracking, row, output_root: str) -> str:
    """A new MLflow run for the attempt, in the configured experiment (created if missing, with its artifacts
    under <output_root>/mlflow), tagged with what leads back to the tables; its id."""
    client = client_of(settings)
    experiment = client.get_experiment_by_name(settings.experiment)
    if experiment is None:
        location = mlflow_uri(artifacts_folder(output_root))
        experiment_id = client.create_experiment(settings.experiment, artifact_location=location)
    else:
        experiment_id = experiment.experiment_id
    tags = {
        "kfed.run_id": row.run_id,
        "kfed.attempt_id": row.attempt_id,
        "kfed.output": output_root,
        "kfed.input": row.input,
    }
    return client.create_run(experiment_id, run_name=row.run_id, tags=tags).info.run_id


def terminated(settings: MlflowTracking, mlflow_run_id: str, status: str) -> None:
    client_of(settings).set_terminated(mlflow_run_id, status)


def log_attempt(
    settings: MlflowTracking,
    mlflow_run_id: str,
    cfg,
    row,
    report: dict[str, bytes],
    profiles: pa.Table,
    clustering,
    artifacts: Artifacts,
) -> None:
    """The published attempt's settings, figures, report files, cluster profiles (profiles/cluster_profiles.csv,
    when the run wrote them) and model, logged to its MLflow run, then FINISHED."""
    from mlflow.entities import Metric, Param

    client = client_of(settings)
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
            clusters_per_device_in_effect=row.clusters_per_device_in_effect,
            clusters_in_effect=row.clusters_in_effect,
            **{name: getattr(row, name) for name in DRIFT_COLUMNS},
        )
        figures.update({f"seconds_{stage}": seconds for stage, seconds in (row.timings or {}).items()})
        client.log_batch(
            mlflow_run_id,
            metrics=[Metric(name, float(value), now, 0) for name, value in figures.items() if value is not None],
            params=[Param(name, str(value)) for name, value in params.items()],
        )
        with tempfile.TemporaryDirectory(prefix="kfed-mlflow-") as work:
            if report:
                folder = Path(work, "report")
                folder.mkdir()
                for name, data in report.items():
                    (folder / name).write_bytes(data)
            if profiles.num_rows:
                Path(work, "profiles").mkdir()
                pa_csv.write_csv(profiles, Path(work, "profiles", "cluster_profiles.csv"))
            save_pyfunc_model(Path(work, "model"), clustering, row.label_mode)
            artifacts.upload(client, mlflow_run_id, Path(work))
    except BaseException:
        client.set_terminated(mlflow_run_id, "FAILED")
        raise
    client.set_terminated(mlflow_run_id)


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
