"""The `kfed-spark` command: run, assign, stream, sql, maintain, forget, report, choose-k, package, demo,
jvm-archive, and the benchmarks' commands (kfed_spark.bench.cli). One function adds each command's parser;
each handler imports what its command needs: the parser alone imports no Spark and none of the
benchmarks' tooling.

spark-submit's jobs/kfed_job.py and jobs/benchmark.py call main() too.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from kfed_spark.bench.cli import add_bench_commands
from kfed_spark.config import QUIET_LOCAL_SPARK, KFedConfig, build_config, load_config
from kfed_spark.errors import KFedError
from kfed_spark.runtime.failures import describe
from kfed_spark.runtime.stopping import (
    STOP_REQUESTED,
    STREAM_STOPPED,
    Terminated,
    silence_spark_after_stop,
    stop_on_sigterm,
)

DEMO_FOLDER = "kfed-demo"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # The job's own stage lines at --log-level (INFO); py4j and others at WARNING (py4j logs a line at
    # INFO when the process exits, which would come after the error line).
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kfed_spark").setLevel("WARNING" if getattr(args, "quiet", False) else args.log_level)
    try:
        return args.handler(args)
    except (Exception, Terminated) as exc:
        message = describe(exc)
        if message is None:
            raise
        if STOP_REQUESTED.is_set():
            silence_spark_after_stop()
        # On a terminal Spark's progress bar may hold the line: back to its start and clear it first. After
        # SIGTERM the JVM may have been logging the interrupted jobs' traces, in chunks that can end mid-line
        # (a stream's test once saw '^kfed-spark: error: ...'): the error line then starts on a line of its own.
        start_of_line = "\r\x1b[K" if sys.stderr.isatty() else "\n" if STOP_REQUESTED.is_set() else ""
        print(f"{start_of_line}kfed-spark: error: {message}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, KFedError) and not STOP_REQUESTED.is_set() else 1


@dataclass(frozen=True)
class SharedArguments:
    """The arguments several commands share, declared once as parent parsers."""

    configured: argparse.ArgumentParser  # --config (required) and --set
    located: argparse.ArgumentParser  # --output, or --config for its output.path
    run_output: argparse.ArgumentParser  # --json and --quiet


def shared_arguments() -> SharedArguments:
    configured = argparse.ArgumentParser(add_help=False)
    configured.add_argument("--config", required=True, help="YAML config file (see conf/local.yaml)")
    configured.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a dotted config key, e.g. --set input.path=/data/x --set k=64 (repeatable)",
    )
    located = argparse.ArgumentParser(add_help=False)
    located.add_argument("--output", help="the output location (default: output.path of --config)")
    located.add_argument("--config", help="YAML config whose output.path and spark settings to use")
    run_output = argparse.ArgumentParser(add_help=False)
    run_output.add_argument(
        "--json",
        action="store_true",
        help="print the run's figures as one JSON object on stdout (for Airflow's XCom and scripts)",
    )
    run_output.add_argument(
        "--quiet",
        action="store_true",
        help="only warnings and the error line on stderr: no stage lines, Spark at ERROR",
    )
    return SharedArguments(configured, located, run_output)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kfed-spark",
        description="One-shot federated clustering (k-FED) of a device-keyed table on Spark, with Delta outputs.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="level of the job's own log lines on stderr (default INFO); Spark's is spark.log.level",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    shared = shared_arguments()
    add_run(commands, shared)
    add_assign(commands, shared)
    add_stream(commands, shared)
    add_sql(commands, shared)
    add_maintain(commands, shared)
    add_forget(commands, shared)
    add_report(commands, shared)
    add_choose_k(commands, shared)
    add_package(commands)
    add_demo(commands)
    add_jvm_archive(commands)
    add_bench_commands(commands)
    return parser


def add_run(commands, shared: SharedArguments) -> None:
    run = commands.add_parser(
        "run",
        parents=[shared.configured, shared.run_output],
        help="cluster a table and write the Delta tables of one run",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config and the input's schema, print the plan, write nothing",
    )
    run.set_defaults(handler=command_run)


def add_assign(commands, shared: SharedArguments) -> None:
    assign = commands.add_parser(
        "assign",
        parents=[shared.configured, shared.run_output],
        help="label a new input with a published run's model and write it as a new run of the same tables "
        "(--config: the new input, the same output.path)",
    )
    add_model_arguments(assign, required=True)
    assign.set_defaults(handler=command_assign)


def add_stream(commands, shared: SharedArguments) -> None:
    stream = commands.add_parser(
        "stream",
        parents=[shared.configured, shared.run_output],
        help="label rows as they arrive in the input (files of a folder, a Delta table) with a finished model, "
        "appending them to stream_labels and stream_quarantine exactly once (--config: the input to watch, "
        "output.path, stream.*)",
    )
    add_model_arguments(stream, required=False)
    trigger = stream.add_mutually_exclusive_group()
    trigger.add_argument(
        "--available-now",
        action="store_true",
        help="label what has arrived since the last batch, then stop (for scheduled tasks)",
    )
    trigger.add_argument(
        "--trigger-seconds",
        type=float,
        metavar="SECONDS",
        help="run on, one micro-batch every SECONDS (default stream.trigger_seconds, 60)",
    )
    stream.set_defaults(handler=command_stream)


def add_sql(commands, shared: SharedArguments) -> None:
    sql = commands.add_parser(
        "sql",
        parents=[shared.located],
        help="run a Spark SQL query against the tables of an output location and print the result",
    )
    sql.add_argument(
        "query",
        help="the query; views labels, centers, local_centers and quarantine hold the "
        "published attempt of every run, latest_labels (and latest_centers, ...) the newest "
        "succeeded run, runs every attempt with its status, stream_labels and stream_quarantine what "
        "`stream` wrote there",
    )
    sql.add_argument("--limit", type=int, default=100, help="rows to print at most (default 100)")
    sql.set_defaults(handler=command_sql)


def add_maintain(commands, shared: SharedArguments) -> None:
    maintain = commands.add_parser(
        "maintain",
        parents=[shared.located],
        help="tidy an output location: mark attempts whose process is gone as abandoned, and delete the rows "
        "of failed, abandoned and superseded attempts",
    )
    maintain.add_argument(
        "--abandon-after-hours",
        type=float,
        metavar="HOURS",
        help="also abandon attempts still running after this long, on any host",
    )
    maintain.add_argument(
        "--vacuum",
        action="store_true",
        help="then VACUUM every table: files of deleted rows older than the table's retention "
        "(delta.deletedFileRetentionDuration, 7 days by default) leave its folder, and with them the past "
        "versions that read them",
    )
    maintain.set_defaults(handler=command_maintain)


def add_forget(commands, shared: SharedArguments) -> None:
    forget = commands.add_parser(
        "forget",
        parents=[shared.located],
        help="take devices out of published runs (an erasure request): each run that holds them gets a new "
        "attempt without them, its server step run again over the other devices' local centers",
    )
    forget.add_argument(
        "--device", dest="devices", action="append", required=True, metavar="ID", help="a device id (repeatable)"
    )
    runs = forget.add_mutually_exclusive_group(required=True)
    runs.add_argument("--run", metavar="RUN_ID", help="forget them in this published run only")
    runs.add_argument("--all-runs", action="store_true", help="forget them in every published run that holds them")
    forget.set_defaults(handler=command_forget)


def add_report(commands, shared: SharedArguments) -> None:
    report = commands.add_parser(
        "report", parents=[shared.located], help="print the report of a run (its report.json, as text)"
    )
    report.add_argument("run_id", metavar="RUN_ID", help="the run whose report to print")
    report.add_argument("--json", action="store_true", help="print report.json as it is")
    report.set_defaults(handler=command_report)


def add_choose_k(commands, shared: SharedArguments) -> None:
    choose_k = commands.add_parser(
        "choose-k",
        parents=[shared.located],
        help="sweep k over a published run's local centers (no pass over the rows), print every k's "
        "figures and the recommended k, and store the sweep beside the run's report",
    )
    choose_k.add_argument(
        "--k",
        dest="k_range",
        required=True,
        type=k_range_argument,
        metavar="LO:HI[:STEP]",
        help="the ks to sweep, both ends included, e.g. 2:100 or 10:200:10",
    )
    choose_k.add_argument(
        "--run",
        metavar="RUN_ID",
        help="the published run whose local centers to sweep (default: the newest succeeded run)",
    )
    choose_k.add_argument("--json", action="store_true", help="print the sweep as one JSON object on stdout")
    choose_k.set_defaults(handler=command_choose_k)


def add_package(commands) -> None:
    package = commands.add_parser(
        "package", help="build what spark-submit ships to executors: the package zip and a packed environment"
    )
    package.add_argument("--out", default="dist", help="output folder (default dist)")
    package.add_argument(
        "--python-prefix",
        metavar="PATH",
        help="where the executors' Python 3.11 lives, if not at this machine's prefix",
    )
    package.add_argument(
        "--rebuild",
        action="store_true",
        help="build the environment anew, not from the one cached for the same requirements (~/.cache/kfed-spark)",
    )
    package.set_defaults(handler=command_package)


def add_demo(commands) -> None:
    demo = commands.add_parser("demo", help="generate a small mixture, cluster it locally, print a summary")
    demo.add_argument("--folder", default=DEMO_FOLDER, help=f"where the demo writes (default ./{DEMO_FOLDER})")
    demo.set_defaults(handler=command_demo)


def add_jvm_archive(commands) -> None:
    archive = commands.add_parser(
        "jvm-archive",
        help="write the JVM class archive that local Spark sessions of this installation start from (seconds "
        "sooner; run it again after upgrading Java or Spark)",
    )
    archive.add_argument("--path", help="where to write it (default: $KFED_JVM_ARCHIVE, else the cache folder)")
    archive.set_defaults(handler=command_jvm_archive)


def add_model_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    """--model-run RUN_ID or --model PATH: the finished model that assign and stream apply."""
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument(
        "--model-run",
        metavar="RUN_ID",
        help="the published run under output.path whose model to apply"
        + ("" if required else " (default: the newest succeeded run)"),
    )
    group.add_argument("--model", metavar="PATH", help="a KFedModel saved by the estimator (model.write().save(PATH))")


def print_result(args: argparse.Namespace, result, text: str) -> None:
    if args.json:
        import dataclasses
        import json

        print(json.dumps(dataclasses.asdict(result), sort_keys=True))
    else:
        print(text)


def spark_quiet(cfg: KFedConfig, args: argparse.Namespace) -> KFedConfig:
    """With --quiet, Spark logs at ERROR unless the config says otherwise."""
    if not args.quiet or "spark.log.level" in cfg.spark.conf:
        return cfg
    import dataclasses

    conf = {**cfg.spark.conf, "spark.log.level": "ERROR", "spark.ui.showConsoleProgress": "false"}
    return dataclasses.replace(cfg, spark=dataclasses.replace(cfg.spark, conf=conf))


def command_run(args: argparse.Namespace) -> int:
    cfg = spark_quiet(load_config(shipped_config(args.config), args.overrides), args)
    stop_on_sigterm()
    if args.dry_run:
        from kfed_spark.runs.job import plan
        from kfed_spark.spark.session import build_session

        print(plan(build_session(cfg.spark), cfg))
        return 0
    result = execute(cfg)
    print_result(
        args,
        result,
        f"run {result.run_id} (attempt {result.attempt_id}, published): {result.n_labelled} rows labelled, "
        f"{result.n_quarantined} quarantined, {result.n_devices} devices, cost {result.cost:.6g}"
        + (f", ARI {result.ari:.4f}" if result.ari is not None else "")
        + (f", cost / planted cost {result.cost / result.truth_cost:.4f}" if result.truth_cost else "")
        + f"; tables under {result.output_path}",
    )
    return 0


def shipped_config(path: str | None) -> str | None:
    """A config given as a bare name that is no file here, under spark-submit: the file of that name
    that `--files` shipped. In client mode spark-submit copies such files only to the executors and
    the driver's SparkFiles folder, not to its working directory, so take it from where it was sent."""
    from kfed_spark.spark.session import under_spark_submit

    if path is None or Path(path).exists() or Path(path).name != path or not under_spark_submit():
        return path
    from urllib.parse import urlparse

    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()  # connects to spark-submit's JVM, whose properties name the files
    for shipped in SparkConf().get("spark.files", "").split(","):
        local = Path(urlparse(shipped).path)
        if local.name == path and local.exists():
            return str(local)
    return path


