"""Commands of the browser side: ``inbox`` (the takeover inbox) and ``map`` (the recovery map).

Both need the optional extra ``web`` only for ``inbox``; ``map`` prints text.

Example:
    $ taskpilots inbox --db runs.db --graph myapp.agent:make_graph
    $ taskpilots map myapp.agent:make_graph --mermaid
"""

from __future__ import annotations

from typing import Annotated

import typer

from taskpilots_graph.cli._actions import GraphOption, graph_on, importable_cwd
from taskpilots_graph.cli._common import DbOption, JsonOption, emit_json, fail, guarded, stdout

__all__ = ["DEFAULT_PORT", "register"]

DEFAULT_PORT = 8765


def inbox(
    graph: GraphOption,
    db: DbOption = None,
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on; beyond loopback needs --token.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = DEFAULT_PORT,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar="TASKPILOTS_INBOX_TOKEN",
            help="Access token (at least 16 characters); required beyond loopback.",
        ),
    ] = None,
) -> None:
    """Serve the takeover inbox: threads waiting on a person, and a form per decision."""
    with guarded():
        from taskpilots_graph.web.security import check_bind

        check_bind(host, token)  # before anything is opened: refuse to start at once
        try:
            import uvicorn

            from taskpilots_graph.web.app import create_app
        except ImportError as exc:
            fail(f"the inbox needs the web extra: pip install 'taskpilots-graph[web]' ({exc})")
        with graph_on(graph, db) as (compiled, cp):
            app = create_app(compiled, checkpointer=cp, token=token, host=host)
            shown = f"[{host}]" if ":" in host else host
            stdout().print(f"takeover inbox on http://{shown}:{port}/", markup=False)
            uvicorn.run(app, host=host, port=port, log_level="warning")


def map_command(
    spec: Annotated[str, typer.Argument(help="module:attribute of the graph (or its factory).")],
    mermaid: Annotated[
        bool, typer.Option("--mermaid", help="Print the Mermaid flowchart.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Print the recovery map of a graph: per tool, what each kind of failure leads to."""
    from taskpilots_graph.checkpointers import RecoveryCheckpointer
    from taskpilots_graph.config import load_graph
    from taskpilots_graph.recovery_map import recovery_map

    with guarded():
        importable_cwd()
        ref = load_graph(spec)
        # Only the tools and policies are read: a factory gets a throwaway store.
        with RecoveryCheckpointer.from_conn_string("sqlite:///:memory:") as cp:
            cp.setup()
            rmap = recovery_map(ref.build(cp) if ref.takes_checkpointer else ref.build())
        if as_json:
            emit_json({"tools": rmap.table(), "warnings": list(rmap.warnings)})
        elif mermaid:
            typer.echo(rmap.mermaid())
        else:
            typer.echo(rmap.render())


def register(app: typer.Typer) -> None:
    """Add ``inbox`` and ``map`` to ``app``."""
    app.command("inbox", short_help="Takeovers in the browser (extra web).")(inbox)
    app.command("map", short_help="Per tool, what each kind of failure leads to.")(map_command)
