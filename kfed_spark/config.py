"""Run configuration: YAML file plus dotted --set overrides, validated into frozen dataclasses."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from kfed_spark.errors import ConfigError
from kfed_spark.params import AlgorithmParams, finite_number, integer

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
IDENTIFIER_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
TABLE_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){0,2}$")
INPUT_FORMATS = ("parquet", "delta", "csv", "json", "orc")


QUIET_LOCAL_SPARK = {
    "spark.ui.enabled": "false",
    "spark.log.level": "WARN",
}
"""Settings of the embedded local Spark that the demo, `sql --output` and the benchmarks start."""


@dataclass(frozen=True)
class InputConfig:
    path: str | None = None
    format: str = "parquet"
    table: str | None = None
    device_col: str = "device_id"
    features_col: str | list[str] = "features"
    truth_col: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    schema: str | None = None
    """The input's columns as DDL ("device_id string, features array<double>"); by default the files' own.
    A stream over a folder that has no files yet needs it."""


@dataclass(frozen=True)
class OutputConfig:
    path: str | None = None
    database: str | None = None


@dataclass(frozen=True)
class StreamConfig:
    """Where `kfed-spark stream` writes (paths; by default under output.path) and how it triggers."""

    labels: str | None = None
    """Delta table of the labelled rows (default <output.path>/stream_labels)."""
    quarantine: str | None = None
    """Delta table of the bad rows (default <output.path>/stream_quarantine)."""
    checkpoint: str | None = None
    """The query's checkpoint (default <output.path>/_checkpoints/stream): a restart resumes from it."""
    trigger_seconds: float = 60.0
    """Seconds between micro-batches when the stream runs on (without --available-now)."""
    max_files_per_trigger: int | None = None
    """Files of new input per micro-batch at most (default: all that arrived)."""


@dataclass(frozen=True)
class IdentityConfig:
    """How a run's cluster ids relate to earlier runs' in the same location (kfed_spark.core.identity)."""

    mode: str = "stable"
    """stable: the clusters are matched to the reference run's and keep their ids, new ones take ids never
    used before; fresh: ids 0..k-1 in the server step's order, nothing matched."""
    reference: str | None = None
    """The run id whose published clusters to match (a backfill names one); by default the newest published
    run of another run id that finished before this attempt started."""
    warm_start: bool = False
    """Seed the server step with the reference run's centers (the seeding rule adds any more that k asks
    for), then refine as usual: on data that changed little, the centers stay where they were."""


IDENTITY_MODES = ("stable", "fresh")


@dataclass(frozen=True)
class MlflowTracking:
    """Where each published attempt is logged in MLflow (kfed_spark.runs.tracking)."""

    uri: str | None = None
    """The tracking server or store (http://host:5000, databricks, sqlite:///mlflow.db); by default
    MLflow's own choice (MLFLOW_TRACKING_URI)."""
    experiment: str = "kfed-spark"
    """The experiment the attempts are logged in, created if missing."""
    timeout_s: float = 10.0
    """Seconds MLflow is given, at most, at each of tracking's two moments: creating the attempt's MLflow
    run as the attempt starts, and logging its figures, report and model after the publish. Past it the
    run goes on (and ends) with one warning, whatever MLflow's own retry settings are."""


@dataclass(frozen=True)
class TrackingConfig:
    mlflow: MlflowTracking | None = None
    """With this section (empty is enough), each published attempt is logged to MLflow."""


NESTED_SECTIONS = {"tracking": {"mlflow": MlflowTracking}}
"""Sections inside a section: the config key path -> its dataclass."""


@dataclass(frozen=True)
class SparkConfig:
    master: str | None = None
    remote: str | None = None
    """A Spark Connect server, sc://host:port (SPARK_REMOTE does the same); master is then the server's."""
    app_name: str = "kfed-spark"
    conf: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FitSettings:
    """What fitting k-FED to a DataFrame reads: the clustering's parameters, the input's columns, and the
    partitions of the local step (default: the session's shuffle partitions). The job's KFedConfig gives
    them (KFedConfig.fitting), and so does the estimator from its Params."""

    algorithm: AlgorithmParams = field(default_factory=AlgorithmParams)
    input: InputConfig = field(default_factory=InputConfig)
    local_partitions: int | None = None


