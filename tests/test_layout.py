"""The package's layout: no import cycles between its parts, no presentation in the domain.

The checks read the source (every ``import`` statement of every module, function-level ones
included), so a cycle hidden behind a deferred import counts too; the cycle check leaves out
imports made for type checking only, the presentation check does not.
A *part* is a subpackage (``checkpointers``, ``locks``, ``notebook``, ...) or a top-level
module (``runner``, ``metrics``, ...). ``__main__`` modules are programs, not layers:
nothing imports them, so they are left out. Each check is also run on a copy of the
package with a deliberately wrong import, to show it fails when it should.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import taskpilots_graph as tp

PACKAGE = Path(tp.__file__).resolve().parent
PRESENTATION = frozenset({"notebook", "web", "cli"})
# Parts that present or drive the package from outside; they may import presentation.
OUTSIDE_DOMAIN = PRESENTATION | {"demo"}


def _module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST, *, types: bool) -> Iterator[ast.AST]:
    """Every node of ``tree``; without ``types``, none under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(tree):
        yield child
        if not types and _is_type_checking(child):
            assert isinstance(child, ast.If)
            for other in child.orelse:
                yield other
                yield from _nodes(other, types=types)
            continue
        yield from _nodes(child, types=types)


def _imports(tree: ast.AST, *, types: bool = True) -> Iterator[tuple[str, int]]:
    """``(imported module, line)`` of every absolute import of the package in ``tree``
    (without ``types``: leaving out the imports made for type checking only)."""
    for node in _nodes(tree, types=types):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "taskpilots_graph":
                for alias in node.names:
                    yield f"taskpilots_graph.{alias.name}", node.lineno
            elif node.module.startswith("taskpilots_graph."):
                yield node.module, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("taskpilots_graph."):
                    yield alias.name, node.lineno


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def edges(root: Path, *, types: bool = True) -> dict[tuple[str, str], list[str]]:
    """``(part, part it imports)`` → where (``module:line``), for the package at ``root``
    (without ``types``: runtime imports only)."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = _module_name(root, path)
        source = _part(module)
        if source is None or module.endswith(".__main__") or source == "__main__":
            continue
        for imported, line in _imports(ast.parse(path.read_text(), str(path)), types=types):
            target = _part(imported)
            if target is not None and target != source:
                found.setdefault((source, target), []).append(f"{module}:{line}")
    return found


def cycles(graph: dict[tuple[str, str], list[str]]) -> list[frozenset[str]]:
    """The strongly connected parts of the import graph that hold more than one part."""
    succ: dict[str, set[str]] = {}
    for a, b in graph:
        succ.setdefault(a, set()).add(b)
        succ.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return found


def unexpected_cycles(root: Path) -> list[list[str]]:
    # Runtime imports: an import made for type checking only (``if TYPE_CHECKING:``) is
    # never executed, so it cannot make a cycle at import time.
    return [sorted(c) for c in cycles(edges(root, types=False))]


def presentation_imports(root: Path) -> list[str]:
    """``module:line -> part`` for each import of presentation by a domain module."""
    return [
        f"{where} -> {target}"
        for (source, target), places in edges(root).items()
        if target in PRESENTATION and source not in OUTSIDE_DOMAIN
        for where in places
    ]


@pytest.fixture
def broken_copy(tmp_path: Path) -> Path:
    """A copy of the package source to spoil one import in."""
    copy = tmp_path / "taskpilots_graph"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _spoil(module: Path, line: str) -> None:
    module.write_text(module.read_text() + f"\n\ndef _spoiled() -> None:\n    {line}\n")


def test_no_import_cycle_between_parts() -> None:
    """The locks sit above the checkpointers, and no cycle appears anywhere."""
    assert unexpected_cycles(PACKAGE) == []
    graph = edges(PACKAGE, types=False)
    assert ("locks", "checkpointers") in graph  # the lock backends set up through the stores
    assert ("checkpointers", "locks") not in graph  # not even deferred into a function


def test_the_cycle_check_sees_a_deferred_import(broken_copy: Path) -> None:
    """A cycle made by an import inside a function is found; a type-only one is not."""
    typed = broken_copy / "events.py"
    typed.write_text(
        typed.read_text()
        + "\n\nif TYPE_CHECKING:\n    from taskpilots_graph.checkpointers import RecoveryAPI\n"
    )
    assert unexpected_cycles(broken_copy) == []
    _spoil(broken_copy / "leases.py", "from taskpilots_graph.locks.hold import hold")
    assert unexpected_cycles(broken_copy) == [["checkpointers", "leases", "locks"]]


def test_checkpointers_need_no_lock_module_at_import() -> None:
    """The checkpointers' module-level imports reach no part of ``taskpilots_graph.locks``."""
    code = (
        "import sys, taskpilots_graph.checkpointers\n"
        "print(sorted(m for m in sys.modules if m.startswith('taskpilots_graph.locks')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_domain_modules_import_no_presentation() -> None:
    """No domain module imports the notebook, web or cli packages (not even lazily)."""
    assert presentation_imports(PACKAGE) == []


def test_the_presentation_check_fails_on_a_lazy_import(broken_copy: Path) -> None:
    """A ``_repr_html_`` importing the notebook package inside the method is caught."""
    _spoil(broken_copy / "metrics.py", "from taskpilots_graph.notebook.html import metrics_html")
    assert presentation_imports(broken_copy) == [
        f"taskpilots_graph.metrics:{len((broken_copy / 'metrics.py').read_text().splitlines())}"
        " -> notebook"
    ]


def test_front_door_is_sorted_and_resolves() -> None:
    """``__all__`` is sorted, has no duplicate, and every name resolves."""
    assert tp.__all__ == sorted(set(tp.__all__))
    for name in tp.__all__:
        assert getattr(tp, name) is not None, name


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_views_are_drawn_once_the_notebook_package_is_imported(tmp_path: Path) -> None:
    """Outside IPython, ``_repr_html_`` is the registered view: none before, the table after."""
    proc = _python(
        f"""
        import sys
        import taskpilots_graph as tp
        with tp.RecoveryCheckpointer.from_conn_string({str(tmp_path / "runs.db")!r}) as cp:
            cp.setup()
            metrics = tp.recovery_metrics(cp)
            assert metrics._repr_html_() is None
            assert "taskpilots_graph.notebook" not in sys.modules
            from taskpilots_graph import notebook
            html = metrics._repr_html_()
        assert html.startswith("<") and "Recovery metrics" in html, html[:300]
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ipython_shows_views_after_a_plain_import(tmp_path: Path) -> None:
    """In IPython, ``import taskpilots_graph`` is enough: the objects show as HTML tables,
    and the notebook package is imported when the first one is shown, not before."""
    proc = _python(
        f"""
        import sys
        from IPython.core.interactiveshell import InteractiveShell

        shell = InteractiveShell.instance()
        import taskpilots_graph as tp

        with tp.RecoveryCheckpointer.from_conn_string({str(tmp_path / "runs.db")!r}) as cp:
            cp.setup()
            metrics = tp.recovery_metrics(cp)
            assert "taskpilots_graph.notebook" not in sys.modules
            shown, _ = shell.display_formatter.format(metrics)
        assert "taskpilots_graph.notebook" in sys.modules
        assert "Recovery metrics" in shown["text/html"], sorted(shown)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def full_scans(root: Path) -> list[str]:
    """``module:line`` of each ``x.list(None)`` / ``x.alist(None)``: listing every checkpoint
    of every thread, which only the thread index may do (as its fallback)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(root, path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("list", "alist")
                and node.args[:1]
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value is None
            ):
                found.append(f"{module}:{node.lineno}")
    return found


def test_one_way_to_list_a_stores_threads(broken_copy: Path) -> None:
    """Threads are listed by ``taskpilots_graph._thread_index`` alone; a scan elsewhere is
    caught."""
    assert {where.partition(":")[0] for where in full_scans(PACKAGE)} == {
        "taskpilots_graph._thread_index"
    }
    _spoil(broken_copy / "runner.py", "print(list(object().list(None)))")
    assert any(w.startswith("taskpilots_graph.runner:") for w in full_scans(broken_copy))


THREADS = ("b", "a", "c", "a", "b", "c")  # two runs on each thread, in this order


def _graph(checkpointer: Any) -> Any:
    """A real one-node graph on ``checkpointer``."""
    from langgraph.graph import START, StateGraph
    from typing_extensions import TypedDict

    class State(TypedDict):
        n: int

    builder = StateGraph(State)
    builder.add_node("step", lambda s: {"n": s["n"] + 1})
    builder.add_edge(START, "step")
    return builder.compile(checkpointer=checkpointer)


def _no_full_scan(monkeypatch: pytest.MonkeyPatch, checkpointer: Any) -> None:
    saver = checkpointer
    while saver is not None:
        for name in ("list", "alist"):
            monkeypatch.setattr(saver, name, _refuse, raising=False)
        saver = getattr(saver, "inner", None)


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a full scan of the checkpoints")


def _latest(checkpointer: Any, thread_id: str) -> str:
    found = checkpointer.get_tuple({"configurable": {"thread_id": thread_id}})
    return str(found.config["configurable"]["checkpoint_id"])


@pytest.mark.parametrize("store", ["memory", "database"])
def test_thread_listing_reads_no_checkpoint_history(
    store: str, conn_string: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory, SQLite and PostgreSQL stores list their threads, with the latest root
    checkpoint of each, without loading the checkpoints (one query, or the memory dict)."""
    from taskpilots_graph._thread_index import thread_ids, thread_index

    url = ":memory:" if store == "memory" else conn_string
    with tp.RecoveryCheckpointer.from_conn_string(url) as cp:
        cp.setup()
        graph = _graph(cp)
        for thread_id in THREADS:
            graph.invoke({"n": 0}, {"configurable": {"thread_id": thread_id}})
        expected = {t: _latest(cp, t) for t in ("a", "b", "c")}
        _no_full_scan(monkeypatch, cp)
        assert thread_ids(cp) == ["a", "b", "c"]
        assert thread_index(cp) == expected


async def test_async_thread_listing_reads_no_checkpoint_history(
    acp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The async stores list their threads the same way."""
    from taskpilots_graph._thread_index import athread_ids, athread_index

    graph = _graph(acp)
    for thread_id in THREADS:
        await graph.ainvoke({"n": 0}, {"configurable": {"thread_id": thread_id}})
    expected = {}
    for t in ("a", "b", "c"):
        found = await acp.aget_tuple({"configurable": {"thread_id": t}})
        expected[t] = str(found.config["configurable"]["checkpoint_id"])
    _no_full_scan(monkeypatch, acp)
    assert await athread_ids(acp) == ["a", "b", "c"]
    assert await athread_index(acp) == expected


def test_ipython_is_told_of_every_view_the_notebook_draws() -> None:
    """The type names the package hands to IPython are the ones the notebook has views for."""
    from taskpilots_graph.notebook.html import VIEWS

    assert sorted(tp._HTML_VIEWS) == sorted(VIEWS)
