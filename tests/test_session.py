"""Building the session: the settings build_session derives, and what the Python workers get."""

import os
import pty
import subprocess
import sys

import pytest


@pytest.mark.fast
def test_the_progress_bar_is_on_only_where_stderr_is_a_terminal(tmp_path):
    """session.console_progress in a process whose stderr is a pseudo-terminal, a file, or a terminal with
    the bar turned off in the config. (That Spark then draws the bar on a terminal was checked by hand.)"""
    check = (
        "from kfed_spark.spark.session import console_progress; import sys; "
        "print(console_progress({} if len(sys.argv) < 2 else {'spark.ui.showConsoleProgress': sys.argv[1]}))"
    )

    def started(stderr, *conf):
        return subprocess.Popen([sys.executable, "-c", check, *conf], stderr=stderr, stdout=subprocess.PIPE, text=True)

    terminal, terminal_end = pty.openpty()
    try:
        with open(tmp_path / "stderr.log", "w") as log_file:
            side_by_side = [started(terminal_end), started(log_file), started(terminal_end, "false")]
            assert [process.communicate(timeout=60)[0].strip() for process in side_by_side] == [
                "true",
                "false",
                "false",
            ]
    finally:
        os.close(terminal)
        os.close(terminal_end)


@pytest.mark.spark
def test_python_workers_get_one_blas_thread(spark):
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    seen = spark.sparkContext.parallelize([0], 1).map(lambda _: {n: os.environ.get(n) for n in names}).collect()
    assert seen == [{name: "1" for name in names}]


@pytest.mark.spark
def test_a_session_writes_a_partition_without_sorting_its_rows_first(spark, tmp_path):
    """Every write of a run is one (run_id, attempt_id) partition: rows go through an open file per
    partition, and a task that meets several partitions still writes each whole."""
    from kfed_spark.spark.session import UNSORTED_PARTITION_WRITES

    for key, value in UNSORTED_PARTITION_WRITES.items():
        assert spark.conf.get(key) == value
    rows = spark.range(0, 1000, numPartitions=2).selectExpr("id", "CAST(id % 7 AS STRING) AS part")
    rows.write.format("delta").partitionBy("part").save(str(tmp_path / "seven"))
    back = spark.read.format("delta").load(str(tmp_path / "seven"))
    assert back.count() == 1000 and back.select("part").distinct().count() == 7


@pytest.mark.spark
def test_a_commit_off_utc_does_not_rebuild_the_tables_file_list(spark, tmp_path):
    """In a session on local time (not UTC), a commit leaves its new snapshot as Delta's incremental commit
    made it: no state reconstruction from the log. With Delta's own default for such a session it rebuilds it."""
    from kfed_spark.spark.session import COMMITS_WITHOUT_FILE_LIST_REPLAY

    (key, value), zone = next(iter(COMMITS_WITHOUT_FILE_LIST_REPLAY.items())), "spark.sql.session.timeZone"
    before = {name: spark.conf.get(name) for name in (key, zone)}
    assert before[key] == value

    def rebuilt_after_append(folder: str) -> bool:
        path = str(tmp_path / folder)
        spark.range(3).write.format("delta").save(path)
        spark.range(3).write.format("delta").mode("append").save(path)
        log = spark.sparkContext._jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, path)
        return log.unsafeVolatileSnapshot().stateReconstructionTriggered()

    try:
        spark.conf.set(zone, "America/Los_Angeles")
        assert not rebuilt_after_append("ours")
        spark.conf.set(key, "true")
        assert rebuilt_after_append("deltas_default")
    finally:
        for name, setting in before.items():
            spark.conf.set(name, setting)


