"""Runs inside the Airflow virtual environment that tests/test_airflow.py builds (Airflow's Spark
provider installs the Spark Connect client as `pyspark`, so it cannot share the job's environment)."""

import logging
import os
from pathlib import Path
from types import SimpleNamespace

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
    dag = bag.dags["kfed_daily"]
    assert all(task.retries == 2 for task in dag.tasks)
    for task in dag.tasks:  # dag.test() would wait out the retry delay before showing a failure
        task.retries = 0
    return dag


def runs():
    return DeltaTable(f"{OUTPUT}/runs").to_pyarrow_table().to_pylist()


def test_dag_has_the_tasks_schedule_and_shipping(dag):
    assert set(dag.task_ids) == {"kfed_cluster", "check_run", "stream_wanted", "kfed_stream"}
    assert dag.get_task("check_run").upstream_task_ids == {"kfed_cluster"}
    assert dag.get_task("kfed_stream").upstream_task_ids == {"stream_wanted"}
    assert dag.get_task("stream_wanted").upstream_task_ids == {"check_run"}
    assert dag.schedule == "0 3 * * *" and not dag.catchup
    dist = os.environ["KFED_DIST"]
    for submit in (dag.get_task("kfed_cluster"), dag.get_task("kfed_stream")):
        assert submit.execution_timeout and submit.on_failure_callback
        assert (submit.py_files, submit._archives) == (f"{dist}/kfed_spark.zip", f"{dist}/kfed-env.tar.gz#environment")
        assert submit.conf["spark.pyspark.python"] == "./environment/bin/python"


def test_a_manual_run_runs_the_job_on_the_cluster_checks_it_and_labels_the_new_rows_with_its_model(dag, caplog):
    """Manual and asset-triggered runs in Airflow 3 have no logical date: `ds` would not render. The one DAG
    run of these tests is such a run, for real, so its run id is named after the DAG run."""
    run = dag.test(logical_date=None)
    assert run.logical_date is None
    assert run.state == "success", [(ti.task_id, ti.state) for ti in run.get_task_instances()]
    kfed_run = run.run_id.replace("+", "_")
    assert [(r["run_id"], r["status"]) for r in runs()] == [(kfed_run, "succeeded")]
    labels = DeltaTable(f"{OUTPUT}/labels").to_pyarrow_table(filters=[("attempt_id", "=", runs()[0]["attempt_id"])])
    assert labels.num_rows == runs()[0]["n_labelled"] == runs()[0]["n_input"]
    streamed = DeltaTable(f"{OUTPUT}/stream_labels").to_pyarrow_table()  # KFED_STREAM_INPUT is the run's input
    assert streamed.num_rows == labels.num_rows and set(streamed.column("model_run_id").to_pylist()) == {kfed_run}
    assert sorted(streamed.column("row_id").to_pylist()) == sorted(labels.column("row_id").to_pylist())

    # The failure callback names the k-FED run and the error, with the real DAG run and task instance.
    callbacks = dag.get_task("kfed_cluster").on_failure_callback
    log_failure = callbacks[0] if isinstance(callbacks, list) else callbacks
    instance = run.get_task_instances()[0]
    with caplog.at_level(logging.ERROR):
        log_failure({"dag_run": run, "task_instance": instance, "exception": ValueError("boom")})
    assert f"k-FED run {kfed_run} (DAG run {run.run_id}" in caplog.text and "boom" in caplog.text


def test_a_scheduled_run_is_named_after_its_day_and_no_stream_input_skips_the_stream(dag):
    """The run id a scheduled DAG run renders, through the DAG's own template environment; and the
    short-circuit that skips kfed_stream when the DAG run names no stream input."""
    cluster = dag.get_task("kfed_cluster")
    run_id = next(arg for arg in cluster.application_args if arg.startswith("run_id="))
    scheduled = SimpleNamespace(
        logical_date=pendulum.datetime(2026, 11, 29, 3, tz="UTC"), run_id="scheduled__2026-11-29"
    )
    assert dag.get_template_env().from_string(run_id).render(dag_run=scheduled) == "run_id=2026-11-29"
    wanted = dag.get_task("stream_wanted").python_callable
    assert (wanted(""), wanted("  "), wanted(os.environ["KFED_STREAM_INPUT"])) == (False, False, True)


def test_check_fails_a_run_that_quarantined_too_much(dag):
    check = dag.get_task("check_run").python_callable
    kfed_run = runs()[0]["run_id"]
    assert check(OUTPUT, kfed_run, "0.0")["n_quarantined"] == 0
    with pytest.raises(ValueError, match="quarantined 0 of"):
        check(OUTPUT, kfed_run, "-0.01")
    with pytest.raises(ValueError, match="did not succeed"):
        check(OUTPUT, "2026-11-30", "0.05")
