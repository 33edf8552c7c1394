"""Building the SparkSession with Delta Lake, for local runs and under spark-submit alike."""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

from pyspark import SparkContext
from pyspark.sql import SparkSession

from kfed_spark.config import SparkConfig
from kfed_spark.errors import KFedError, UnreachableError, first_line
from kfed_spark.runtime.packaging import delta_package
from kfed_spark.runtime.stopping import remember_session

log = logging.getLogger(__name__)
T = TypeVar("T")

DELTA_SQL_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}
UNSORTED_PARTITION_WRITES = {"spark.sql.maxConcurrentOutputFileWriters": "4"}
"""Each write of a run goes to one (run_id, attempt_id) partition of its table: a task writes it
through an open file per partition (up to this many), instead of Spark's default of sorting its rows
by the partition columns first, which on a million rows of features costs about as much as the
write. A task that meets more partitions than that sorts the rest, as by default."""
COMMITS_WITHOUT_FILE_LIST_REPLAY = {
    "spark.databricks.delta.allFilesInCrc.verificationMode.forceOnNonUTC.enabled": "false",
}
"""Delta keeps a small table's list of files in each commit's checksum file. Where the session's or the JVM's
time zone is not UTC, it also rebuilds that list from the log after every commit (Spark jobs, up to a second a
commit on a local Spark) only to compare the two: a difference is logged and the list left out of later
checksum files; what a query reads never depends on it. In UTC Delta does not check; kfed-spark's sessions
commit as in UTC wherever they run."""
SESSION_DEFAULTS = {**UNSORTED_PARTITION_WRITES, **COMMITS_WITHOUT_FILE_LIST_REPLAY}
"""The SQL settings of every session build_session makes, local or over Spark Connect, under the config's own."""
DEFAULT_SPARK_LOG_LEVEL = "WARN"
"""Spark's own log level unless the config sets spark.log.level (under spark-submit Spark would log at INFO)."""
SESSION_CONF_PREFIXES = ("spark.sql.", "spark.databricks.")
"""Settings a Spark Connect client may set on its session; the rest belong to the server."""
CONSOLE_PROGRESS = "spark.ui.showConsoleProgress"
ONE_BLAS_THREAD_PER_WORKER = {
    f"spark.executorEnv.{name}": "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
}
"""Each Python worker runs one task on one core: its numpy kernels use one BLAS thread (a config that
sets these keys, for spark.task.cpus > 1, wins). The driver, where the server step runs, is left to
use its cores."""
TASKS_PER_LOCAL_CORE = 3
"""Shuffle partitions per core of a local Spark: Spark's tuning guide asks for 2-3 tasks per core."""
DELTA_SNAPSHOT_PARTITIONS = 50
"""Delta's own number of tasks that read a table's log, the most a local Spark is given."""
LOCAL_MASTER = re.compile(r"local(?:\[(\*|\d+)(?:,\d+)?\])?")
"""local, local[N], local[*] and their forms with a number of task retries (local[N,F])."""
DEFAULT_CONNECT_PORT = 15002
LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1"}
"""Hosts of a Spark Connect URL that name this machine."""
DELTA_JARS_ENV = "KFED_DELTA_JARS"
"""Comma-separated local Delta jars, for machines that cannot resolve packages from Maven."""
JVM_ARCHIVE_ENV = "KFED_JVM_ARCHIVE"
"""The JVM class archive that local sessions start with (`kfed-spark jvm-archive` writes it); `none`: no archive."""
DRIVER_DEFAULT_JAVA_OPTIONS = "spark.driver.defaultJavaOptions"
"""Java options Spark puts before spark.driver.extraJavaOptions: the archive goes here, so that a config's
own extra options stay as they are."""
QUIET_ARCHIVE = "-Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"
"""An archive the JVM cannot use (another Java, another class path) is skipped without a word on the console."""
THROUGHPUT_COLLECTOR = "-XX:+UseParallelGC"
"""The garbage collector of a local Spark that this process starts (with_local_collector)."""
COLLECTOR_OPTION = re.compile(r"-XX:\+Use\w+GC\b")
"""A Java option that chooses a garbage collector: the JVM refuses to start with two."""
DRIVER_JAVA_OPTIONS = (DRIVER_DEFAULT_JAVA_OPTIONS, "spark.driver.extraJavaOptions")
JAVA_OPTIONS_ENVIRONMENT = (
    "SPARK_SUBMIT_OPTS",
    "JAVA_TOOL_OPTIONS",
    "_JAVA_OPTIONS",
    "JDK_JAVA_OPTIONS",
    "PYSPARK_SUBMIT_ARGS",
)
"""The environment variables that the JVM pyspark starts through spark-submit also takes Java options from."""


