"""The code's style: `ruff check` and `ruff format --check` with the settings in pyproject.toml."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff_passes(command):
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "kfed_spark", "tests", "jobs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
