"""Helpers shared by the test modules. conftest.py imports this module in every test process, fast tier
included: what needs Spark or the kernels is imported by the helper that uses it."""

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from kfed_spark.config import FitSettings, InputConfig, OutputConfig
from kfed_spark.params import AlgorithmParams


def published(spark, out, name):
    """The published rows of one output table (what every documented read path shows)."""
    from kfed_spark.store.output import OutputTables

    return OutputTables(spark, OutputConfig(path=str(out))).published(name)


def assert_commented(spark, path, name):
    """The Delta table at path carries its table comment and a comment on every column."""
    from kfed_spark.store.tables import TABLE_COMMENTS

    assert spark.sql(f"DESCRIBE DETAIL delta.`{path}`").first().description == TABLE_COMMENTS[name]
    columns = {
        row.col_name: row.comment
        for row in spark.sql(f"DESCRIBE delta.`{path}`").collect()
        if row.col_name and not row.col_name.startswith("#")
    }
    assert all(columns.values()), (name, columns)


def runs_of(spark, out):
    """Every attempt recorded under an output location, oldest first."""
    from kfed_spark.store.output import OutputTables

    return OutputTables(spark, OutputConfig(path=str(out))).read("runs").orderBy("started_at").collect()


MIXTURE = dict(k=12, k_per_device=3, devices=60, points_per_device=100, dim=8, seed=3)
"""The tests' separated mixture (conftest's mixture_path): 12 clusters, 60 devices x 100 rows, 3 per device, d = 8."""

N_ROWS = MIXTURE["devices"] * MIXTURE["points_per_device"]
"""Rows of the tests' mixture."""


FAR_MIXTURE = dict(k=12, k_per_device=4, devices=60, points_per_device=100, dim=6, seed=5)
"""The scale tests' mixture (kfed_spark.bench.synthetic.mixture): 12 clusters, 60 devices x 100 rows, 4 per
device, d = 6."""


FEATURE_MOVES = {"shifted by 1e6": (1.0, 1e6), "shifted by 1e9": (1.0, 1e9), "scaled by 1e-6": (1e-6, 0.0)}
"""(scale, shift) of the features that must change no label: readings, coordinates in metres, prices and
timestamps sit far from the origin, and units differ."""


def spread(x) -> float:
    """The rows' own spread: their total squared distance from their mean (n times the total variance)."""
    return float(np.sum((x - x.mean(axis=0)) ** 2))


def run_cli(config: Path, *overrides: str) -> int:
    """`kfed-spark run --config CONFIG --set ...` in this process."""
    from kfed_spark.cli import main

    args = ["run", "--config", str(config)]
    for item in overrides:
        args += ["--set", item]
    return main(args)


def labels_of(spark, out, run_id):
    return published(spark, out, "labels").filter(f"run_id = '{run_id}'")


def mixture_estimator():
    """The estimator with the settings of the config fixture's run over the mixture."""
    from kfed_spark.estimator import KFed

    return KFed(k=MIXTURE["k"], kPerDevice=MIXTURE["k_per_device"], seed=11)


def by_row(df, *columns):
    return df.select("row_id", *columns).orderBy("row_id").toPandas().set_index("row_id")


