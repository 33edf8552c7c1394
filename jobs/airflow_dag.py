"""Airflow 3 DAG `kfed_daily`: one k-FED run per day, a check of what the run wrote, and optionally the
day's new rows labelled with that day's model.

kfed_cluster submits jobs/kfed_job.py with SparkSubmitOperator (connection `spark_default` says
where: local, yarn, spark://host:7077, k8s://...), shipping what `kfed-spark package` built (the
package zip and the packed environment, so the executors need no Python packages of their own). The run
id is the logical date (2026-11-29) when the DAG run has one, so a retried or re-triggered day replaces
that day's run; a run without one (manual or asset-triggered) is a run of its own, named after the DAG
run. check_run fails the DAG run when the `runs` table has no published attempt of that run id, or when
the run quarantined more than `max_quarantine_share` of its rows. Retries are safe: an attempt is
published whole or not at all, and a task killed on its timeout leaves an attempt that the next one
tidies away. check_run reads the Delta table with delta-rs, so the Airflow workers need no Spark.
With the param stream_input set (a folder or Delta table where new rows arrive), kfed_stream then runs
`kfed-spark stream --available-now` with the day's run as the model: it labels every row that arrived since
its last run into stream_labels and stops; its checkpoint under the output path makes a retry label each
row exactly once. With stream_input empty (the default), stream_wanted skips it.
Set the params at trigger time or through the KFED_* environment variables below.
"""

import logging
import os
import re
from pathlib import Path

import pendulum
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import DAG, task

log = logging.getLogger(__name__)

PROJECT = Path(__file__).resolve().parents[1]
DIST = Path(os.environ.get("KFED_DIST", PROJECT / "dist"))  # what `kfed-spark package --out dist` wrote
DEFAULTS = {
    "config": os.environ.get("KFED_CONFIG", str(PROJECT / "conf" / "cluster.yaml")),
    "output": os.environ.get("KFED_OUTPUT", "s3a://my-bucket/kfed"),
    "max_quarantine_share": float(os.environ.get("KFED_MAX_QUARANTINE_SHARE", "0.05")),
    "stream_input": os.environ.get("KFED_STREAM_INPUT", ""),
}
DELTA_PACKAGE = os.environ.get("KFED_DELTA_PACKAGE", "io.delta:delta-spark_4.2_2.13:4.4.0")
DRIVER_PYTHON = os.environ.get("KFED_DRIVER_PYTHON")
"""In client mode (standalone, or YARN client) the driver runs on the Airflow worker: a Python there with
kfed-spark installed (Airflow's own environment has not). Leave unset in cluster deploy mode, where the
driver uses the packed environment too."""
TIMEOUT = pendulum.duration(minutes=int(os.environ.get("KFED_TIMEOUT_MINUTES", "120")))


def kfed_run_id(logical_date, dag_run_id: str) -> str:
    """The k-FED run id of a DAG run: its logical day, or its own id (made a valid run id) without one."""
    if logical_date is not None:
        return logical_date.strftime("%Y-%m-%d")
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", dag_run_id)[:128]


RUN_ID = "{{ kfed_run_id(dag_run.logical_date, dag_run.run_id) }}"  # logical_date is undefined without one


def log_failure(context) -> None:
    """on_failure_callback: say which k-FED run failed and why, in the task's log."""
    dag_run = context["dag_run"]
    log.error(
        "k-FED run %s (DAG run %s, task %s, try %s) failed: %s",
        kfed_run_id(dag_run.logical_date, dag_run.run_id),
        dag_run.run_id,
        context["task_instance"].task_id,
        context["task_instance"].try_number,
        context.get("exception"),
    )


@task
def check_run(output: str, kfed_run_id: str, max_quarantine_share: float) -> dict:
    """Fail unless the run succeeded and quarantined at most max_quarantine_share of its input."""
    from deltalake import DeltaTable

    # (not named run_id: Airflow reserves that argument name for its own run id)
    attempts = (
        DeltaTable(f"{output}/runs")
        .to_pyarrow_table(filters=[("run_id", "=", kfed_run_id), ("status", "=", "succeeded")])
        .to_pylist()
    )
    if not attempts:
        raise ValueError(f"k-FED run {kfed_run_id} did not succeed: no published attempt in {output}/runs")
    run = max(attempts, key=lambda attempt: attempt["publish_seq"])  # the published attempt
    allowed = float(max_quarantine_share)  # a rendered template arrives as text
    share = run["n_quarantined"] / run["n_input"]
    if share > allowed:
        raise ValueError(
            f"k-FED run {kfed_run_id} quarantined {run['n_quarantined']} of {run['n_input']} rows "
            f"({share:.1%}), more than the allowed {allowed:.1%}"
        )
    return {key: run[key] for key in ("n_input", "n_labelled", "n_quarantined", "cost")}


@task.short_circuit
def stream_wanted(stream_input: str) -> bool:
    """Go on to kfed_stream only when the DAG run names where new rows arrive."""
    return bool(stream_input.strip())


def spark_job(task_id: str, name: str, arguments: list[str]) -> SparkSubmitOperator:
    """jobs/kfed_job.py submitted with what `kfed-spark package` built: the package zip and the packed environment."""
    return SparkSubmitOperator(
        task_id=task_id,
        conn_id="spark_default",
        application=str(PROJECT / "jobs" / "kfed_job.py"),
        name=name,
        packages=DELTA_PACKAGE,
        py_files=str(DIST / "kfed_spark.zip"),
        archives=f"{DIST / 'kfed-env.tar.gz'}#environment",
        conf={
            "spark.pyspark.python": "./environment/bin/python",
            **({"spark.pyspark.driver.python": DRIVER_PYTHON} if DRIVER_PYTHON else {}),
        },
        # SIGTERM on timeout: the job records its attempt as failed and the retry starts clean.
        execution_timeout=TIMEOUT,
        application_args=arguments,
    )


with DAG(
    dag_id="kfed_daily",
    schedule="0 3 * * *",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    params=DEFAULTS,
    user_defined_macros={"kfed_run_id": kfed_run_id},
    default_args={"retries": 2, "retry_delay": pendulum.duration(minutes=10), "on_failure_callback": log_failure},
    tags=["kfed"],
) as dag:
    cluster = spark_job(
        "kfed_cluster",
        f"kfed-{RUN_ID}",
        [
            "run",
            "--config",
            "{{ params.config }}",
            "--set",
            f"run_id={RUN_ID}",
            "--set",
            "output.path={{ params.output }}",
        ],
    )
    stream = spark_job(
        "kfed_stream",
        f"kfed-stream-{RUN_ID}",
        [
            "stream",
            "--available-now",
            "--model-run",
            RUN_ID,
            "--config",
            "{{ params.config }}",
            "--set",
            "output.path={{ params.output }}",
            "--set",
            "input.path={{ params.stream_input }}",
        ],
    )
    checked = check_run("{{ params.output }}", RUN_ID, "{{ params.max_quarantine_share }}")
    cluster >> checked >> stream_wanted("{{ params.stream_input }}") >> stream
