"""The clustering's parameters: one table of names, defaults, types, constraints and meanings.

Each field of AlgorithmParams is one row. The YAML config is an AlgorithmParams (KFedConfig
extends it), the estimator declares one Param per field (camelCase: k_per_device -> kPerDevice)
with this default and meaning, and the kernels take their default arguments from DEFAULTS.
Validation is the constraints below, checked in one place (AlgorithmParams.check).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from kfed_spark.errors import ConfigError

Constraint = Callable[[object], str | None]
"""Checks a value: None if it is allowed, else what is required ('an integer >= 1')."""

SEEDING_RULES = ("farthest", "kmeanspp")
SEEDINGS = (*SEEDING_RULES, "robust")
"""The values seeding takes: the server's seeding rules, and "robust", the name older versions gave
farthest-point seeding with the outlier filter, which now means "farthest" (the filter is
robust_min_size, 0 turns it off)."""
SERVER_REFINES = ("lloyd", "none")
SERVER_STEPS = ("auto", "driver", "distributed")
LABEL_MODES = ("induced", "nearest")


def integer(minimum: int) -> Constraint:
    def check(value: object) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            return f"an integer >= {minimum}"
        return None

    return check


def finite_number(value: object) -> str | None:
    """A finite number >= 0 (YAML reads .inf and .nan as floats)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return "a finite number >= 0"
    return None


def one_of(*choices: str) -> Constraint:
    def check(value: object) -> str | None:
        return None if value in choices else f"one of {', '.join(choices)}"

    return check


def cluster_count(value: object) -> str | None:
    """k: a number, or 'auto' (the run sweeps k_range and chooses: kfed_spark.k_sweep)."""
    return None if value == "auto" or integer(1)(value) is None else "an integer >= 1 or 'auto'"


def k_range(value: object) -> str | None:
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and integer(1)(value[0]) is None
        and integer(1)(value[1]) is None
        and value[0] <= value[1]
    ):
        return None
    return "[LO, HI] with 1 <= LO <= HI"


def count_source(value: object) -> str | None:
    """k_per_device: a number, 'auto', or the name of a column or side table."""
    if isinstance(value, str):
        return None if value.strip() else "an integer, 'auto', or the name of a column or table"
    return integer(1)(value)


def param(default: object, constraint: Constraint, doc: str):
    return field(default=default, metadata={"constraint": constraint, "doc": doc})


@dataclass(frozen=True)
class AlgorithmParams:
    """What decides the clustering; every other setting says where rows come from and go."""

    k: int | str = param(
        8,
        cluster_count,
        "number of global clusters, or 'auto': after the local step the run sweeps k_range over "
        "the local centers and takes the k the sweep recommends (kfed_spark.k_sweep), with no extra pass over the rows",
    )
    k_range: tuple[int, int] = param((2, 30), k_range, "with k 'auto': the smallest and largest k swept, both included")
    k_per_device: int | str = param(
        2,
        count_source,
        "local clusters per device: an integer in [1, k], 'auto' (each device estimates its own), "
        "or a column of the input or a side table (device column + k)",
    )
    k_per_device_max: int = param(16, integer(1), "with k_per_device 'auto': the largest k a device may estimate")
    seeding: str = param(
        "kmeanspp",
        one_of(*SEEDINGS),
        "server seeding rule: kmeanspp (count-weighted greedy k-means++, best of several, on a sample of "
        "the local centers when they are many) or farthest (the paper's farthest-point); robust is an older "
        "name for farthest",
    )
    robust_min_size: float = param(
        0.25,
        finite_number,
        "outlier filter of the server step: local centers backed by fewer rows than this "
        "times the median center's are left out of seeding and refinement and assigned at the end; 0 turns it off",
    )
    local_restarts: int = param(
        3, integer(1), "rough clusterings each device tries in its projection; it keeps the lowest-cost one"
    )
    server_refine: str = param(
        "lloyd", one_of(*SERVER_REFINES), "lloyd (count-weighted Lloyd over the local centers) or none (the paper)"
    )
    server_step: str = param(
        "auto",
        one_of(*SERVER_STEPS),
        "where the server step runs: driver (every local center in the driver's memory), distributed (Spark "
        "partitions reduce the local centers to weighted representatives, the driver merges those) or auto "
        "(distributed above server_distributed_above local centers)",
    )
    server_distributed_above: int = param(
        2_000_000, integer(1), "with server_step auto: the most local centers the driver merges itself"
    )
    server_representatives: int = param(
        2, integer(1), "distributed server step: weighted representatives each partition keeps, per global cluster"
    )
    label_mode: str = param(
        "induced",
        one_of(*LABEL_MODES),
        "induced (a row takes the global cluster of its device's nearest local center) or nearest (the nearest "
        "global center)",
    )
    max_iter: int = param(100, integer(1), "most Lloyd rounds, on each device and on the server")
    tol: float = param(
        1e-8, finite_number, "Lloyd stops when the centers move less than tol times the data's total variance"
    )
    max_rows_per_device: int = param(
        100_000, integer(1), "a larger device is clustered on a deterministic sample of this many rows"
    )
    seed: int = param(0, integer(0), "seed of every random draw, with the device id")

    @classmethod
    def of(cls, settings: object) -> "AlgorithmParams":
        """The algorithm's parameters out of anything that has them (a KFedConfig, say), and nothing else."""
        return cls(**{spec.name: getattr(settings, spec.name) for spec in fields(cls)})

    @classmethod
    def of_config(cls, config: dict) -> "AlgorithmParams":
        """The parameters a run recorded (its runs row's config, as JSON); a parameter added since takes its default."""
        values = {spec.name: config[spec.name] for spec in fields(cls) if spec.name in config}
        if isinstance(values.get("k_range"), list):
            values["k_range"] = tuple(values["k_range"])
        return cls(**values)

    @property
    def largest_k(self) -> int:
        """k, or with k 'auto' the largest k it may become: the bound of every device's k."""
        return self.k_range[1] if self.k == "auto" else self.k

    def check(self) -> None:
        """Raise ConfigError for the first value its constraint refuses, or a k_per_device above the
        smallest k the run may take."""
        for spec in fields(AlgorithmParams):
            value = getattr(self, spec.name)
            required = spec.metadata["constraint"](value)
            if required is not None:
                raise ConfigError(f"{spec.name} must be {required}, got {value!r}")
        smallest, what = (self.k_range[0], "the smallest k of k_range") if self.k == "auto" else (self.k, "k")
        if not isinstance(self.k_per_device, str) and self.k_per_device > smallest:
            raise ConfigError(f"k_per_device ({self.k_per_device}) must not exceed {what} ({smallest})")


DEFAULTS = AlgorithmParams()