def build_session(spark_cfg: SparkConfig, paths: Sequence[str] = ()) -> SparkSession:
    """A SparkSession with the Delta extensions, or a Spark Connect session (also last_built_session()).

    Delta's jars come, in this order, from KFED_DELTA_JARS, from jars the configuration already
    names (spark.jars / spark.jars.packages, as on a cluster), or from Maven through
    delta-spark's configure_spark_with_delta_pip, which picks the jar matching the installed
    pyspark; with the last two, the filesystems that `paths` (the config's input and output) need
    come with them (filesystem_packages). Under spark-submit the JVM is already up, so --packages or
    --jars decide instead (and delta-spark's Python package, which a packed environment leaves out,
    is not imported). Over Spark Connect the server has its own jars, extensions and master; only
    the SQL settings of the configuration reach it.
    """
    builder = SparkSession.builder.appName(spark_cfg.app_name)
    remote = connect_url(spark_cfg)
    if remote:
        check_reachable(remote)
        settings = {**SESSION_DEFAULTS, **spark_cfg.conf}
        sent = {key: value for key, value in settings.items() if key.startswith(SESSION_CONF_PREFIXES)}
        if len(sent) < len(settings):
            server_side = ", ".join(sorted(set(settings) - set(sent)))
            log.debug("over Spark Connect the server decides %s: not sent", server_side)
        for key, value in sent.items():
            builder = builder.config(key, conf_value(value))
        session = builder.remote(remote).getOrCreate()
        cores = server_local_cores(session, remote)
        if cores is not None:
            for key, value in partition_sizes(cores).items():
                if key not in spark_cfg.conf:
                    session.conf.set(key, value)
        return _remembered(session)
    if spark_cfg.master:
        builder = builder.master(spark_cfg.master)
    if is_local(spark_cfg) and "PYSPARK_PYTHON" not in os.environ:
        # Workers would take `python3` from PATH, which is not this environment's when the CLI was
        # started by its absolute path (cron, systemd, a BashOperator) without activating it. PySpark
        # reads the workers' interpreter from this variable when it creates the SparkContext.
        os.environ["PYSPARK_PYTHON"] = spark_cfg.conf.get("spark.pyspark.python", sys.executable)
    # This process starts the JVM: not under spark-submit, and no session of its own is running yet.
    starts_spark = not under_spark_submit() and SparkContext._active_spark_context is None
    conf = {
        **DELTA_SQL_CONF,
        **SESSION_DEFAULTS,
        "spark.log.level": DEFAULT_SPARK_LOG_LEVEL,
        **ONE_BLAS_THREAD_PER_WORKER,
        **(local_sizes(spark_cfg) if starts_spark else {}),
        **spark_cfg.conf,
    }
    if starts_spark:
        conf = with_jvm_archive(with_local_collector(conf) if local_cores(spark_cfg) else conf)
    for key, value in {**conf, CONSOLE_PROGRESS: console_progress(conf)}.items():
        builder = builder.config(key, conf_value(value))
    local_jars = os.environ.get(DELTA_JARS_ENV)
    extra = filesystem_packages(paths) if starts_spark else []  # a JVM that is up has its jars
    resolve = False
    if local_jars:
        builder = builder.config("spark.jars", local_jars)
        if extra:
            builder = builder.config("spark.jars.packages", ",".join(extra))
    elif not {"spark.jars", "spark.jars.packages"} & set(spark_cfg.conf) and not under_spark_submit():
        known = resolved_jars(extra)
        if known:
            builder = builder.config("spark.jars", ",".join(known))
        else:
            from delta import configure_spark_with_delta_pip

            builder, resolve = configure_spark_with_delta_pip(builder, extra_packages=extra), True
    session = builder.getOrCreate()
    if resolve:
        remember_jars(session, extra)
    return _remembered(session)


