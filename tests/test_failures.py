"""The one line that describes a failure (kfed_spark.runtime.failures), and the stop that SIGTERM leaves behind."""

import pytest
from pyspark.errors import PySparkException

from kfed_spark.errors import ConfigError
from kfed_spark.runtime.failures import describe
from kfed_spark.runtime.packaging import delta_package
from kfed_spark.runtime.stopping import STOP_REQUESTED, STOPPED, STREAM_STOPPED, Terminated

TRACE = """Job aborted due to stage failure: Task 0 in stage 3.0 failed 1 times
org.apache.spark.api.python.PythonException: Traceback (most recent call last):
  File "/worker.py", line 1247, in main
    process()
ModuleNotFoundError: No module named 'numpy'
\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(PythonRunner.scala:572)"""


@pytest.mark.fast
def test_our_errors_say_what_they_are_and_a_bug_keeps_its_traceback():
    assert describe(ConfigError("k must be an integer >= 1, got 0")) == "k must be an integer >= 1, got 0"
    assert describe(ValueError("a bug")) is None


@pytest.mark.fast
def test_spark_s_failures_are_cut_to_what_to_do():
    assert describe(PySparkException(message=TRACE)) == (
        "Spark failed: a Python worker raised ModuleNotFoundError: No module named 'numpy'"
    )
    missing = PySparkException(message="java.lang.ClassNotFoundException: delta.DefaultSource\n\tat Foo.bar")
    assert describe(missing) == (
        "Delta Lake is not on Spark's classpath (java.lang.ClassNotFoundException: delta.DefaultSource); "
        f"pass --packages {delta_package()}"
    )
    assert describe(PySparkException(message="[TABLE_OR_VIEW_NOT_FOUND] x\nmore")) == (
        "Spark failed: [TABLE_OR_VIEW_NOT_FOUND] x"
    )


@pytest.mark.fast
def test_after_sigterm_every_failure_is_the_stop_and_says_what_it_left():
    try:
        STOP_REQUESTED.message = STREAM_STOPPED
        STOP_REQUESTED.set()
        assert describe(PySparkException(message="[OPERATION_CANCELED] job cancelled")) == STREAM_STOPPED
        assert describe(Terminated(STREAM_STOPPED)) == STREAM_STOPPED
    finally:
        STOP_REQUESTED.clear()
        STOP_REQUESTED.message = STOPPED
    assert describe(Terminated(STOPPED)) == STOPPED


@pytest.mark.spark
def test_a_python_worker_failure_is_told_by_its_own_exception(spark):
    """Executors without the job's packages fail in the worker; Spark's first line only says a worker
    failed, so the one-line error carries the worker's exception line instead."""

    def lacks_numpy(batches):  # defined here, so that the worker gets it by value, not by module
        raise ModuleNotFoundError("No module named 'numpy'")
        yield  # a generator, as mapInPandas wants

    with pytest.raises(Exception) as failure:
        spark.range(3).mapInPandas(lacks_numpy, "id long").collect()
    assert (
        describe(failure.value) == "Spark failed: a Python worker raised ModuleNotFoundError: No module named 'numpy'"
    )


@pytest.mark.spark
def test_a_lost_task_result_is_told_with_what_to_do(spark):
    """toArrow fetches its result in another thread, and Spark wraps that thread's failure (awaitResult): the
    line is the failure inside. A result the driver could not take (TaskResultLost: a million devices' local
    centers on Spark's default 1 GiB heap) says to raise the driver's memory."""
    from py4j.protocol import Py4JJavaError

    jvm = spark.sparkContext._jvm
    lost = (
        "Job aborted due to stage failure: Task 1 in stage 14.0 failed 1 times, most recent failure: Lost task 1.0 "
        "in stage 14.0 (TID 40) (192.0.2.2 executor driver): TaskResultLost (result lost from block manager)"
    )
    wrapped = jvm.org.apache.spark.SparkException(
        "Exception thrown in awaitResult: ", jvm.org.apache.spark.SparkException(lost)
    )
    assert describe(Py4JJavaError("An error occurred while calling o171.getResult.", wrapped)) == (
        f"Spark failed: org.apache.spark.SparkException: {lost}; a task's result did not reach the driver, most "
        "often because the driver is short of memory: raise spark.driver.memory"
    )