def execute(cfg: KFedConfig, parent_run_id: str | None = None, model_path: str | None = None):
    """Start (or join) the SparkSession the config describes and run the job in it."""
    from kfed_spark.runs.job import run
    from kfed_spark.spark.fitting import StageTimer
    from kfed_spark.spark.session import build_session

    timer = StageTimer()
    with timer.stage("session"):
        spark = build_session(cfg.spark)
    return run(spark, cfg, parent_run_id, model_path, timer)


def command_assign(args: argparse.Namespace) -> int:
    cfg = spark_quiet(load_config(shipped_config(args.config), args.overrides), args)
    stop_on_sigterm()
    result = execute(cfg, parent_run_id=args.model_run, model_path=args.model)
    print_result(
        args,
        result,
        f"run {result.run_id} (model of {result.parent_run_id}): {result.n_labelled} rows labelled, "
        f"{result.n_quarantined} quarantined, {result.n_devices} devices; "
        f"tables under {result.output_path}",
    )
    return 0


def command_stream(args: argparse.Namespace) -> int:
    from kfed_spark.runs.streaming import start
    from kfed_spark.spark.session import build_session
    from kfed_spark.store.delta import OutputTables
    from kfed_spark.store.models import finished_model

    overrides = args.overrides + (
        [] if args.trigger_seconds is None else [f"stream.trigger_seconds={args.trigger_seconds}"]
    )
    cfg = spark_quiet(load_config(shipped_config(args.config), overrides), args)
    stop_on_sigterm(STREAM_STOPPED)
    spark = build_session(cfg.spark)
    model = finished_model(OutputTables(spark, cfg.output), args.model_run, args.model)
    stream = start(spark, cfg, model, args.available_now)
    stream.query.awaitTermination()
    result = stream.result()
    print_result(
        args,
        result,
        f"stream with the model of {result.model_run_id}: {result.batches} micro-batches, {result.n_labelled} rows "
        f"labelled into {result.labels_table}, {result.n_quarantined} quarantined into {result.quarantine_table}, "
        f"{result.n_new_devices} devices the model had not seen",
    )
    return 0


