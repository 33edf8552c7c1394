"""What `kfed-spark package` ships (fast: the environment itself is built by tests/test_cluster.py)."""

import zipfile
from importlib.metadata import version

import pytest

from kfed_spark.runtime.packaging import (
    ENV_ARCHIVE,
    build,
    drop_test_suites,
    environment_key,
    packed_cache,
    runtime_requirements,
    write_package_zip,
)

pytestmark = pytest.mark.fast


def test_the_environment_pins_the_job_dependencies_at_the_versions_installed_here():
    requirements = runtime_requirements()
    assert f"numpy=={version('numpy')}" in requirements and f"pyarrow=={version('pyarrow')}" in requirements
    # the cluster's Spark provides pyspark; Delta's jar comes with --packages; test tools stay out
    assert not [r for r in requirements if r.startswith(("pyspark", "delta-spark", "pytest", "apache-airflow"))]


def test_the_package_zip_holds_every_module_under_its_package_name(tmp_path):
    with zipfile.ZipFile(write_package_zip(tmp_path / "kfed_spark.zip")) as archive:
        names = archive.namelist()
    assert {"kfed_spark/runs/job.py", "kfed_spark/__init__.py", "kfed_spark/bench/synthetic.py"} <= set(names)
    assert all(name.startswith("kfed_spark/") and name.endswith(".py") for name in names)


def test_an_environment_packed_from_the_same_inputs_is_copied_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    key = environment_key(runtime_requirements(), None)
    assert key != environment_key(runtime_requirements(), "/opt/python") != environment_key(["numpy==1.0"], None)
    cached = packed_cache() / f"{key}.tar.gz"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"packed before")  # not an archive: a build would replace it, a copy keeps it
    packaged = build(tmp_path / "dist")
    assert (
        packaged.env_archive == tmp_path / "dist" / ENV_ARCHIVE
        and packaged.env_archive.read_bytes() == b"packed before"
    )
    assert packaged.package_zip.is_file()


def test_the_packed_environment_leaves_out_the_packages_test_suites(tmp_path):
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    kept = [site / "numpy" / "testing" / "__init__.py", site / "numpy" / "tests.py", site / "pandas" / "core.py"]
    dropped = [site / "numpy" / "tests" / "test_a.py", site / "scipy" / "stats" / "tests" / "data" / "tests" / "b.csv"]
    for file in kept + dropped:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text("")
    drop_test_suites(tmp_path)
    assert all(file.is_file() for file in kept)
    assert not (site / "numpy" / "tests").exists() and not (site / "scipy" / "stats" / "tests").exists()
