"""Runs inside the Airflow virtual environment that tests/test_airflow.py builds (Airflow's Spark
provider installs the Spark Connect client as `pyspark`, so it cannot share the job's environment)."""

import os
from pathlib import Path

import pendulum
import pytest
from deltalake import DeltaTable

try:
    from airflow.dag_processing.dagbag import DagBag
except ImportError:  # Airflow 2 location
    from airflow.models import DagBag

DAG_FILE = Path(__file__).resolve().parents[2] / "jobs" / "airflow_dag.py"
OUTPUT = os.environ["KFED_OUTPUT"]


@pytest.fixture(scope="module")
def dag():
    bag = DagBag(dag_folder=str(DAG_FILE))
    assert bag.import_errors == {}
    return bag.dags["kfed_daily"]


def test_dag_has_the_tasks_and_schedule(dag):
    assert set(dag.task_ids) == {"kfed_cluster", "check_run"}
    assert dag.get_task("check_run").upstream_task_ids == {"kfed_cluster"}
    assert dag.schedule == "0 3 * * *" and not dag.catchup
    submit = dag.get_task("kfed_cluster")
    args = submit.render_template(submit.application_args, {"ds": "2026-11-29", "params": dag.params})
    assert args == ["--config", os.environ["KFED_CONFIG"], "--set", "run_id=2026-11-29", "--set", f"output.path={OUTPUT}"]


def test_dag_runs_the_job_and_checks_it(dag):
    run = dag.test(logical_date=pendulum.datetime(2026, 11, 29, tz="UTC"))
    assert run.state == "success", [(ti.task_id, ti.state) for ti in run.get_task_instances()]
    runs = DeltaTable(f"{OUTPUT}/runs").to_pyarrow_table().to_pylist()
    assert [(r["run_id"], r["status"]) for r in runs] == [("2026-11-29", "succeeded")]
    labels = DeltaTable(f"{OUTPUT}/labels").to_pyarrow_table(filters=[("attempt_id", "=", runs[0]["attempt_id"])])
    assert labels.num_rows == runs[0]["n_labelled"] == runs[0]["n_input"]


def test_check_fails_a_run_that_quarantined_too_much(dag):
    check = dag.get_task("check_run").python_callable
    assert check(OUTPUT, "2026-11-29", "0.0")["n_quarantined"] == 0
    with pytest.raises(ValueError, match="quarantined 0 of"):
        check(OUTPUT, "2026-11-29", "-0.01")
    with pytest.raises(ValueError, match="did not succeed"):
        check(OUTPUT, "2026-11-30", "0.05")
