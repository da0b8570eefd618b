"""The README and docs/ as a newcomer reads them: every code block runs (tests/docs_runner.py), in a
folder of its own, as the page shows it; a block that cannot run here says why; the README stays a
short page that starts with a quickstart and links to the rest."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .docs_runner import RUN, blocks

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "ARCHITECTURE.md")]


def _run(page: Path, folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.docs_runner", str(page), str(folder)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, subprocess.CompletedProcess[str]]:
    """Every page run once, two at a time (a page is one process, mostly waiting on the commands it
    starts): the pages take half the time they take one after another."""
    from concurrent.futures import ThreadPoolExecutor

    folders = {page: tmp_path_factory.mktemp(page.stem) for page in PAGES}
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(PAGES, pool.map(lambda page: _run(page, folders[page]), PAGES), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_every_code_block_of_the_page_runs(page: Path, page_runs: dict[Path, subprocess.CompletedProcess[str]]) -> None:
    ran = page_runs[page]
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    expected = sum(1 for block in blocks(page.read_text()) if block.kind in RUN and not block.not_run)
    assert f"{expected} blocks run" in ran.stdout


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_a_block_is_code_that_runs_text_or_says_why_not(page: Path) -> None:
    for block in blocks(page.read_text()):
        where = f"{page.name}:{block.line}"
        assert block.kind, f"{where}: a block says what it is (python, bash, console, text...)"
        if block.not_run is not None:
            assert block.kind in RUN and len(block.not_run) > 10, f"{where}: a block not run says why"


def test_the_readme_is_short_and_starts_with_a_quickstart() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) < 25_000
    lines = text.splitlines()
    quickstart = lines.index("## Quickstart")
    assert quickstart < 40 and "ds.loader(" in "\n".join(lines[quickstart:80])
    assert "state_dict()" in "\n".join(lines[quickstart:80])
    for link in re.findall(r"\]\(((?:docs/)[^)#]+)", text):
        assert (ROOT / link).is_file(), link


@pytest.mark.parametrize("page", [*PAGES, ROOT / "docs" / "ARCHITECTURE.md"], ids=lambda page: page.name)
def test_every_relative_link_of_a_page_resolves_from_its_folder(page: Path) -> None:
    """A link or image is read from the page's own folder: `docs/x.md` written inside docs/ (a
    README habit) pointed at docs/docs/x.md, and the contact sheet of docs/duplicates.md showed
    nothing."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # (code blocks hold no links)
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:|#", t)]
    missing = [t for t in targets if not (page.parent / t.split("#")[0]).exists()]
    assert missing == [], f"{page.name}: {missing}"


@pytest.mark.slow
def test_the_runner_fails_a_page_whose_code_is_stale(tmp_path: Path) -> None:
    """A test of the tests: a command that fails, an error line that is not what the command says,
    a Python block that raises, and a table of rows the command no longer prints each fail the page."""
    cases = {
        "command": "```console\n$ shardkit verify nowhere/\n```\n",
        "error": "```console\n$ shardkit pack --format lmbd a b\nerror: some other words\n```\n",
        "python": "```python\nfrom shardkit import open_shards\nopen_shards('nowhere/')\n```\n",
        "table": "```console\n$ shardkit doctor\n│ python │ 3 │\n│ a row doctor lost │ x │\n```\n",
    }
    for name, page in cases.items():
        path = tmp_path / f"{name}.md"
        path.write_text(page)
        folder = tmp_path / name
        folder.mkdir()
        ran = _run(path, folder)
        assert ran.returncode != 0 and f"{name}.md:1" in ran.stdout + ran.stderr, (name, ran.stdout, ran.stderr)
