"""Commands that run a graph: ``resume``, ``decide`` and ``rewind``.

The graph comes from ``--graph module:attribute``. The preferred form is a factory taking
the checkpointer, so the graph runs on exactly the store opened from ``--db``::

    def make_graph(checkpointer):
        return tp.create_recovery_agent(model, tools, checkpointer=checkpointer)

A compiled graph, or a factory without arguments, runs on its own checkpointer; ``--db``
is then refused (it could not be honoured).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from taskpilots_graph.cli._common import (
    DbOption,
    JsonOption,
    checked_db,
    emit_json,
    fail,
    guarded,
    parse_json_option,
    say,
    say_block,
    stdout,
    to_jsonable,
)

__all__ = ["GraphOption", "graph_on", "register"]

GraphOption = Annotated[
    str,
    typer.Option(
        "--graph",
        "-g",
        metavar="MODULE:ATTR",
        help="module:attribute of a factory taking the checkpointer (or a compiled graph).",
    ),
]
ThreadArgument = Annotated[str, typer.Argument(metavar="THREAD", help="The thread id.")]


def importable_cwd() -> None:
    """Let ``--graph`` name modules of the current folder, as ``python -m`` would."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


@contextmanager
def graph_on(spec: str, db: str | None) -> Iterator[tuple[Any, Any]]:
    """The graph named by ``spec`` and the checkpointer it runs on.

    A factory is built by :func:`taskpilots_graph.config.open_graph` on the store of
    ``--db`` (and its lease backend, so the runners hold the thread's lease), exactly as
    ``taskpilots supervise`` builds it.

    Raises:
        ConfigurationError: A bad spec, or ``--db`` with a graph that has its own store.
        StorageError: A missing SQLite file or an unreachable database.
    """
    from taskpilots_graph.config import StorageSettings, load_graph, open_graph
    from taskpilots_graph.errors import ConfigurationError

    importable_cwd()
    ref = load_graph(spec)
    if not ref.takes_checkpointer:
        if db:
            raise ConfigurationError(
                f"{spec} brings its own checkpointer, so --db cannot apply; make it a "
                "factory taking the checkpointer: def make_graph(checkpointer): ..."
            )
        graph = ref.build()
        yield graph, graph.checkpointer
        return
    conn = checked_db(db)
    with open_graph(spec, StorageSettings.resolve(db=conn)) as graph:
        if graph.checkpointer is None or isinstance(graph.checkpointer, bool):
            raise ConfigurationError(f"the graph from {spec} has no checkpointer")
        yield graph, graph.checkpointer


def _last_text(result: Any) -> str | None:
    messages = result.get("messages") if isinstance(result, dict) else None
    if not messages:
        return None
    content = getattr(messages[-1], "content", None)
    return content if isinstance(content, str) else None


def _run(graph: Any, cp: Any, thread: str, call: Callable[[], Any], as_json: bool) -> None:
    """Run ``call`` and report where the thread stands afterwards."""
    from taskpilots_graph.decisions import pending_takeovers
    from taskpilots_graph.errors import ToolWaiting
    from taskpilots_graph.threads import thread_info

    retry_at: float | None = None
    result: Any = None
    try:
        result = call()
    except ToolWaiting as waiting:
        retry_at = waiting.retry_at
    info = to_jsonable(thread_info(cp, thread))
    requests = pending_takeovers(cp, thread_ids=[thread])
    last = _last_text(result)
    if as_json:
        takeover = requests[0] if requests else None  # emit_json makes it JSON
        emit_json(
            {"thread": info, "last_message": last, "retry_at": retry_at, "takeover": takeover}
        )
        return
    out = stdout()
    out.print(f"thread {thread}: [bold]{info.get('status')}[/bold]")
    if last:
        say(f"last message: {last}")
    if retry_at is not None:
        say(f"waits for a tool; resume it after {retry_at:.0f} (unix time)")
    for request in requests:
        say_block(str(request))


def resume(
    thread: ThreadArgument, graph: GraphOption, db: DbOption = None, as_json: JsonOption = False
) -> None:
    """Continue a thread from its latest checkpoint; completed steps do not run again."""
    from taskpilots_graph import runner
    from taskpilots_graph.errors import PendingTakeover

    with guarded(), graph_on(graph, db) as (compiled, cp):
        try:
            _run(compiled, cp, thread, lambda: runner.resume(compiled, thread), as_json)
        except PendingTakeover:
            fail(
                f"thread {thread!r} waits on a person; answer it with "
                f"'taskpilots decide {thread} ACTION' (see 'taskpilots show {thread}')"
            )


def decide(
    thread: ThreadArgument,
    action: Annotated[
        str,
        typer.Argument(
            metavar="ACTION",
            help="retry, skip, provide_result, edit_args, abandon, or accept (a drifted "
            "result: keep the new value).",
        ),
    ],
    graph: GraphOption,
    args: Annotated[
        str | None,
        typer.Option("--args", metavar="JSON", help="New arguments as a JSON object (edit_args)."),
    ] = None,
    result: Annotated[
        str | None,
        typer.Option(
            "--result", metavar="JSON", help="The tool's result as JSON (provide_result)."
        ),
    ] = None,
    tool_call_id: Annotated[
        str | None,
        typer.Option(
            "--tool-call-id", metavar="ID", help="The waiting step, when several steps wait."
        ),
    ] = None,
    takeover: Annotated[
        str | None,
        typer.Option(
            "--takeover",
            metavar="ID",
            help="The takeover answered (its id, from 'taskpilots show'); refused if it was "
            "answered meanwhile.",
        ),
    ] = None,
    by: Annotated[
        str | None, typer.Option("--by", metavar="NAME", help="Who decides (recorded).")
    ] = None,
    note: Annotated[
        str | None, typer.Option("--note", metavar="TEXT", help="A note recorded with it.")
    ] = None,
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Answer a thread's takeover and continue it."""
    from functools import partial

    from taskpilots_graph.decisions import decide
    from taskpilots_graph.errors import StaleDecision
    from taskpilots_graph.takeover import parse_decision

    with guarded():
        given = {
            "args": parse_json_option("--args", args),
            "result": parse_json_option("--result", result),
            "tool_call_id": tool_call_id,
            "interrupt_id": takeover,
            "decided_by": by,
            "note": note,
        }
        fields = {"action": action, **{k: v for k, v in given.items() if v is not None}}
        decision = parse_decision(fields)  # InvalidDecision before anything is opened
        with graph_on(graph, db) as (compiled, cp):
            answer = partial(decide, compiled, thread, decision)
            try:
                _run(compiled, cp, thread, answer, as_json)
            except StaleDecision as stale:
                # Nothing changed; point at what waits now rather than invite a blind re-run.
                fail(f"{stale}. See 'taskpilots show {thread}' for the takeover pending now")


def rewind(
    thread: ThreadArgument,
    to: Annotated[
        str, typer.Option("--to", metavar="TARGET", help="A business milestone or a checkpoint id.")
    ],
    graph: GraphOption,
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Go back to a milestone or checkpoint and continue from there."""
    from taskpilots_graph import runner

    with guarded(), graph_on(graph, db) as (compiled, cp):
        _run(compiled, cp, thread, lambda: runner.rewind(compiled, thread, to=to), as_json)


def register(app: typer.Typer) -> None:
    """Add ``resume``, ``decide`` and ``rewind`` to ``app``."""
    app.command("resume", short_help="Continue a thread from its last checkpoint.")(resume)
    app.command("decide", short_help="Answer a takeover and continue the thread.")(decide)
    app.command("rewind", short_help="Go back to a milestone and continue.")(rewind)
