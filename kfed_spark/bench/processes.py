"""The benchmark as users run it: every contender a fresh process of its own, one after the other.

spark-submit, an Airflow task and cron start a new process for every run, so each run pays the JVM's
start, the Python workers' start and imports, and a cold JIT. The contenders, on the same Parquet input:
`kfed-spark run` as a scheduled run (a new run id into an output location an earlier run created),
`kfed-spark choose-k` sweeping k over that run's local centers, MLlib KMeans fit + transform + Delta
write (kfed_spark.bench.contenders), and Spark's bare passes of
k-FED's shape with no clustering in them (the same). Each is timed from its start to its exit, with the
stages it reports, and its process tree's peak resident memory and CPU time by role.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import yaml

from kfed_spark.bench.benchmark import (
    BENCH_SPARK_CONF,
    PYTHON_DRIVER,
    PYTHON_WORKER,
    SPARK_JVM,
    memory_label,
    peak_resident_mb,
    planted,
    process_role,
)
from kfed_spark.bench.contenders import MLLIB_LABELS
from kfed_spark.core.metrics import adjusted_rand_index
from kfed_spark.errors import KFedError

KFED = "k-FED: kfed-spark run, a new run id into an existing location"
MLLIB = "Spark MLlib KMeans: read, fit, transform, Delta write"
PASSES = "Spark's bare passes of k-FED's shape, no clustering"
SWEEP = "k sweep: kfed-spark choose-k over the k-FED run's local centers"
SWEEP_KS = (2, 100)
"""The ks the benchmark's sweep covers (at most as many as the run has local centers)."""
SWEEP_MAX_CENTERS = 50_000
"""The benchmark sweeps k over a run of at most this many local centers (the sweep's time grows with them)."""
SETUP_DEVICES = 50
"""Devices of the input slice the setup run clusters, to create the location the timed run writes into."""


@dataclass
class ProcessRun:
    name: str
    seconds: float
    """Wall time of the process, from its start to its exit."""
    stages: dict[str, float]
    peak_memory_mb: dict[str, float]
    cpu_seconds: dict[str, float]
    """User + system CPU time of the process tree by role (ROLES), as last sampled."""
    cost: float | None = None
    ari: float | None = None


@dataclass
class FreshReport:
    rows: int
    devices: int
    dim: int
    k: int
    k_per_device: int
    runs: list[ProcessRun]
    ratios: dict[str, float]
    command: str
    planted_cost: float
    """The k-means cost of the planted clusters (each row at its true cluster's mean)."""
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [
            f"{self.rows:,} rows, {self.devices:,} devices, d = {self.dim}, k = {self.k}, {self.k_per_device} "
            f"clusters per device; each contender a fresh process, one run each; `{self.command}`",
            "",
            "| contender (fresh process) | seconds | k-means cost | cost / planted | ARI vs planted "
            "| peak memory MB: driver, JVM, largest worker | CPU s: driver, JVM, workers |",
            "| --- | ---: | ---: | ---: | ---: | --- | --- |",
        ]
        for run in self.runs:
            memory = ", ".join(f"{run.peak_memory_mb.get(memory_label(role), 0):,.0f}" for role in ROLES)
            cpu = ", ".join(f"{run.cpu_seconds.get(role, 0):,.1f}" for role in ROLES)
            cost = "" if run.cost is None else f"{run.cost:.6g} | {run.cost / self.planted_cost:.4f}"
            ari = "" if run.ari is None else f"{run.ari:.4f}"
            lines.append(f"| {run.name} | {run.seconds:.2f} | {cost or ' | '} | {ari} | {memory} | {cpu} |")
        lines += ["", "| ratio (fresh processes) | value |", "| --- | ---: |"]
        lines += [f"| {name} | {value:.2f} |" for name, value in self.ratios.items()]
        for run in self.runs:
            lines += ["", f"{run.name}, stages (s): " + ", ".join(f"{s} {v:.2f}" for s, v in run.stages.items())]
        lines += [""] + self.notes
        return "\n".join(lines).rstrip() + "\n"


ROLES = (PYTHON_DRIVER, SPARK_JVM, PYTHON_WORKER)
"""The roles of a contender's processes (benchmark.process_role), in the table's order."""