def hadoop_version() -> str:
    """The Hadoop version of the installed pyspark's jars (hadoop-client-api-X.Y.Z.jar)."""
    import pyspark

    for jar in (Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar"):
        return jar.name.removeprefix("hadoop-client-api-").removesuffix(".jar")
    raise KFedError("cannot tell the Hadoop version of the installed pyspark: no hadoop-client-api jar in its jars")


def filesystem_packages(paths: Sequence[str]) -> list[str]:
    """The Maven packages of the Hadoop filesystems that paths need beyond Spark's own: hadoop-aws for
    s3a:// (at the Hadoop version pyspark ships: S3A and the Hadoop client must match)."""
    schemes = {urlparse(str(path)).scheme for path in paths}
    return [f"org.apache.hadoop:hadoop-aws:{hadoop_version()}"] if "s3a" in schemes else []


def in_background(work: Callable[..., T], *args) -> Future[T]:
    """work(*args) started in a thread of its own, beside the caller's Spark work (a session takes
    jobs from several threads); the future's result() waits for it and returns its value or raises
    its error."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kfed-background")
    try:
        return executor.submit(work, *args)
    finally:
        executor.shutdown(wait=False)  # the thread ends when the work does


def console_progress(conf: dict) -> str:
    """Spark's progress bar, on where the JVM's stderr (this process's) is a terminal and the config
    does not turn it off: in a file (an Airflow task log, cron, CI) its carriage-return redraws pile
    up as fragments, and the error line gets glued to one of them."""
    wanted = conf_value(conf.get(CONSOLE_PROGRESS, "true")) != "false"
    return "true" if wanted and os.isatty(2) else "false"


def _remembered(session: SparkSession) -> SparkSession:
    remember_session(session)
    return session


def cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kfed-spark"


def resolved_jars_file(extra: Sequence[str] = ()) -> Path:
    """Where the jars that Delta's package (and the extra packages) resolved to are listed."""
    name = "+".join([delta_package(), *(package.replace(":", "_") for package in extra)])
    return cache_folder() / f"{name}.jars"


def jvm_archive_file() -> Path | None:
    """Where `kfed-spark jvm-archive` writes the class archive and local sessions look for it: KFED_JVM_ARCHIVE,
    else one per Spark version in the cache folder; None when KFED_JVM_ARCHIVE is `none`."""
    import pyspark

    chosen = os.environ.get(JVM_ARCHIVE_ENV)
    if chosen == "none":
        return None
    return Path(chosen) if chosen else cache_folder() / f"jvm-classes-spark-{pyspark.__version__}.jsa"


def with_jvm_archive(conf: dict) -> dict:
    """The session's settings with the driver JVM started from the class archive, where there is one and
    the config names no archive of its own. The JVM then maps the classes a run loads, already parsed and
    verified, instead of reading them from the jars: a local session starts seconds sooner."""
    archive = jvm_archive_file()
    options = " ".join(conf_value(conf.get(key, "")) for key in DRIVER_JAVA_OPTIONS)
    if archive is None or not archive.is_file() or "SharedArchiveFile" in options or "ArchiveClassesAtExit" in options:
        return conf
    return with_default_java_options(conf, f"-XX:SharedArchiveFile={archive} {QUIET_ARCHIVE}")


def with_local_collector(conf: dict) -> dict:
    """The settings of a local Spark that this process starts, with the throughput collector where no Java
    option chooses a collector (names_a_collector). In local mode one JVM is the driver and every executor,
    on a few cores that its Python workers need too. Java's default collector does much of its work on
    threads of its own while the job runs, which takes those cores; the throughput collector does all of it
    in pauses, which a batch job does not mind."""
    if names_a_collector(conf):
        return conf
    return with_default_java_options(conf, THROUGHPUT_COLLECTOR)


def with_default_java_options(conf: dict, options: str) -> dict:
    """The settings with options after the driver's default Java options, which Spark puts before
    spark.driver.extraJavaOptions: a config's own extra options stay as they are, and come after them."""
    default = conf_value(conf.get(DRIVER_DEFAULT_JAVA_OPTIONS, ""))
    return {**conf, DRIVER_DEFAULT_JAVA_OPTIONS: f"{default} {options}".strip()}


def names_a_collector(conf: dict) -> bool:
    """Some Java option the local JVM gets besides kfed-spark's chooses a garbage collector: in the settings,
    the environment (JAVA_OPTIONS_ENVIRONMENT) or spark-defaults.conf; a properties file that
    PYSPARK_SUBMIT_ARGS names counts as one that does."""
    if "--properties-file" in os.environ.get("PYSPARK_SUBMIT_ARGS", ""):
        return True
    options = [conf_value(conf.get(key, "")) for key in DRIVER_JAVA_OPTIONS]
    options += [os.environ.get(name, "") for name in JAVA_OPTIONS_ENVIRONMENT]
    import pyspark

    home = os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)  # pip's pyspark is its own home
    try:
        defaults = Path(os.environ.get("SPARK_CONF_DIR") or os.path.join(home, "conf"), "spark-defaults.conf")
        options += [line for line in defaults.read_text().splitlines() if line.strip().startswith(DRIVER_JAVA_OPTIONS)]
    except OSError:
        pass
    return any(COLLECTOR_OPTION.search(text) for text in options)


def write_jvm_archive(target: Path, work: Path) -> int:
    """Run the demo in a process of its own whose JVM writes the classes it loaded to a class archive when it
    exits; then move the archive to target (whole or not at all: a session starting meanwhile sees the old
    one or none). Returns the archive's size in bytes."""
    import subprocess

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}")
    env = {
        **os.environ,
        JVM_ARCHIVE_ENV: "none",
        "SPARK_SUBMIT_OPTS": f"{os.environ.get('SPARK_SUBMIT_OPTS', '')} -XX:ArchiveClassesAtExit={partial} "
        f"{QUIET_ARCHIVE}".strip(),
    }
    command = [sys.executable, "-m", "kfed_spark.cli", "demo", "--folder", str(work)]
    # The JVM writes the archive as it exits, after the demo's Python; it shares the demo's output pipes,
    # so run() returns once the JVM is gone and the archive whole.
    demo = subprocess.run(command, env=env, capture_output=True, text=True)
    if demo.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        last = (demo.stderr.strip().splitlines() or ["no output"])[-1]
        raise KFedError(f"cannot write the JVM class archive: the demo that loads the classes failed: {last}")
    partial.replace(target)
    return target.stat().st_size


