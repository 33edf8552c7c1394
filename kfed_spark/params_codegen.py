"""Writes the estimator's Param declarations and the README's parameter table from the parameter table.

pyspark declares its shared Params as code generated once and checked in (pyspark/ml/param/shared.py),
so that a reader and an IDE see every Param, getter and keyword. The estimator's Params are the rows of
kfed_spark.params.AlgorithmParams (camelCase) and its ESTIMATOR_COLUMNS; this module
writes their declarations between the `# BEGIN GENERATED <block>` and `# END GENERATED <block>` lines of
estimator.py. The README's table of the parameters is written the same way, between the
`<!-- BEGIN GENERATED parameters -->` and `<!-- END GENERATED parameters -->` lines. In a source checkout,
`python -m kfed_spark.params_codegen` rewrites both; tests/test_estimator.py and tests/test_params.py
fail when they differ from what it would write.
"""

from __future__ import annotations

import re
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

from kfed_spark.params import ESTIMATOR_COLUMNS, AlgorithmParams, camel

ESTIMATOR = Path(__file__).with_name("estimator.py")
README = Path(__file__).resolve().parent.parent / "README.md"

CONVERTERS = {
    "int": "TypeConverters.toInt",
    "float": "TypeConverters.toFloat",
    "str": "TypeConverters.toString",
    "int | str": "_int_or_text",
    "tuple[int, int]": "_int_pair",
    "float | None": "_optional_float",
    "tuple[float, float] | None": "_float_pair",
}
"""The Param type converter of each annotation the parameter table uses."""


def declared() -> list[tuple[str, str, str, object, str]]:
    """(Param name, annotation, converter, default, meaning) of every Param, in the table's order."""
    rows = [
        (camel(spec.name), spec.type, CONVERTERS[spec.type], spec.default, spec.metadata["doc"] + ".")
        for spec in fields(AlgorithmParams)
    ]
    rows += [(name, "str", CONVERTERS["str"], default, doc) for name, (default, doc) in ESTIMATOR_COLUMNS.items()]
    return rows


def code(value: object) -> str:
    """A value as Python source, strings in double quotes (as ruff formats them)."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def literal(text: str, indent: str) -> str:
    """text as Python string literals of at most 100 characters a line, implicitly joined."""
    lines = textwrap.wrap(text, 96, drop_whitespace=False, break_on_hyphens=False)
    return "\n".join(f"{indent}{code(line)}" for line in lines)


def accessor(name: str) -> str:
    return name[0].upper() + name[1:]


def blocks() -> dict[str, str]:
    """The generated code of each block, indented for the class it sits in."""
    rows = declared()
    params = []
    for name, kind, converter, _, doc in rows:
        params.append(
            f"    {name}: Param[{kind}] = Param(\n        Params._dummy(),\n        {code(name)},\n"
            f"{literal(doc, '        ')},\n        typeConverter={converter},\n    )\n"
        )
    getters = [
        f"    def get{accessor(name)}(self) -> {kind}:\n        return self.getOrDefault(self.{name})\n"
        for name, kind, _, _, _ in rows
    ]
    defaults = "".join(f"            {name}={code(default)},\n" for name, _, _, default, _ in rows)
    declarations = (
        "\n".join(params)
        + "\n"
        + ("    def _declared_defaults(self) -> None:\n        self._setDefault(\n" + defaults + "        )\n\n")
        + "\n".join(getters)
    )
    keywords = "".join(f"        {name}: {kind} = {code(default)},\n" for name, kind, _, default, _ in rows)
    init = (
        "    @keyword_only\n    def __init__(\n        self,\n        *,\n" + keywords + "    ) -> None:\n"
        "        super().__init__()\n        self._reference: KFedModel | None = None\n"
        "        self._warm_start = False\n        self._set(**self._input_kwargs)\n\n"
        "    @keyword_only\n    def setParams(\n        self,\n        *,\n" + keywords + "    ) -> KFed:\n"
        "        return self._set(**self._input_kwargs)\n"
    )
    setters = "\n".join(
        f"    def set{accessor(name)}(self, value: {kind}) -> KFed:\n        return self._set({name}=value)\n"
        for name, kind, _, _, _ in rows
    )
    return {"params": declarations, "init": init, "setters": setters}


def rewritten(text: str) -> str:
    """estimator.py's text with every generated block as blocks() writes it."""
    for name, code in blocks().items():
        pattern = re.compile(rf"(    # BEGIN GENERATED {name}\n).*?(    # END GENERATED {name}\n)", re.S)
        if not pattern.search(text):
            raise ValueError(f"estimator.py has no generated block {name!r}")
        text = pattern.sub(lambda match: match.group(1) + code + "\n" + match.group(2), text)
    return text


def shown(value: object) -> str:
    """A default as the README's table shows it (as YAML writes it)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, tuple):
        return f"`[{', '.join(map(str, value))}]`"
    return str(value)


def readme_table() -> str:
    """The README's table of the parameters: the YAML key (the estimator's Param is its camelCase), default, meaning."""
    rows = [f"| `{spec.name}` | {shown(spec.default)} | {spec.metadata['doc']} |" for spec in fields(AlgorithmParams)]
    return "\n".join(["| key | default | meaning |", "| --- | --- | --- |", *rows]) + "\n"


def rewritten_readme(text: str) -> str:
    """The README's text with its parameter table as readme_table() writes it."""
    pattern = re.compile(r"(<!-- BEGIN GENERATED parameters -->\n).*?(<!-- END GENERATED parameters -->\n)", re.S)
    if not pattern.search(text):
        raise ValueError("README.md has no generated block 'parameters'")
    return pattern.sub(lambda match: match.group(1) + readme_table() + match.group(2), text)


if __name__ == "__main__":
    ESTIMATOR.write_text(rewritten(ESTIMATOR.read_text()))
    README.write_text(rewritten_readme(README.read_text()))
    sys.exit(0)
