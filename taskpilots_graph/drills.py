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
and in LangGraph ``ToolNode`` nodes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar

from langchain_core.runnables import RunnableConfig

from taskpilots_graph.config import GraphRef, load_graph
from taskpilots_graph.drill_journal import Journal, Wrap, instrumented
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.tool_tables import graph_tools

__all__ = [
    "DEFAULT_INPUT",
    "DrillResult",
    "DrillsReport",
    "drill_graph",
    "is_drill_graph",
    "run_drills",
]

DEFAULT_INPUT: dict[str, Any] = {"messages": [{"role": "user", "content": "Run the drill task."}]}
"""What each drill thread is started with, unless ``input`` is given."""

MAX_ROUNDS = 12
"""Resumes a drill allows before it calls the run an endless replay."""

DRILL_MARK = "__taskpilots_drill_graph__"
"""The attribute :func:`drill_graph` sets on a factory."""

CHILD_TIMEOUT_S = 180.0
RUN_CONFIG: RunnableConfig = {"recursion_limit": 200}
Outcome = Literal["passed", "failed", "skipped"]


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


# -- driving a thread --------------------------------------------------------------------------


def _settled(graph: Any, thread_id: str) -> str:
    snapshot = graph.get_state({"configurable": {"thread_id": thread_id}})
    if snapshot.interrupts:
        return "awaiting_human"
    flow = snapshot.values.get("flow") if isinstance(snapshot.values, dict) else None
    if isinstance(flow, dict) and flow.get("stage"):
        return str(flow["stage"])
    return "running" if (snapshot.next or snapshot.tasks) else "closed"


@dataclass
class _Drive:
    settled: str
    resumes: int = 0
    errors: list[str] = field(default_factory=list)


def _drive(graph: Any, thread_id: str, input_: Any, clock: Any, *, start: bool) -> _Drive:
    """Run (or resume) a thread as an operator would until it settles or looks endless.

    A ``ToolWaiting`` run is resumed once its ``retry_at`` has passed on the virtual clock;
    a run that raised is resumed by id, as after any failure; a takeover stops the drive.
    """
    from taskpilots_graph import runner
    from taskpilots_graph.errors import PendingTakeover, ThreadNotFound, ToolWaiting

    drive = _Drive(settled="running")
    for round_ in range(MAX_ROUNDS + 1):
        try:
            if start and round_ == 0:
                runner.run(graph, thread_id, input_, config=RUN_CONFIG)
            else:
                drive.resumes += 1
                runner.resume(graph, thread_id, config=RUN_CONFIG)
        except ToolWaiting as waiting:
            clock.advance(max(0.0, waiting.retry_at - clock.now()))
            continue
        except PendingTakeover:
            drive.settled = "awaiting_human"
            return drive
        except ThreadNotFound:
            drive.settled = "lost"
            drive.errors.append("no checkpoint to resume: the run would restart from its entry")
            return drive
        except ConfigurationError:
            raise  # the graph is set up wrongly: no drill can say anything about it
        except Exception as exc:  # the user's graph failed: resume it, as an operator would
            drive.errors.append(f"{type(exc).__name__}: {exc}")
            continue
        drive.settled = _settled(graph, thread_id)
        if drive.settled != "running":
            return drive
    drive.settled = "endless"
    return drive


# -- the verdicts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrillResult:
    """The verdict of one drill.

    Attributes:
        name: ``transient``, ``outage_after_effect``, ``long_outage`` or ``crash``.
        outcome: ``passed``, ``failed`` or ``skipped`` (the baseline gave it nothing to
            act on, e.g. no tool was called).
        detail: One line saying what happened.
        thread_id: The drill's thread (look at it with ``taskpilots show``).
        tool: The tool the fault was injected into.
        settled: Where the run ended: ``closed``, ``awaiting_human``, ``failed``,
            ``endless`` (still not settled after the allowed resumes), ``lost`` ...
        duplicates: Side-effect executions beyond the baseline's.
        keyed_reruns: Re-executions of idempotent tools under the same invocation key.
    """

    name: str
    outcome: Outcome
    detail: str
    thread_id: str
    tool: str | None = None
    settled: str | None = None
    duplicates: int = 0
    keyed_reruns: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