def resolved_jars(extra: Sequence[str] = ()) -> list[str] | None:
    """The local jars Ivy resolved Delta's package (and the extra packages) to at an earlier start, if they
    are all still there. Naming them skips the resolution, its 30-line report on every start, and a second
    of start-up."""
    try:
        jars = resolved_jars_file(extra).read_text().split()
    except OSError:
        return None
    return jars if jars and all(Path(jar).is_file() for jar in jars) else None


def remember_jars(session: SparkSession, extra: Sequence[str] = ()) -> None:
    jars = [urlparse(jar).path for jar in session.sparkContext.getConf().get("spark.jars", "").split(",") if jar]
    if jars:
        try:
            target = resolved_jars_file(extra)
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f"{target.name}.{os.getpid()}")
            partial.write_text("\n".join(jars) + "\n")
            partial.replace(target)  # whole or not at all, for a process starting at the same moment
        except OSError as exc:
            log.debug("cannot keep the list of Delta's jars: %s", exc)


def conf_value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_reachable(remote: str, timeout: float = 10.0) -> None:
    """Fail in one line when nothing listens at the Connect URL: the client would otherwise retry for
    minutes before giving up."""
    try:
        socket.create_connection(connect_address(remote), timeout=timeout).close()
    except OSError as exc:
        raise UnreachableError(f"cannot reach the Spark Connect server at {remote}: {exc.strerror or exc}") from None


