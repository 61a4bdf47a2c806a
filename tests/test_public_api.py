"""The public surface: the pinned front door, declared module surfaces, picklable errors."""

from __future__ import annotations

import importlib
import pickle
import pkgutil
from types import ModuleType

import pytest

import taskpilots_graph as tp
from taskpilots_graph import errors


def _modules() -> list[str]:
    return [
        m.name
        for m in pkgutil.walk_packages(tp.__path__, prefix="taskpilots_graph.")
        if ".demo.__main__" not in m.name and not m.name.endswith(".worker")
    ]


# The order of every __all__ is checked by ruff (RUF022); these tests check its contents.


def test_package_all_resolves() -> None:
    """Every name in ``taskpilots_graph.__all__`` exists."""
    for name in tp.__all__:
        assert hasattr(tp, name), name


@pytest.mark.parametrize("module", _modules())
def test_every_module_declares_all(module: str) -> None:
    """Each module lists its public names explicitly, and they all exist."""
    mod = importlib.import_module(module)
    assert isinstance(getattr(mod, "__all__", None), list), f"{module} has no __all__"
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name}"


# The front door holds the API contract and nothing else; every other name is imported from
# its submodule. A name added here is a decision, not a side effect of writing a module.
FRONT_DOOR = [
    "AsyncRecoveryCheckpointer",
    "Backoff",
    "ConfigurationError",
    "Decision",
    "Done",
    "Event",
    "EventKind",
    "FailureKind",
    "Invocation",
    "LedgerEntry",
    "LedgerStatus",
    "ModelPolicy",
    "NotDone",
    "PendingTakeover",
    "RecoveryCheckpointer",
    "RecoveryMetrics",
    "RecoveryMiddleware",
    "SideEffectUncertain",
    "TakeoverRequest",
    "TaskPilotsError",
    "ThreadBusy",
    "ToolNode",
    "ToolPolicy",
    "Unknown",
    "__version__",
    "adecide",
    "alist_threads",
    "apending_takeovers",
    "arecovery_metrics",
    "aresume",
    "arewind",
    "arun",
    "athread_info",
    "create_recovery_agent",
    "current_invocation",
    "decide",
    "list_threads",
    "pending_takeovers",
    "recovery_metrics",
    "resume",
    "rewind",
    "run",
    "side_effect",
    "thread_info",
]


def test_front_door_is_the_contract() -> None:
    """``__all__`` is exactly the pinned contract, sorted, without duplicates."""
    assert tp.__all__ == FRONT_DOOR
    assert tp.__all__ == sorted(tp.__all__)
    assert len(set(tp.__all__)) == len(tp.__all__)


def test_front_door_names_are_their_modules_objects() -> None:
    """Each exported name is the very object its submodule defines (one home per name)."""
    for name, module in tp._EXPORTS.items():
        assert getattr(tp, name) is getattr(importlib.import_module(module), name), name


def test_no_name_has_two_meanings() -> None:
    """A public name means one thing across the public modules (no two ``classify``).

    ``main`` is the conventional name of each entry point's function and is left out.
    """
    homes: dict[str, dict[int, str]] = {}
    for module in _modules():
        if "._" in module:
            continue
        mod = importlib.import_module(module)
        for name in mod.__all__:
            value = getattr(mod, name)
            if name != "main" and not isinstance(value, ModuleType):
                homes.setdefault(name, {}).setdefault(id(value), module)
    twice = {name: sorted(found.values()) for name, found in homes.items() if len(found) > 1}
    assert twice == {}


def test_errors_live_in_the_errors_module() -> None:
    """The front door's errors are the ones of ``taskpilots_graph.errors`` (or the ledger's)."""
    for name in errors.__all__:
        if name in tp.__all__:
            assert getattr(tp, name) is getattr(errors, name)
    assert tp.SideEffectUncertain.__mro__[1] is errors.TaskPilotsError


@pytest.mark.parametrize(
    "err",
    [
        errors.CorruptRecordError("bad row", table="taskpilots_events", key="t#1"),
        errors.UnsupportedOperation("copy_thread", "SqliteSaver"),
        errors.ThreadNotFound("t-404"),
        errors.LedgerConflict("k"),
        errors.PendingTakeover("t-1", ["i-1"]),
        tp.SideEffectUncertain(key="k", tool="create_ticket", thread_id="t", reason="r"),
    ],
)
def test_errors_survive_pickling(err: errors.TaskPilotsError) -> None:
    """Errors cross process boundaries with their message and fields intact."""
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    assert back.__dict__ == err.__dict__


def test_methods_written_once_for_both_forms_show_what_they_return() -> None:
    """A method built from one body for its sync and async forms (``taskpilots_graph._twins``)
    shows the value a caller gets in ``help()`` and Jupyter, not the body's generator."""
    import inspect

    from taskpilots_graph.checkpointers import retention

    shown: dict[str, str] = {}
    for owner in (tp.RecoveryCheckpointer, tp.AsyncRecoveryCheckpointer, retention):
        for name in dir(owner):
            member = getattr(owner, name)
            if name.startswith("_") or not hasattr(member, "__wrapped__"):
                continue  # only wrapped functions can show another function's signature
            shown[f"{owner.__name__}.{name}"] = str(inspect.signature(member))
    assert "RecoveryCheckpointer.events" in shown
    assert "AsyncRecoveryCheckpointer.aevents" in shown
    assert {name: sig for name, sig in shown.items() if "Steps[" in sig} == {}
