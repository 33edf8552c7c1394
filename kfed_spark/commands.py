"""What each `kfed-spark` command does, once kfed_spark.cli has parsed its arguments: a handler per command,
each importing what its command needs, so that parsing imports no Spark.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kfed_spark.config import QUIET_LOCAL_SPARK, KFedConfig, build_config, load_config
from kfed_spark.errors import KFedError
from kfed_spark.runtime.stopping import (
    STREAM_STOPPED,
    stop_on_sigterm,
)


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

        print(plan(build_session(cfg.spark, cfg.paths), cfg))
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
    """Start (or join) the SparkSession the config describes and run the job in it; a session it started
    is stopped once the run no longer needs it (before MLflow tracking)."""
    from pyspark.sql import SparkSession

    from kfed_spark.runs.job import run
    from kfed_spark.spark.fitting import StageTimer
    from kfed_spark.spark.session import build_session

    timer = StageTimer()
    joined = SparkSession.getActiveSession() is not None
    with timer.stage("session"):
        spark = build_session(cfg.spark, cfg.paths)
    return run(spark, cfg, parent_run_id, model_path, timer, own_session=not joined)


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
    from kfed_spark.store.models import finished_model
    from kfed_spark.store.output import OutputTables

    overrides = args.overrides + (
        [] if args.trigger_seconds is None else [f"stream.trigger_seconds={args.trigger_seconds}"]
    )
    cfg = spark_quiet(load_config(shipped_config(args.config), overrides), args)
    stop_on_sigterm(STREAM_STOPPED)
    spark = build_session(cfg.spark, cfg.paths)
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
    from kfed_spark.store.output import OutputTables

    if args.config:
        cfg = load_config(shipped_config(args.config), [f"output.path={args.output}"] if args.output else [])
        output, spark_cfg = cfg.output, cfg.spark
    elif args.output:
        output, spark_cfg = OutputConfig(path=args.output), SparkConfig(master="local[2]", conf=QUIET_LOCAL_SPARK)
    else:
        raise KFedError("give --output PATH or --config FILE to say which tables to use")
    return OutputTables(build_session(spark_cfg, [str(output.path)]), output)


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


def command_describe(args: argparse.Namespace) -> int:
    """A published run's clusters from its cluster_profiles (and centers, for their devices)."""
    import json

    from kfed_spark.runs.describe import (
        TOLD_FEATURES,
        chosen_cluster,
        cluster_line,
        cluster_summaries,
        cluster_table,
    )
    from kfed_spark.store.delta import attempt_filter, concurrently
    from kfed_spark.store.models import published_run

    tables = output_session(args)
    run = published_run(tables, args.run)
    run_id = run.run_id
    if not tables.check_log("cluster_profiles"):
        raise KFedError(f"no cluster profiles of a published run {run_id!r} under {tables.root}")
    of_attempt = attempt_filter(run_id, run.attempt_id)
    columns = {"cluster_profiles": ["*"], "centers": ["cluster_id", "n_devices"]}
    found = concurrently(
        lambda name: tables.read(name).filter(of_attempt).select(*columns[name]).toPandas(), list(columns)
    )
    profile, centers = found["cluster_profiles"], found["centers"]
    if profile.empty:
        raise KFedError(
            f"no cluster profiles of a published run {run_id!r} under {tables.root} (a run with profiles: false, "
            "or of an older version, has none)"
        )
    summaries = cluster_summaries(profile, dict(zip(centers.cluster_id.tolist(), centers.n_devices.tolist())))
    if args.cluster is not None:
        summaries = [chosen_cluster(summaries, args.cluster)]
    if args.json:
        print(json.dumps({"run_id": run_id, "clusters": summaries}, indent=2))
    elif args.cluster is not None:
        print(cluster_table(summaries[0]))
    else:
        print(f"run {run_id}: {len(summaries)} clusters")
        print("\n".join(cluster_line(summary, args.top or TOLD_FEATURES) for summary in summaries))
    return 0


def command_history(args: argparse.Namespace) -> int:
    """The location's last published runs, oldest first, with their drift figures; their cluster sizes as a figure."""
    import json

    from kfed_spark.runs.history import cluster_sizes, history_rows, history_text, published_runs
    from kfed_spark.runs.report import sizes_over_runs_figure

    tables = output_session(args)
    if not tables.check_log("runs"):
        raise KFedError(f"no kfed-spark runs under {tables.root}")
    rows = history_rows(published_runs(tables, args.last))
    if args.figure:
        attempts = [(row["run_id"], row["attempt_id"]) for row in rows]
        Path(args.figure).write_bytes(sizes_over_runs_figure(cluster_sizes(tables, attempts), [r for r, _ in attempts]))
    print(json.dumps({"runs": rows}, indent=2) if args.json else history_text(rows))
    return 0


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
        if run.retracted:
            print(
                f"run {run.run_id}: retracted, with no attempt published now: without {run.n_devices} of the "
                f"devices, {run.retracted}; attempt {run.superseded_attempt_id} and its {run.n_rows_removed} rows "
                "deleted"
            )
        else:
            print(
                f"run {run.run_id}: attempt {run.attempt_id} published without {run.n_devices} of the devices "
                f"({run.n_rows_removed} rows removed; {run.k} clusters, {run.n_ids_kept} kept their ids); attempt "
                f"{run.superseded_attempt_id} superseded and its rows deleted"
            )
        if run.mlflow_artifacts_deleted:
            print(
                f"run {run.run_id}: the artifacts of its attempts' MLflow runs, the devices' local centers among "
                f"them, are deleted ({', '.join(run.mlflow_artifacts_deleted.values())}); their params and metrics "
                "stay in MLflow"
            )
        if run.mlflow_run_id and run.mlflow_run_id not in run.mlflow_artifacts_deleted:
            replaced = "retracted" if run.retracted else "superseded"
            print(
                f"run {run.run_id}: MLflow run {run.mlflow_run_id} logged the {replaced} attempt, with the devices' "
                "local centers in artifacts that its experiment keeps elsewhere; delete that run in MLflow"
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