def write_empty_config(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("{}\n")
    return path


def fitted_labels(raw, input_settings=None, local_partitions=None, **params):
    """Fit k-FED to a DataFrame and label its rows through the fit layer alone (no table written):
    the Clustering and a pandas frame of every labelled row's columns, cluster_id and local_cluster_id."""
    from kfed_spark.spark.fitting import fit
    from kfed_spark.spark.labelling import label_rows

    settings = FitSettings(AlgorithmParams(**params), InputConfig(**(input_settings or {})), local_partitions)
    settings.algorithm.check()
    clustering = fit(raw, settings)
    labelled = label_rows(clustering.checked, clustering.model, raw.schema, settings.input.device_col, clustering.dim)
    return clustering, labelled.filter("__kfed_reason IS NULL").drop("__kfed_sq_dist", "__kfed_reason").toPandas()


ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def docs_page(name: str) -> str:
    """A page of the docs, whose recipes the tests run as they are written there."""
    return (DOCS / name).read_text(encoding="utf-8")


def _docs_duckdb_view() -> str:
    """The docs' DuckDB view of the published labels, read out of the page so that they cannot drift."""
    text = docs_page("output-tables.md")
    start = text.index('duckdb.sql("""\nCREATE OR REPLACE VIEW published_labels') + len('duckdb.sql("""')
    return text[start : text.index('""")', start)]


DUCKDB_PUBLISHED_LABELS = _docs_duckdb_view()
"""The docs' view of the published labels for DuckDB (over delta-rs datasets named labels and runs)."""


def duckdb_published(out, name: str, storage_options: dict[str, str] | None = None):
    """The published rows of output table `name` as DuckDB sees them without Spark: every table read with
    delta-rs (from a bucket with its storage_options), and the docs' view of the published labels
    (DUCKDB_PUBLISHED_LABELS) put on `name`."""
    import duckdb
    from deltalake import DeltaTable

    con = duckdb.connect()
    for table in ("runs", name):
        con.register(table, DeltaTable(f"{out}/{table}", storage_options=storage_options).to_pyarrow_dataset())
    if name == "runs":
        return con.sql("SELECT * FROM runs").to_arrow_table()
    con.sql(
        DUCKDB_PUBLISHED_LABELS.replace("published_labels", f"published_{name}").replace("FROM labels", f"FROM {name}")
    )
    return con.sql(f"SELECT * FROM published_{name}").to_arrow_table()


def docs_device_profile_queries() -> list[str]:
    """The docs' two SQL queries on device_clusters: per-cluster training devices, client selection."""
    text = docs_page("output-tables.md")
    start = text.index("```sql\n-- Devices to train each cluster's own model on") + len("```sql\n")
    return [query.strip() for query in text[start : text.index("```", start)].split(";") if query.strip()]


needs_shared_data = pytest.mark.needs_shared_data
"""A test that reads the real datasets: conftest.py skips it where they are not (shared_data_missing)."""


def shared_data_missing() -> str | None:
    """Why the real datasets cannot be read here, or None if they can."""
    from kfed_spark.bench.datasets import default_data_dir

    folder = default_data_dir()
    if folder.is_dir():
        return None
    return f"the real datasets are not at {folder} (set KFED_DATA_DIR, or lay shared/ beside the clone)"


def report_folder(out, run_id) -> Path:
    """The one report folder of a run id's attempts (tests that look at it run the id once)."""
    (folder,) = (Path(out) / "reports" / run_id).iterdir()
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spark_home() -> Path:
    from pyspark.find_spark_home import _find_spark_home

    return Path(_find_spark_home())


def wait_for(log: Path, text: str, times: int = 1, timeout: float = 180.0) -> None:
    """Wait until a server's log shows a line `times` times."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and log.read_text(errors="replace").count(text) >= times:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{log} did not show {text!r} {times} time(s) in {timeout} s:\n{log.read_text()[-3000:]}")


def wait_for_port(port: int, log: Path, timeout: float = 180.0) -> None:
    """Wait until something listens on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s:\n{log.read_text()[-3000:]}")


@contextmanager
def servers(logs: Path):
    """Start server processes with `start(command, env)` (each logging to logs/process<i>.log); stop them
    all by pid on the way out, politely first."""
    processes = []

    def start(command: list[str], env: dict[str, str]) -> Path:
        log = logs / f"process{len(processes)}.log"
        with open(log, "w") as sink:
            processes.append(subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env))
        return log

    try:
        yield start
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def tool_python(name: str, requirements: list[str]) -> Path:
    """The python of a virtual environment of the tool's own, for a tool that cannot share the tests'
    environment (Airflow's Spark provider installs the Spark Connect client as `pyspark`; MLflow's server
    pins a pyarrow below this one). Built with uv (the test extra) on first use, which resolves and installs
    a few hundred packages in parallel, and kept under ~/.cache/kfed-spark/<name>-venv (KFED_<NAME>_VENV
    elsewhere) while the requirements stay the same."""
    default = Path.home() / ".cache" / "kfed-spark" / f"{name}-venv"
    venv = Path(os.environ.get(f"KFED_{name.upper()}_VENV", default))
    wanted = "\n".join(requirements)
    marker = venv / "kfed-requirements.txt"
    if not marker.exists() or marker.read_text() != wanted:
        uv = [sys.executable, "-m", "uv"]
        subprocess.run([*uv, "venv", "--quiet", "--clear", "--python", sys.executable, str(venv)], check=True)
        python = str(venv / "bin" / "python")
        install = [*uv, "pip", "install", "--quiet", "--compile-bytecode", "--python", python, *requirements]
        subprocess.run(install, check=True, timeout=1800)
        marker.write_text(wanted)
    return venv / "bin" / "python"


