"""The package's shape: its folders are layers that import only downward, no module takes part in an import
cycle (lazy imports included in both), the numeric core imports no Spark, and each entry point leaves out
what it does not need."""

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import kfed_spark

pytestmark = pytest.mark.fast


PACKAGE = Path(kfed_spark.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that the file imports anywhere in it (in a function too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one importing itself (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_is_in_an_import_cycle():
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    graph = {module_name(path): imports_of(path, modules) - {"kfed_spark"} for path in paths}
    assert cycles(graph) == []


def test_the_cycle_check_sees_a_cycle_through_a_lazy_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]] and cycles({"a": {"b"}, "b": set()}) == []


LAYERS = (
    ("kfed_spark.errors", "kfed_spark.params", "kfed_spark.config"),
    ("kfed_spark.core",),
    ("kfed_spark.runtime",),
    ("kfed_spark.spark",),
    ("kfed_spark.store",),
    ("kfed_spark.runs",),
    ("kfed_spark.bench",),
    (
        "kfed_spark.cli",
        "kfed_spark.commands",
        "kfed_spark.estimator",
        "kfed_spark.estimator_params",
        "kfed_spark.params_codegen",
    ),
)
"""The package's layers, lowest first: the settings every layer reads; the numeric core; process plumbing
(stopping, failures, packaging, test-only fault hooks); the Spark pipeline; the output location's
contract (table schemas, Delta I/O, the runs ledger, stored models); a run's lifecycle; the benchmarks;
the entry points. A module imports from its own layer and the layers below it, never from one above."""


def layer_of(module: str) -> int:
    found = [i for i, members in enumerate(LAYERS) for m in members if module == m or module.startswith(m + ".")]
    assert found, f"{module} is in no layer of LAYERS"
    return found[0]


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import of a module from a layer above its own."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def package_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    packages = {name for name in modules if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()}
    return {
        module_name(path): imports_of(path, modules) - packages for path in paths if module_name(path) not in packages
    }


def test_every_import_points_to_the_same_layer_or_one_below():
    assert upward_imports(package_graph()) == []


def test_the_layer_check_sees_an_upward_import():
    graph = {"kfed_spark.core.linalg": {"kfed_spark.params"}, "kfed_spark.spark.fitting": {"kfed_spark.store.tables"}}
    assert upward_imports(graph) == [("kfed_spark.spark.fitting", "kfed_spark.store.tables")]


def test_the_numeric_core_imports_no_spark():
    """The kernels are tested without a JVM and run in the Python workers: nothing of pyspark in them."""
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not [name for name in imported if name.split(".")[0] in ("pyspark", "delta")], path.name


@dataclass(frozen=True)
class ImportLimit:
    imports: str  # what an entry point imports
    left_out: tuple[str, ...]  # packages or modules that must not come with it
    why: str
    missing: tuple[str, ...] = ()  # packages not installed where it runs

    def script(self) -> str:
        """A fresh interpreter's check: the modules of left_out that the imports loaded."""
        missing = "".join(f"sys.modules[{name!r}] = None; " for name in self.missing)
        return (
            f"import sys; {missing}import {self.imports}; "
            f"print(sorted(m for m in sys.modules if any(m == o or m.startswith(o + '.') for o in {self.left_out!r})))"
        )


BENCH_TOOLING = tuple(
    f"kfed_spark.bench.{path.stem}"
    for path in sorted((PACKAGE / "bench").glob("*.py"))
    if path.stem not in ("__init__", "cli", "pages")
) + ("sklearn",)


IMPORT_LIMITS = [
    ImportLimit(
        "kfed_spark.cli, kfed_spark.runs.job, kfed_spark.spark.session",
        BENCH_TOOLING,
        "`kfed-spark run` before its Spark session imports none of the benchmarks' tooling (their parsers only)",
    ),
    ImportLimit(
        "kfed_spark.estimator",
        ("kfed_spark.runs", "kfed_spark.store.ledger", "kfed_spark.bench"),
        "a notebook without delta-spark imports the estimator: the fit layer, not the job's stages",
        missing=("delta",),
    ),
    ImportLimit(
        "kfed_spark.spark.workers",
        ("scipy",),
        "every Python worker of a run imports kfed_spark.spark.workers; scipy's statistics would cost it 0.4 s (the "
        "privacy accounting imports them only when a run has a budget)",
    ),
]


def test_each_entry_point_leaves_out_what_it_does_not_need():
    """Each in an interpreter of its own, all side by side (each is a Python start-up)."""
    started = [
        subprocess.Popen(
            [sys.executable, "-c", limit.script()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for limit in IMPORT_LIMITS
    ]
    for limit, process in zip(IMPORT_LIMITS, started):
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-2000:]
        assert out.strip() == "[]", limit.why


def test_the_import_check_sees_a_module_that_comes_along():
    check = ImportLimit("json", ("json.decoder",), "json's package loads its decoder").script()
    assert subprocess.run([sys.executable, "-c", check], capture_output=True, text=True).stdout.strip() != "[]"
