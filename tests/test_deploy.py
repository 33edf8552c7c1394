"""The job where users start it: tested with processes whose environment is not the developer's."""

import json
import os
import subprocess
import sys
from pathlib import Path

from kfed_spark.cli import main

from conftest import MIXTURE
from helpers import published


def test_the_cli_started_by_its_absolute_path_needs_no_activated_environment(spark, config, tmp_path):
    """cron, systemd or a BashOperator start /path/to/env/bin/kfed-spark with a PATH whose python3 has
    no numpy: local-mode workers must run the CLI's own interpreter, not `python3` from PATH."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    assert subprocess.run([bare / "bin" / "python3", "-c", "import numpy"], capture_output=True).returncode != 0
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYSPARK", "VIRTUAL_ENV", "PYTHON", "SPARK_HOME"))}
    env["PATH"] = f"{bare / 'bin'}:/usr/bin:/bin"
    cli = Path(sys.executable).parent / "kfed-spark"
    result = subprocess.run([str(cli), "run", "--config", str(config)], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert published(spark, tmp_path / "out", "labels").count() == MIXTURE["devices"] * MIXTURE["points_per_device"]

    # --quiet: no stage lines, and the one-line error is the last line on stderr.
    failed = subprocess.run([str(cli), "run", "--config", str(config), "--quiet", "--set", "input.truth_col=nope"],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    lines = [line for line in failed.stderr.splitlines() if line.strip()]
    assert failed.returncode == 2 and lines[-1].startswith("kfed-spark: error: input has no truth column 'nope'")
    assert not [line for line in lines if " INFO kfed_spark" in line]


def test_run_prints_its_figures_as_json(spark, config, capsys):
    assert main(["run", "--config", str(config), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert (figures["run_id"], figures["n_labelled"], figures["n_quarantined"]) == (
        "first", MIXTURE["devices"] * MIXTURE["points_per_device"], 0)
    assert figures["attempt_id"] and figures["ari"] >= 0.95 and "labels" in figures["timings"]
