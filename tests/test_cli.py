"""The command line's shape: what every command shares, and what a run does not import."""

import subprocess
import sys

import pytest

from kfed_spark.bench.datasets import DATASETS
from kfed_spark.cli import DATASET_NAMES, build_parser

pytestmark = pytest.mark.fast


def test_the_parser_names_the_datasets_the_tooling_knows():
    assert set(DATASET_NAMES) == set(DATASETS)


def test_a_run_imports_none_of_the_benchmarks_tooling():
    """What `kfed-spark run` imports before its Spark session: the CLI, the job and the session."""
    code = (
        "import sys, kfed_spark.cli, kfed_spark.job, kfed_spark.session; "
        "print(sorted(m for m in sys.modules if m.startswith('kfed_spark.bench')))"
    )
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"


@pytest.mark.parametrize("command", ["run", "assign", "stream"])
def test_the_commands_that_run_take_a_config_its_overrides_and_the_run_output_flags(command):
    model = ["--model-run", "r"] if command == "assign" else []
    args = build_parser().parse_args(
        [command, "--config", "c.yaml", "--set", "k=3", "--set", "seed=1", "--json", *model]
    )
    assert (args.config, args.overrides, args.json, args.quiet) == ("c.yaml", ["k=3", "seed=1"], True, False)
    assert build_parser().parse_args([command, "--config", "c.yaml", *model]).overrides == []


@pytest.mark.parametrize("command", [["sql", "SELECT 1"], ["maintain"], ["report", "r"], ["choose-k", "--k", "2:4"]])
def test_the_commands_that_read_a_location_take_an_output_or_a_config(command):
    args = build_parser().parse_args([*command, "--output", "/data/kfed"])
    assert (args.output, args.config) == ("/data/kfed", None)
