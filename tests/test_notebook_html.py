"""The notebook HTML views: well-formed, script-free, escaped, and saying the facts of a run.

Each view is parsed with the standard library's ``html.parser`` into a small tree: every
tag must close in order, no ``<script>`` may appear, and the tables must hold the rows
and cells of the known runs of ``_notebook_runs`` (real SQLite file, scripted model).
The takeover widget is driven by clicking its buttons from code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser

import pytest
from _notebook_runs import SCRIPT_RESULT, Runs, build_runs
from langgraph.checkpoint.memory import InMemorySaver

import taskpilots_graph as tp
from taskpilots_graph import notebook
from taskpilots_graph.errors import InvalidDecision, NoPendingTakeover, ThreadNotFound
from taskpilots_graph.replay import replay

VOID = {"br", "hr", "img", "meta", "link", "input", "col", "wbr"}


@dataclass
class Node:
    tag: str
    attrs: dict[str, str] = field(default_factory=dict)
    content: list[Node | str] = field(default_factory=list)  # text and children, in order

    @property
    def children(self) -> list[Node]:
        return [c for c in self.content if isinstance(c, Node)]

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def all_text(self) -> str:
        return "".join(c if isinstance(c, str) else c.all_text() for c in self.content)

    def walk(self) -> Iterator[Node]:
        yield self
        for child in self.children:
            yield from child.walk()

    def find_all(self, tag: str, cls: str | None = None) -> list[Node]:
        return [n for n in self.walk() if n.tag == tag and (cls is None or cls in n.classes)]

    def find(self, tag: str, cls: str | None = None) -> Node:
        (found,) = self.find_all(tag, cls)
        return found


class _Tree(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#root")
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].content.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        assert tag not in VOID, f"end tag for void element <{tag}>"
        assert self.stack[-1].tag == tag, f"</{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.stack[-1].content.append(data)


def parse(html: str) -> Node:
    """Parse ``html`` and check it is well formed and free of scripts."""
    tree = _Tree()
    tree.feed(html)
    tree.close()
    assert tree.stack == [tree.root], f"unclosed tags: {[n.tag for n in tree.stack[1:]]}"
    tags = {n.tag for n in tree.root.walk()}
    assert "script" not in tags
    assert not any(k.startswith("on") for n in tree.root.walk() for k in n.attrs)
    return tree.root


def rows(table: Node) -> list[list[str]]:
    return [
        [td.all_text() for td in tr.find_all("td")] for tr in table.find("tbody").find_all("tr")
    ]


def header(table: Node) -> list[str]:
    return [th.all_text() for th in table.find("thead").find_all("th")]


@pytest.fixture
def runs(sqlite_path: str) -> Iterator[Runs]:
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as cp:
        cp.setup()
        yield build_runs(cp)


def test_timeline_lists_every_event_with_its_state(runs: Runs) -> None:
    """The timeline of a retried run has one coloured row per event, failures in red."""
    view = notebook.timeline(runs.cp, "t-retry")
    root = parse(view._repr_html_())
    table = root.find("table", "tp-timeline-table")
    assert header(table) == [
        "#",
        "time",
        "+s",
        "actor",
        "event",
        "tool",
        "attempt",
        "what happened",
    ]
    body = rows(table)
    assert len(body) == len(runs.cp.events("t-retry")) == 19
    events = [r[4] for r in body]
    assert events.count("tool_failed") == 2
    assert events.count("retry_scheduled") == 2
    assert events[-1] == "agent_finished"
    failed = table.find("tbody").find_all("tr", "tp-s-failed")
    assert [r.find_all("td")[4].all_text() for r in failed] == ["tool_failed", "tool_failed"]
    assert len(table.find("tbody").find_all("tr", "tp-s-waiting")) == 2
    assert len(table.find("tbody").find_all("tr", "tp-s-closed")) == 1
    summary = root.find("div", "tp-summary").all_text()
    assert "status closed" in summary
    assert "4 tool calls, 2 failures, 2 retries" in summary
    assert view.states.count("failed") == 2


def test_tool_result_with_script_is_shown_escaped(runs: Runs) -> None:
    """A tool result holding ``<script>`` reads as text in the timeline and the ledger."""
    for html in (
        notebook.timeline(runs.cp, "t-retry")._repr_html_(),
        notebook.ledger_view(runs.cp, "t-retry")._repr_html_(),
    ):
        assert "<script>" not in html
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
        assert SCRIPT_RESULT in parse(html).all_text()


def test_timeline_marks_degradation_takeover_and_resume(runs: Runs) -> None:
    """Degradation, the takeover and the decision's resume get their own colours."""
    degraded = parse(notebook.timeline(runs.cp, "t-degrade")._repr_html_())
    (row,) = degraded.find("tbody").find_all("tr", "tp-s-degraded")
    assert "degraded to fallback kb_backup" in row.all_text()

    waiting = notebook.timeline(runs.cp, "t-takeover")
    assert waiting.status == "awaiting_human"
    root = parse(waiting._repr_html_())
    assert "status awaiting_human" in root.find("div", "tp-summary").all_text()
    assert len(root.find("tbody").find_all("tr", "tp-s-uncertain")) == 1
    assert len(root.find("tbody").find_all("tr", "tp-s-human")) == 1

    tp.decide(runs.takeover_graph, "t-takeover", tp.Decision(action="skip"))
    after = notebook.timeline(runs.cp, "t-takeover")
    root = parse(after._repr_html_())
    assert after.status == "closed"
    assert after.count("run_resumed") == 1
    assert len(root.find("tbody").find_all("tr", "tp-s-resumed")) >= 1
    assert len(root.find("tbody").find_all("tr", "tp-s-human")) == 2  # asked, decided


