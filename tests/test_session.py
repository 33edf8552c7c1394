"""Building the session: the settings build_session derives, and what the Python workers get."""

import os
import pty
import subprocess
import sys

import pytest


@pytest.mark.fast
def test_the_progress_bar_is_on_only_where_stderr_is_a_terminal(tmp_path):
    """session.console_progress in a process whose stderr is a pseudo-terminal, a file, or a terminal with
    the bar turned off in the config. (That Spark then draws the bar on a terminal was checked by hand.)"""
    check = (
        "from kfed_spark.session import console_progress; import sys; "
        "print(console_progress({} if len(sys.argv) < 2 else {'spark.ui.showConsoleProgress': sys.argv[1]}))"
    )

    def decided(stderr, *conf):
        return subprocess.run(
            [sys.executable, "-c", check, *conf], stderr=stderr, stdout=subprocess.PIPE, text=True, check=True
        ).stdout.strip()

    terminal, terminal_end = pty.openpty()
    try:
        with open(tmp_path / "stderr.log", "w") as log_file:
            assert (decided(terminal_end), decided(log_file), decided(terminal_end, "false")) == (
                "true",
                "false",
                "false",
            )
    finally:
        os.close(terminal)
        os.close(terminal_end)


@pytest.mark.spark
def test_python_workers_get_one_blas_thread(spark):
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    seen = spark.sparkContext.parallelize([0], 1).map(lambda _: {n: os.environ.get(n) for n in names}).collect()
    assert seen == [{name: "1" for name in names}]
