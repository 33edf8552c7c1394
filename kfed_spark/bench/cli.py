"""The benchmarks' commands and the data they generate or prepare: generate, prepare, bench,
bench-quality, bench-paper, bench-server, bench-s3. kfed_spark.cli adds them to `kfed-spark`; each handler imports
what its command needs, so that building the parser imports none of the benchmarks' tooling.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kfed_spark.bench.pages import FRESH_SECTION, WARM_SECTION, command_line, page, write_page
from kfed_spark.config import QUIET_LOCAL_SPARK
from kfed_spark.errors import KFedError

DATASET_NAMES = ("femnist", "mnist", "shakespeare")
"""The real datasets `prepare` and `bench-quality` know (kfed_spark.bench.datasets.DATASETS; a test holds
them equal): named here so that the parser, which every command builds, imports none of the tooling."""


def add_bench_commands(commands) -> None:
    real_data = argparse.ArgumentParser(add_help=False)
    real_data.add_argument(
        "--data-dir", help="folder holding the raw datasets (default $KFED_DATA_DIR or ../shared/data)"
    )
    real_data.add_argument("--max-devices", type=int, help="use only this many devices of each real dataset")
    result_page = argparse.ArgumentParser(add_help=False)
    result_page.add_argument(
        "--page",
        type=Path,
        metavar="FILE",
        help="also write the result page (with its provenance header and figures) here, e.g. docs/benchmarks/...",
    )
    add_generate(commands)
    add_prepare(commands, real_data)
    add_bench(commands, result_page)
    add_bench_quality(commands, real_data, result_page)
    add_bench_paper(commands, real_data, result_page)
    add_bench_server(commands)
    add_bench_s3(commands, result_page)


def add_generate(commands) -> None:
    generate = commands.add_parser("generate", help="write a heterogeneous Gaussian mixture as Parquet")
    generate.add_argument("--out", required=True, help="output folder for the Parquet file")
    add_mixture_arguments(generate)
    generate.set_defaults(handler=command_generate)


def add_prepare(commands, real_data: argparse.ArgumentParser) -> None:
    prepare = commands.add_parser(
        "prepare",
        parents=[real_data],
        help="turn a real dataset (femnist, mnist, shakespeare) into the job's input table (Parquet)",
    )
    prepare.add_argument("dataset", choices=DATASET_NAMES, help="which dataset")
    prepare.add_argument("--out", required=True, help="output folder for the Parquet file")
    prepare.add_argument("--seed", type=int, default=0, help="seed of any random split (default 0)")
    prepare.set_defaults(handler=command_prepare)


def add_bench(commands, result_page: argparse.ArgumentParser) -> None:
    bench = commands.add_parser(
        "bench",
        parents=[result_page],
        help="time k-FED on Spark against MLlib KMeans and Spark's bare passes, each as a fresh process, "
        "then in one warm session with a no-Spark floor and scikit-learn, on each shape of table",
    )
    bench.add_argument(
        "--shape",
        action="append",
        choices=sorted(BENCH_SHAPES),
        help="a generated shape of table (repeat for several; default: every one): "
        + "; ".join(f"{name}: {describe_shape(shape)}" for name, shape in BENCH_SHAPES.items()),
    )
    bench.add_argument(
        "--data", help="a generated mixture (Parquet) to time instead of the shapes; give its --k and --k-per-device"
    )
    bench.add_argument("--out", default="kfed-bench", help="folder for the data, the tables and the report")
    add_mixture_arguments(bench, defaults=None)
    bench.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    bench.add_argument("--driver-memory", default="2g", help="Spark driver memory (default 2g)")
    bench.add_argument("--no-sklearn", action="store_true", help="skip scikit-learn (it holds all rows in memory)")
    bench.add_argument(
        "--repeats", type=int, default=3, help="runs of each method in the warm session; the fastest counts (default 3)"
    )
    bench.add_argument(
        "--no-warm",
        action="store_true",
        help="only the fresh processes: skip the second table, timed in one warm session",
    )
    bench.add_argument(
        "--mllib-limit",
        type=float,
        metavar="SECONDS",
        help="stop MLlib's fit after this long and report its time as a lower bound (default: none)",
    )
    bench.set_defaults(handler=command_bench)


BENCH_SHAPES = {
    "few-large-devices": {"k": 64, "k_per_device": 8, "devices": 1000, "points_per_device": 500, "dim": 32},
    "many-small-devices": {"k": 32, "k_per_device": 2, "devices": 100_000, "points_per_device": 10, "dim": 16},
}
"""The shapes `kfed-spark bench` times: a thousand devices of 500 rows (clusters that each device sees
well), and the paper's setting, a hundred thousand phones of ten rows from two clusters each."""


