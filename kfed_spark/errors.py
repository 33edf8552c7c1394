"""Errors a user can act on, and the one line that describes any failure (the CLI prints it last on
stderr; a failed attempt's runs row records it)."""

import re
import threading

STOPPED = "stopped by SIGTERM; the attempt was recorded as failed and nothing of it was published"
STREAM_STOPPED = ("stopped by SIGTERM; every micro-batch that finished is written, and a restart from the checkpoint "
                  "goes on after the last one")


class StopRequest(threading.Event):
    """Set when the process was asked to stop (SIGTERM): whatever exception the stop then causes (PySpark
    may raise a cancelled job's error in place of Terminated), the failure is the stop, and `message`
    says what it means for the command that was running."""

    message = STOPPED


STOP_REQUESTED = StopRequest()


class KFedError(Exception):
    """Base class of every error kfed-spark reports to its user."""

    exit_code = 2
    """The CLI's exit code: 2 for the user's mistakes, 1 for what went wrong around them."""


class ConfigError(KFedError):
    """The configuration is invalid."""


class InputError(KFedError):
    """The input table is missing or does not fit the data contract."""


class UnreachableError(KFedError):
    """A server the job needs (Spark Connect) does not answer."""

    exit_code = 1


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message: Spark's own messages carry a JVM trace after it."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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
        full = str(exc.java_exception)
    elif isinstance(exc, PySparkException):
        full = str(exc)
    else:
        return None
    raised = python_worker_error(full)
    if raised:
        return f"Spark failed: a Python worker raised {raised}"
    text = first_line(Exception(full))
    if "delta" in text.lower() and ("ClassNotFoundException" in text or "find" in text.lower()):
        from kfed_spark.session import delta_package

        package = delta_package() or "io.delta:delta-spark_<spark>_2.13:<delta>"
        return f"Delta Lake is not on Spark's classpath ({text}); pass --packages {package}"
    return f"Spark failed: {text}"


PYTHON_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)(: .*)?$")


def python_worker_error(text: str) -> str | None:
    """The exception line of the Python traceback in Spark's message when a Python worker failed (as
    `No module named 'numpy'` on executors without the job's packages); Spark's own first line only
    says that a worker failed."""
    if "Traceback (most recent call last)" not in text:
        return None
    tail = text.split("Traceback (most recent call last)")[-1]
    return next((line.strip() for line in tail.splitlines() if PYTHON_EXCEPTION_LINE.match(line.strip())), None)


class Terminated(KeyboardInterrupt):
    """The process was asked to stop (SIGTERM). A KeyboardInterrupt, as PySpark's own SIGINT handler
    raises, so that py4j drops the connection whose answer will never be read."""
