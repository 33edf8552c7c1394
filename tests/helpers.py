"""Helpers shared by the test modules."""

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from kfed_spark.bench.datasets import default_data_dir

from kfed_spark.config import OutputConfig
from kfed_spark.io import OutputTables


def published(spark, out, name):
    """The published rows of one output table (what every documented read path shows)."""
    return OutputTables(spark, OutputConfig(path=str(out))).published(name)


def runs_of(spark, out):
    """Every attempt recorded under an output location, oldest first."""
    return OutputTables(spark, OutputConfig(path=str(out))).read("runs").orderBy("started_at").collect()


ROOT = Path(__file__).resolve().parents[1]


def _readme_duckdb_view() -> str:
    """The README's DuckDB view of the published labels, read out of the README so that they cannot drift."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index('duckdb.sql("""\nCREATE OR REPLACE VIEW published_labels') + len('duckdb.sql("""')
    return text[start:text.index('""")', start)]


DUCKDB_PUBLISHED_LABELS = _readme_duckdb_view()
"""The README's view of the published labels for DuckDB (over delta-rs datasets named labels and runs)."""


needs_shared_data = pytest.mark.skipif(
    not default_data_dir().is_dir(),
    reason=f"the real datasets are not at {default_data_dir()} (set KFED_DATA_DIR, or lay shared/ beside the clone)",
)


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


def bare_environment(folder: Path) -> dict[str, str]:
    """What the workers see: a PATH whose python3 is a venv without packages, no PYSPARK_* or venv."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    assert subprocess.run([folder / "bin" / "python3", "-c", "import numpy"], capture_output=True).returncode != 0
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYSPARK", "VIRTUAL_ENV", "PYTHON", "SPARK_"))}
    return {**env, "PATH": f"{folder / 'bin'}:/usr/bin:/bin", "SPARK_LOCAL_IP": "127.0.0.1"}