def output_session(args: argparse.Namespace):
    """The OutputTables that --output or --config name, in a session the config describes (or local)."""
    from kfed_spark.config import OutputConfig, SparkConfig
    from kfed_spark.spark.session import build_session
    from kfed_spark.store.delta import OutputTables

    if args.config:
        cfg = load_config(shipped_config(args.config), [f"output.path={args.output}"] if args.output else [])
        output, spark_cfg = cfg.output, cfg.spark
    elif args.output:
        output, spark_cfg = OutputConfig(path=args.output), SparkConfig(master="local[2]", conf=QUIET_LOCAL_SPARK)
    else:
        raise KFedError("give --output PATH or --config FILE to say which tables to use")
    return OutputTables(build_session(spark_cfg), output)


def command_sql(args: argparse.Namespace) -> int:
    tables = output_session(args)
    if not tables.register_views():
        raise KFedError(f"no kfed-spark tables under {tables.root}")
    result = tables.spark.sql(args.query).limit(args.limit).toPandas()
    print(result.to_string(index=False))
    return 0


def command_report(args: argparse.Namespace) -> int:
    import json

    from kfed_spark.runs.report import terminal_text

    raw = output_session(args).read_report(args.run_id)
    print(raw.decode() if args.json else terminal_text(json.loads(raw)))
    return 0


