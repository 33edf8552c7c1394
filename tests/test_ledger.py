"""The rules of the attempt ledger that need no Spark: publish numbers, the published attempt, dead processes."""

import os
import socket
import subprocess
import sys

import pytest

from kfed_spark.store.ledger import committed_publish_seqs, highest_cluster_id, process_gone, published_attempts
from kfed_spark.store.tables import RunRecord

pytestmark = pytest.mark.fast


def attempt(run_id, attempt_id, status, publish_seq):
    return RunRecord.of({"run_id": run_id, "attempt_id": attempt_id, "status": status, "publish_seq": publish_seq})


ROWS = [
    attempt("day1", "a", "superseded", 1),
    attempt("day1", "b", "succeeded", 2),
    attempt("day1", "c", "running", 3),  # claimed, not committed
    attempt("day1", "d", "failed", None),
    attempt("day2", "e", "running", 1),
    attempt("day3", "f", "succeeded", 1),
    attempt("day3", "g", "succeeded", 2),  # published; f is superseded but not yet marked
    attempt("day4", "h", "superseded", 1),
    attempt("day4", "i", "retracted", 2),  # an erasure took its run back: nothing published
]


def test_only_committed_publish_numbers_count():
    committed = committed_publish_seqs(ROWS)
    assert [committed[run] for run in ("day1", "day2", "day3", "day4", "new")] == [2, 0, 2, 2, 0]


def test_the_published_attempt_is_the_succeeded_one_with_the_highest_number():
    assert published_attempts(ROWS) == {"day1": "b", "day3": "g"}


def test_a_retracted_run_s_cluster_ids_stay_used():
    def published_with(status, run_id, highest):
        return RunRecord.of({"run_id": run_id, "attempt_id": run_id, "status": status, "highest_cluster_id": highest})

    rows = [published_with("succeeded", "day1", 7), published_with("retracted", "day2", 11)]
    assert highest_cluster_id(rows, "day3") == 11
    assert highest_cluster_id(rows, "day2") == 7  # a re-run of the retracted run id may take its ids again


def test_a_process_is_gone_only_when_certain():
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    assert process_gone(host, int(finished.stdout))
    assert not process_gone(host, os.getpid())  # this process
    assert not process_gone("another-host", int(finished.stdout))  # cannot tell: not gone


def test_writes_to_one_table_on_a_local_disk_take_turns_across_processes(tmp_path, monkeypatch):
    """Delta on a local disk cannot stop two processes committing the same version (the rename
    overwrites): OutputTables.writing makes them take turns per table, and only per table."""
    import subprocess
    import sys
    import threading

    from kfed_spark.config import OutputConfig
    from kfed_spark.store.output import OutputTables

    out = str(tmp_path / "out")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from kfed_spark.config import OutputConfig\n"
            "from kfed_spark.store.output import OutputTables\n"
            f"with OutputTables(None, OutputConfig(path={out!r})).writing('runs'):\n"
            "    print('holding', flush=True)\n"
            "    sys.stdin.readline()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "holding"
    tables = OutputTables(None, OutputConfig(path=out))
    with tables.writing("labels"):  # another table: no wait
        assert holder.poll() is None
    entered = threading.Event()

    def write_runs():
        with tables.writing("runs"):
            entered.set()

    writer = threading.Thread(target=write_runs)
    writer.start()
    assert not entered.wait(0.5)  # the same table: it waits while the other process holds it
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert entered.wait(30) and holder.wait(timeout=30) == 0
    writer.join()
    monkeypatch.chdir(tmp_path)
    with OutputTables(None, OutputConfig(path="s3a://bucket/out")).writing("runs"):
        pass  # an object store's log store excludes writers itself: no lock, no local folder
    assert not (tmp_path / "s3a:").exists()
