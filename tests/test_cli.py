"""The command line's shape: what every command shares (what a run does not import: tests/test_modules.py)."""

import pytest

from kfed_spark.bench.cli import DATASET_NAMES
from kfed_spark.bench.datasets import DATASETS
from kfed_spark.cli import build_parser

pytestmark = pytest.mark.fast


def test_the_parser_names_the_datasets_the_tooling_knows():
    assert set(DATASET_NAMES) == set(DATASETS)


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