@pytest.mark.fast
def test_a_local_session_starts_from_the_class_archive_unless_told_otherwise(tmp_path, monkeypatch):
    from kfed_spark.spark.session import DRIVER_DEFAULT_JAVA_OPTIONS, JVM_ARCHIVE_ENV, with_jvm_archive

    archive = tmp_path / "classes.jsa"
    monkeypatch.setenv(JVM_ARCHIVE_ENV, str(archive))
    assert with_jvm_archive({"spark.log.level": "WARN"}) == {"spark.log.level": "WARN"}  # none written yet
    archive.write_bytes(b"")
    options = with_jvm_archive({DRIVER_DEFAULT_JAVA_OPTIONS: "-Xss4m"})[DRIVER_DEFAULT_JAVA_OPTIONS]
    assert options.startswith(f"-Xss4m -XX:SharedArchiveFile={archive} -Xshare:auto")
    own = {"spark.driver.extraJavaOptions": "-XX:SharedArchiveFile=/elsewhere.jsa"}
    assert with_jvm_archive(own) == own  # the config's own archive
    monkeypatch.setenv(JVM_ARCHIVE_ENV, "none")
    assert with_jvm_archive({}) == {}


@pytest.mark.spark
def test_the_tests_jvm_maps_the_class_archive(spark, jvm_archive):
    """What `kfed-spark jvm-archive` is for: the JVM maps the archive's classes (jcmd's CDS line counts the
    bytes mapped: the archive's and the JDK's own), it does not merely get the option. On a machine without
    the archive, the worker that did not write it starts its session before it is there (conftest's
    jvm_archive): that session got no archive, and the archive is not there yet or newer than its JVM."""
    from kfed_spark.spark.session import DRIVER_DEFAULT_JAVA_OPTIONS

    runtime = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
    if "SharedArchiveFile" not in spark.sparkContext.getConf().get(DRIVER_DEFAULT_JAVA_OPTIONS, ""):
        assert not jvm_archive.is_file() or jvm_archive.stat().st_mtime > runtime.getStartTime() / 1000
        return
    info = subprocess.run(["jcmd", str(runtime.getPid()), "VM.info"], capture_output=True, text=True, check=True).stdout
    mapped = next(line for line in info.splitlines() if line.startswith("CDS archive(s) mapped at"))
    assert int(mapped.split("size ")[1].split(",")[0]) > jvm_archive.stat().st_size


@pytest.mark.fast
def test_a_local_spark_collects_with_the_throughput_collector_unless_an_option_names_one(tmp_path, monkeypatch):
    """Two collectors stop the JVM from starting: the throughput collector is added only where no Java option
    of the settings, the environment or spark-defaults.conf chooses one."""
    from kfed_spark.spark.session import DRIVER_DEFAULT_JAVA_OPTIONS, JAVA_OPTIONS_ENVIRONMENT, with_local_collector

    for name in JAVA_OPTIONS_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    assert with_local_collector({DRIVER_DEFAULT_JAVA_OPTIONS: "-Xss4m"}) == {
        DRIVER_DEFAULT_JAVA_OPTIONS: "-Xss4m -XX:+UseParallelGC"
    }
    turned_off = {"spark.driver.extraJavaOptions": "-XX:-UseSerialGC"}  # turns one off, chooses none
    assert with_local_collector(turned_off) == {**turned_off, DRIVER_DEFAULT_JAVA_OPTIONS: "-XX:+UseParallelGC"}
    own = {"spark.driver.extraJavaOptions": "-Dx=1 -XX:+UseG1GC"}
    assert with_local_collector(own) == own
    for name in JAVA_OPTIONS_ENVIRONMENT:
        monkeypatch.setenv(name, "-XX:+UseSerialGC")
        assert with_local_collector({}) == {}, name
        monkeypatch.delenv(name)
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--properties-file /etc/spark.conf pyspark-shell")
    assert with_local_collector({}) == {}  # a file of settings it does not read
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS")
    (tmp_path / "spark-defaults.conf").write_text("spark.driver.extraJavaOptions  -XX:+UseZGC\n")
    assert with_local_collector({}) == {}


