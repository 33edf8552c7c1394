"""The code's style and types, and the docs site: `ruff check` and `ruff format --check`, mypy on the numeric core,
`mkdocs build --strict`, each with the settings in pyproject.toml or mkdocs.yml."""

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


def test_mypy_passes_on_the_numeric_core():
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_docs_site_builds_strictly(tmp_path):
    """A broken link, an anchor that is gone or a page missing from the navigation fails the build."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
