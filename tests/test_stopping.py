"""Stopping on SIGTERM (kfed_spark.stopping): a real signal to this process, without a Spark session."""

import os
import signal
import time

import pytest

from kfed_spark import session
from kfed_spark.stopping import (
    STOP_REQUESTED,
    STOPPED,
    STREAM_STOPPED,
    Terminated,
    silence_spark_after_stop,
    stop_on_sigterm,
)

pytestmark = pytest.mark.fast


@pytest.fixture()
def own_sigterm(monkeypatch):
    """This process's SIGTERM handler and stop state as they were, afterwards; no session remembered
    (a session the test process built would be interrupted and silenced)."""
    monkeypatch.setattr(session, "_last_built", [])
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)
    STOP_REQUESTED.clear()
    STOP_REQUESTED.message = STOPPED


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
