"""Helpers shared by the test modules."""

from pathlib import Path

import pytest

from kfed_spark.datasets import default_data_dir

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
