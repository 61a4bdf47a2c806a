"""Fault drills against any graph: the three drills of the source documents plus a crash.

Before production, a graph should show that it recovers locally and never repeats an
effect. :func:`run_drills` takes a graph given as ``"module:attribute"`` (a factory taking
the checkpointer, see :func:`~taskpilots_graph.config.load_graph`), runs it once without
faults (the *baseline*), then once per drill on a fresh thread with a fault injected into
one of its tools:

* **transient**: a tool fails twice with a timeout (a pure tool if there is one), then
  works: only that step may run again;
* **outage after effect**: the first side effect commits, then the next tool is down for
  three calls: nothing already done may run again;
* **long outage**: a tool stays down: the run must settle (degraded, waiting on a person
  or failed) within a bounded number of resumes, never replay endlessly;
* **crash**: a child process is SIGKILLed right after the first side effect ran, and a
  fresh process resumes the thread by id: the effect must not run a second time.

The drills run the graph's tools many times, so only a factory marked with
:func:`drill_graph` (built on test doubles) is accepted, unless ``real_effects=True``.
Faults come from :mod:`taskpilots_graph.testing` and a virtual clock (backoffs take no
time). Every tool is wrapped to journal each completed execution to a SQLite file of its
own, outside the agent's database and process, so a crash cannot hide a repeat. An
execution of a side-effecting tool beyond what the baseline did with the same arguments is
a **duplicate**; a re-execution of an ``idempotent`` tool under the same invocation key is
reported apart (safe only if the service dedups by that key). Side-effecting tools are
those declared with ``@side_effect``, or every tool if the graph declares none (a plain
LangGraph graph), or the ``effect_tools`` given. Tools are found in the recovery executor
and in LangGraph ``ToolNode`` nodes. A thread is driven by :mod:`taskpilots_graph.drill_runs`
and judged by :mod:`taskpilots_graph.drill_verdicts`.
"""

from __future__ import annotations

import os
import signal
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from taskpilots_graph.config import GraphRef, load_graph
from taskpilots_graph.drill_journal import Journal, Wrap
from taskpilots_graph.drill_runs import child_drive, drive, in_child, last_line
from taskpilots_graph.drill_verdicts import Baseline, DrillResult, DrillsReport, verdict
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.tool_tables import graph_tools

__all__ = ["DEFAULT_INPUT", "drill_graph", "is_drill_graph", "run_drills"]

DEFAULT_INPUT: dict[str, Any] = {"messages": [{"role": "user", "content": "Run the drill task."}]}
"""What each drill thread is started with, unless ``input`` is given."""

DRILL_MARK = "__taskpilots_drill_graph__"
"""The attribute :func:`drill_graph` sets on a factory."""

_Drill = tuple[str, str | None, Wrap, tuple[str, ...]]  # name, tool, fault, settled states


# -- loading a graph ---------------------------------------------------------------------------

_Factory = TypeVar("_Factory", bound=Callable[..., Any])


def drill_graph(factory: _Factory) -> _Factory:
    """Declare that ``factory`` builds its graph on test doubles, so drills may run it.

    The drills call every tool of the graph many times, with faults in between; nothing
    checks what a tool does, so the factory's author says it: the tools are fakes (for
    example :mod:`taskpilots_graph.testing`, or a service stub writing to a local file).
    ``taskpilots drill`` refuses an unmarked factory unless ``--real-effects`` is given.

    Example::

        @drill_graph
        def make_drill_graph(checkpointer):
            return tp.create_recovery_agent(model, fake_tools, checkpointer=checkpointer)

        is_drill_graph(make_drill_graph)  # True
    """
    setattr(factory, DRILL_MARK, True)
    return factory


def is_drill_graph(target: Any) -> bool:
    """``target`` was marked with :func:`drill_graph`."""
    return getattr(target, DRILL_MARK, False) is True


# -- the drills --------------------------------------------------------------------------------