@pytest.mark.spark
def test_a_local_spark_runs_the_collector_it_is_given():
    """A local session that this process starts collects with the throughput collector, and with the one a
    Java option in the environment chooses instead (the JVM would not start with both)."""
    from kfed_spark.spark.session import JAVA_OPTIONS_ENVIRONMENT

    show = (
        "from kfed_spark.config import SparkConfig; from kfed_spark.spark.session import build_session; "
        "spark = build_session(SparkConfig(master='local[1]')); "
        "beans = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getGarbageCollectorMXBeans(); "
        "print(sorted(bean.getName() for bean in beans)); spark.stop()"
    )
    env = {key: value for key, value in os.environ.items() if key not in JAVA_OPTIONS_ENVIRONMENT}
    runs = [
        subprocess.Popen([sys.executable, "-c", show], env={**env, **extra}, stdout=subprocess.PIPE, text=True)
        for extra in ({}, {"SPARK_SUBMIT_OPTS": "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"})
    ]
    seen = [run.communicate(timeout=300)[0].strip().splitlines()[-1] for run in runs]
    assert seen == ["['PS MarkSweep', 'PS Scavenge']", "['Copy', 'MarkSweepCompact']"]


SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"
SNAPSHOT_PARTITIONS = "spark.databricks.delta.snapshotPartitions"


@pytest.mark.fast
def test_a_local_spark_gets_partition_counts_sized_to_its_cores(monkeypatch):
    """Three shuffle partitions and one Delta snapshot partition per core of a local Spark that the job starts;
    nothing for a Spark it does not start itself."""
    from kfed_spark.config import SparkConfig
    from kfed_spark.spark.session import local_sizes, master_cores

    for name in ("MASTER", "PYSPARK_GATEWAY_PORT", "SPARK_REMOTE"):
        monkeypatch.delenv(name, raising=False)

    def sizes(master=None, **cfg):
        return local_sizes(SparkConfig(master=master, **cfg))

    cores = len(os.sched_getaffinity(0))
    assert sizes("local[3]") == {SHUFFLE_PARTITIONS: "9", SNAPSHOT_PARTITIONS: "3"}
    assert sizes("local[4,2]") == {SHUFFLE_PARTITIONS: "12", SNAPSHOT_PARTITIONS: "4"}  # 2: task retries
    assert sizes("local") == {SHUFFLE_PARTITIONS: "3", SNAPSHOT_PARTITIONS: "1"}
    assert (
        sizes() == sizes("local[*]") == {SHUFFLE_PARTITIONS: str(3 * cores), SNAPSHOT_PARTITIONS: str(min(cores, 50))}
    )
    assert sizes("local[64]") == {SHUFFLE_PARTITIONS: "192", SNAPSHOT_PARTITIONS: "50"}  # never above Delta's own
    for master in ("spark://127.0.0.1:7077", "yarn", "k8s://https://127.0.0.1:6443", "local-cluster[2,1,1024]"):
        assert sizes(master) == {}, master
    assert sizes(remote="sc://127.0.0.1:15002") == {}  # the server's master decides (server_local_cores)
    assert master_cores("local[*]", this_machine=False) is None  # a server's CPUs elsewhere are unknown
    assert master_cores("local[*]", this_machine=True) == cores
    assert master_cores("local[2,3]", this_machine=False) == 2
    assert master_cores("spark://10.0.0.1:7077", this_machine=True) is None
    monkeypatch.setenv("MASTER", "local[5]")
    assert sizes()[SHUFFLE_PARTITIONS] == "15"
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")  # under spark-submit: its own settings stand
    monkeypatch.delenv("MASTER")
    assert sizes() == {}


@pytest.mark.spark
def test_a_session_already_running_keeps_its_own_partition_counts(spark):
    """A run in a process whose Spark is already up (a notebook's, the tests') with a config of no Spark
    settings leaves that session's partition counts as they are: it did not start that Spark."""
    from kfed_spark.config import SparkConfig
    from kfed_spark.spark.session import build_session

    before = {name: spark.conf.get(name) for name in (SHUFFLE_PARTITIONS, SNAPSHOT_PARTITIONS)}
    try:
        assert build_session(SparkConfig()) is spark
        assert {name: spark.conf.get(name) for name in before} == before
    finally:
        for name, value in before.items():
            spark.conf.set(name, value)