def test_timeline_repr_is_plain_text(runs: Runs) -> None:
    """``repr`` says the same facts without markup."""
    text = repr(notebook.timeline(runs.cp, "t-retry"))
    first = text.splitlines()[0]
    assert first == (
        "Timeline('t-retry', status='closed', 19 events, 4 tool calls, 2 failures, "
        "0 takeovers, 0 resumes)"
    )
    assert "retry of kb_search scheduled" in text
    assert "<" not in first


def test_ledger_view_shows_keys_status_and_proof(runs: Runs) -> None:
    """The ledger table has one row per effect with its key, status and attempt."""
    view = notebook.ledger_view(runs.cp)
    entries = runs.cp.ledger(None)
    assert len(view) == len(entries) == 3  # create_ticket, reserve, charge
    root = parse(view._repr_html_())
    table = root.find("table", "tp-ledger-table")
    assert header(table) == [
        "key",
        "thread",
        "tool",
        "status",
        "attempt",
        "arguments",
        "result",
        "proof",
        "error",
        "updated",
    ]
    body = {r[2]: r for r in rows(table)}
    assert set(body) == {"create_ticket", "reserve", "charge"}
    for entry in entries:
        assert body[entry.tool][0] == entry.key
        assert body[entry.tool][3] == entry.status.value
    assert body["charge"][3] == "uncertain"
    assert "TimeoutError" in body["charge"][8]
    (uncertain,) = table.find("tbody").find_all("tr", "tp-s-uncertain")
    assert "charge" in uncertain.all_text()
    assert "3 entries" in root.find("div", "tp-summary").all_text()
    assert view.by_status() == {"committed": 2, "uncertain": 1}
    assert "uncertain   charge key=" in repr(view)


def test_takeover_request_shows_done_uncertain_and_options(runs: Runs) -> None:
    """A takeover names the uncertain effect, what is committed and what each option does."""
    (request,) = tp.pending_takeovers(runs.cp)
    root = parse(request._repr_html_())
    text = root.all_text()
    assert "Takeover requested on thread 't-takeover'" in text
    (uncertain,) = runs.cp.ledger("t-takeover")[1:]
    assert uncertain.status is tp.LedgerStatus.UNCERTAIN
    tables = root.find_all("table")
    uncertain_rows = [
        r
        for t in tables
        for r in t.find_all("tr", "tp-s-uncertain")
        if uncertain.key in r.all_text()
    ]
    assert len(uncertain_rows) == 1
    committed = [r.all_text() for t in tables for r in t.find_all("tr", "tp-s-ok")]
    assert any("reserve" in c for c in committed)
    options = root.find("table", "tp-options")
    assert [r[0] for r in rows(options)] == list(request.options)
    assert len(rows(options)) == 5
    assert all(r[1] for r in rows(options))
    head = {r[0]: r[1] for r in rows(root.find("table", "tp-takeover-head"))}
    assert head["goal"] == "reserve A, then charge C"
    assert head["failure"].startswith("side_effect_uncertain")