class ProcessTreeSampler(threading.Thread):
    """Samples a process and all its descendants every `interval` seconds until stopped, by role
    (benchmark.process_role): the peak resident memory (VmHWM, the largest process of a role) and the CPU
    time (user + system, summed over a role's processes). Both as last sampled: a peak shortly before a
    process exits is held, but not the CPU of its last interval, nor that of a process that lived less."""

    def __init__(self, pid: int, interval: float = 0.25):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peaks: dict[str, float] = {}
        self.cpu: dict[int, tuple[str, float]] = {}
        """pid -> (its role, its CPU seconds when last sampled)."""
        self.finished = threading.Event()

    def run(self) -> None:
        while not self.finished.wait(self.interval):
            for pid in descendants(self.pid):
                role, megabytes, seconds = process_role(pid, self.pid), peak_resident_mb(pid), cpu_seconds(pid)
                if role is None or megabytes is None or seconds is None:
                    continue
                label = memory_label(role)
                self.peaks[label] = max(self.peaks.get(label, 0.0), megabytes)
                self.cpu[pid] = role, seconds

    def stop(self) -> tuple[dict[str, float], dict[str, float]]:
        """(peak memory MB, CPU seconds), each by role."""
        self.finished.set()
        self.join()
        cpu: dict[str, float] = {}
        for role, seconds in self.cpu.values():
            cpu[role] = cpu.get(role, 0.0) + seconds
        return self.peaks, cpu


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """A process's user + system CPU time so far (/proc/pid/stat), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def descendants(root: int) -> set[int]:
    """root and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def timed_process(name: str, argv: list[str], log_path: Path) -> tuple[float, str, dict[str, float], dict[str, float]]:
    """Run argv to its exit: (wall seconds, its stdout, its process tree's peak memory and CPU seconds by role);
    its stderr goes to log_path. A failure raises, naming the log."""
    with open(log_path, "w") as log:
        start = time.perf_counter()
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
        sampler = ProcessTreeSampler(process.pid)
        sampler.start()
        stdout, _ = process.communicate()
        seconds = time.perf_counter() - start
    peaks, cpu = sampler.stop()
    if process.returncode != 0:
        raise KFedError(f"the benchmark's {name} process failed (exit {process.returncode}); its log: {log_path}")
    return seconds, stdout, peaks, cpu


def kfed_command() -> list[str]:
    """The kfed-spark CLI of this environment, by its absolute path, as cron or Airflow would start it."""
    script = Path(sys.executable).parent / "kfed-spark"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kfed_spark.cli"]


def read_into_file_cache(data: str) -> None:
    """Read every file of the input once, so that each contender starts with the same warm file cache."""
    for path in sorted(Path(data).rglob("*")) if Path(data).is_dir() else [Path(data)]:
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass


def kfed_config(
    data: str, location: Path, k: int, k_per_device: int, seed: int, master: str, driver_memory: str
) -> dict:
    """The scheduled run's config: conf/local.yaml's settings on the benchmark's input, without the run
    report (the other contenders make none)."""
    return {
        "input": {"path": data, "format": "parquet", "device_col": "device_id", "features_col": "features"},
        "output": {"path": str(location)},
        "k": k,
        "k_per_device": k_per_device,
        "seed": seed,
        "report": False,
        "spark": {"master": master, "conf": {"spark.driver.memory": driver_memory, **BENCH_SPARK_CONF}},
    }


def ari_against(truth_by_row: np.ndarray, folder: Path) -> float:
    """ARI of the (row_id, cluster_id) labels in a folder of Parquet files (a Delta table's, or one of its
    partitions) against the input's truth."""
    table = ds.dataset(str(folder), format="parquet").to_table(columns=["row_id", "cluster_id"])
    return adjusted_rand_index(truth_by_row[table.column("row_id").to_numpy()], table.column("cluster_id").to_numpy())