def _baseline(
    ref: GraphRef, cp: Any, journal: Journal, input_: Any, effect_tools: Any, run: str
) -> Baseline:
    from taskpilots_graph.tools import spec_of

    thread_id = f"drill-{run}-baseline"
    graph = ref.build(cp)
    tools = graph_tools(graph)
    if effect_tools:
        if unknown := sorted(set(effect_tools) - set(tools)):
            raise ConfigurationError(f"the graph has no tool(s) {', '.join(unknown)}")
        effects = frozenset(effect_tools)
    else:
        declared = {n for n, t in tools.items() if spec_of(t) is not None}
        effects = frozenset(declared or tools)
    idempotent = frozenset(n for n, t in tools.items() if (s := spec_of(t)) and s.idempotent)
    done, _ = drive(graph, journal, thread_id, input_)
    if done.settled != "closed" or done.errors:
        why = done.errors[-1] if done.errors else f"it ended {done.settled}"
        raise ConfigurationError(f"the graph does not finish cleanly without faults: {why}")
    return Baseline(tuple(journal.executions(thread_id)), effects, idempotent)


def _fault_drill(
    ref: GraphRef, cp: Any, journal: Journal, input_: Any, base: Baseline, run: str, drill: _Drill
) -> DrillResult:
    name, tool, fault, ok_states = drill
    thread_id = f"drill-{run}-{name.replace('_', '-')}"
    if tool is None:
        return DrillResult(name, "skipped", "the baseline run gave it no tool to act on", thread_id)
    done, faults = drive(ref.build(cp), journal, thread_id, input_, fault=(tool, fault))
    runs = journal.executions(thread_id)
    extra = ""
    if name == "transient":
        # Only the failed step may run again: every other execution matches the baseline.
        others = Counter((t, a) for t, a, _ in runs if t != tool)
        expected = Counter({k: v for k, v in base.count().items() if k[0] != tool})
        if done.settled == "closed" and others != expected:
            extra = "other steps ran again besides the failed one"
        if done.settled == "closed" and faults[tool].calls < 3:
            extra = extra or f"{tool} was not retried"
    return verdict(name, thread_id, tool, done, base, runs, ok_states=ok_states, extra=extra)


def _first_pure(base: Baseline) -> str | None:
    """The first tool without side effects the baseline ran, else its first tool."""
    tools = base.tools()
    return next((t for t in tools if t not in base.effects), tools[0] if tools else None)


def _after_first_effect(base: Baseline) -> str | None:
    """The tool the baseline ran right after its first side effect, if any."""
    tools = base.tools()
    first = next((i for i, tool in enumerate(tools) if tool in base.effects), len(tools))
    return tools[first + 1] if first + 1 < len(tools) else None


def _plan(base: Baseline) -> list[_Drill]:
    """The fault drills: name, the tool to fault, the fault, the states the run may end in."""
    from taskpilots_graph import testing

    down, timeout = partial(ConnectionRefusedError, "drill: down"), partial(TimeoutError, "drill")
    settles = ("closed", "awaiting_human", "failed")
    pure, after = _first_pure(base), _after_first_effect(base)
    return [
        ("transient", pure, partial(testing.failing, times=2, exc=timeout), ("closed",)),
        ("outage_after_effect", after, partial(testing.failing, times=3, exc=down), settles),
        ("long_outage", pure, partial(testing.down_for, seconds=10.0**9, exc=down), settles),
    ]


def _crash_drill(
    ref: GraphRef, conn: str, journal: Journal, input_: Any, base: Baseline, run: str
) -> DrillResult:
    thread_id = f"drill-{run}-crash"
    target = next((t for t in base.tools() if t in base.effects), None)
    if target is None:
        return DrillResult("crash", "skipped", "the baseline ran no side effect", thread_id)
    first = in_child(ref.spec, conn, journal, thread_id, input_, kill_after=target)
    if first.returncode != -signal.SIGKILL:
        detail = f"the run did not reach {target} again ({last_line(first)})"
        return DrillResult("crash", "failed", detail, thread_id, target)
    done = child_drive(in_child(ref.spec, conn, journal, thread_id, input_, kill_after=None))
    runs = journal.executions(thread_id)
    ok_states = ("closed", "awaiting_human")
    return verdict("crash", thread_id, target, done, base, runs, ok_states=ok_states)