@dataclass(frozen=True)
class DrillsReport:
    """Every drill's verdict, and the recovery metrics of the drill threads.

    Attributes:
        graph: The ``module:attribute`` drilled.
        baseline: The tools the fault-free run executed, in order.
        results: One :class:`DrillResult` per drill.
        metrics: ``recovery_metrics(...).as_dict()`` over the drill threads.
        database: Where the drill runs are stored (kept only with ``workdir=``).
        real_effects: The graph was not marked :func:`drill_graph`: its tools may have
            reached real services (``real_effects=True`` was given).
    """

    graph: str
    baseline: tuple[str, ...]
    results: tuple[DrillResult, ...]
    metrics: dict[str, Any]
    database: str
    real_effects: bool = False

    @property
    def passed(self) -> bool:
        """No drill failed."""
        return all(r.outcome != "failed" for r in self.results)

    @property
    def duplicates(self) -> int:
        """Duplicate side effects over all drills."""
        return sum(r.duplicates for r in self.results)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "graph": self.graph,
            "passed": self.passed,
            "duplicates": self.duplicates,
            "baseline": list(self.baseline),
            "drills": [r.as_dict() for r in self.results],
            "metrics": self.metrics,
            "database": self.database,
            "real_effects": self.real_effects,
        }


@dataclass(frozen=True)
class _Baseline:
    calls: tuple[tuple[str, str, str | None], ...]
    effects: frozenset[str]
    idempotent: frozenset[str]

    def tools(self) -> list[str]:
        return [t for t, _, _ in self.calls]

    def count(self) -> Counter[tuple[str, str]]:
        return Counter((t, a) for t, a, _ in self.calls)


def _repeats(base: _Baseline, runs: list[tuple[str, str, str | None]]) -> tuple[int, int, str]:
    """(duplicates, keyed re-runs, description) of a drill thread's effect executions."""
    expected = base.count()
    seen: Counter[tuple[str, str]] = Counter()
    keys_seen: set[tuple[str, str | None]] = set()
    duplicates = keyed = 0
    named: list[str] = []
    for tool, args, key in runs:
        if tool not in base.effects:
            continue
        seen[(tool, args)] += 1
        if seen[(tool, args)] <= expected[(tool, args)]:
            keys_seen.add((tool, key))
            continue
        if tool in base.idempotent and key is not None and (tool, key) in keys_seen:
            keyed += 1  # the same idempotency key: the service is trusted to dedup it
            continue
        duplicates += 1
        named.append(f"{tool}{args}")
    text = f"repeated {', '.join(named)}" if named else ""
    return duplicates, keyed, text


def _verdict(
    name: str,
    thread_id: str,
    tool: str | None,
    drive: _Drive,
    base: _Baseline,
    runs: list[tuple[str, str, str | None]],
    *,
    ok_states: tuple[str, ...],
    extra: str = "",
) -> DrillResult:
    duplicates, keyed, repeated = _repeats(base, runs)
    problems = [p for p in (repeated, extra) if p]
    if drive.settled not in ok_states:
        last = f" (last error: {drive.errors[-1]})" if drive.errors else ""
        problems.append(f"ended {drive.settled} after {drive.resumes} resume(s){last}")
    outcome: Outcome = "failed" if problems else "passed"
    detail = "; ".join(problems) or (
        f"ended {drive.settled} after {drive.resumes} resume(s), nothing repeated"
        + (f", {keyed} keyed re-run(s) left to the service" if keyed else "")
    )
    return DrillResult(name, outcome, detail, thread_id, tool, drive.settled, duplicates, keyed)


# -- the drills --------------------------------------------------------------------------------


def _baseline(
    ref: GraphRef, cp: Any, journal: Journal, input_: Any, effect_tools: Any, run: str
) -> _Baseline:
    from taskpilots_graph import testing
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
    with instrumented(graph, journal, thread_id), testing.fake_clock() as clock:
        drive = _drive(graph, thread_id, input_, clock, start=True)
    if drive.settled != "closed" or drive.errors:
        why = drive.errors[-1] if drive.errors else f"it ended {drive.settled}"
        raise ConfigurationError(f"the graph does not finish cleanly without faults: {why}")
    return _Baseline(tuple(journal.executions(thread_id)), effects, idempotent)