@dataclass(frozen=True)
class FreshSetup:
    """What every contender of the fresh-process benchmark runs against: the input, the folders, the k-FED
    configs (the untimed setup run's and the timed run's), the commands and the planted clusters by row."""

    data: str
    out: Path
    location: Path  # the k-FED output location
    configs: dict[str, Path]
    kfed: list[str]  # kfed-spark, by its absolute path
    contender: list[str]  # python -m kfed_spark.bench.contenders
    common: list[str]  # the contenders' shared arguments
    truth_by_row: np.ndarray

    def timed(self, name: str, command: list[str], log: str) -> tuple[float, str, dict[str, float], dict[str, float]]:
        return timed_process(name, command, self.out / "logs" / log)


def fresh_setup(
    data: str, out: Path, k: int, k_per_device: int, seed: int, master: str, driver_memory: str
) -> tuple[FreshSetup, int, int, int]:
    """The setup every contender shares, and the input's rows, devices and dimension. A first run on
    SETUP_DEVICES devices creates the k-FED location untimed, as a scheduled run finds it."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    table = pq.read_table(data, columns=["row_id", "device_id", "true_cluster"])
    truth_by_row = np.empty(len(table), dtype=np.int64)
    truth_by_row[table.column("row_id").to_numpy()] = table.column("true_cluster").to_numpy()
    device_ids = np.unique(table.column("device_id").to_numpy())
    dim = len(ds.dataset(data, format="parquet").head(1, columns=["features"]).column("features")[0])

    location = out / "kfed"
    shutil.rmtree(location, ignore_errors=True)
    setup_input = out / "setup_input"
    shutil.rmtree(setup_input, ignore_errors=True)
    ds.write_dataset(
        ds.dataset(data, format="parquet").to_table(filter=ds.field("device_id").isin(device_ids[:SETUP_DEVICES])),
        str(setup_input),
        format="parquet",
    )
    configs = {}
    for role, source in (("setup", str(setup_input)), ("timed", data)):
        configs[role] = out / f"kfed-{role}.yaml"
        configs[role].write_text(
            yaml.safe_dump(kfed_config(source, location, k, k_per_device, seed, master, driver_memory), sort_keys=False)
        )
    common = ["--data", data, "--out", str(out), "--k", str(k), "--seed", str(seed)]
    common += ["--master", master, "--driver-memory", driver_memory]
    setup = FreshSetup(
        data,
        out,
        location,
        configs,
        kfed_command(),
        [sys.executable, "-m", "kfed_spark.bench.contenders"],
        common,
        truth_by_row,
    )
    setup.timed("setup", [*setup.contender, "setup", *common, "--kfed-config", str(configs["setup"])], "setup.log")
    return setup, len(table), len(device_ids), dim


def time_kfed(setup: FreshSetup) -> tuple[ProcessRun, dict]:
    """`kfed-spark run`, a new run id into the existing location; its run's JSON figures."""
    run_id = f"bench-{time.strftime('%Y%m%dT%H%M%S')}"
    read_into_file_cache(setup.data)
    command = [*setup.kfed, "run", "--config", str(setup.configs["timed"]), "--set", f"run_id={run_id}", "--json"]
    seconds, stdout, peaks, cpu = setup.timed("k-FED", command, "kfed.log")
    result = last_json_line(stdout)
    stages = with_rest(result["timings"], seconds, "process start, imports and exit")
    labels = setup.location / "labels" / f"run_id={run_id}" / f"attempt_id={result['attempt_id']}"
    ari = ari_against(setup.truth_by_row, labels)
    return ProcessRun(KFED, seconds, stages, peaks, cpu, result["cost"], ari), result


def time_sweep(setup: FreshSetup, result: dict) -> tuple[ProcessRun, dict, int]:
    """`kfed-spark choose-k` over the k-FED run's local centers; its JSON and the top k swept."""
    top = min(SWEEP_KS[1], result["n_local_centers"])
    command = [*setup.kfed, "choose-k", "--output", str(setup.location), "--run", result["run_id"]]
    command += ["--k", f"{SWEEP_KS[0]}:{top}", "--json"]
    seconds, stdout, peaks, cpu = setup.timed("k sweep", command, "choose-k.log")
    swept = last_json_line(stdout)
    sweep_seconds = sum(f["seconds"] for f in swept["figures"])
    stages = {
        "server steps and figures": round(sweep_seconds, 3),
        "process start, reading the run, report files and exit": round(seconds - sweep_seconds, 3),
    }
    return ProcessRun(f"{SWEEP}, k = {SWEEP_KS[0]}..{top}", seconds, stages, peaks, cpu), swept, top


