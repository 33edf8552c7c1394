"""Configuration loading, overrides and validation messages."""

import pytest
import yaml

from kfed_spark.config import build_config, load_config
from kfed_spark.errors import ConfigError

pytestmark = pytest.mark.fast

BASE = ["input.path=/data/in", "output.path=/data/out"]


def test_defaults_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("input: {path: /x}\noutput: {path: /y}\nk: 10\nspark: {conf: {a.b: '1'}}\n")
    cfg = load_config(path, ["k=12", "k_per_device=3", "input.device_col=writer", "spark.master=local[2]"])
    assert (cfg.algorithm.k, cfg.algorithm.k_per_device, cfg.algorithm.seed) == (12, 3, 0)
    assert cfg.input.device_col == "writer" and cfg.input.features_col == "features"
    assert cfg.spark.master == "local[2]" and cfg.spark.conf == {"a.b": "1"}
    assert (cfg.algorithm.server_refine, cfg.algorithm.label_mode) == ("lloyd", "induced")


def test_overrides_inside_free_form_mappings_keep_their_dots():
    cfg = load_config(None, BASE + ["spark.conf.spark.driver.memory=2g", "input.options.header=false"])
    assert cfg.spark.conf == {"spark.driver.memory": "2g"}
    assert cfg.input.options == {"header": False}


def test_a_date_as_run_id_stays_the_text_given(tmp_path):
    assert load_config(None, BASE + ["run_id=2026-11-29"]).run_id == "2026-11-29"
    path = tmp_path / "c.yaml"
    path.write_text("input: {path: /x}\noutput: {path: /y}\nrun_id: 2026-11-29\n")
    assert load_config(path).run_id == "2026-11-29"
    path.write_text("input: {path: /x}\noutput: {path: /y}\nidentity: {reference: 2026-11-28}\n")
    assert load_config(path).identity.reference == "2026-11-28"


def test_mlflow_tracking_is_on_with_its_section_even_empty():
    assert load_config(None, BASE).tracking.mlflow is None
    on = build_config({**yaml.safe_load("input: {path: /in}\noutput: {path: /out}"), "tracking": {"mlflow": None}})
    assert (on.tracking.mlflow.uri, on.tracking.mlflow.experiment) == (None, "kfed-spark")
    named = load_config(None, BASE + ["tracking.mlflow.uri=http://127.0.0.1:5000", "tracking.mlflow.experiment=e"])
    assert (named.tracking.mlflow.uri, named.tracking.mlflow.experiment) == ("http://127.0.0.1:5000", "e")


def test_features_can_be_a_list_of_columns():
    cfg = load_config(None, BASE + ["input.features_col=[x1, x2, x3]"])
    assert cfg.input.features_col == ["x1", "x2", "x3"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["colour=red"], "unknown config key 'colour'"),
        (["input.colour=red"], "unknown config key input.colour"),
        (["k=0"], "k must be an integer >= 1 or 'auto', got 0"),
        (["k=automatic"], "k must be an integer >= 1 or 'auto', got 'automatic'"),
        (["k=auto", "k_range=[5, 2]"], r"k_range must be \[LO, HI\] with 1 <= LO <= HI, got \(5, 2\)"),
        (["k=auto", "k_range=3"], r"k_range must be \[LO, HI\] with 1 <= LO <= HI, got 3"),
        (
            ["k=auto", "k_range=[2, 30]", "k_per_device=4"],
            r"k_per_device \(4\) must not exceed the smallest k of k_range \(2\)",
        ),
        (["k=4", "k_per_device=5"], r"k_per_device \(5\) must not exceed k \(4\)"),
        (["k_per_device=0"], "k_per_device must be an integer >= 1"),
        (["seed=-1"], "seed must be an integer >= 0, got -1"),
        (["seed=1.5"], "seed must be an integer >= 0, got 1.5"),
        (["server_refine=kmeans"], "server_refine must be one of lloyd, none, got 'kmeans'"),
        (["seeding=random"], "seeding must be one of farthest, kmeanspp, robust"),
        (["robust_min_size=-1"], "robust_min_size must be a finite number >= 0"),
        (["robust_min_size=.inf"], "robust_min_size must be a finite number >= 0, got inf"),
        (["tol=.nan"], "tol must be a finite number >= 0, got nan"),
        (["k_per_device=auto", "k_per_device_max=0"], "k_per_device_max must be an integer >= 1"),
        (["k_per_device=' '"], "k_per_device must be an integer, 'auto', or the name of a column or table"),
        (["report=maybe"], "report must be true or false"),
        (["label_mode=soft"], "label_mode must be one of induced, nearest"),
        (["run_id=a b"], "run_id 'a b' is not allowed"),
        (["run_id=x'; DROP TABLE y"], "is not allowed"),
        (["input.table=db.t"], "set exactly one of input.path and input.table"),
        (["input.format=xlsx"], "input.format must be one of"),
        (["output.path="], "output.path is required"),
        (["input.device_col="], "must be column names"),
        (["k"], "--set takes KEY=VALUE"),
        (["input.format=delta", "input.schema=a int"], "input.schema is DDL text for files of a path"),
        (["stream.trigger_seconds=0"], "stream.trigger_seconds must be a finite number > 0, got 0"),
        (["stream.trigger_seconds=.inf"], "stream.trigger_seconds must be a finite number > 0, got inf"),
        (["stream.max_files_per_trigger=0"], "stream.max_files_per_trigger must be an integer >= 1"),
        (["stream.labels_table=x"], "unknown config key stream.labels_table"),
        (["identity.mode=renumber"], "identity.mode must be one of stable, fresh, got 'renumber'"),
        (["identity.mode=fresh", "identity.reference=day-1"], "need identity.mode: stable"),
        (["identity.warm_start=sometimes"], "identity.warm_start must be true or false"),
        (["identity.reference=a b"], "identity.reference 'a b' is not allowed"),
        (["tracking.mlflow.url=http://x"], "unknown config key tracking.mlflow.url"),
        (["tracking.mlflow=yes"], "config section tracking.'mlflow' must be a mapping"),
        (["tracking.mlflow.experiment="], "tracking.mlflow.experiment must be non-empty text, got None"),
    ],
)
def test_invalid_configuration_is_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, BASE + overrides)


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("k: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listing)


def test_the_readme_quick_start_config_is_valid():
    """The config the README's quick start writes, read as the job reads it."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    quick = readme[readme.index("## Quick start on your own table") :]
    text = re.search(r"cat > kfed.yaml <<'YAML'\n(.*?)\nYAML\n", quick, re.S).group(1)
    cfg = build_config(yaml.safe_load(text))
    assert (cfg.algorithm.k, cfg.algorithm.k_range, cfg.input.features_col) == ("auto", (2, 40), ["x1", "x2", "x3"])
