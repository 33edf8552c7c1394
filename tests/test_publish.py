"""A run stays whole for its readers when it is killed, stopped or run twice: real processes, real Delta tables.

Each run here is a `kfed-spark run` (or `kfed-spark forget`) process of its own, killed with SIGKILL (by a
test hook at a named point, or from outside), stopped with SIGTERM, or started beside others at once. The
states a SIGKILL leaves at each commit point come from three processes that copy their location at every point
(Interrupted): at a point nothing more reaches the disk before the kill would, so each copy holds what
that kill leaves, and its attempt's process is gone by the time the test reads it. One re-run is killed
for real, from outside, once its labels are committed.
After each, the test reads what every documented read path shows: the published views that
`kfed-spark sql` and `output.database` define, latest_labels, `kfed-spark report` and the docs'
DuckDB recipe.
"""

import json
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import duckdb
import pytest
from conftest import write_config
from deltalake import DeltaTable

from helpers import DUCKDB_PUBLISHED_LABELS, MIXTURE, N_ROWS, clean_environment, cli_process, runs_of
from kfed_spark.cli import main
from kfed_spark.config import OutputConfig
from kfed_spark.errors import KFedError
from kfed_spark.runtime.fault_injection import FAULT_ENV
from kfed_spark.store.ledger import published_attempts
from kfed_spark.store.output import OutputTables
from kfed_spark.store.tables import DATA_TABLES, RunRecord

pytestmark = pytest.mark.integration  # processes of their own: spark-submit, servers, the CLI


POINTS = ["created", "claimed", "labels", "tables", "report", "published"]
"""Every point of a run after something is committed: the tables' creation, the running row, the labels
commit, the other tables' commits, the report files (the last thing before the publish commit), and the
publish commit (before the earlier attempt is marked superseded)."""


def start(config, *overrides, fault=None):
    """`kfed-spark run` in a process of its own, acting out `fault` if given."""
    env = {**clean_environment(), **({FAULT_ENV: fault} if fault else {})}
    return cli_process("run", "--config", str(config), *[arg for item in overrides for arg in ("--set", item)], env=env)


def finish(process, timeout=300):
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def stderr_until(process, text: str) -> list[str]:
    """The process's stderr lines up to the first that holds text (read as they come: the job logs each stage
    and commit as it lands), or all of them if it ends first."""
    lines = []
    for line in process.stderr:
        lines.append(line)
        if text in line:
            break
    return lines


