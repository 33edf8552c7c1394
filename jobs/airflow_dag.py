"""Airflow 3 DAG `kfed_daily`: one k-FED run per day, then a check of what the run wrote.

kfed_cluster submits jobs/kfed_job.py with SparkSubmitOperator (connection `spark_default` says
where: local, yarn, spark://host:7077, k8s://...), with the run id taken from the logical date.
check_run fails the DAG run when the `runs` table has no published (succeeded) attempt of that run
id, or when the run quarantined more than `max_quarantine_share` of its rows. Retries are safe: an
attempt is published whole or not at all, and a retry replaces the run. It reads the Delta table with
delta-rs, so the Airflow workers need no Spark. Set the params at trigger time or through the
KFED_* environment variables below.
"""

import os
from pathlib import Path

import pendulum
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import DAG, task

PROJECT = Path(__file__).resolve().parents[1]
DEFAULTS = {
    "config": os.environ.get("KFED_CONFIG", str(PROJECT / "conf" / "cluster.yaml")),
    "output": os.environ.get("KFED_OUTPUT", "s3a://my-bucket/kfed"),
    "max_quarantine_share": float(os.environ.get("KFED_MAX_QUARANTINE_SHARE", "0.05")),
}
DELTA_PACKAGE = os.environ.get("KFED_DELTA_PACKAGE", "io.delta:delta-spark_4.2_2.13:4.4.0")


@task
def check_run(output: str, kfed_run_id: str, max_quarantine_share: float) -> dict:
    """Fail unless the run succeeded and quarantined at most max_quarantine_share of its input."""
    from deltalake import DeltaTable

    # (not named run_id: Airflow reserves that argument name for its own run id)
    attempts = DeltaTable(f"{output}/runs").to_pyarrow_table(
        filters=[("run_id", "=", kfed_run_id), ("status", "=", "succeeded")]
    ).to_pylist()
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


with DAG(
    dag_id="kfed_daily",
    schedule="0 3 * * *",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    params=DEFAULTS,
    default_args={"retries": 2, "retry_delay": pendulum.duration(minutes=10)},
    tags=["kfed"],
) as dag:
    cluster = SparkSubmitOperator(
        task_id="kfed_cluster",
        conn_id="spark_default",
        application=str(PROJECT / "jobs" / "kfed_job.py"),
        name="kfed-{{ ds_nodash }}",
        packages=DELTA_PACKAGE,
        application_args=[
            "--config", "{{ params.config }}",
            "--set", "run_id={{ ds }}",
            "--set", "output.path={{ params.output }}",
        ],
    )
    cluster >> check_run("{{ params.output }}", "{{ ds }}", "{{ params.max_quarantine_share }}")