def k_range_argument(text: str) -> list[int]:
    from kfed_spark.core.k_sweep import k_values

    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError(text)
        return k_values(*[int(part) for part in parts])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI or LO:HI:STEP with 1 <= LO <= HI, got {text!r}") from None


def command_choose_k(args: argparse.Namespace) -> int:
    """The sweep over the run's published attempt only: a failed or superseded attempt's centers are never read."""
    import json

    from kfed_spark.runs.report import k_sweep_files
    from kfed_spark.store.models import stored_model

    tables = output_session(args)
    model = stored_model(tables, args.run)
    sweep = model.sweep(args.k_range)
    files = k_sweep_files(sweep, model.origin, model.attempt_id)
    tables.write_report(model.origin, model.attempt_id, files)
    where = tables.report_dir(model.origin, model.attempt_id)
    if args.json:
        print(
            json.dumps(
                {"run_id": model.origin, "attempt_id": model.attempt_id, "stored_in": where, **sweep.as_dict()},
                sort_keys=True,
            )
        )
    else:
        print(
            f"k sweep of run {model.origin} (attempt {model.attempt_id}): {sweep.n_local_centers} local centers of "
            f"{sweep.n_rows} rows\n{sweep.text()}\nstored in {where}/{{{','.join(files)}}}"
        )
    return 0


def command_maintain(args: argparse.Namespace) -> int:
    from datetime import timedelta

    from kfed_spark.store.ledger import Ledger

    tables = output_session(args)
    if not tables.check_log("runs"):
        raise KFedError(f"no kfed-spark tables under {tables.root}")
    after = None if args.abandon_after_hours is None else timedelta(hours=args.abandon_after_hours)
    rows = Ledger(tables).tidy(after)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
    print(
        f"{len(rows)} attempts under {tables.root}: "
        + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    )
    if args.vacuum:
        print(f"vacuumed {', '.join(tables.vacuum())}")
    return 0


