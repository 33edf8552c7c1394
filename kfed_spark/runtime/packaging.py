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

Building the environment takes most of a minute; a scheduled deployment that packages before each
submit, or a second checkout on one machine, would pay it every time for the same bytes. So a packed
environment is kept under ~/.cache/kfed-spark (XDG_CACHE_HOME if set), keyed by everything that goes
into it (the pinned requirements, venv-pack, this interpreter, the prefix and this module), and copied from there
while none of that changes; `--rebuild` builds it anew.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path

from kfed_spark.errors import KFedError

log = logging.getLogger(__name__)

ENV_ARCHIVE = "kfed-env.tar.gz"
PACKAGE_ZIP = "kfed_spark.zip"
VENV_PACK = "venv-pack==0.2.0"
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
    source = Path(__file__).resolve().parent.parent
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for module in sorted(source.rglob("*.py")):
            archive.write(module, f"kfed_spark/{module.relative_to(source).as_posix()}")
    return target


def build(out: Path, python_prefix: str | None = None, rebuild: bool = False) -> Packaged:
    """Write the package zip and a packed environment into `out` (the environment from the cache when
    one was packed from the same inputs, unless `rebuild`)."""
    out.mkdir(parents=True, exist_ok=True)
    requirements = runtime_requirements()
    archive = out / ENV_ARCHIVE
    key = environment_key(requirements, python_prefix)
    cached = packed_cache() / f"{key}.tar.gz"
    if rebuild or not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{key}.{os.getpid()}.partial.tar.gz")  # venv-pack goes by the extension
        pack_environment(requirements, python_prefix, partial)
        os.replace(partial, cached)  # whole or absent, for a build running beside this one
    else:
        log.info("reusing the environment packed from the same requirements: %s", cached)
    archive.unlink(missing_ok=True)
    shutil.copyfile(cached, archive)
    return Packaged(write_package_zip(out / PACKAGE_ZIP), archive, requirements)


def packed_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kfed-spark" / "packed-environments"


def environment_key(requirements: list[str], python_prefix: str | None) -> str:
    """A digest of what a packed environment is made of: the pinned requirements, venv-pack, the
    interpreter the venv is made from (its path and version), the prefix it is packed for, and this
    module, which builds it."""
    builder = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    inputs = [requirements, VENV_PACK, os.path.realpath(sys.executable), sys.version, python_prefix, builder]
    return hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:20]


def pack_environment(requirements: list[str], python_prefix: str | None, archive: Path) -> None:
    """A virtual environment with `requirements`, packed by venv-pack into `archive`."""
    with tempfile.TemporaryDirectory(prefix="kfed-env-") as work:
        env = Path(work) / "environment"
        log.info("creating a virtual environment with %s", " ".join(requirements))
        run([sys.executable, "-m", "venv", str(env)])
        pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        run([*pip, VENV_PACK, *requirements])
        drop_test_suites(env)
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


def drop_test_suites(env: Path) -> None:
    """Remove the installed packages' own test suites (numpy's, scipy's, pandas's, pyarrow's, matplotlib's:
    a sixth of the environment), which nothing imports at run time: every executor unpacks the archive, and
    without them it is about 15% smaller and unpacks about 18% faster."""
    for site_packages in env.glob("lib/python*/site-packages"):
        for folder in sorted(site_packages.rglob("tests")):  # a parent before the suites inside it
            if folder.is_dir():
                shutil.rmtree(folder)


def run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise KFedError(f"packaging failed: {Path(command[0]).name} exited {result.returncode}: {tail[0]}")


def delta_package() -> str | None:
    """The Maven coordinate of the Delta jar matching the installed pyspark and delta-spark,
    for `spark-submit --packages` (the same rule configure_spark_with_delta_pip follows); None where
    delta-spark is not installed (a packed environment on a cluster)."""
    import pyspark

    try:
        delta = version("delta-spark")
    except PackageNotFoundError:
        return None
    spark_minor = ".".join(pyspark.__version__.split(".")[:2])
    return f"io.delta:delta-spark_{spark_minor}_2.13:{delta}"