def describe_shape(shape: dict) -> str:
    """A shape of table in words: devices x rows, d, k, clusters per device."""
    return (
        f"{shape['devices']:,} devices x {shape['points_per_device']:,} rows, d = {shape['dim']}, k = {shape['k']}, "
        f"{shape['k_per_device']} clusters per device"
    )


def add_bench_quality(commands, real_data: argparse.ArgumentParser, result_page: argparse.ArgumentParser) -> None:
    quality = commands.add_parser(
        "bench-quality",
        parents=[real_data, result_page],
        help="ARI, NMI and cost of k-FED variants, MLlib and scikit-learn on the real datasets and a mixture",
    )
    quality.add_argument(
        "--datasets",
        help=f"comma-separated names among {', '.join(DATASET_NAMES)}, mixture, "
        "mixture-iid, mixture-outliers, close-means, mixture-uneven (default: all)",
    )
    quality.add_argument("--out", default="kfed-quality", help="folder for quality.json and quality.md")
    quality.add_argument("--seed", type=int, default=0, help="seed of every method (default 0)")
    quality.set_defaults(handler=command_bench_quality)


def add_bench_paper(commands, real_data: argparse.ArgumentParser, result_page: argparse.ArgumentParser) -> None:
    paper = commands.add_parser(
        "bench-paper",
        parents=[real_data, result_page],
        help="the k-FED paper's experiments (section 4): structured against IID partitions, one round against "
        "MLlib's rounds, the synthetic setting",
    )
    paper.add_argument(
        "--datasets", help="comma-separated among femnist, shakespeare, mixture (default: the paper's two)"
    )
    paper.add_argument("--out", default="kfed-paper", help="folder for paper.md, paper.json and the figures")
    paper.add_argument("--seed", type=int, default=0, help="seed of the partition and rounds studies (default 0)")
    paper.add_argument("--synthetic-k", help="comma-separated k of the synthetic setting (default 16,25,36,64,100)")
    paper.add_argument("--seeds", type=int, help="seeds of the synthetic setting (default 10)")
    paper.add_argument("--rounds", help="comma-separated numbers of MLlib's rounds (default 1,2,3,5,10,20)")
    paper.set_defaults(handler=command_bench_paper)


def add_bench_server(commands) -> None:
    server = commands.add_parser("bench-server", help="time the server step (alg. 2) alone on many local centers")
    server.add_argument("--devices", type=int, default=200_000, help="devices (default 200000)")
    server.add_argument("--per-device", type=int, default=5, help="local centers per device (default 5)")
    server.add_argument("--k", type=int, default=1000, help="global clusters (default 1000)")
    server.add_argument("--dim", type=int, default=32, help="dimension (default 32)")
    server.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    server.add_argument(
        "--distributed",
        action="store_true",
        help="run the distributed server step on a local Spark (server_step: distributed) instead "
        "of the driver's numpy one",
    )
    server.add_argument(
        "--out",
        default="kfed-bench-server",
        help="with --distributed: folder for the generated local centers and their clusters",
    )
    server.add_argument("--driver-memory", default="2g", help="with --distributed: Spark driver memory (default 2g)")
    server.set_defaults(handler=command_bench_server)


def add_bench_s3(commands, result_page: argparse.ArgumentParser) -> None:
    s3 = commands.add_parser(
        "bench-s3",
        parents=[result_page],
        help="count the S3 requests of a daily run against a loopback S3 API (moto's server)",
    )
    s3.add_argument("--out", default="kfed-s3", help="folder for the input, the server's log and the page")
    s3.set_defaults(handler=command_bench_s3)


def add_mixture_arguments(parser: argparse.ArgumentParser, defaults: dict | None = BENCH_SHAPES["few-large-devices"]):
    """The shape of a generated mixture; k and k-per-device are also what the benchmark clusters with.
    Without defaults, each one given replaces the value of every shape the benchmark generates."""

    shape = (
        ("k", "clusters in the mixture"),
        ("k_per_device", "clusters each device holds"),
        ("devices", "number of devices"),
        ("points_per_device", "rows per device"),
        ("dim", "number of features"),
    )
    unset = "each shape's own"
    for name, meaning in shape:
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=defaults[name] if defaults else None,
            help=f"{meaning} (default {defaults[name] if defaults else unset})",
        )
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of every method (default 0)")
    parser.add_argument(
        "--wide",
        type=int,
        default=0,
        metavar="W",
        help="W more columns that clustering does not read, doubles and strings (default 0)",
    )


