"""Stopping on SIGTERM (what Airflow sends on a timeout, and a cluster manager before it kills): the
signal's handler, the state a stop leaves for whoever reports the failure, and what each stop means."""

from __future__ import annotations

import signal
import threading
import time
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

T = TypeVar("T")

STOPPED = "stopped by SIGTERM; the attempt was recorded as failed and nothing of it was published"
STREAM_STOPPED = (
    "stopped by SIGTERM; every micro-batch that finished is written, and a restart from the checkpoint "
    "goes on after the last one"
)


INTERRUPT_WAIT_SECONDS = 5.0
"""How long a SIGTERM waits for the interrupt of the session's Spark work before the run records its failure."""
LOG_SETTLE_SECONDS = 0.5
"""How long the error line waits, once Spark's log is off, for log lines the JVM was already writing."""


_last_built: list[SparkSession] = []
"""The session to interrupt on SIGTERM: kfed_spark.spark.session.build_session remembers each it builds."""


def last_built_session() -> SparkSession | None:
    """The session build_session last remembered, found without a call into the JVM: a SIGTERM handler
    runs in the main thread, which may be inside a py4j call whose connection must not carry another."""
    return _last_built[-1] if _last_built else None


def remember_session(spark: SparkSession) -> None:
    """Make `spark` the session a SIGTERM interrupts."""
    _last_built[:] = [spark]


class StopRequest(threading.Event):
    """Set when the process was asked to stop (SIGTERM): whatever exception the stop then causes (PySpark
    may raise a cancelled job's error in place of Terminated), the failure is the stop, and `message`
    says what it means for the command that was running."""

    message = STOPPED
    interrupting: threading.Thread | None = None
    """The thread interrupting the session's Spark work, once a stop started one."""


STOP_REQUESTED = StopRequest()


def despite_the_stop(action: Callable[[], T]) -> T:
    """Run `action`, Spark work that records what a stop left behind; if it fails after a stop was
    requested, wait for the stop's interrupt to finish (INTERRUPT_WAIT_SECONDS at most) and run `action`
    once more: so `action` must be safe to run twice. On a busy machine the stop can break such work in two
    ways: the interrupt cancels every Spark job active when Spark
    processes it, which can come after the handler stopped waiting for it; and the first py4j call after
    the interrupted one can get an empty answer from the JVM (py4j, on the interrupted call, asks the JVM
    to shut down that call's socket and closes every pooled connection to it)."""
    try:
        return action()
    except Exception:
        if not STOP_REQUESTED.is_set():
            raise
        interrupting = STOP_REQUESTED.interrupting
        if interrupting is not None:
            interrupting.join(INTERRUPT_WAIT_SECONDS)
            if interrupting.is_alive():
                raise
        return action()


class Terminated(KeyboardInterrupt):
    """The process was asked to stop (SIGTERM). A KeyboardInterrupt, as PySpark's own SIGINT handler
    raises, so that py4j drops the connection whose answer will never be read."""


def stop_on_sigterm(message: str = STOPPED) -> None:
    """On SIGTERM (what Airflow sends on a timeout), interrupt this session's Spark work and raise
    Terminated in the main thread, so that the run records its attempt as failed and exits; `message`
    is the error line that says what the stop left behind.

    The main thread may be waiting inside a py4j call (a count, a write), whose connection cannot
    carry another command until it returns: so the session is the one build_session remembered
    (asking the JVM for the active one hung the process), and the interrupt goes from a thread of
    its own, over its own connection; the handler waits for it (INTERRUPT_WAIT_SECONDS at most), and
    the failure's records wait for it too (despite_the_stop).
    """

    def handler(signum, frame):
        STOP_REQUESTED.set()
        spark = last_built_session()
        if spark is not None:
            STOP_REQUESTED.interrupting = threading.Thread(target=spark.interruptAll, daemon=True)
            STOP_REQUESTED.interrupting.start()
            # Raise once the interrupt is done, if it is done soon: the failure's own Spark work (recording
            # the attempt as failed) comes next, and an interrupt that lands after it began cancels it too
            # (despite_the_stop then runs it again).
            STOP_REQUESTED.interrupting.join(INTERRUPT_WAIT_SECONDS)
        raise Terminated(message)

    STOP_REQUESTED.message = message
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def silence_spark_after_stop(timeout: float = 5.0) -> None:
    """After SIGTERM, and before the error line: turn Spark's log off, so that nothing the JVM logs while
    the process exits (a stream's falling-behind warning, an interrupted job's trace) follows the error
    line. The session is not stopped: its interrupted tasks may hang, and the process is exiting anyway.
    A Spark Connect client has no JVM log here. Bounded by `timeout`, from a thread of its own."""
    from pyspark.sql import SparkSession

    spark = last_built_session()
    if isinstance(spark, SparkSession):
        silencer = threading.Thread(target=spark.sparkContext.setLogLevel, args=("OFF",), daemon=True)
        silencer.start()
        silencer.join(timeout)
        if not silencer.is_alive():
            # A JVM thread that passed its level check just before the switch still writes its line, and on
            # a busy machine it can land after the error line: give such lines a moment to land.
            time.sleep(LOG_SETTLE_SECONDS)