@dataclass(frozen=True)
class KFedConfig:
    """A run: the clustering's parameters (kfed_spark.params; at the top level of the YAML file) and where
    rows come from and go."""

    algorithm: AlgorithmParams = field(default_factory=AlgorithmParams)
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    spark: SparkConfig = field(default_factory=SparkConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    identity: IdentityConfig = field(default_factory=IdentityConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    run_id: str | None = None
    local_partitions: int | None = None
    on_bad_rows: str = "quarantine"
    report: bool = True
    """Write report.json and report.html under <output.path>/reports/<run_id>/<attempt_id>/."""
    profiles: bool | None = None
    """Write the run's cluster_profiles (each cluster's mean and spread per feature, from the rows); null: yes,
    but for a run with privacy_epsilon, whose guarantee the rows' figures are outside of."""

    @property
    def writes_profiles(self) -> bool:
        return self.profiles if self.profiles is not None else self.algorithm.privacy_epsilon is None

    @property
    def fitting(self) -> FitSettings:
        return FitSettings(self.algorithm, self.input, self.local_partitions)

    @property
    def paths(self) -> list[str]:
        """Every path the config names (input, output, the stream's tables and checkpoint), for the
        filesystems a session needs."""
        named = (self.input.path, self.output.path, self.stream.labels, self.stream.quarantine, self.stream.checkpoint)
        return [str(path) for path in named if path]

    def with_algorithm(self, **changes: Any) -> KFedConfig:
        """This config with some of the clustering's parameters changed."""
        return dataclasses.replace(self, algorithm=dataclasses.replace(self.algorithm, **changes))


SECTIONS = {
    "input": InputConfig,
    "output": OutputConfig,
    "spark": SparkConfig,
    "stream": StreamConfig,
    "identity": IdentityConfig,
    "tracking": TrackingConfig,
}
MAPPING_KEYS = ("spark.conf", "input.options")
"""Config keys whose values are free-form mappings with dotted keys of their own."""


def load_config(path: str | Path | None, overrides: list[str] = ()) -> KFedConfig:
    """Read a YAML config (or start from the defaults), apply KEY=VALUE overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}".replace("\n", " ")) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(raw).__name__}")
    for item in overrides:
        apply_override(raw, item)
    return build_config(raw)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set a dotted key (`input.path=/data`) in the raw config; the value is read as YAML."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set takes KEY=VALUE, got {item!r}")
    key = key.strip()
    mapping = next((m for m in MAPPING_KEYS if key.startswith(m + ".")), None)
    if mapping:  # spark.conf.spark.driver.memory: the key inside the mapping keeps its dots
        *parents, leaf = mapping.split(".") + [key[len(mapping) + 1 :]]
    else:
        *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
    parsed = yaml.safe_load(value) if value.strip() else None
    node[leaf] = value.strip() if isinstance(parsed, (date, datetime)) else parsed  # run_id=2026-11-29 is text


def build_config(raw: dict[str, Any]) -> KFedConfig:
    """The config from its YAML mapping: sections, the job's own keys, and the clustering's parameters at the
    top level (the privacy ones also as a `privacy:` section)."""
    values: dict[str, Any] = {}
    algorithm: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"config section {key!r} must be a mapping")
            values[key] = _section(key, SECTIONS[key], value)
        elif key == "privacy" and isinstance(value, dict):  # privacy.epsilon: the parameter privacy_epsilon
            for name, setting in value.items():
                if f"privacy_{name}" not in _field_names(AlgorithmParams):
                    raise ConfigError(f"unknown config key 'privacy.{name}'; known: epsilon, delta, bounds, rounds")
                algorithm[f"privacy_{name}"] = setting
        elif key in _field_names(AlgorithmParams):
            algorithm[key] = value
        elif key in _field_names(KFedConfig) - {"algorithm"}:
            values[key] = value
        else:
            known = (_field_names(KFedConfig) - {"algorithm"}) | _field_names(AlgorithmParams)
            raise ConfigError(f"unknown config key {key!r}; known keys: {', '.join(sorted(known))}")
    if isinstance(values.get("run_id"), (date, datetime)):  # YAML reads `run_id: 2026-11-29` as a date
        values["run_id"] = values["run_id"].isoformat()
    identity = values.get("identity")
    if identity is not None and isinstance(identity.reference, (date, datetime)):
        values["identity"] = dataclasses.replace(identity, reference=identity.reference.isoformat())
    cfg = KFedConfig(algorithm=AlgorithmParams(**algorithm), **values)
    validate(cfg)
    return cfg


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _section(name: str, cls: type, raw: dict[str, Any]) -> Any:
    unknown = set(raw) - _field_names(cls)
    if unknown:
        raise ConfigError(
            f"unknown config key {name}.{sorted(unknown)[0]}; known keys in {name}: "
            f"{', '.join(sorted(_field_names(cls)))}"
        )
    inner = {}
    for key, section in NESTED_SECTIONS.get(name, {}).items():
        if key in raw:
            value = raw[key] or {}  # `mlflow:` with nothing under it turns the section on
            if not isinstance(value, dict):
                raise ConfigError(f"config section {name}.{key!r} must be a mapping")
            inner[key] = _section(f"{name}.{key}", section, value)
    return cls(**{**raw, **inner})


def validate(cfg: KFedConfig) -> None:
    cfg.algorithm.check()
    validate_columns(cfg.input)
    validate_run(cfg)
    validate_io(cfg)


def validate_columns(inp: InputConfig) -> None:
    """The column names the clustering reads (what the estimator's params also set)."""
    columns = [inp.device_col] + (inp.features_col if isinstance(inp.features_col, list) else [inp.features_col])
    if not inp.features_col or any(not isinstance(c, str) or not c for c in columns):
        raise ConfigError("input.device_col and input.features_col must be column names (features: one or a list)")


def validate_run(cfg: KFedConfig) -> None:
    """The job's own settings, beside the clustering's."""
    if cfg.local_partitions is not None and integer(1)(cfg.local_partitions):
        raise ConfigError(f"local_partitions must be an integer >= 1, got {cfg.local_partitions!r}")
    if not isinstance(cfg.report, bool):
        raise ConfigError(f"report must be true or false, got {cfg.report!r}")
    if cfg.profiles is not None and not isinstance(cfg.profiles, bool):
        raise ConfigError(f"profiles must be true or false, got {cfg.profiles!r}")
    if cfg.on_bad_rows not in ("quarantine", "fail"):
        raise ConfigError(f"on_bad_rows must be 'quarantine' or 'fail', got {cfg.on_bad_rows!r}")
    for key, run_id in (("run_id", cfg.run_id), ("identity.reference", cfg.identity.reference)):
        if run_id is not None and not (isinstance(run_id, str) and RUN_ID_PATTERN.match(run_id)):
            raise ConfigError(
                f"{key} {run_id!r} is not allowed: use 1-128 letters, digits, '_', '.', ':' or '-', "
                "starting with a letter or digit"
            )
    identity = cfg.identity
    if identity.mode not in IDENTITY_MODES:
        raise ConfigError(f"identity.mode must be one of {', '.join(IDENTITY_MODES)}, got {identity.mode!r}")
    if not isinstance(identity.warm_start, bool):
        raise ConfigError(f"identity.warm_start must be true or false, got {identity.warm_start!r}")
    if identity.mode == "fresh" and (identity.reference is not None or identity.warm_start):
        raise ConfigError("identity.reference and identity.warm_start need identity.mode: stable")


def validate_io(cfg: KFedConfig) -> None:
    """Where the input comes from and where the tables go."""
    inp = cfg.input
    if (inp.path is None) == (inp.table is None):
        raise ConfigError("set exactly one of input.path and input.table")
    if inp.table is not None and not TABLE_NAME_PATTERN.match(str(inp.table)):
        raise ConfigError(f"input.table {inp.table!r} is not a table name like db.table")
    if inp.format not in INPUT_FORMATS:
        raise ConfigError(f"input.format must be one of {', '.join(INPUT_FORMATS)}, got {inp.format!r}")
    if inp.schema is not None and (inp.table is not None or inp.format == "delta" or not isinstance(inp.schema, str)):
        raise ConfigError("input.schema is DDL text for files of a path (a table or Delta input has its own schema)")
    if cfg.output.path is None:
        raise ConfigError("output.path is required: the folder the Delta tables are written under")
    if "'" in str(cfg.output.path):
        raise ConfigError("output.path must not contain a single quote")
    if cfg.output.database is not None and not IDENTIFIER_PATTERN.match(str(cfg.output.database)):
        raise ConfigError(f"output.database {cfg.output.database!r} is not a plain identifier")
    mlflow = cfg.tracking.mlflow
    if mlflow is not None:
        for key, value in (("uri", mlflow.uri), ("experiment", mlflow.experiment)):
            if not (isinstance(value, str) and value.strip()) and (key, value) != ("uri", None):
                raise ConfigError(f"tracking.mlflow.{key} must be non-empty text, got {value!r}")
        if finite_number(mlflow.timeout_s) or mlflow.timeout_s == 0:
            raise ConfigError(f"tracking.mlflow.timeout_s must be a finite number > 0, got {mlflow.timeout_s!r}")
    stream = cfg.stream
    if finite_number(stream.trigger_seconds) or stream.trigger_seconds == 0:
        raise ConfigError(f"stream.trigger_seconds must be a finite number > 0, got {stream.trigger_seconds!r}")
    if stream.max_files_per_trigger is not None and integer(1)(stream.max_files_per_trigger):
        raise ConfigError(f"stream.max_files_per_trigger must be an integer >= 1, got {stream.max_files_per_trigger!r}")


def resolve_run_id(cfg: KFedConfig) -> str:
    """The configured run id, or one made from the current UTC time."""
    return cfg.run_id or datetime.now(timezone.utc).strftime("run-%Y%m%dT%H%M%S%fZ")


def as_dict(cfg: KFedConfig) -> dict[str, Any]:
    """The config as its YAML file has it, the clustering's parameters at the top level (as `runs.config`
    records it, and build_config reads it back)."""
    values = dataclasses.asdict(cfg)
    return {**values.pop("algorithm"), **values}