def test_metrics_show_the_four_figures_and_tools(runs: Runs) -> None:
    """The metrics view has the four headline figures, runs by status and per-tool rows."""
    metrics = tp.recovery_metrics(runs.cp)
    root = parse(metrics._repr_html_())
    headline = rows(root.find("table", "tp-metrics-table"))
    assert [r[0] for r in headline] == [
        "local recovery success rate",
        "duplicate side-effect rate",
        "mean time to close after a tool failure",
        "human takeovers per 100 runs",
    ]
    assert headline[0][1] == "100.0%"  # both settled failed steps recovered; one pending
    assert headline[1][1] == "0.0%"
    assert headline[3][1] == "33.3"  # 1 takeover over 3 runs
    runs_row = rows(root.find("table", "tp-runs"))[0]
    assert runs_row == ["3", "0", "0", "1", "2", "0"]
    tools = {r[0]: r for r in rows(root.find("table", "tp-tools"))}
    assert set(tools) == {"charge", "create_ticket", "kb_backup", "kb_search", "reserve"}
    assert tools["kb_search"][1:2] == ["4"]
    assert tools["kb_search"][2] == "external_outage: 1, transient: 2"
    assert tools["kb_search"][4] == "1"  # one degradation


def test_thread_info_and_replay_render(runs: Runs) -> None:
    """ThreadInfo and Replay show as HTML too."""
    info = parse(tp.thread_info(runs.cp, "t-takeover")._repr_html_())
    fields = {r[0]: r[1] for r in rows(info.find("table", "tp-thread-table"))}
    assert fields["status"] == "awaiting_human"
    assert fields["takeover pending"] == "yes"
    replayed = parse(replay(runs.cp, "t-retry")._repr_html_())
    assert len(rows(replayed.find("table", "tp-timeline-table"))) == 19


def test_async_views_match_sync(runs: Runs, sqlite_path: str) -> None:
    """``atimeline`` / ``aledger_view`` read the same as their sync forms."""

    async def read() -> tuple[notebook.Timeline, notebook.LedgerView]:
        url = f"sqlite:///{sqlite_path}"
        async with tp.AsyncRecoveryCheckpointer.from_conn_string(url) as acp:
            return await notebook.atimeline(acp, "t-retry"), await notebook.aledger_view(acp)

    timeline, ledger = asyncio.run(read())
    assert timeline == notebook.timeline(runs.cp, "t-retry")
    assert ledger == notebook.ledger_view(runs.cp)


def test_bad_input_raises_typed_errors(runs: Runs) -> None:
    """An unknown thread or a plain LangGraph saver gives the library's typed errors."""
    with pytest.raises(ThreadNotFound):
        notebook.timeline(runs.cp, "no-such-thread")
    with pytest.raises(tp.ConfigurationError):
        notebook.timeline(InMemorySaver(), "t-retry")
    with pytest.raises(tp.ConfigurationError):
        notebook.ledger_view(InMemorySaver())


def test_widget_decides_on_click_and_refuses_twice(runs: Runs) -> None:
    """One button per option; a click calls decide; a refused click changes nothing."""
    (request,) = tp.pending_takeovers(runs.cp)
    widget = notebook.takeover_widget(runs.takeover_graph, request, decided_by="ana")
    assert list(widget.buttons) == list(request.options)
    assert "Takeover requested" in widget.widget.children[0].value

    assert widget.click("provide_result") is None  # empty text box: refused
    assert isinstance(widget.error, InvalidDecision)
    assert "Refused" in widget.status.value
    assert tp.thread_info(runs.cp, "t-takeover").status == "awaiting_human"

    widget.buttons["skip"].click()
    assert widget.decision is not None
    assert widget.decision.action == "skip"
    assert tp.thread_info(runs.cp, "t-takeover").status == "closed"
    assert all(b.disabled for b in widget.buttons.values())
    decided = [e for e in runs.cp.events("t-takeover") if e.kind is tp.EventKind.DECISION_RECORDED]
    assert [e.payload["decided_by"] for e in decided] == ["ana"]

    assert widget.click("skip") is None  # answered already: nothing waits any more
    assert isinstance(widget.error, NoPendingTakeover)
    assert "decided skip" in repr(widget)