def mixture_shape(args: argparse.Namespace) -> dict:
    """The generated mixture's shape as add_mixture_arguments took it, as write_mixture takes it."""
    names = ("k", "k_per_device", "devices", "points_per_device", "dim", "seed", "wide")
    return {name: getattr(args, name) for name in names}


def command_bench(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from kfed_spark.bench.benchmark import bench_session, benchmark
    from kfed_spark.bench.processes import benchmark_fresh
    from kfed_spark.bench.synthetic import write_mixture

    if not args.no_sklearn and not args.no_warm:
        require_sklearn("bench", "or pass --no-sklearn")
    out = Path(args.out).resolve()
    command = command_line("bench")
    given = {name: value for name, value in mixture_shape(args).items() if value is not None}
    if args.data is not None:
        if "k" not in given or "k_per_device" not in given:
            raise KFedError("bench --data needs the table's --k and --k-per-device")
        shapes = {"given": given}
    else:
        shapes = {name: {**BENCH_SHAPES[name], **given} for name in args.shape or BENCH_SHAPES}
    inputs, saved = {}, {}
    for name, shape in shapes.items():  # every shape's fresh processes first, with no other JVM alive
        inputs[name] = args.data or str(out / name / "input")
        if args.data is None:
            write_mixture(inputs[name], **{"seed": args.seed, "wide": args.wide, **shape})
        fresh = benchmark_fresh(
            inputs[name],
            out / name / "fresh",
            shape["k"],
            shape["k_per_device"],
            args.seed,
            command,
            args.master,
            args.driver_memory,
        )
        saved[name] = {"fresh": fresh}
    spark = None if args.no_warm else bench_session("kfed-spark-bench", args.driver_memory, args.master)
    sections = []
    for name, shape in shapes.items():
        title = name if args.data is not None else f"{name}: {describe_shape(shape)}"
        sections += [f"## {title}", "", FRESH_SECTION, "", saved[name]["fresh"].markdown()]
        if spark is not None:
            warm = benchmark(
                spark,
                inputs[name],
                out / name / "warm",
                shape["k"],
                shape["k_per_device"],
                args.seed,
                command,
                not args.no_sklearn,
                args.repeats,
                args.mllib_limit,
            )
            sections += [WARM_SECTION, "", warm.markdown()]
            saved[name]["warm"] = warm
    saved = {name: {table: asdict(report) for table, report in tables.items()} for name, tables in saved.items()}
    (out / "benchmark.json").write_text(json.dumps(saved, indent=2))
    text = page("Speed: k-FED against MLlib KMeans and Spark's bare passes", "\n".join(sections), command)
    write_page(text, page_targets(out / "benchmark.md", args.page))
    print(text)
    print(f"report: {out / 'benchmark.md'} and {out / 'benchmark.json'}")
    return 0


def command_bench_quality(args: argparse.Namespace) -> int:
    from kfed_spark.bench.quality import PROBLEMS, bench_quality

    names = list(PROBLEMS) if args.datasets is None else comma_list(args.datasets)
    if not names or set(names) - set(PROBLEMS):
        raise KFedError(f"--datasets takes names from {', '.join(PROBLEMS)}, got {args.datasets!r}")
    require_sklearn("bench-quality", "(its centralized baseline)")
    spark = quiet_local_session("kfed-spark-quality")
    command = command_line("bench-quality")
    out = Path(args.out).resolve()
    body = bench_quality(spark, names, out, args.data_dir, args.max_devices, args.seed, command)
    text = page("Quality: k-FED's settings, MLlib and scikit-learn on real and synthetic data", body, command)
    write_page(text, page_targets(out / "quality.md", args.page))
    print(text, end="")
    print(f"report: {out / 'quality.md'} and {out / 'quality.json'}")
    return 0


def command_bench_paper(args: argparse.Namespace) -> int:
    from kfed_spark.bench import paper

    names = paper.PAPER_DATASETS if args.datasets is None else comma_list(args.datasets)
    if not names or set(names) - set(paper.K_PRIMES):
        raise KFedError(f"--datasets takes names from {', '.join(paper.K_PRIMES)}, got {args.datasets!r}")
    ks = paper.SYNTHETIC_KS if args.synthetic_k is None else whole_numbers(args.synthetic_k)
    rounds = paper.ROUNDS if args.rounds is None else whole_numbers(args.rounds)
    seeds = paper.SYNTHETIC_SEEDS if args.seeds is None else args.seeds
    if not ks or min(ks) < 4 or not rounds or min(rounds) < 1 or seeds < 1:
        raise KFedError(
            "--synthetic-k takes whole numbers of at least 4, --rounds at least 1 and --seeds at least 1, got "
            f"{args.synthetic_k!r}, {args.rounds!r} and {args.seeds}"
        )
    require_sklearn("bench-paper", "(its centralized k-means)")
    spark = quiet_local_session("kfed-spark-paper")
    out = Path(args.out).resolve()
    command = command_line("bench-paper")
    body, figures = paper.bench_paper(
        spark, list(names), out, args.data_dir, args.max_devices, args.seed, ks, seeds, rounds, command
    )
    text = page("The paper's experiments (section 4)", body, command)
    write_page(text, page_targets(out / "paper.md", args.page), figures)
    print(text)
    print(f"report: {out / 'paper.md'}, {out / 'paper.json'} and the figures beside them")
    return 0


def command_bench_s3(args: argparse.Namespace) -> int:
    from kfed_spark.bench.object_store import bench_s3_requests

    out = Path(args.out).resolve()
    command = command_line("bench-s3")
    text = page("S3 requests of a daily run", bench_s3_requests(out, command), command)
    write_page(text, page_targets(out / "s3-requests.md", args.page))
    print(text, end="")
    return 0


def comma_list(text: str) -> list[str]:
    """The non-empty items of a comma-separated list."""
    return [part.strip() for part in text.split(",") if part.strip()]


def whole_numbers(text: str) -> tuple[int, ...]:
    """Comma-separated whole numbers, or () if any is not one."""
    try:
        return tuple(int(part) for part in comma_list(text))
    except ValueError:
        return ()


def quiet_local_session(app_name: str):
    """The benchmarks' local[2] session, without the console progress bar."""
    from kfed_spark.config import SparkConfig
    from kfed_spark.spark.session import build_session

    conf = {**QUIET_LOCAL_SPARK, "spark.ui.showConsoleProgress": "false"}
    return build_session(SparkConfig(master="local[2]", app_name=app_name, conf=conf))


def page_targets(own: Path, page: Path | None) -> list[Path]:
    """Where a bench writes its page: its own output folder, and --page if given."""
    return [own] if page is None else [own, page.resolve()]


def require_sklearn(command: str, hint: str) -> None:
    """The benchmarks compare with scikit-learn, which the job itself does not need: say so before any work."""
    import importlib.util

    if importlib.util.find_spec("sklearn") is None:
        raise KFedError(f"{command} needs scikit-learn: pip install 'kfed-spark[bench]' {hint}")


def command_bench_server(args: argparse.Namespace) -> int:
    from kfed_spark.bench.benchmark import bench_session
    from kfed_spark.bench.server import benchmark_distributed_server, benchmark_server

    if args.distributed:
        spark = bench_session("kfed-spark-bench-server", args.driver_memory)
        figures = benchmark_distributed_server(
            spark, Path(args.out).resolve(), args.devices, args.per_device, args.k, args.dim, args.seed
        )
    else:
        figures = benchmark_server(args.devices, args.per_device, args.k, args.dim, args.seed)
    for name, value in figures.items():
        print(f"{name}: {value:g}")
    return 0


def command_generate(args: argparse.Namespace) -> int:
    from kfed_spark.bench.synthetic import write_mixture

    try:
        table = write_mixture(args.out, **mixture_shape(args))
    except ValueError as exc:
        raise KFedError(str(exc)) from None
    print(f"wrote {table.num_rows} rows ({args.devices} devices, d = {args.dim}, k = {args.k}) to {args.out}")
    return 0


def command_prepare(args: argparse.Namespace) -> int:
    import numpy as np

    from kfed_spark.bench.datasets import DATASETS, load, write_parquet_folder

    table = load(args.dataset, args.data_dir, args.max_devices, args.seed)
    write_parquet_folder(table, args.out)
    per_device = table.group_by("device_id").aggregate([("true_cluster", "count_distinct")])
    devices = per_device.num_rows
    clusters = len(set(table.column("true_cluster").to_pylist()))
    dim = len(table.column("features")[0])
    # The docs' advice: a known k_z beats `auto` on images; here it is the truth's own count per device.
    k_per_device = int(np.median(per_device.column("true_cluster_count_distinct").to_numpy()))
    print(
        f"wrote {table.num_rows} rows of {DATASETS[args.dataset].description}: {devices} devices, d = {dim}, "
        f"{clusters} true clusters ({k_per_device} per device, median), to {args.out}\n"
        f"cluster it: kfed-spark run --config conf/local.yaml --set input.path={args.out} "
        f"--set input.truth_col=true_cluster --set k={clusters} --set k_per_device={k_per_device}"
    )
    return 0
