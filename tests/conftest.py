"""One local SparkSession with Delta for the whole test run, built by the product's own builder; the tiers.

Every test process imports this module, the fast tier's included: what starts Spark or writes data is
imported by the fixture that does it."""

import fcntl
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy  # noqa: F401  (loads the BLAS that threadpool_limits below sets)
import pytest
from threadpoolctl import threadpool_limits

from helpers import MIXTURE, bare_environment, free_port, run_cli, servers, shared_data_missing, spark_home, wait_for
from kfed_spark.config import SparkConfig

collect_ignore = ["airflow"]  # run inside the Airflow environment by test_airflow.py

TIERS = ("fast", "spark", "integration")
"""Every test names its tier, by its module's pytestmark or a marker of its own: fast (no JVM, the edit
loop's tier: `-m fast`), spark (the one Spark session of this process: with fast, `-m "not integration"`)
or integration (processes of their own: spark-submit, servers, the CLI)."""

JVM_FIXTURES = {"spark", "config", "published_run", "config_after_first_run", "standalone_master", "connect_url"}
"""Fixtures that start Spark, or a run that starts it."""


threadpool_limits(limits=1, user_api="blas")
"""The test process's numpy multiplies small matrices: a second BLAS thread only spins on a core that the JVM
or another test process wants. The processes the tests start keep their own BLAS threads."""

