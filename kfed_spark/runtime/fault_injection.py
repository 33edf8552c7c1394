"""Test-only fault injection, set by the tests through the KFED_TEST_FAULT environment variable.

`kill:POINT` sends SIGKILL to this process at a named point of a run, `fail:POINT` raises there,
`wait:POINT:FILE` waits there until FILE exists (after creating FILE.<pid>, so that a test knows it
is waiting: to make two attempts overlap). `copy:FOLDER:INTO` copies FOLDER (the run's output location)
to INTO/<point> at every point and goes on: each copy holds what a SIGKILL at that point would leave on
disk, so one process gives the states of every kill point. Faults separated by `;` act in turn, each at its
own point (`wait:checked:A;wait:before_publish:B`: wait at two points). In the local-step tasks,
`fail_first_attempt` makes every task fail its first attempt (Spark retries it) and `stall` makes them hang.
Not a user setting: nothing in the config or the docs names it.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

from kfed_spark.errors import KFedError

FAULT_ENV = "KFED_TEST_FAULT"
WAIT_LIMIT_SECONDS = 300


TASK_FAULTS = ("fail_first_attempt", "stall")


def task_fault() -> str | None:
    """The fault the local-step tasks should act out, if one is requested."""
    fault = os.environ.get(FAULT_ENV)
    return fault if fault in TASK_FAULTS else None


def point(name: str) -> None:
    """A named point of a run where a test may kill, fail, pause or copy this process's output."""
    for fault in os.environ.get(FAULT_ENV, "").split(";"):
        act(fault, name)


def act(fault: str, name: str) -> None:
    """Act out one fault (`action:point[:argument]`, or `copy:FOLDER:INTO`) at point `name`."""
    action, _, rest = fault.partition(":")
    where, _, gate = rest.partition(":")
    if action == "copy":
        copy_location(Path(where), Path(gate) / name)
        return
    if where != name:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "fail":
        raise KFedError(f"injected failure at {name}")
    elif action == "wait":
        Path(f"{gate}.{os.getpid()}").touch()
        deadline = time.monotonic() + WAIT_LIMIT_SECONDS
        while not Path(gate).exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def copy_location(folder: Path, into: Path) -> None:
    """Copy what is on disk under folder now; a file that a writer of another thread renames or deletes
    meanwhile is left out, as a kill would have left it unfinished."""
    for source in folder.rglob("*") if folder.is_dir() else ():
        target = into / source.relative_to(folder)
        try:
            if source.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
        except FileNotFoundError:
            pass