def _fault_drill(
    name: str,
    ref: GraphRef,
    cp: Any,
    journal: Journal,
    input_: Any,
    base: _Baseline,
    tool: str | None,
    fault: Wrap,
    ok_states: tuple[str, ...],
    run: str,
) -> DrillResult:
    from taskpilots_graph import testing

    thread_id = f"drill-{run}-{name.replace('_', '-')}"
    if tool is None:
        return DrillResult(name, "skipped", "the baseline run gave it no tool to act on", thread_id)
    graph = ref.build(cp)
    with (
        instrumented(graph, journal, thread_id, fault=(tool, fault)) as faults,
        testing.fake_clock() as clock,
    ):
        drive = _drive(graph, thread_id, input_, clock, start=True)
    runs = journal.executions(thread_id)
    extra = ""
    if name == "transient":
        # Only the failed step may run again: every other execution matches the baseline.
        others = Counter((t, a) for t, a, _ in runs if t != tool)
        expected = Counter({k: v for k, v in base.count().items() if k[0] != tool})
        if drive.settled == "closed" and others != expected:
            extra = "other steps ran again besides the failed one"
        if drive.settled == "closed" and faults[tool].calls < 3:
            extra = extra or f"{tool} was not retried"
    return _verdict(name, thread_id, tool, drive, base, runs, ok_states=ok_states, extra=extra)


def _first_pure(base: _Baseline) -> str | None:
    """The first tool without side effects the baseline ran, else its first tool."""
    tools = base.tools()
    return next((t for t in tools if t not in base.effects), tools[0] if tools else None)


def _after_first_effect(base: _Baseline) -> str | None:
    tools = base.tools()
    for i, tool in enumerate(tools):
        if tool in base.effects:
            return tools[i + 1] if i + 1 < len(tools) else None
    return None


def _child(payload: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # The child imports the user's module exactly as this process can.
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    return subprocess.run(
        [sys.executable, "-m", "taskpilots_graph.drills", json.dumps(payload)],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )


def _crash_drill(
    ref: GraphRef, conn: str, journal: Journal, input_: Any, base: _Baseline, run: str
) -> DrillResult:
    thread_id = f"drill-{run}-crash"
    target = next((t for t in base.tools() if t in base.effects), None)
    if target is None:
        return DrillResult("crash", "skipped", "the baseline ran no side effect", thread_id)
    payload = {"spec": ref.spec, "conn": conn, "journal": journal.path, "thread_id": thread_id}
    first = _child({**payload, "input": input_, "start": True, "kill_after": target})
    if first.returncode != -signal.SIGKILL:
        tail = (first.stderr.strip().splitlines() or ["no output"])[-1]
        return DrillResult(
            "crash", "failed", f"the run did not reach {target} again ({tail})", thread_id, target
        )
    second = _child({**payload, "input": input_, "start": False, "kill_after": None})
    if second.returncode != 0:
        tail = (second.stderr.strip().splitlines() or ["no output"])[-1]
        drive = _Drive(settled="error", errors=[tail])
    else:
        drive = _Drive(**json.loads(second.stdout.strip().splitlines()[-1]))
    runs = journal.executions(thread_id)
    return _verdict(
        "crash", thread_id, target, drive, base, runs, ok_states=("closed", "awaiting_human")
    )


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
    from taskpilots_graph import testing
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
            down = partial(ConnectionRefusedError, "drill: down")
            plan: list[tuple[str, str | None, Wrap, tuple[str, ...]]] = [
                (
                    "transient",
                    _first_pure(base),
                    lambda t: testing.failing(t, times=2, exc=lambda: TimeoutError("drill")),
                    ("closed",),
                ),
                (
                    "outage_after_effect",
                    _after_first_effect(base),
                    lambda t: testing.failing(t, times=3, exc=down),
                    ("closed", "awaiting_human", "failed"),
                ),
                (
                    "long_outage",
                    _first_pure(base),
                    lambda t: testing.down_for(t, 10.0**9, exc=down),
                    ("closed", "awaiting_human", "failed"),
                ),
            ]
            for name, tool, fault, ok in plan:
                notify(name)
                results.append(
                    _fault_drill(name, ref, cp, journal, input_, base, tool, fault, ok, run)
                )
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


# -- the crash drill's child process -----------------------------------------------------------


def _child_main(argv: list[str]) -> int:
    """One life of the crash drill's worker: start (and die) or resume the thread."""
    from taskpilots_graph import testing
    from taskpilots_graph.checkpointers import RecoveryCheckpointer

    payload = json.loads(argv[0])
    ref = load_graph(payload["spec"])
    journal = Journal(payload["journal"])
    thread_id = payload["thread_id"]
    with RecoveryCheckpointer.from_conn_string(payload["conn"]) as cp:
        graph = ref.build(cp)
        with (
            instrumented(graph, journal, thread_id, kill_after=payload["kill_after"]),
            testing.fake_clock() as clock,
        ):
            drive = _drive(graph, thread_id, payload["input"], clock, start=payload["start"])
    print(json.dumps(asdict(drive)))
    return 0


if __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[1:]))
