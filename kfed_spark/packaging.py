"""What spark-submit ships to a cluster whose executors have none of the job's Python packages.

`kfed-spark package --out dist` writes two files:

- `kfed_spark.zip`, the package's modules, for `--py-files`;
- `kfed-env.tar.gz`, a virtual environment with the job's dependencies at the versions installed
  here, packed with venv-pack, for `--archives dist/kfed-env.tar.gz#environment` and
  `spark.pyspark.python=./environment/bin/python`.

Why venv-pack: conda-pack needs conda, which pip users do not have; PEX would work too (Spark
documents both), but a packed venv unpacks to a plain directory on each executor, which is easier to
inspect when a worker fails. Neither carries the interpreter itself: the executors need this Python
version at this prefix (or at `--python-prefix`); a cluster without it needs a container image.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib.metadata import requires, version
from pathlib import Path

from kfed_spark.errors import KFedError

log = logging.getLogger(__name__)

ENV_ARCHIVE = "kfed-env.tar.gz"
PACKAGE_ZIP = "kfed_spark.zip"
PROVIDED_BY_SPARK = {"pyspark", "delta-spark"}
"""The cluster's Spark puts pyspark on its workers' path; Delta's jar comes with --packages."""


@dataclass(frozen=True)
class Packaged:
    package_zip: Path
    env_archive: Path
    requirements: list[str]


def runtime_requirements() -> list[str]:
    """The project's own dependencies, pinned to the versions installed here, so executors compute with
    the same numpy, pandas and pyarrow as the driver."""
    pinned = []
    for requirement in requires("kfed-spark") or []:
        if ";" in requirement and "extra" in requirement.split(";", 1)[1]:
            continue
        name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0)
        if name.lower() not in PROVIDED_BY_SPARK:
            pinned.append(f"{name}=={version(name)}")
    return pinned


def write_package_zip(target: Path) -> Path:
    """The kfed_spark package's modules, as `--py-files` wants them."""
    source = Path(__file__).resolve().parent
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for module in sorted(source.rglob("*.py")):
            archive.write(module, f"kfed_spark/{module.relative_to(source).as_posix()}")
    return target


def build(out: Path, python_prefix: str | None = None) -> Packaged:
    """Write the package zip and a packed environment into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    requirements = runtime_requirements()
    with tempfile.TemporaryDirectory(prefix="kfed-env-") as work:
        env = Path(work) / "environment"
        log.info("creating a virtual environment with %s", " ".join(requirements))
        run([sys.executable, "-m", "venv", str(env)])
        run(
            [
                str(env / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "venv-pack==0.2.0",
                *requirements,
            ]
        )
        archive = out / ENV_ARCHIVE
        archive.unlink(missing_ok=True)
        log.info("packing it into %s", archive)
        pack = [
            str(env / "bin" / "venv-pack"),
            "--prefix",
            str(env),
            "--output",
            str(archive),
            "--compress-level",
            "1",
            "--quiet",
        ]
        run(pack + (["--python-prefix", python_prefix] if python_prefix else []))
    return Packaged(write_package_zip(out / PACKAGE_ZIP), archive, requirements)


def run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise KFedError(f"packaging failed: {Path(command[0]).name} exited {result.returncode}: {tail[0]}")