SHORT_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""Every JVM the tests start through spark-submit (a CLI run, spark-submit, the Connect and Thrift servers,
Airflow's task) lives seconds: it skips the optimising compiler, whose work a short process never repays, and
collects with the serial collector, since a concurrent collector's threads only take CPU from the other
processes in a heap this small. The suite's own long-lived JVM keeps the optimising compiler
(SESSION_JVM_OPTIONS). A developer's own SPARK_SUBMIT_OPTS stays."""
os.environ.setdefault("SPARK_SUBMIT_OPTS", SHORT_JVM_OPTIONS)

MODULE_TIER = re.compile(r"^pytestmark = pytest\.mark\.(fast|spark|integration)\b", re.MULTILINE)


def pytest_ignore_collect(collection_path, config):
    """`-m fast` does not import the modules whose pytestmark is another tier: none of their tests can be
    fast (pytest_collection_modifyitems allows one tier a test), and importing them (MLflow's client among
    them) would take longer than the fast tier's collection itself."""
    if config.getoption("markexpr") != "fast" or not collection_path.match("test_*.py"):
        return None
    tier = MODULE_TIER.search(collection_path.read_text(encoding="utf-8"))
    return True if tier and tier.group(1) != "fast" else None


def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_shared_data") and (missing := shared_data_missing()):
        pytest.skip(missing)


LONGEST_MODULES = (
    "test_object_store",
    "test_publish",
    "test_job",
    "test_airflow",
    "test_benchmark",
    "test_connect",
    "test_forget",
    "test_cluster",
    "test_deploy",
    "test_streaming",
    "test_catalog",
)
"""The modules that take longest, longest first: they run before the others. Each xdist worker takes a whole
module when it is free (`--dist loadfile`), so a long one taken last would keep one worker busy while the
other has nothing left."""


def pytest_configure(config):
    """xdist hands out modules with the most tests first unless told not to: keep the order that
    pytest_collection_modifyitems gives them."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """Refuse a test without exactly one tier, and a fast one that asks for a fixture that starts Spark; the
    LONGEST_MODULES first."""
    rank = {name: place for place, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))
    wrong = []
    for item in items:
        tiers = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
        if len(tiers) != 1 or ("fast" in tiers and JVM_FIXTURES & set(item.fixturenames)):
            wrong.append(f"{item.nodeid}: {', '.join(sorted(tiers)) or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            "every test needs one tier marker (fast, spark or integration), and a fast one "
            "no Spark fixture:\n" + "\n".join(wrong)
        )


@pytest.fixture(autouse=True)
def no_jvm_in_the_fast_tier(request, monkeypatch):
    """A fast test cannot start a JVM: JAVA_HOME points nowhere, in this process and in any it starts. The
    others start their JVMs from the class archive."""
    if request.node.get_closest_marker("fast"):
        monkeypatch.setenv("JAVA_HOME", "/nonexistent/the-fast-tier-starts-no-jvm")
    else:
        request.getfixturevalue("jvm_archive")


@pytest.fixture(scope="session")
def jvm_archive(tmp_path_factory):
    """The class archive (`kfed-spark jvm-archive`) that every local Spark of the tests and of the processes
    they start begins from, as a user's would once written: written here once per machine and Spark version,
    it saves seconds of every JVM start after it. Of two xdist workers one writes it; the other
    waits only until that one's first Spark start has resolved Delta's jars into the Ivy cache (two
    resolutions at once into one Ivy cache can fail), and goes on without the archive until it is there."""
    from kfed_spark.spark.session import jvm_archive_file, resolved_jars, write_jvm_archive

    archive = jvm_archive_file()
    if archive is not None and not archive.is_file():
        archive.parent.mkdir(parents=True, exist_ok=True)
        with open(archive.with_name(f"{archive.name}.lock"), "w") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another worker is writing it
                    if resolved_jars():
                        return archive
                    time.sleep(1)
                    continue
                if not archive.is_file():
                    write_jvm_archive(archive, tmp_path_factory.mktemp("jvm-archive"))
                return archive
    return archive


TEST_SPARK_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.task.maxFailures": "1",
    "spark.sql.session.timeZone": "UTC",
    "spark.databricks.delta.snapshotPartitions": "2",
    # No test reads Delta's per-file statistics or checksum files; without them a commit of a few rows
    # costs about half as much, and the tests make a few hundred commits.
    "spark.databricks.delta.stats.collect": "false",
    "spark.databricks.delta.writeChecksumFile.enabled": "false",
    "spark.log.level": "ERROR",
    # Small Arrow batches: a device's rows span several batches, a batch holds several devices.
    "spark.sql.execution.arrow.maxRecordsPerBatch": "100",
    # A JVM that serves many tests keeps only the status a test reads, not Spark's last 1,000 jobs,
    # stages and SQL plans and 100,000 tasks.
    "spark.ui.retainedJobs": "50",
    "spark.ui.retainedStages": "50",
    "spark.ui.retainedTasks": "1000",
    "spark.sql.ui.retainedExecutions": "20",
}


SESSION_HEAP = "3g"
"""The heap of the one JVM that serves a worker's share of the suite: it holds Delta's cached snapshot of every
table the tests wrote (capping that cache costs more time than the memory is worth), and bench-quality's MNIST
read needs its own session's 2g (bench_session) inside it. The processes the tests start keep Spark's
default."""


INTERPRETED_SQL = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}
"""The suite's own session evaluates SQL expressions interpreted (factoryMode is Spark's switch for its own
tests): each of its thousands of small queries would otherwise generate Java code, compile it with Janino, and
leave the JVM's compilers to compile it again, more work than the query. Every process the tests start (the
CLI, spark-submit, the servers) generates code, as a user's does."""


SESSION_JVM_OPTIONS = (
    "-XX:TieredStopAtLevel=4 -XX:Tier4InvocationThreshold=20000 -XX:Tier4MinInvocationThreshold=2400 "
    "-XX:Tier4CompileThreshold=60000 -XX:Tier4BackEdgeThreshold=160000 -XX:-UseSerialGC -XX:+UseParallelGC"
)
"""The session's JVM lives as long as its worker, so it compiles with C2, but only code run several times as
often as Java's defaults ask before C2 takes it: the suite runs much code a few thousand times, which C2 would
compile at a cost it does not repay. It collects with the throughput collector: concurrent marking of a heap
that Delta's snapshot cache keeps growing takes CPU that the two workers' processes lack."""


@pytest.fixture(scope="session")
def spark(tmp_path_factory, jvm_archive):
    from kfed_spark.spark.session import build_session

    warehouse = tmp_path_factory.mktemp("warehouse")
    conf = {
        **TEST_SPARK_CONF,
        **INTERPRETED_SQL,
        "spark.driver.memory": SESSION_HEAP,
        "spark.driver.extraJavaOptions": SESSION_JVM_OPTIONS,
        "spark.sql.warehouse.dir": str(warehouse),
    }
    session = build_session(SparkConfig(master="local[2]", app_name="kfed-tests", conf=conf))
    yield session
    session.stop()


