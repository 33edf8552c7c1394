"""Attempts of a run, and how one is published: write, audit, publish, with `runs` as the commit point.

Delta commits one table at a time, so a run's tables cannot change in one commit. Instead every
attempt of a run id gets its own attempt id and appends its rows, tagged with it, to every table;
readers see only published attempts (kfed_spark.store.delta's views). An attempt is published by one commit
of its `runs` row with status `succeeded`; until that commit the previously published attempt of the
run id is what readers see, and after it the new one, whole.

Who may publish: each run id has a publish number, kept by Delta itself as an idempotent-write
marker on `runs` (txnAppId per run id, txnVersion = the number). An attempt claims the number after
the highest one committed for its run id when it starts (`runs` as read while it validates), and
publishes with it. Of two overlapping attempts the first to publish wins; the other's publish is
skipped by Delta (or fails, if both commit at the same moment) and it fails with a one-line conflict
error. Nothing is lost: the loser's rows were never visible.

Every attempt has a `runs` row from its start: running, then succeeded or failed (with the error
and the stage timings so far). The next run, or `kfed-spark maintain`, tidies up: an attempt still
`running` whose process is gone (same host, pid dead), or that can no longer publish because its
number was taken, becomes `abandoned`; a succeeded attempt that a later one replaced becomes
`superseded`; and the rows of failed, abandoned, superseded and retracted attempts are deleted.

An erasure that leaves nothing of a run to cluster retracts its published attempt instead (retract):
one fenced commit of that attempt's row as `retracted`, after which the run id has no published
attempt, as if its runs had all failed.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from kfed_spark.errors import AttemptConflict, ConfigError, KFedError, first_line
from kfed_spark.runtime.stopping import despite_the_stop
from kfed_spark.store.delta import collected, rows_table
from kfed_spark.store.output import OutputTables
from kfed_spark.store.tables import (
    ABANDONED,
    FAILED,
    RETRACTED,
    RUNNING,
    RUNS_SCHEMA,
    SUCCEEDED,
    SUPERSEDED,
    RunRecord,
)

log = logging.getLogger("kfed_spark")

FINISHED_UNPUBLISHED = (FAILED, ABANDONED, SUPERSEDED, RETRACTED)
"""Statuses whose rows no reader sees and the tidy-up deletes."""


@dataclass(frozen=True)
class Attempt:
    run_id: str
    attempt_id: str
    publish_seq: int
    """The publish number this attempt claims: one above the highest its run id had committed at its start."""


def new_attempt_id(started_at: datetime) -> str:
    return f"{started_at:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"


def process_gone(host: str, pid: int) -> bool:
    """True only when the process is certainly not running: on this host, and no such pid (or a zombie)."""
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Ledger:
    """The `runs` table of an output location as the record of every attempt."""

    def __init__(self, tables: OutputTables):
        self.tables = tables
        self.spark = tables.spark
        self.publishing: set[tuple[str, str]] = set()
        """(run id, attempt id) of the attempts this process began to publish."""

    def rows(self, run_id: str | None = None, attempt_id: str | None = None) -> list[RunRecord]:
        """Every runs row, or those of a run id's partitions, or of an attempt's: only their files are read,
        where the whole table is a file per attempt the location ever ran."""
        return [RunRecord.of(values) for values in collected(self.tables.read_few("runs", (), run_id, attempt_id))]

    def rows_if_any(self, run_id: str | None = None) -> list[RunRecord]:
        """rows(run_id), or none where the location has no runs table yet."""
        return self.rows(run_id) if self.tables.check_log("runs") else []

    def row_of(self, run_id: str, attempt_id: str) -> RunRecord | None:
        found = self.rows(run_id, attempt_id)
        return found[0] if found else None

    def status_of(self, run_id: str, attempt_id: str) -> str | None:
        row = self.row_of(run_id, attempt_id)
        return None if row is None else row.status

    def write(self, row: RunRecord, fence: int | None = None, new: bool = False) -> None:
        """Replace the attempt's row (fenced: see OutputTables.write_attempt_row), or add it if `new`."""
        values = rows_table([row.values()], RUNS_SCHEMA)
        if new:
            self.tables.add_attempt_row(values, row.run_id, row.attempt_id)
        else:
            self.tables.write_attempt_row(values, row.run_id, row.attempt_id, fence)

    def begin(self, row: RunRecord, known: list[RunRecord] | None = None) -> tuple[Attempt, RunRecord]:
        """Tidy up, then record a new attempt of row.run_id as running. `row` holds the run's settings;
        the attempt's own columns (status, publish number, host, pid) are set in the row returned.
        `known`: the runs rows as read at the attempt's start, if the caller has them (else read here)."""
        rows = self.tidy(rows=known)
        run_id = row.run_id
        attempt = Attempt(run_id, row.attempt_id, committed_publish_seqs(rows)[run_id] + 1)
        row = row.changed(
            status=RUNNING,
            publish_seq=attempt.publish_seq,
            error=None,
            rows_removed=False,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        self.write(row, new=True)  # attempt ids are unique: no row to replace
        log.info("run %s: attempt %s started (publish number %d)", run_id, attempt.attempt_id, attempt.publish_seq)
        return attempt, row

    def publish(self, attempt: Attempt, row: RunRecord) -> list[RunRecord]:
        """The one commit that makes the attempt what readers see, or AttemptConflict if another
        attempt of the run id took its publish number first. Returns the run id's runs rows read back
        after it (its partitions only: the time to read them does not grow with the location's age)."""
        self.publishing.add((attempt.run_id, attempt.attempt_id))
        self.write(row.changed(status=SUCCEEDED, publish_seq=attempt.publish_seq), fence=attempt.publish_seq)
        rows = self.rows(attempt.run_id)
        landed = next((r for r in rows if (r.run_id, r.attempt_id) == (attempt.run_id, attempt.attempt_id)), None)
        if landed is None or landed.status != SUCCEEDED:
            winner = published_attempts(rows).get(attempt.run_id)
            raise AttemptConflict(
                f"attempt {attempt.attempt_id} of run {attempt.run_id!r} was not published: attempt {winner} of the "
                "same run id was published while it ran"
            )
        log.info("run %s: published attempt %s", attempt.run_id, attempt.attempt_id)
        return rows

    def supersede_others(self, attempt: Attempt, rows: list[RunRecord]) -> None:
        """After a publish: mark the run id's earlier succeeded attempts superseded, among `rows` (as
        read back by the publish). What readers see is already decided (the highest publish number
        wins); this only keeps the record plain. Only lower numbers: a later attempt may have been
        published since, if this process stalled."""
        try:
            for other in rows:
                if (
                    other.run_id == attempt.run_id
                    and other.status == SUCCEEDED
                    and other.publish_seq < attempt.publish_seq
                ):
                    self.write(other.changed(status=SUPERSEDED))
        except Exception as exc:
            log.warning("could not mark the earlier attempts of run %s superseded: %s", attempt.run_id, first_line(exc))

    def retract(self, row: RunRecord, why: str) -> RunRecord:
        """Take back the run's published attempt (its runs row `row`, with whatever else the retraction
        records), so that its run id has none published: one commit of the row as retracted, with `why` as
        its error, fenced with the run id's next publish number. An attempt of the run id that publishes
        first wins, and this fails with AttemptConflict; one that began before it can no longer publish (its
        number is taken). The next tidy-up deletes the attempt's rows.

        Earlier attempts of the run id that still read succeeded are marked superseded first (tidy): were
        one left, the published rule would fall back to it."""
        rows = self.tidy()
        run_id = row.run_id
        if published_attempts(rows).get(run_id) != row.attempt_id:
            raise AttemptConflict(f"attempt {row.attempt_id} of run {run_id!r} is no longer the published one")
        left = [r for r in rows if r.run_id == run_id and r.status == SUCCEEDED and r.attempt_id != row.attempt_id]
        if left:
            raise KFedError(
                f"run {run_id!r} cannot be retracted yet: earlier attempt {left[0].attempt_id} could not be marked "
                "superseded; try again"
            )
        number = committed_publish_seqs(rows)[run_id] + 1
        retracted = row.changed(status=RETRACTED, publish_seq=number, error=why, rows_removed=False)
        self.write(retracted, fence=number)
        if self.status_of(run_id, row.attempt_id) != RETRACTED:
            winner = published_attempts(self.rows()).get(run_id)
            raise AttemptConflict(
                f"run {run_id!r} was not retracted: its attempt {winner} was published while this ran"
            )
        log.info("run %s: attempt %s retracted (%s)", run_id, row.attempt_id, why)
        return retracted

    def fail(self, row: RunRecord, error: str) -> None:
        """Record a failed attempt, after deleting its rows (best effort: the next tidy-up retries).
        An attempt whose publish commit landed before the failure stays published, and one that began to
        publish and whose record cannot be read is left as it is. What this process never began (a
        publish, a write) is not read or deleted: a stop on SIGTERM has seconds."""
        key = (row.run_id, row.attempt_id)
        if key in self.publishing:
            try:
                published = despite_the_stop(lambda: self.status_of(*key)) == SUCCEEDED
            except Exception as exc:
                log.warning(
                    "could not read the record of attempt %s, which began to publish; the next tidy-up settles it: %s",
                    row.attempt_id,
                    first_line(exc),
                )
                return
            if published:
                log.warning("attempt %s failed after it was published: %s", row.attempt_id, error)
                return
        removed = key not in self.tables.attempts_begun
        try:
            if not removed:
                despite_the_stop(lambda: self.tables.delete_attempt(*key))
                removed = True
        except Exception as exc:
            log.warning("could not delete the rows of failed attempt %s: %s", row.attempt_id, first_line(exc))
        failed = row.changed(
            status=FAILED, error=error, publish_seq=None, rows_removed=removed, finished_at=datetime.now(timezone.utc)
        )
        try:
            despite_the_stop(lambda: self.write(failed))
        except Exception as exc:
            log.warning("could not record failed attempt %s: %s", row.attempt_id, first_line(exc))

    def tidy(self, abandon_after: timedelta | None = None, rows: list[RunRecord] | None = None) -> list[RunRecord]:
        """Mark abandoned and superseded attempts and delete the rows of every finished unpublished one;
        returns the runs rows as they are afterwards. Best effort: a step that fails (another process
        tidying at the same time) is logged and left for the next tidy-up.

        With abandon_after, a running attempt started longer ago than that is abandoned too, wherever
        it runs: its publish number is taken first (a fenced commit), so that it can never publish
        rows that are about to be deleted. `rows`: the runs rows to start from, if already read.
        """
        rows = self.rows() if rows is None else rows
        committed = committed_publish_seqs(rows)
        published = published_attempts(rows)
        now = datetime.now(timezone.utc)
        result = []
        for row in rows:
            try:
                row = self._tidy_one(row, committed, published, now, abandon_after)
            except Exception as exc:
                log.warning(
                    "tidy-up of attempt %s of run %s left for later: %s",
                    row.attempt_id,
                    row.run_id,
                    first_line(exc),
                )
            result.append(row)
        return result

    def _tidy_one(self, row: RunRecord, committed, published, now, abandon_after) -> RunRecord:
        run_id, changed = row.run_id, row
        if row.status == RUNNING:
            fenced = False
            if row.publish_seq <= committed[run_id]:
                why = "abandoned: a later attempt of the run id was published, so it could never publish"
            elif process_gone(row.host, row.pid):
                why = f"abandoned: its process {row.pid} on {row.host} is gone"
            elif abandon_after is not None and now - _utc(row.started_at) > abandon_after:
                why = f"abandoned: still running after {abandon_after}"
                self.write(row.changed(status=ABANDONED, error=why), fence=row.publish_seq)
                if self.status_of(run_id, row.attempt_id) != ABANDONED:
                    return row  # it published just now
                fenced = True
            else:
                return row
            # Only a fenced abandonment committed the attempt's publish number (committed_publish_seqs).
            changed = row.changed(
                status=ABANDONED, error=why, finished_at=now, publish_seq=row.publish_seq if fenced else None
            )
            log.info("run %s: attempt %s %s", run_id, row.attempt_id, why)
        elif row.status == SUCCEEDED and published.get(run_id) != row.attempt_id:
            changed = row.changed(status=SUPERSEDED)
        if changed.status in FINISHED_UNPUBLISHED and not row.rows_removed:
            self.tables.delete_attempt(run_id, row.attempt_id)
            changed = changed.changed(rows_removed=True)
        if changed != row:
            self.write(changed)
        return changed


def committed_publish_seqs(rows: list[RunRecord]) -> defaultdict[str, int]:
    """Per run id, the highest publish number that an attempt committed (0 if none): a running
    attempt's number is only claimed, and failed or unfenced abandoned attempts hold none."""
    committed: defaultdict[str, int] = defaultdict(int)
    for row in rows:
        if row.status != RUNNING and row.publish_seq is not None:
            committed[row.run_id] = max(committed[row.run_id], row.publish_seq)
    return committed


def published_attempts(rows: list[RunRecord]) -> dict[str, str]:
    """run id -> its published attempt (the succeeded one with the highest publish number); the same
    rule as tables.PUBLISHED_ATTEMPTS, which readers' views use."""
    best: dict[str, tuple[int, str]] = {}
    for row in rows:
        if row.status == SUCCEEDED:
            best[row.run_id] = max(best.get(row.run_id, (-1, "")), (row.publish_seq, row.attempt_id))
    return {run_id: attempt for run_id, (_, attempt) in best.items()}


def reference_attempt(
    rows: list[RunRecord], run_id: str, started_at: datetime, named: str | None = None
) -> RunRecord | None:
    """The runs row of the published attempt whose clusters a new attempt of run_id matches (identity):
    the named run id's, or else the newest published run of another run id that finished before
    started_at (None if there is none). A named run id that is not published is a ConfigError."""
    chosen = published_rows(rows)
    if named is not None:
        found = [r for r in chosen if r.run_id == named]
        if not found:
            raise ConfigError(f"identity.reference {named!r} is not a published run of this output location")
        return found[0]
    return newest([r for r in chosen if r.run_id != run_id and _utc(r.finished_at) < started_at])


def published_rows(rows: list[RunRecord]) -> list[RunRecord]:
    """The runs rows of the published attempts (published_attempts), one per run id: what readers' views show
    of runs, found without a query."""
    published = published_attempts(rows)
    return [r for r in rows if published.get(r.run_id) == r.attempt_id]


def newest(rows: list[RunRecord]) -> RunRecord | None:
    """The row that finished last, the greater run id on a tie (tables.LATEST_ATTEMPT's order); None for none."""
    return max(rows, key=lambda r: (_utc(r.finished_at), r.run_id), default=None)


def highest_cluster_id(rows: list[RunRecord], run_id: str) -> int:
    """The highest cluster id that any attempt of another run id ever published (-1 if none): a row
    of an older version, without highest_cluster_id, used 0..k-1. The run id's own attempts do not
    count, so that a re-run gives its new clusters the same ids again."""
    ever_published = [r for r in rows if r.status in (SUCCEEDED, SUPERSEDED, RETRACTED) and r.run_id != run_id]
    return max(
        (r.k - 1 if r.highest_cluster_id is None else r.highest_cluster_id for r in ever_published),
        default=-1,
    )


def _utc(moment: datetime) -> datetime:
    """Spark returns timestamps as naive local times; astimezone reads a naive time as local."""
    return moment.astimezone(timezone.utc)
