"""The job where users start it: tested with processes whose environment is not the developer's."""

import os
import subprocess
import sys
from pathlib import Path

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
