"""A fast start: the package and the CLI's ``--help`` / ``--version`` load no LangGraph.

Each check runs a fresh interpreter under ``-X importtime`` and reads the modules it
imported from stderr. Timings are not asserted (they depend on the machine).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import taskpilots_graph as tp

FRAMEWORK = ("langgraph", "langchain")
OPTIONAL = ("redis", "psycopg", "procrastinate", "opentelemetry", "matplotlib", "ipywidgets")
OPTIONAL += ("starlette", "fastapi", "uvicorn", "jinja2", "prometheus_client")
SCRIPT = Path(sys.executable).parent / "taskpilots"


def _imported(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -X importtime ARGS``; the process and every module it imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    modules = {
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "self [us]" not in line
    }
    assert modules, proc.stderr  # -X importtime did report
    return proc, modules


def _from(modules: set[str], roots: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0].startswith(roots))


@pytest.mark.parametrize("module", ["taskpilots_graph", "taskpilots_graph.cli"])
def test_help_imports_no_framework_module(module: str) -> None:
    """``python -m taskpilots_graph --help`` and ``taskpilots --help`` load no LangGraph."""
    proc, modules = _imported("-m", module, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower()
    assert _from(modules, FRAMEWORK) == []
    assert _from(modules, OPTIONAL) == []


@pytest.mark.parametrize("module", ["taskpilots_graph", "taskpilots_graph.cli"])
def test_help_is_plain_text_without_rich(module: str) -> None:
    """Help is click's plain text: no rich module is loaded (nor any ``<bool>`` label)."""
    proc, modules = _imported("-m", module, "demo", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _from(modules, ("rich",)) == []
    assert "--skip-plain" in proc.stdout
    assert "<bool>" not in proc.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "taskpilots_graph", "--version"],
        ["-m", "taskpilots_graph.cli", "--version"],
    ],
)
def test_version_prints_the_package_version(command: list[str]) -> None:
    """``--version`` prints the installed version, still without LangGraph."""
    proc, modules = _imported(*command)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"taskpilots-graph {tp.__version__}"
    assert _from(modules, FRAMEWORK) == []


def test_the_installed_script_prints_its_version() -> None:
    """The ``taskpilots`` console script answers ``--version`` too."""
    proc = subprocess.run(
        [str(SCRIPT), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"taskpilots-graph {tp.__version__}"


def test_importing_the_package_loads_no_submodule_or_dependency() -> None:
    """``import taskpilots_graph`` defers every public name to its first use."""
    proc, modules = _imported("-c", "import taskpilots_graph")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _from(modules, ("taskpilots_graph",)) == ["taskpilots_graph"]
    assert _from(modules, FRAMEWORK) == []


def test_public_names_load_no_optional_dependency() -> None:
    """Resolving every public name imports no optional library LangGraph does not load."""
    code = (
        "import sys, langgraph.graph, langchain.agents, langchain_core.tools\n"
        "before = set(sys.modules)\n"
        "import taskpilots_graph as tp\n"
        "for name in tp.__all__: getattr(tp, name)\n"
        "print(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _from(set(proc.stdout.split()), OPTIONAL) == []


def test_lazy_table_matches_all() -> None:
    """Every name of ``__all__`` has a source, ``dir()`` lists them, and they resolve."""
    lazy = set(tp._EXPORTS) | {"__version__"}
    assert lazy == set(tp.__all__)
    assert set(tp.__all__) <= set(dir(tp))
    with pytest.raises(AttributeError):
        _ = tp.no_such_name


def test_no_public_name_is_also_a_submodule() -> None:
    """Loading a submodule binds it on the package: no exported name may be one of them."""
    import pkgutil

    submodules = {m.name for m in pkgutil.iter_modules(tp.__path__)}
    assert submodules & set(tp.__all__) == set()
    code = (
        "import taskpilots_graph as tp, taskpilots_graph.replay, taskpilots_graph.runner\n"
        "from taskpilots_graph.runner import run\n"
        "assert tp.run is run\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