def run_drills(
    graph: str,
    *,
    input: Any = None,
    workdir: str | os.PathLike[str] | None = None,
    effect_tools: Sequence[str] | None = None,
    crash: bool = True,
    on_drill: Callable[[str], None] | None = None,
    real_effects: bool = False,
) -> DrillsReport:
    """Run the fault drills and the crash drill against ``graph``; report each verdict.

    Example:
        >>> report = run_drills("myapp.agent:make_graph")  # doctest: +SKIP
        >>> report.passed, report.duplicates  # doctest: +SKIP
        (True, 0)

    Args:
        graph: ``module:attribute`` of a factory taking the checkpointer.
        input: What each drill thread starts with (default :data:`DEFAULT_INPUT`).
        workdir: Keep the drill databases there (default: a temporary folder, removed).
        effect_tools: Count these tools as side effects (default: the ``@side_effect``
            tools, or every tool when the graph declares none).
        crash: Also run the crash drill (two child processes).
        on_drill: Called with each drill's name before it starts (progress display).
        real_effects: Drill a factory not marked :func:`drill_graph`, whose tools may
            reach real services (the drills perform their side effects many times).

    Raises:
        ConfigurationError: The graph cannot be loaded, is not a factory taking the
            checkpointer, is neither marked :func:`drill_graph` nor allowed real effects,
            or does not finish cleanly without faults.
    """
    from taskpilots_graph.checkpointers import RecoveryCheckpointer
    from taskpilots_graph.metrics import recovery_metrics

    ref = load_graph(graph)
    if not ref.takes_checkpointer:
        raise ConfigurationError(
            f"drills run on a database of their own: make {graph} a factory taking the "
            "checkpointer, e.g. def make_graph(checkpointer): ..."
        )
    marked = is_drill_graph(ref.target)
    if not marked and not real_effects:
        raise ConfigurationError(
            f"{graph} is not marked as building its tools on test doubles, so the drills "
            "would call its real services (real tickets, e-mails, refunds, many times); "
            "build the graph on fakes in a factory decorated with "
            "@taskpilots_graph.drills.drill_graph, or pass --real-effects "
            "(real_effects=True) to drill real services on purpose"
        )
    input_ = DEFAULT_INPUT if input is None else input
    # Thread ids of their own per call: a kept workdir can be drilled again.
    run = uuid.uuid4().hex[:8]
    notify = on_drill or (lambda _name: None)
    with tempfile.TemporaryDirectory(prefix="taskpilots-drill-") as tmp:
        folder = Path(workdir) if workdir is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        conn = f"sqlite:///{(folder / 'drill-runs.db').resolve()}"
        journal = Journal(folder / "drill-executions.db")
        with RecoveryCheckpointer.from_conn_string(conn) as cp:
            cp.setup()
            notify("baseline")
            base = _baseline(ref, cp, journal, input_, effect_tools, run)
            results = []
            for drill in _plan(base):
                notify(drill[0])
                results.append(_fault_drill(ref, cp, journal, input_, base, run, drill))
            if crash:
                notify("crash")
                results.append(_crash_drill(ref, conn, journal, input_, base, run))
            threads = [f"drill-{run}-baseline", *(r.thread_id for r in results)]
            metrics = recovery_metrics(cp, thread_ids=threads).as_dict()
    return DrillsReport(
        graph=graph,
        baseline=tuple(base.tools()),
        results=tuple(results),
        metrics=metrics,
        database=conn if workdir is not None else "(temporary)",
        real_effects=not marked,
    )
