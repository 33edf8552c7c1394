"""The benchmarks' result pages: each bench command writes its markdown under a header that says where the
figures come from (commit, date, machine, the versions that run, the exact command), so that a page is
never copied by hand and a reader can tell which code and which machine measured it.

The README's headline is the speed page's fresh-process tables, copied by `python -m kfed_spark.bench.pages`
between its GENERATED lines; tests/test_docs.py fails while the two differ.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
"""The source checkout this package runs from (when it runs from one)."""
README = REPOSITORY / "README.md"
SPEED_PAGE = REPOSITORY / "docs" / "benchmarks" / "speed.md"
FRESH_SECTION = "### Fresh processes, as spark-submit, Airflow and cron run each contender"
WARM_SECTION = "### One warm session (JVM, Python workers and output tables warmed up first)"
PROVENANCE_ROW = re.compile(r"^\| (command|commit|date|machine|Java|Spark, Delta|Python, numpy) \| (.+) \|$", re.M)
"""A row of a page's provenance table (provenance() writes them)."""


def git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPOSITORY), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> str:
    """The checkout's commit, marked when the package's files differ from it; else the installed version."""
    head = git("rev-parse", "--short=12", "HEAD")
    if head is None:
        return f"kfed-spark {installed('kfed-spark')} (not a git checkout)"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", "kfed_spark", "pyproject.toml")
    return f"{head} with uncommitted changes" if changed else head


def installed(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> str:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return "unknown"
    return f"{pages * size / 2**30:.1f} GiB"


def java_version() -> str:
    java = Path(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else Path("java")
    try:
        done = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "not found"
    return (done.stderr or done.stdout).splitlines()[0].strip() if (done.stderr or done.stdout) else "unknown"


def provenance(command: str) -> list[tuple[str, str]]:
    """What a reader needs to know to trust or repeat a page's figures."""
    return [
        ("command", f"`{command}`"),
        ("commit", commit()),
        ("date", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")),
        ("machine", f"{os.cpu_count()} cores, {memory_gib()}, {cpu_model()}"),
        ("Java", java_version()),
        ("Spark, Delta", f"pyspark {installed('pyspark')}, delta-spark {installed('delta-spark')}"),
        ("Python, numpy", f"{platform.python_version()}, numpy {installed('numpy')}"),
    ]


def cell(text: str) -> str:
    """Text as a markdown table cell: its pipes (MLlib's k-means||) escaped, so that they do not split it."""
    return text.replace("|", "\\|")


def page(title: str, body: str, command: str) -> str:
    """A result page: its title, the provenance table, then the bench's own markdown."""
    rows = "".join(f"| {key} | {value} |\n" for key, value in provenance(command))
    return (
        f"# {title}\n\n"
        f"Written by `{command.split()[0]} {command.split()[1]}`: run it again to replace this page, never edit it.\n\n"
        "| provenance | |\n| --- | --- |\n" + rows + "\n" + body.rstrip() + "\n"
    )


def write_page(text: str, targets: list[Path], figures: dict[str, bytes] | None = None) -> None:
    """The page to each target, with the figures it names beside it."""
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        for name, data in (figures or {}).items():
            (target.parent / name).write_bytes(data)


def command_line(command: str) -> str:
    """The command as the user typed it, for a page's header."""
    return "kfed-spark " + " ".join(sys.argv[1:]) if sys.argv[1:2] == [command] else f"kfed-spark {command}"


def headline(speed_page: str) -> str:
    """Each shape's fresh-process tables on the speed page (contenders, then ratios), under the shape and
    the commit, date and machine."""
    stamp = dict(PROVENANCE_ROW.findall(speed_page))
    parts = [f"{stamp['date']}, commit {stamp['commit']}, {stamp['machine']}:\n"]
    for section in re.split(r"^## ", speed_page, flags=re.M)[1:]:
        shape = section.splitlines()[0]
        fresh = section[section.index(FRESH_SECTION) :].split(WARM_SECTION)[0]
        parts.append(f"**{shape}**\n\n" + "\n".join(re.findall(r"(?:^\|.*\|\n)+", fresh, re.M)[:2]))
    return "\n".join(parts)


def rewritten_block(text: str, block: str, content: str) -> str:
    """text with its generated block `block` (between `<!-- BEGIN GENERATED block -->` and
    `<!-- END GENERATED block -->`) replaced by content."""
    pattern = re.compile(rf"(<!-- BEGIN GENERATED {block} -->\n).*?(<!-- END GENERATED {block} -->\n)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no generated block {block!r}")
    return pattern.sub(lambda match: match.group(1) + content + match.group(2), text)


def rewritten_readme(readme: str, speed_page: str) -> str:
    """The README with its headline block as headline() writes it from the speed page."""
    return rewritten_block(readme, "headline", headline(speed_page))


if __name__ == "__main__":
    README.write_text(rewritten_readme(README.read_text(), SPEED_PAGE.read_text()))
