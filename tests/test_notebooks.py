"""Every notebook in ``notebooks/`` executes from top to bottom, offline; none is skipped.

The notebooks are stored without outputs and import only the public API (``taskpilots_graph``
plus its ``testing`` and ``notebook`` modules). Each runs in a fresh kernel with the test's
temporary folder as working directory; any cell error fails the test. The exported HTML of
``04_crash_and_resume`` (``jupyter nbconvert --execute --to html``, as a reader would make it)
must show the timeline and the ledger of the crashed-then-resumed thread, and, opened in
Chromium with JupyterLab's own stylesheet, paint every timeline row in the colour of its
legend badge (JupyterLab stripes table rows with more specific selectors).
"""

from __future__ import annotations

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient
from playwright.sync_api import Route, sync_playwright

pytestmark = pytest.mark.slow

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 180
CHROMIUM = "/usr/bin/chromium"
PUBLIC_MODULES = {"taskpilots_graph", "taskpilots_graph.testing", "taskpilots_graph.notebook"}
_IMPORT = re.compile(r"^\s*(?:from|import)\s+(taskpilots_graph[\w.]*)", re.MULTILINE)


def test_all_five_notebooks_are_found() -> None:
    """The notebooks named by the docs are all there (and so all executed below)."""
    names = [p.stem for p in NOTEBOOKS]
    assert names == [
        "01_quickstart",
        "02_tool_failures",
        "03_human_takeover",
        "04_crash_and_resume",
        "05_metrics",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path) -> None:
    """Stored without outputs, importing only the public API, it runs without an error."""
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    code = [c for c in book.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "stored with outputs"
    modules = {m for c in code for m in _IMPORT.findall(c.source)}
    assert modules <= PUBLIC_MODULES, f"private imports: {sorted(modules - PUBLIC_MODULES)}"

    client = NotebookClient(
        book,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert errors == []


class _Tables(HTMLParser):
    """Collects the rows of the library's tables (by class) from a whole exported page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: list[tuple[str, list[list[str]]]] = []
        self._table: list[list[str]] | None = None
        self._cell: list[str] | None = None
        self.headings: list[str] = []
        self._heading: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag == "table" and any(c.startswith("tp-") for c in classes):
            self._table = []
            self.tables.append((classes[0], self._table))
        elif self._table is not None and tag == "tr":
            self._table.append([])
        elif self._table is not None and tag == "td":
            self._cell = []
        elif tag == "h4":
            self._heading = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._table = None
        elif tag == "td" and self._table is not None and self._cell is not None:
            self._table[-1].append("".join(self._cell))
            self._cell = None
        elif tag == "h4" and self._heading is not None:
            self.headings.append("".join(self._heading))
            self._heading = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._heading is not None:
            self._heading.append(data)


def test_exported_html_of_crash_and_resume_shows_timeline_and_ledger(tmp_path: Path) -> None:
    """``jupyter nbconvert --execute --to html`` of 04 shows the timeline and ledger tables."""
    (source,) = [p for p in NOTEBOOKS if p.stem == "04_crash_and_resume"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jupyter",
            "nbconvert",
            "--execute",
            "--to",
            "html",
            f"--ExecutePreprocessor.timeout={CELL_TIMEOUT_S}",
            "--output-dir",
            str(tmp_path),
            str(source),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    page = (tmp_path / "04_crash_and_resume.html").read_text()
    found = _Tables()
    found.feed(page)

    assert "Timeline of thread 't-crash'" in found.headings
    assert found.headings.count("Side-effect ledger of thread 't-crash'") == 2
    (timeline,) = [rows for css, rows in found.tables if css == "tp-timeline-table"]
    body = [r for r in timeline if r]
    events = [r[4] for r in body]
    assert events[0] == "agent_started"
    assert events[-1] == "agent_finished"
    assert "run_resumed" in events
    reconciled = [r for r in body if r[4] == "effect_reconciled"]
    assert len(reconciled) == 1
    assert "create_ticket" in reconciled[0][5]
    assert "done" in reconciled[0][7]
    assert events.count("tool_succeeded") == 2  # lookup before the kill, the email after

    before, after = [rows for css, rows in found.tables if css == "tp-ledger-table"]
    before, after = [r for r in before if r], [r for r in after if r]
    assert [(r[2], r[3]) for r in before] == [("create_ticket", "intended")]
    assert [(r[2], r[3]) for r in after] == [
        ("create_ticket", "committed"),
        ("send_email", "committed"),
    ]
    assert "found" in after[0][7]  # the ticket's proof is the pre-check's
    assert "<script>alert" not in page

    painted = _painted(tmp_path / "04_crash_and_resume.html")
    legend: dict[str, str] = painted["legend"]
    assert len(legend) == 11
    assert len(set(legend.values())) == 11, legend  # each state its own colour
    rows = painted["timeline"]
    assert [r["event"] for r in rows] == events
    for row in rows:
        # The whole row, every cell, is painted with its legend badge's colour: not the
        # stripe JupyterLab gives odd and even rows.
        assert set(row["cells"]) == {legend[row["state"]]}, row
        assert row["align"] == "left", row
    states = {r["event"]: r["state"] for r in rows}
    assert states["effect_reconciled"] == "tp-s-reconciled"
    assert states["run_resumed"] == "tp-s-resumed"
    assert states["agent_finished"] == "tp-s-closed"
    # The ledger's rows use the same colours: committed reads as "ok", intended as "waiting".
    ledgers = painted["ledgers"]
    assert [r["cells"] for r in ledgers[0]] == [[legend["tp-s-waiting"]] * 10]
    assert [r["cells"] for r in ledgers[1]] == [[legend["tp-s-ok"]] * 10] * 2


# What a reader sees: the background actually painted behind each cell (its own, else the
# nearest ancestor's), the legend badges' colours, and the alignment of the last column.
_PAINTED_JS = """() => {
  const painted = (el) => {
    for (let e = el; e; e = e.parentElement) {
      const bg = getComputedStyle(e).backgroundColor;
      if (bg && bg !== "rgba(0, 0, 0, 0)" && bg !== "transparent") return bg;
    }
    return null;
  };
  const state = (el) => [...el.classList].find((c) => c.startsWith("tp-s-")) || null;
  const rows = (table) => [...table.querySelectorAll("tbody tr")].map((tr) => ({
    state: state(tr),
    event: tr.children.length > 4 ? tr.children[4].textContent : null,
    cells: [...tr.children].map(painted),
    align: getComputedStyle(tr.lastElementChild).textAlign,
  }));
  const view = document.querySelector(".tp-timeline");
  const legend = {};
  for (const badge of view.querySelectorAll(".tp-legend .tp-badge")) {
    legend[state(badge)] = painted(badge);
  }
  return {
    legend,
    timeline: rows(view.querySelector("table.tp-timeline-table")),
    ledgers: [...document.querySelectorAll("table.tp-ledger-table")].map(rows),
  };
}"""


def _offline(route: Route) -> None:
    # The export links MathJax and friends from a CDN; the test runs offline.
    if route.request.url.startswith("file:"):
        route.continue_()
    else:
        route.abort()


def _painted(page_path: Path) -> dict[str, Any]:
    """Open the exported page in headless Chromium and read what it paints."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page()
            page.route("**/*", _offline)
            page.goto(page_path.as_uri(), wait_until="domcontentloaded")
            found: dict[str, Any] = page.evaluate(_PAINTED_JS)
            return found
        finally:
            browser.close()