def last_line(err):
    lines = [line for line in err.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def waiting_at(gate, processes: int) -> None:
    """Wait until `processes` processes wait at `gate` (each made gate.<pid>: fault_injection.point)."""
    deadline = time.monotonic() + 240
    while len(list(gate.parent.glob(f"{gate.name}.*"))) < processes and time.monotonic() < deadline:
        time.sleep(0.2)


def what_readers_see(spark, out, run_id="first"):
    """Per read path, which attempts of run_id it shows and how many rows of each."""
    tables = OutputTables(spark, OutputConfig(path=str(out)))
    views = tables.register_views()
    names = [name for name in (*DATA_TABLES, "latest_labels") if name in views]
    seen = {name: {} for name in (*DATA_TABLES, "latest_labels")}
    if names:  # one query over every view
        counts = " UNION ALL ".join(
            f"SELECT '{name}' AS view, attempt_id, count(*) AS n FROM {name} WHERE run_id = '{run_id}' "
            "GROUP BY attempt_id"
            for name in names
        )
        for row in spark.sql(counts).collect():
            seen[row.view][row.attempt_id] = row.n
    try:
        seen["report"] = json.loads(tables.read_report(run_id))["attempt_id"]
    except KFedError:
        seen["report"] = None
    if "labels" in views:
        con = duckdb.connect()
        con.register("labels", DeltaTable(str(out / "labels")).to_pyarrow_dataset())
        con.register("runs", DeltaTable(str(out / "runs")).to_pyarrow_dataset())
        con.sql(DUCKDB_PUBLISHED_LABELS)
        rows = con.sql(f"SELECT attempt_id, count(*) FROM published_labels WHERE run_id = '{run_id}' GROUP BY ALL")
        seen["duckdb"] = dict(rows.fetchall())
    else:
        seen["duckdb"] = {}
    return seen


def assert_whole(seen, attempt, k, latest=True, n_rows=N_ROWS):
    """Every read path shows the whole of `attempt` (k clusters, n_rows labelled), or nothing when attempt is
    None; latest_labels shows it too when its run is the newest."""
    if attempt is None:
        assert seen == {name: {} for name in (*DATA_TABLES, "latest_labels")} | {"report": None, "duckdb": {}}
        return
    for name in ("labels", "latest_labels", "duckdb") if latest else ("labels", "duckdb"):
        assert seen[name] == {attempt: n_rows}, name
    assert seen["centers"] == {attempt: k}
    assert seen["cluster_changes"] == {attempt: k}  # no other run id: every cluster new
    assert set(seen["local_centers"]) == {attempt}
    assert set(seen["device_clusters"]) == {attempt}
    assert seen["quarantine"] == {}
    assert seen["report"] == attempt


def published_attempt(spark, out, run_id="first"):
    return published_attempts([RunRecord.of(r.asDict()) for r in runs_of(spark, out)]).get(run_id)


def raw_attempts(spark, out, name="labels"):
    return {
        r.attempt_id for r in spark.read.format("delta").load(str(out / name)).select("attempt_id").distinct().collect()
    }


FORGET_DEVICE_3 = ("forget", "--device", "3", "--run", "first")


@dataclass(frozen=True)
class Interrupted:
    """The process of kill-point cases: `kfed-spark run` or `forget` (command), on an empty location or
    on a copy of published_run's (rerun), copying its location at every point as it goes on, or, when
    killed, killed with SIGKILL from outside once it logs its labels commit."""

    command: str
    rerun: bool
    killed: bool = False


def interrupted_process(tmp_path_factory, mixture_path, published_run, case: Interrupted):
    """Run case's process to its end: (exit code, stderr, its folder of copies or its location)."""
    folder = tmp_path_factory.mktemp("interrupted")
    config = write_config(folder, mixture_path)
    if case.rerun:
        shutil.copytree(published_run[1], folder / "out")
    args = FORGET_DEVICE_3 if case.command == "forget" else ("run", "--set", "k=6")
    if not case.killed:
        fault = f"copy:{folder / 'out'}:{folder / 'copies'}"
        code, _, err = finish(
            cli_process(*args, "--config", str(config), env={**clean_environment(), FAULT_ENV: fault})
        )
        return code, err, folder / "copies"
    process = cli_process(*args, "--config", str(config))
    labels_committed = f"wrote {folder / 'out' / 'labels'}"
    lines = stderr_until(process, labels_committed)
    if lines and labels_committed in lines[-1]:
        process.send_signal(signal.SIGKILL)
    code, _, err = finish(process, timeout=60)
    return code, "".join(lines) + err, folder / "out"


KILLED_RERUN = Interrupted("run", True, killed=True)
"""The case killed for real: a re-run, from outside, while it goes on past its labels commit."""
RUN_CASES = {rerun: Interrupted("run", rerun) for rerun in (False, True)}
FORGET_CASE = Interrupted("forget", True)


def case_read_by(item) -> Interrupted | None:
    """The process a test of this module reads, if any."""
    if item.originalname == "test_a_run_killed_at_any_commit_point_leaves_readers_a_whole_run":
        return RUN_CASES[item.callspec.params["rerun"]]
    if item.originalname == "test_forget_killed_at_any_commit_point_leaves_readers_a_whole_run":
        return FORGET_CASE
    if item.originalname == "test_a_run_killed_from_outside_after_its_labels_commit_changes_nothing_readers_see":
        return KILLED_RERUN
    return None


@pytest.fixture(scope="module")
def interrupted(request, tmp_path_factory, mixture_path, published_run):
    """The kill-point tests' processes, started ahead of the tests two at a time, so that while a test
    checks what one left the next ones run: Interrupted -> a future of interrupted_process(). Only the
    processes the selected tests read start."""
    cases = {}
    for item in request.session.items:
        case = case_read_by(item) if item.module is request.module else None
        if case is not None:
            cases[case] = None
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {
            case: pool.submit(interrupted_process, tmp_path_factory, mixture_path, published_run, case)
            for case in cases
        }


@pytest.fixture(scope="module")
def published_before(spark, published_run):
    """The attempt readers see in published_run's location, which the re-run and forget cases start from."""
    return published_attempt(spark, published_run[1])


def left_at(interrupted, case: Interrupted, point: str):
    """The location as a SIGKILL of case's process at point leaves it: the copy the process made there (it
    went on and published)."""
    code, err, folder = interrupted[case].result()
    assert code == 0, err[-2000:]
    return folder / point


KILLS = [(point, True) for point in POINTS] + [(point, False) for point in ("created", "labels", "published")]
"""Every point on a re-run, where readers must go on seeing the earlier attempt; on a first run, the points
where the location is left in a state of another kind: tables without a runs row, rows of no published
attempt (claimed, tables and report leave the same as labels, and the re-run cases stop there), the first
publish."""


@pytest.mark.parametrize(
    ("point", "rerun"), KILLS, ids=[f"{point}-{'rerun' if rerun else 'first_run'}" for point, rerun in KILLS]
)
def test_a_run_killed_at_any_commit_point_leaves_readers_a_whole_run(
    spark, interrupted, published_before, point, rerun
):
    out = left_at(interrupted, RUN_CASES[rerun], point)
    old = published_before if rerun else None

    seen = what_readers_see(spark, out)
    rows = runs_of(spark, out)
    new = [r.attempt_id for r in rows if r.attempt_id != old]
    if point == "published":
        (killed,) = new
        assert_whole(seen, killed, 6)
    else:
        assert_whole(seen, old, MIXTURE["k"])
        killed = new[0] if new else None
        if point == "created":
            assert killed is None  # killed before its running row
        else:
            assert [r.status for r in rows if r.attempt_id == killed] == ["running"]
    print(
        f"\nkilled at {point} ({'re-run' if rerun else 'first run'}): readers saw "
        + ("the killed attempt" if seen["report"] == killed and killed else "the earlier attempt" if old else "nothing")
    )

    # The next maintenance (or run) finds the process gone and removes what the attempt left.
    assert main(["maintain", "--output", str(out)]) == 0
    statuses = {r.attempt_id: (r.status, r.rows_removed) for r in runs_of(spark, out)}
    if point == "published":
        assert statuses[killed] == ("succeeded", False)
        if old:
            assert statuses[old] == ("superseded", True) and old not in raw_attempts(spark, out)
    elif killed:
        assert statuses[killed] == ("abandoned", True) and killed not in raw_attempts(spark, out)
    assert_whole(
        what_readers_see(spark, out),
        killed if point == "published" else old,
        6 if point == "published" else MIXTURE["k"],
    )


@pytest.mark.parametrize("point", POINTS)
def test_forget_killed_at_any_commit_point_leaves_readers_a_whole_run(spark, interrupted, published_before, point):
    """`kfed-spark forget` takes a device out of a run through a new attempt, published as a run's: killed at
    any point, readers see the run with the device or the run without it, whole; once the process is gone
    the next tidy-up removes what it left, and forget again finishes the erasure."""
    out = left_at(interrupted, FORGET_CASE, point)
    old = published_before
    rows = runs_of(spark, out)
    new = [r.attempt_id for r in rows if r.attempt_id != old]
    without = N_ROWS - MIXTURE["points_per_device"]
    if point == "published":
        (killed,) = new
        assert_whole(what_readers_see(spark, out), killed, MIXTURE["k"], n_rows=without)
    else:
        assert_whole(what_readers_see(spark, out), old, MIXTURE["k"])
        assert [r.status for r in rows if r.attempt_id != old] == ([] if point == "created" else ["running"])

    assert main(["maintain", "--output", str(out)]) == 0
    statuses = {r.attempt_id: (r.status, r.rows_removed) for r in runs_of(spark, out)}
    if point == "published":
        assert statuses[old] == ("superseded", True) and old not in raw_attempts(spark, out)
        assert_whole(what_readers_see(spark, out), killed, MIXTURE["k"], n_rows=without)
        return
    if new:
        assert statuses[new[0]] == ("abandoned", True) and new[0] not in raw_attempts(spark, out)
    assert_whole(what_readers_see(spark, out), old, MIXTURE["k"])
    if point == "report":  # the erasure, asked again, is done
        assert main([*FORGET_DEVICE_3, "--output", str(out)]) == 0
        assert_whole(what_readers_see(spark, out), published_attempt(spark, out), MIXTURE["k"], n_rows=without)


def test_a_run_killed_from_outside_after_its_labels_commit_changes_nothing_readers_see(
    spark, interrupted, published_before
):
    code, err, out = interrupted[KILLED_RERUN].result()
    assert code == -signal.SIGKILL, err[-2000:]
    old = published_before
    assert_whole(what_readers_see(spark, out), old, MIXTURE["k"])
    (killed,) = [r.attempt_id for r in runs_of(spark, out) if r.attempt_id != old]
    assert killed in raw_attempts(spark, out)  # its labels are there, unpublished
    # The next run of the run id finds the process gone, abandons the attempt and deletes its rows.
    assert main(["run", "--config", str(out.parent / "kfed.yaml"), "--set", "k=5"]) == 0
    statuses = {r.attempt_id: r.status for r in runs_of(spark, out)}
    assert statuses[killed] == "abandoned" and statuses[old] == "superseded"
    assert killed not in raw_attempts(spark, out)
    assert_whole(what_readers_see(spark, out), published_attempt(spark, out), 5)


def test_sigterm_stops_the_spark_work_marks_the_attempt_failed_and_exits(spark, config_after_first_run, tmp_path):
    config, out = config_after_first_run, tmp_path / "out"
    old = published_attempt(spark, out)
    process = start(config, "k=6", fault="stall")  # every local-step task hangs
    before = stderr_until(process, "stage claim took")  # not polled from runs: its Spark jobs would slow the process
    time.sleep(3)  # inside the local step's Spark job
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code, _, err = finish(process, timeout=60)
    stopped_after = time.monotonic() - sent
    err = "".join(before) + err
    assert code == 1, err[-2000:]
    assert last_line(err).startswith("kfed-spark: error: stopped by SIGTERM")
    assert stopped_after < 15, err[-3000:]
    (attempt,) = [r for r in runs_of(spark, out) if r.attempt_id != old]
    assert (attempt.status, attempt.rows_removed) == ("failed", True), err[-3000:]
    assert attempt.error.startswith("stopped by SIGTERM") and "validate" in attempt.timings
    assert_whole(what_readers_see(spark, out), old, MIXTURE["k"])


def test_first_runs_at_once_create_the_tables_and_each_run_id_publishes_one_attempt(spark, config, tmp_path):
    """Three attempts start into an empty location: two of run `one` and one of run `two`.
    - They create the tables at the same moment; the losers of each creation find the table there and go on.
    - While they wait to publish, run `two` runs whole in this process: the attempt of `two` that started before
      it was published cannot publish after it.
    - The two attempts of `one` then publish at the same moment: exactly one does, the other fails in one line.
    Readers see each run id's published attempt whole."""
    out = tmp_path / "out"
    created, publish_one, publish_two = (tmp_path / gate for gate in ("created", "publish_one", "publish_two"))
    gates = f"wait:checked:{created};wait:before_publish:"
    processes = {f"one, k={k}": start(config, "run_id=one", f"k={k}", fault=gates + str(publish_one)) for k in (6, 5)}
    processes["two"] = start(config, "run_id=two", fault=gates + str(publish_two))
    waiting_at(created, 3)
    created.touch()  # the three create the tables at the same moment
    waiting_at(publish_one, 2)
    waiting_at(publish_two, 1)
    assert main(["run", "--config", str(config), "--set", "run_id=two", "--set", "k=5"]) == 0
    publish_two.touch()
    publish_one.touch()  # both attempts of `one` publish at the same moment
    results = {name: finish(process) for name, process in processes.items()}

    code, _, err = results.pop("two")
    assert code == 1 and "was not published: attempt" in last_line(err), err[-2000:]
    assert sorted(code for code, _, _ in results.values()) == [0, 1], [err[-1500:] for _, _, err in results.values()]
    (loser_err,) = [err for code, _, err in results.values() if code == 1]
    assert "was published at the same moment" in last_line(loser_err) or "was not published" in last_line(loser_err)
    runs = [RunRecord.of(r.asDict()) for r in runs_of(spark, out)]
    published = published_attempts(runs)
    newest = max((r for r in runs if r.status == "succeeded"), key=lambda r: r.finished_at).run_id
    for run_id, ks in (("one", (5, 6)), ("two", (5,))):  # `two`: this process's run
        assert sorted(r.status for r in runs if r.run_id == run_id) == ["failed", "succeeded"], run_id
        (succeeded,) = [r for r in runs if r.run_id == run_id and r.status == "succeeded"]
        assert succeeded.k in ks and succeeded.attempt_id == published[run_id]
        assert_whole(what_readers_see(spark, out, run_id), succeeded.attempt_id, succeeded.k, latest=run_id == newest)