def bare_environment(folder: Path) -> dict[str, str]:
    """What the workers see: a PATH whose python3 is a venv without packages, no PYSPARK_*, SPARK_* (but
    conftest's SPARK_SUBMIT_OPTS, a JVM option) or venv."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    assert subprocess.run([folder / "bin" / "python3", "-c", "import numpy"], capture_output=True).returncode != 0
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYSPARK", "VIRTUAL_ENV", "PYTHON", "SPARK_")) or key == "SPARK_SUBMIT_OPTS"
    }
    return {**env, "PATH": f"{folder / 'bin'}:/usr/bin:/bin", "SPARK_LOCAL_IP": "127.0.0.1"}


def refused(capsys) -> str:
    """The last stderr line of a refused run."""
    return capsys.readouterr().err.strip().splitlines()[-1]


def dirty_input(spark, path):
    rows = [
        (1, "a", [0.0, 0.0]),
        (2, "a", [9.0, 9.0]),
        (3, "b", [0.1, 0.0]),
        (4, "b", [9.0, 9.1]),
        (5, None, [1.0, 1.0]),
        (6, "a", [float("nan"), 0.0]),
        (7, "b", [1.0, None]),
    ]
    spark.createDataFrame(rows, "row_id long, device_id string, features array<double>").write.parquet(str(path))


SUBMIT_CONF = {
    "spark.ui.enabled": "false",
    "spark.databricks.delta.snapshotPartitions": "2",
    "spark.sql.shuffle.partitions": "2",
}
"""What the tests' spark-submit processes set beyond the job's config: small sizes, no UI."""


def spark_submit_job(config: Path, output: Path, master: str = "local[2]", env: dict | None = None):
    """jobs/kfed_job.py under pyspark's own spark-submit, as the deployment page's cluster section runs it (with the
    Delta package matching the installed versions): the finished process, its output captured."""
    from kfed_spark.runtime.packaging import delta_package

    conf = [arg for key, value in SUBMIT_CONF.items() for arg in ("--conf", f"{key}={value}")]
    command = [
        str(spark_home() / "bin" / "spark-submit"),
        "--master",
        master,
        "--packages",
        delta_package(),
        *conf,
        str(ROOT / "jobs" / "kfed_job.py"),
        "--config",
        str(config),
        "--set",
        f"output.path={output}",
    ]
    return subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=600, env={**os.environ, **(env or {})}
    )


CLI = Path(sys.executable).parent / "kfed-spark"
"""The test environment's kfed-spark, by its absolute path, as cron, systemd or Airflow start it."""


def clean_environment() -> dict[str, str]:
    """This process's environment without a fault for the CLI to act out (kfed_spark.runtime.fault_injection)."""
    from kfed_spark.runtime.fault_injection import FAULT_ENV

    return {key: value for key, value in os.environ.items() if key != FAULT_ENV}


def cli_process(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
) -> subprocess.Popen:
    """`kfed-spark ARGS` as a process of its own, started by its absolute path; env: its whole environment
    (default clean_environment()); its output as text."""
    return subprocess.Popen(
        [str(CLI), *args],
        env=clean_environment() if env is None else env,
        cwd=cwd,
        stdout=stdout,
        stderr=stderr,
        text=True,
    )


def run_cli_process(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """cli_process() run to its end: its exit code, stdout and stderr."""
    return subprocess.run(
        [str(CLI), *args],
        env=clean_environment() if env is None else env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
