"""The README and the docs as a reader meets them: a short README that starts with the two commands CI runs,
links that lead to pages, figures that come from the bench commands only. `mkdocs build --strict` (.ci/run)
checks the site's own links and navigation."""

import re
from pathlib import Path

import pytest

from helpers import DOCS, ROOT
from kfed_spark.bench.pages import PROVENANCE_ROW, README, SPEED_PAGE, rewritten_readme

pytestmark = pytest.mark.fast

GENERATED_PAGES = ("speed.md", "quality.md", "paper.md", "s3-requests.md")
"""The pages under docs/benchmarks that the bench commands write."""

COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
ISO_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def prose(text: str) -> str:
    """Hand-written markdown: without its generated blocks, code blocks and inline code (where example commands
    and run ids live)."""
    text = re.sub(r"<!-- BEGIN GENERATED (\w+) -->.*?<!-- END GENERATED \1 -->", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))


def hand_written() -> list[Path]:
    pages = [path for path in DOCS.rglob("*.md") if path.parent.name != "benchmarks" or path.name == "index.md"]
    return [README, ROOT / "CHANGELOG.md", *pages]


def test_the_readme_is_short_and_starts_with_what_it_does_and_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
    assert text.startswith("# kfed-spark\n\nOne-shot federated clustering")
    assert [line.split("#")[0].strip() for line in first_block] == [
        "pip install -e . && kfed-spark demo",
        "pip install -e '.[test]' && python -m pytest -q -n 2 --dist loadfile",
    ]
    assert first_block[1].split("#")[0].strip() in (ROOT / ".ci" / "run").read_text()  # what CI runs


def test_the_readme_s_links_lead_to_files_and_their_headings():
    text = README.read_text()
    for target in re.findall(r"\]\(([^)#]+\.md)(?:#([^)]+))?\)", text):
        path, anchor = ROOT / target[0], target[1]
        assert path.exists(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
            slugs = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, target


def test_the_readme_s_headline_is_the_speed_page_s():
    assert rewritten_readme(README.read_text(), SPEED_PAGE.read_text()) == README.read_text()


def test_the_readme_s_table_list_is_the_tables_comments():
    """After a table is added or its comment changes, `python -m kfed_spark.params_codegen` rewrites it."""
    from kfed_spark.params_codegen import rewritten_readme as with_table_list

    assert with_table_list(README.read_text()) == README.read_text()


@pytest.mark.parametrize("name", GENERATED_PAGES)
def test_every_benchmark_page_says_where_its_figures_come_from(name):
    text = (DOCS / "benchmarks" / name).read_text()
    header = dict(PROVENANCE_ROW.findall(text))
    assert len(header) == 7 and header["command"].startswith("`kfed-spark bench"), name
    assert COMMIT_HASH.search(header["commit"]) and ISO_DATE.search(header["date"]), name


def test_no_hand_written_page_carries_a_commit_or_a_date():
    """Figures that age belong to the generated pages; a hand-written page that names a commit or a day is a
    measurement copied by hand."""
    texts = {path.relative_to(ROOT).as_posix(): prose(path.read_text()) for path in hand_written()}
    found = {name: COMMIT_HASH.findall(text) + ISO_DATE.findall(text) for name, text in texts.items()}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_the_date_and_hash_checks_see_them():
    assert COMMIT_HASH.findall("at c5cd0c4, not at 1000000 or deadbeef") == ["c5cd0c4"]
    assert ISO_DATE.findall(prose("on 2026-12-01, not `run_id=2026-11-29`")) == ["2026-12-01"]
    generated = "<!-- BEGIN GENERATED headline -->\n2026-12-05, commit c5cd0c4\n<!-- END GENERATED headline -->\n"
    assert prose(generated + "measured at c5cd0c4") == "\nmeasured at c5cd0c4"