def connect_address(remote: str) -> tuple[str | None, int]:
    """The host and port of a Spark Connect URL (sc://host:port/;params); Spark Connect's port by default."""
    parsed = urlparse(remote.replace("sc://", "http://", 1))
    return parsed.hostname, parsed.port or DEFAULT_CONNECT_PORT


def connect_url(spark_cfg: SparkConfig) -> str | None:
    """The Spark Connect server to use: spark.remote of the config, else SPARK_REMOTE."""
    return spark_cfg.remote or os.environ.get("SPARK_REMOTE")


def is_local(spark_cfg: SparkConfig) -> bool:
    """Spark will run in this process's own local JVM: a local master, or none at all outside
    spark-submit and Spark Connect; PySpark then defaults to local[*]."""
    if connect_url(spark_cfg):
        return False
    master = spark_cfg.master or os.environ.get("MASTER")
    if master:
        return master.startswith("local")
    return not under_spark_submit()


def local_cores(spark_cfg: SparkConfig) -> int | None:
    """The cores of the local Spark that spark_cfg starts in this process: N of local[N], this process's
    CPUs for local[*] or no master, 1 for local; None for any other master (a cluster's, spark-submit's,
    Spark Connect's, local-cluster)."""
    if not is_local(spark_cfg):
        return None
    return master_cores(spark_cfg.master or os.environ.get("MASTER") or "local[*]", this_machine=True)


def server_local_cores(session: SparkSession, remote: str) -> int | None:
    """The cores of a Spark Connect server that runs Spark in local mode, as its master says: N of local[N],
    1 of local, and for local[*] this machine's CPUs where the server listens on this machine (else its CPUs
    are unknown); None for a cluster's master, or a server that does not tell its master."""
    try:
        master = session.conf.get("spark.master", None)
    except Exception as exc:  # a managed server may refuse to tell: its sizes are then its own
        log.debug("the Spark Connect server does not tell its master: %s", first_line(exc))
        return None
    host, _ = connect_address(remote)
    return master_cores(master or "", this_machine=host in LOOPBACK_HOSTS)


def master_cores(master: str, this_machine: bool) -> int | None:
    """The cores of a local master (local, local[N], local[*], with or without task retries); local[*]'s
    only where its JVM runs on this machine (this_machine): this process's CPUs. None otherwise."""
    found = LOCAL_MASTER.fullmatch(master)
    if found is None:
        return None
    cores = found.group(1)
    if cores == "*":
        return len(os.sched_getaffinity(0)) if this_machine else None
    return 1 if cores is None else int(cores)


def local_sizes(spark_cfg: SparkConfig) -> dict[str, str]:
    """Partition counts for the local Spark that spark_cfg starts, sized to its cores (partition_sizes)."""
    cores = local_cores(spark_cfg)
    return {} if cores is None else partition_sizes(cores)


def partition_sizes(cores: int) -> dict[str, str]:
    """Partition counts for a Spark in local mode on `cores` cores, under a config's own settings. Spark's 200
    shuffle partitions and Delta's 50 snapshot partitions are sized for clusters: on one machine most of
    those tasks cost more than their work, and nearly halve a small run's speed. A Spark Connect server in
    local mode gets them too: each is a setting of the run's own session there, not of the server."""
    return {
        "spark.sql.shuffle.partitions": str(TASKS_PER_LOCAL_CORE * cores),
        "spark.databricks.delta.snapshotPartitions": str(min(cores, DELTA_SNAPSHOT_PARTITIONS)),
    }


def under_spark_submit() -> bool:
    """This Python was started by spark-submit, whose JVM is already up (it passes its gateway's port)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ
