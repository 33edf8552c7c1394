"""The one line that describes any failure: the CLI prints it last on stderr, a failed attempt's runs row
records it. Ours say what they are; Spark's and its JVM's are cut to their first line (the full trace
stays in Spark's log), with what to do where that is known (a Python worker's error, Delta's jar
missing from the classpath)."""

from __future__ import annotations

import re

from kfed_spark.errors import KFedError, first_line
from kfed_spark.runtime.packaging import delta_package
from kfed_spark.runtime.stopping import STOP_REQUESTED, Terminated


def describe(exc: BaseException) -> str | None:
    """One line for a failure of ours or of Spark and its JVM (the full trace stays in Spark's log);
    None for anything else, a bug whose traceback should be seen."""
    if STOP_REQUESTED.is_set():
        return STOP_REQUESTED.message
    if isinstance(exc, (KFedError, Terminated)):
        return str(exc)
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    if isinstance(exc, Py4JJavaError):
        full = str(unwrapped(exc.java_exception))
    elif isinstance(exc, PySparkException):
        full = str(exc)
    else:
        return None
    raised = python_worker_error(full)
    if raised:
        return f"Spark failed: a Python worker raised {raised}"
    text = first_line(Exception(full))
    if "delta" in text.lower() and ("ClassNotFoundException" in text or "find" in text.lower()):
        package = delta_package() or "io.delta:delta-spark_<spark>_2.13:<delta>"
        return f"Delta Lake is not on Spark's classpath ({text}); pass --packages {package}"
    if RESULT_LOST in text:
        return f"Spark failed: {text}; {RESULT_LOST_HINT}"
    return f"Spark failed: {text}"


AWAITED = "Exception thrown in awaitResult"
"""The message of Spark's wrapper of a failure in another thread: the failure is its cause."""
RESULT_LOST = "TaskResultLost"
RESULT_LOST_HINT = (
    "a task's result did not reach the driver, most often because the driver is short of memory: "
    "raise spark.driver.memory"
)


def unwrapped(java_exception):
    """The Java exception, or the failure inside Spark's wrapper (AWAITED) that a result fetched in another
    thread throws, as toArrow's does."""
    while java_exception.getCause() is not None and str(java_exception.getMessage() or "").startswith(AWAITED):
        java_exception = java_exception.getCause()
    return java_exception


PYTHON_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)(: .*)?$")


def python_worker_error(text: str) -> str | None:
    """The exception line of the Python traceback in Spark's message when a Python worker failed (as
    `No module named 'numpy'` on executors without the job's packages); Spark's own first line only
    says that a worker failed."""
    if "Traceback (most recent call last)" not in text:
        return None
    tail = text.split("Traceback (most recent call last)")[-1]
    return next((line.strip() for line in tail.splitlines() if PYTHON_EXCEPTION_LINE.match(line.strip())), None)