def time_contender(setup: FreshSetup, name: str, role: str, labels: Path | None = None) -> ProcessRun:
    """One of the contenders' own processes (MLlib, the bare passes), the input read into the file cache first."""
    read_into_file_cache(setup.data)
    seconds, stdout, peaks, cpu = setup.timed(name, [*setup.contender, role, *setup.common], f"{role}.log")
    figures = last_json_line(stdout)
    stages = with_rest(figures["stages"], seconds, "process start, imports and exit")
    if labels is None:
        return ProcessRun(PASSES, seconds, stages, peaks, cpu)
    return ProcessRun(MLLIB, seconds, stages, peaks, cpu, figures["cost"], ari_against(setup.truth_by_row, labels))


def benchmark_fresh(
    data: str,
    out: Path,
    k: int,
    k_per_device: int,
    seed: int,
    command: str,
    master: str = "local[2]",
    driver_memory: str = "2g",
) -> FreshReport:
    """Each contender as a process of its own, one after the other, on the same input."""
    setup, rows, devices, dim = fresh_setup(data, out, k, k_per_device, seed, master, driver_memory)
    kfed_run, result = time_kfed(setup)
    sweeps = result["n_local_centers"] <= SWEEP_MAX_CENTERS
    if sweeps:
        sweep_run, swept, top = time_sweep(setup, result)
    shutil.rmtree(out / MLLIB_LABELS, ignore_errors=True)
    mllib_run = time_contender(setup, "MLlib", "mllib", out / MLLIB_LABELS)
    passes_run = time_contender(setup, "bare passes", "passes")
    ratios = {
        "MLlib / k-FED, wall time": mllib_run.seconds / kfed_run.seconds,
        "k-FED / Spark's bare passes, wall time": kfed_run.seconds / passes_run.seconds,
        "k-FED cost / MLlib cost": kfed_run.cost / mllib_run.cost,
    }
    notes = [
        f"Each process was started by this benchmark ({sys.executable}), one after the other, after reading the "
        "input once into the file cache; peak memory and CPU time are sampled every 0.25 s over the process tree "
        "(CPU time as last sampled: a lower bound, short of each process's last quarter second)."
    ]
    runs = [kfed_run, mllib_run, passes_run]
    if sweeps:
        ratios[f"k sweep of {top - SWEEP_KS[0] + 1} ks / one MLlib read and fit at k = {k}, wall time"] = (
            sweep_run.seconds / mllib_run.stages["read and fit"]
        )
        notes.append(
            f"The k sweep recommended k = {swept['recommended_k']} ({swept['rule']}); the input's true k is {k}."
        )
        runs.insert(1, sweep_run)
    else:
        notes.append(
            f"No k sweep: the run shared {result['n_local_centers']:,} local centers, more than the "
            f"{SWEEP_MAX_CENTERS:,} this benchmark sweeps."
        )
    return FreshReport(rows, devices, dim, k, k_per_device, runs, ratios, command, planted(data)[3], notes)


JOB_STAGES = (
    "session",
    "validate",
    "claim",
    "local_step",
    "k_sweep",
    "server_step",
    "labels",
    "other_tables",
    "report",
    "publish",
    "supersede",
)
"""The job's stages in the order it runs them (its JSON lists them sorted by name)."""


def last_json_line(stdout: str) -> dict:
    """What a contender printed last: its figures as one JSON object."""
    return json.loads(stdout.strip().splitlines()[-1])


def with_rest(stages: dict[str, float], seconds: float, rest: str) -> dict[str, float]:
    """The stages a process reported, in the job's order, and the rest of its wall time under the name `rest`."""
    ordered = sorted(stages, key=lambda s: JOB_STAGES.index(s) if s in JOB_STAGES else len(JOB_STAGES))
    return {**{s: stages[s] for s in ordered}, rest: round(seconds - sum(stages.values()), 3)}