@pytest.fixture(scope="session")
def mixture_path(tmp_path_factory):
    """A separated 12-cluster mixture: 60 devices x 100 rows, 3 clusters per device, d = 8."""
    from kfed_spark.bench.synthetic import write_mixture

    path = tmp_path_factory.mktemp("mixture")
    write_mixture(path, **MIXTURE)
    return str(path)


def write_config(folder: Path, mixture_path: str) -> Path:
    """A run config over the mixture: output under folder/out, run id 'first', seed 11. A process of its
    own started on it gets the test session's sizes (not Spark's defaults for big tables), but no master
    and no log level: spark-submit's --master and the tests that read Spark's log decide those."""
    path = folder / "kfed.yaml"
    spark_conf = json.dumps(
        {
            key: value
            for key, value in TEST_SPARK_CONF.items()
            if key not in ("spark.task.maxFailures", "spark.log.level")
        }
    )
    path.write_text(
        f"""
input: {{path: "{mixture_path}", format: parquet, truth_col: true_cluster}}
output: {{path: "{folder / "out"}"}}
k: {MIXTURE["k"]}
k_per_device: {MIXTURE["k_per_device"]}
seed: 11
run_id: first
spark: {{conf: {spark_conf}}}
"""
    )
    return path


@pytest.fixture()
def config(tmp_path, mixture_path):
    """The run config over the mixture (write_config), its output under tmp_path/out."""
    return write_config(tmp_path, mixture_path)


@pytest.fixture(scope="session")
def published_run(spark, tmp_path_factory, mixture_path):
    """(config, output folder) of one published run of the config over the mixture, shared by the tests
    that only read a finished run: they must not write under it."""
    config = write_config(tmp_path_factory.mktemp("published"), mixture_path)
    assert run_cli(config) == 0
    return config, config.parent / "out"


@pytest.fixture()
def config_after_first_run(config, published_run):
    """The config fixture, its output (tmp_path/out) already holding a published run 'first': a copy of
    published_run's location (Delta tables name their files relative to the table), for the tests that
    write after a first run without paying for one of their own."""
    shutil.copytree(published_run[1], config.parent / "out")
    return config


@dataclass(frozen=True)
class StandaloneCluster:
    url: str
    work_dirs: list[Path]

    def applications(self) -> set[str]:
        """The applications whose executors ran on a worker."""
        return {app.name for work in self.work_dirs if work.is_dir() for app in work.glob("app-*")}


@pytest.fixture(scope="session")
def standalone_master(tmp_path_factory):
    """A master and two workers started from pyspark's own spark-class, stopped by pid afterwards; their
    python3 has no numpy."""
    logs = tmp_path_factory.mktemp("standalone")
    # The executors the workers start are short-lived JVMs too; they inherit the workers' environment.
    env = {**bare_environment(logs / "bare"), "JAVA_TOOL_OPTIONS": SHORT_JVM_OPTIONS}
    port = free_port()
    url = f"spark://127.0.0.1:{port}"
    spark_class = str(spark_home() / "bin" / "spark-class")
    with servers(logs) as start:
        master_log = start(
            [
                spark_class,
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--webui-port",
                str(free_port()),
            ],
            env,
        )
        wait_for(master_log, "Starting Spark master")
        for i in range(2):
            start(
                [
                    spark_class,
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    "127.0.0.1",
                    "--cores",
                    "1",
                    "--memory",
                    "1g",
                    "--webui-port",
                    str(free_port()),
                    "--work-dir",
                    str(logs / f"work{i}"),
                    url,
                ],
                env,
            )
        wait_for(master_log, "Registering worker", 2)
        yield StandaloneCluster(url, [logs / f"work{i}" for i in range(2)])


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """An S3 API on 127.0.0.1 with one bucket (kfed_spark.bench.object_store.LoopbackS3), for the tests of
    object storage."""
    from kfed_spark.bench.object_store import loopback_s3

    with loopback_s3(tmp_path_factory.mktemp("moto")) as store:
        yield store
