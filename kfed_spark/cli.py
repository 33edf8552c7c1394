"""The `kfed-spark` command: run, assign, stream, sql, maintain, forget, report, choose-k, package, demo,
jvm-archive, and the benchmarks' commands (kfed_spark.bench.cli). One function adds each command's parser;
its handler (kfed_spark.commands) imports what its command needs: the parser alone imports no Spark and
none of the benchmarks' tooling.

spark-submit's jobs/kfed_job.py and jobs/benchmark.py call main() too.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass

from kfed_spark.bench.cli import add_bench_commands
from kfed_spark.commands import (
    command_assign,
    command_choose_k,
    command_demo,
    command_describe,
    command_forget,
    command_history,
    command_jvm_archive,
    command_maintain,
    command_package,
    command_report,
    command_run,
    command_sql,
    command_stream,
)
from kfed_spark.errors import KFedError
from kfed_spark.runtime.failures import describe
from kfed_spark.runtime.stopping import (
    STOP_REQUESTED,
    Terminated,
    silence_spark_after_stop,
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
        # SIGTERM the JVM may have been logging the interrupted jobs' traces, in chunks that can end mid-line:
        # the error line then starts on a line of its own.
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
    add_describe(commands, shared)
    add_history(commands, shared)
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


def add_describe(commands, shared: SharedArguments) -> None:
    profile = commands.add_parser(
        "describe",
        parents=[shared.located],
        help="print what sets each cluster of a published run apart: its size, devices and most distinctive "
        "features (from cluster_profiles)",
    )
    profile.add_argument("--run", metavar="RUN_ID", help="the published run (default: the newest succeeded run)")
    profile.add_argument("--cluster", type=int, metavar="N", help="every feature of cluster N, most distinctive first")
    profile.add_argument("--top", type=int, metavar="T", help="features per cluster (default 3)")
    profile.add_argument("--json", action="store_true", help="print every cluster's ranked features as JSON")
    profile.set_defaults(handler=command_describe)


def add_history(commands, shared: SharedArguments) -> None:
    history = commands.add_parser(
        "history",
        parents=[shared.located],
        help="print the location's published runs over time, each with how far its clusters moved from its "
        "reference run's, and draw their cluster sizes by cluster id",
    )
    history.add_argument("--last", type=int, default=30, metavar="N", help="the newest N published runs (default 30)")
    history.add_argument("--figure", metavar="PNG", help="write the cluster sizes over these runs to this file")
    history.add_argument("--json", action="store_true", help="print the runs' figures as JSON")
    history.set_defaults(handler=command_history)


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


def k_range_argument(text: str) -> list[int]:
    from kfed_spark.core.k_sweep import k_values

    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError(text)
        return k_values(*[int(part) for part in parts])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI or LO:HI:STEP with 1 <= LO <= HI, got {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