def command_forget(args: argparse.Namespace) -> int:
    from kfed_spark.runs.forget import forget

    stop_on_sigterm()
    tables = output_session(args)
    if not tables.check_log("runs"):
        raise KFedError(f"no kfed-spark tables under {tables.root}")
    done = forget(tables, args.devices, None if args.all_runs else args.run)
    if not done:
        print(f"no published run under {tables.root} holds rows of {', '.join(args.devices)}: nothing to forget")
    for run in done:
        print(
            f"run {run.run_id}: attempt {run.attempt_id} published without {run.n_devices} of the devices "
            f"({run.n_rows_removed} rows removed; {run.k} clusters, {run.n_ids_kept} kept their ids); attempt "
            f"{run.superseded_attempt_id} superseded and its rows deleted"
        )
        if run.mlflow_run_id:
            print(
                f"run {run.run_id}: MLflow run {run.mlflow_run_id} logged the superseded attempt, with the devices' "
                "local centers; forget does not change MLflow: delete that run there"
            )
    if done:
        print(
            "the deleted rows stay in the tables' Delta history until VACUUM removes their files after the "
            "retention period (see the erasure page of the docs)"
        )
    return 0


def command_package(args: argparse.Namespace) -> int:
    from kfed_spark.runtime.packaging import build

    packaged = build(Path(args.out), args.python_prefix, args.rebuild)
    print(
        f"wrote {packaged.package_zip} and {packaged.env_archive} ({' '.join(packaged.requirements)})\n"
        f"ship them with: --py-files {packaged.package_zip} --archives {packaged.env_archive}#environment "
        "--conf spark.pyspark.python=./environment/bin/python"
    )
    return 0


def command_jvm_archive(args: argparse.Namespace) -> int:
    import tempfile

    from kfed_spark.spark.session import JVM_ARCHIVE_ENV, jvm_archive_file, write_jvm_archive

    target = Path(args.path).resolve() if args.path else jvm_archive_file()
    if target is None:
        raise KFedError(f"{JVM_ARCHIVE_ENV} is 'none': give --path")
    with tempfile.TemporaryDirectory(prefix="kfed-jvm-archive-") as work:
        size = write_jvm_archive(target, Path(work))
    print(f"JVM class archive: {target} ({size / 1e6:.0f} MB); local Spark sessions start from it")
    return 0


def command_demo(args: argparse.Namespace) -> int:
    from kfed_spark.bench.synthetic import write_mixture
    from kfed_spark.store.delta import attempt_filter

    folder = Path(args.folder).resolve()
    data = folder / "input"
    k, k_per_device, devices, points, dim = 16, 4, 200, 200, 16
    write_mixture(data, k=k, k_per_device=k_per_device, devices=devices, points_per_device=points, dim=dim, seed=1)
    cfg = build_config(
        {
            "input": {"path": str(data), "format": "parquet", "truth_col": "true_cluster"},
            "output": {"path": str(folder / "output")},
            "k": k,
            "k_per_device": k_per_device,
            "seed": 1,
            "run_id": "demo",
            "spark": {
                "master": "local[2]",
                "app_name": "kfed-spark-demo",
                "conf": QUIET_LOCAL_SPARK,
            },
        }
    )
    result = execute(cfg)
    labels = f"{result.output_path}/labels"
    query = (
        f"SELECT cluster_id, count(*) AS n_rows, count(DISTINCT device_id) AS n_devices "
        f"FROM delta.`{labels}` WHERE {attempt_filter('demo', result.attempt_id)} "
        "GROUP BY cluster_id ORDER BY n_rows DESC LIMIT 5"
    )
    from pyspark.sql import SparkSession

    top = SparkSession.getActiveSession().sql(query).toPandas()
    print(
        f"\nk-FED demo: {result.n_input} rows on {result.n_devices} devices, d = {dim}, k = {k} "
        f"({k_per_device} clusters per device)\n"
        f"  labelled {result.n_labelled}, quarantined {result.n_quarantined}\n"
        f"  k-means cost {result.cost:.6g} ({result.cost / result.truth_cost:.4f} x the planted clusters' cost)\n"
        f"  ARI against the planted clusters {result.ari:.4f}\n"
        f"  tables (Delta): {result.output_path}/{{labels,centers,local_centers,quarantine,runs}}\n"
        f"  report: {result.output_path}/reports/demo/{result.attempt_id}/report.html "
        f"(kfed-spark report demo --output {result.output_path})\n"
        f"  query: {query}\n\n{top.to_string(index=False)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
