"""Which attempt of a run id is published, as every reader outside the Spark views decides it, held to
tables.PUBLISHED_ATTEMPTS: the job's own bookkeeping (ledger.published_attempts), the docs' DuckDB
view and the Airflow DAG's check_run, over one runs table whose traps catch any other rule."""

import ast

import duckdb
import pyarrow as pa
import pytest
from deltalake import write_deltalake

from helpers import DUCKDB_PUBLISHED_LABELS, ROOT
from kfed_spark.store.ledger import published_attempts
from kfed_spark.store.tables import PUBLISHED_ATTEMPTS, RunRecord

pytestmark = pytest.mark.fast

RUNS = [
    # run a: two succeeded attempts (a kill between the publish commit and the supersede leaves that),
    # the published one neither the newest to finish nor the greatest id; a running attempt has
    # claimed a higher number, a failed one holds none.
    ("a", "a-2", "succeeded", 1, "2026-11-29 03:40", 100),
    ("a", "a-1", "succeeded", 2, "2026-11-29 03:20", 200),
    ("a", "a-3", "running", 3, None, 300),
    ("a", "a-4", "failed", None, "2026-11-29 03:50", 400),
    ("a", "a-0", "superseded", 0, "2026-11-29 03:00", 500),
    # run b: nothing published; run c: one attempt
    ("b", "b-1", "failed", None, "2026-11-30 03:10", 600),
    ("c", "c-1", "succeeded", 1, "2026-11-30 03:10", 700),
    # run d: its published attempt retracted by an erasure (the one before it superseded): nothing published
    ("d", "d-1", "superseded", 1, "2026-12-01 03:10", 800),
    ("d", "d-2", "retracted", 3, "2026-12-01 03:20", 900),
]
PUBLISHED = {"a": "a-1", "c": "c-1"}


def runs_table() -> pa.Table:
    columns = ["run_id", "attempt_id", "status", "publish_seq", "finished_at", "n_input"]
    table = pa.Table.from_pylist([dict(zip(columns, row, strict=True)) for row in RUNS])
    n_input = table.column("n_input")
    return (
        table.append_column("n_labelled", n_input)
        .append_column("n_quarantined", pa.array([0] * len(RUNS), pa.int64()))
        .append_column("cost", pa.array([1.0] * len(RUNS)))
    )


def test_the_rule_in_sql_picks_the_succeeded_attempt_with_the_highest_publish_number():
    runs = runs_table()  # noqa: F841  (DuckDB reads the Arrow table by its variable name)
    found = dict(duckdb.sql(PUBLISHED_ATTEMPTS.format(runs="runs")).fetchall())
    assert found == PUBLISHED


def test_the_job_s_bookkeeping_applies_the_same_rule():
    assert published_attempts([RunRecord.of(row) for row in runs_table().to_pylist()]) == PUBLISHED


def test_the_readme_s_duckdb_view_shows_the_published_attempts_only():
    con = duckdb.connect()
    con.register("runs", runs_table())
    labels = pa.table(
        {"run_id": [r[0] for r in RUNS], "attempt_id": [r[1] for r in RUNS], "cluster_id": [0] * len(RUNS)}
    )
    con.register("labels", labels)
    con.sql(DUCKDB_PUBLISHED_LABELS)
    assert dict(con.sql("SELECT run_id, attempt_id FROM published_labels").fetchall()) == PUBLISHED


def dag_check_run():
    """check_run of jobs/airflow_dag.py without Airflow: its function alone, undecorated (the DAG file
    imports Airflow, which lives in an environment of its own; tests/test_airflow.py runs it there)."""
    tree = ast.parse((ROOT / "jobs" / "airflow_dag.py").read_text())
    (function,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "check_run"]
    function.decorator_list = []
    namespace = {}
    exec(compile(ast.Module(body=[function], type_ignores=[]), "airflow_dag.py", "exec"), namespace)
    return namespace["check_run"]


def test_the_dag_checks_the_published_attempt(tmp_path):
    write_deltalake(str(tmp_path / "runs"), runs_table())
    check_run = dag_check_run()
    by_attempt = {row[1]: row[5] for row in RUNS}
    for run_id, attempt in PUBLISHED.items():
        assert check_run(str(tmp_path), run_id, "0.0")["n_input"] == by_attempt[attempt]
    for run_id in ("b", "d"):
        with pytest.raises(ValueError, match="did not succeed"):
            check_run(str(tmp_path), run_id, "0.0")