def test_drifted_result_is_shown_with_both_values() -> None:
    """A takeover about a drifted result shows the previous and current values, escaped."""
    request = tp.TakeoverRequest(
        thread_id="t-drift",
        reason="quote changed after a retry",
        options={"accept": "keeps the new result", "abandon": "undoes committed effects"},
        drift={
            "tool": "get_quote",
            "previous": {"price": 10},
            "current": {"price": 12, "note": "<b>new</b>"},
            "difference": ["price: 10 -> 12"],
        },
    )
    root = parse(request._repr_html_())
    fields = {r[0]: r[1] for r in rows(root.find("table", "tp-drift"))}
    assert fields["tool"] == "get_quote"
    assert fields["previous"] == '{"price": 10}'
    assert fields["current"] == '{"note": "<b>new</b>", "price": 12}'  # text, not markup
    assert all(b.all_text() != "new" for b in root.find_all("b"))
    assert fields["difference"] == "price: 10 -> 12"
    assert [r[0] for r in rows(root.find("table", "tp-options"))] == ["accept", "abandon"]


def test_retry_on_a_virtual_clock_of_its_own_prints_no_foreign_date(runs: Runs) -> None:
    """``t-retry`` ran on ``testing.fake_clock()`` (a fixed day in 2023): its retry rows say
    the due time is on the engine's own clock instead of printing that date beside today's
    log times, in the table and in ``repr``."""
    view = notebook.timeline(runs.cp, "t-retry")
    table = parse(view._repr_html_()).find("table", "tp-timeline-table")
    retries = [r[7] for r in rows(table) if r[4] == "retry_scheduled"]
    assert len(retries) == 2
    assert all("engine's own (virtual) clock" in text for text in retries), retries
    for shown in (view._repr_html_(), repr(view)):
        assert "2023-" not in shown


def test_retry_due_time_reads_as_a_time_and_an_offset_of_its_row(sqlite_path: str) -> None:
    """On a clock that starts at the real time (real, or the notebooks' virtual one), a
    retry row gives its due time in the time column's format and how long after the row it
    falls: the backoff."""
    import re
    import time
    from datetime import datetime

    from langchain_core.tools import tool

    from taskpilots_graph import testing

    @tool
    def kb_search(query: str) -> str:
        """Search."""
        return "article"

    flaky = testing.failing(kb_search, times=1, exc=TimeoutError("read timed out"))
    policy = tp.ToolPolicy(max_attempts=3, backoff=tp.Backoff(initial=2.0, jitter=False))
    with tp.RecoveryCheckpointer.from_conn_string(f"sqlite:///{sqlite_path}") as cp:
        cp.setup()
        graph = tp.create_recovery_agent(
            testing.ScriptedModel(plan=[("kb_search", {"query": "refund"})]),
            [flaky.tool],
            checkpointer=cp,
            policies={"kb_search": policy},
        )
        with testing.fake_clock(start=time.time()) as clock:
            tp.run(graph, "t-1", {"messages": [("user", "find it")]})
        view = notebook.timeline(cp, "t-1")
    assert clock.slept == [2.0]
    table = parse(view._repr_html_()).find("table", "tp-timeline-table")
    ((logged, text),) = [(r[1], r[7]) for r in rows(table) if r[4] == "retry_scheduled"]
    found = re.fullmatch(
        r"retry of kb_search due (\d\d:\d\d:\d\d\.\d{3}), \+(\d+\.\d{3}) s after this row \(.*\)",
        text,
    )
    assert found is not None, text
    due, ahead = found.groups()
    assert 1.0 < float(ahead) <= 2.0  # the 2 s backoff, less the time the run took to log it
    # Same clock, same format: the due time is the row's time plus the offset shown.
    gap = datetime.strptime(due, "%H:%M:%S.%f") - datetime.strptime(logged, "%H:%M:%S.%f")
    assert abs(gap.total_seconds() % 86_400 - float(ahead)) < 0.002
    assert f"due {due}" in repr(view)
