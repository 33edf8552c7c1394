"""Stopping on SIGTERM (kfed_spark.runtime.stopping): a real signal to this process, without a Spark session."""

import os
import signal
import threading
import time

import pytest

from kfed_spark.runtime import stopping
from kfed_spark.runtime.stopping import (
    STOP_REQUESTED,
    STOPPED,
    STREAM_STOPPED,
    Terminated,
    despite_the_stop,
    silence_spark_after_stop,
    stop_on_sigterm,
)

pytestmark = pytest.mark.fast


@pytest.fixture()
def own_sigterm(monkeypatch):
    """This process's SIGTERM handler and stop state as they were, afterwards; no session remembered
    (a session the test process built would be interrupted and silenced)."""
    monkeypatch.setattr(stopping, "_last_built", [])
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)
    STOP_REQUESTED.clear()
    STOP_REQUESTED.message = STOPPED
    STOP_REQUESTED.interrupting = None


def test_sigterm_raises_terminated_saying_what_the_stop_left_and_marks_the_stop(own_sigterm):
    stop_on_sigterm(STREAM_STOPPED)
    assert not STOP_REQUESTED.is_set()
    with pytest.raises(Terminated, match="every micro-batch that finished is written"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in the main thread long before this ends
    assert STOP_REQUESTED.is_set() and STOP_REQUESTED.message == STREAM_STOPPED
    assert isinstance(Terminated(STOPPED), KeyboardInterrupt)  # py4j drops the connection it interrupts


def test_without_a_session_there_is_nothing_to_silence(own_sigterm):
    started = time.monotonic()
    silence_spark_after_stop()
    assert time.monotonic() - started < 1


def work_that_an_interrupt_cancels(interrupted: threading.Event, tries: list[str]):
    """Work lasting 0.3 s that fails if the interrupt lands while it runs, as a cancelled Spark job does."""

    def work():
        before = interrupted.is_set()
        time.sleep(0.3)
        tries.append("cancelled" if interrupted.is_set() and not before else "done")
        if tries[-1] == "cancelled":
            raise RuntimeError("job cancelled")
        return len(tries)

    return work


def test_work_that_a_late_interrupt_cancelled_runs_again_once_the_interrupt_is_done(own_sigterm):
    interrupted, tries = threading.Event(), []
    STOP_REQUESTED.set()
    STOP_REQUESTED.interrupting = threading.Thread(target=lambda: (time.sleep(0.1), interrupted.set()))
    STOP_REQUESTED.interrupting.start()
    assert despite_the_stop(work_that_an_interrupt_cancels(interrupted, tries)) == 2
    assert tries == ["cancelled", "done"]


def test_work_that_fails_after_the_interrupt_was_done_runs_once_more(own_sigterm):
    """The first py4j call after the interrupted one can fail with an empty answer from the JVM."""
    tries = []
    STOP_REQUESTED.set()
    STOP_REQUESTED.interrupting = threading.Thread(target=lambda: None)
    STOP_REQUESTED.interrupting.start()
    STOP_REQUESTED.interrupting.join()

    def fails_once():
        tries.append("failed" if not tries else "done")
        if tries[-1] == "failed":
            raise RuntimeError("Answer from Java side is empty")
        return len(tries)

    assert despite_the_stop(fails_once) == 2


def test_without_a_stop_failing_work_is_not_run_again(own_sigterm):
    tries = []

    def failing():
        tries.append("failed")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        despite_the_stop(failing)
    assert tries == ["failed"]
