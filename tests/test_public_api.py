"""The public surface: a complete, sorted ``__all__`` and picklable errors."""

from __future__ import annotations

import importlib
import pickle
import pkgutil

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


def test_public_classes_and_functions_are_exported() -> None:
    """Nothing a user needs from the top-level modules is missing from the package."""
    for module in (
        "agent",
        "ledger",
        "runner",
        "tools",
        "errors",
        "events",
        "state",
        "takeover",
        "policy",
        "recovery",
    ):
        mod = importlib.import_module(f"taskpilots_graph.{module}")
        public = {n for n in mod.__all__ if not n.isupper() and n[0] != "_"}
        internal = {
            "Step",
            "PrecheckOutcome",
            "args_digest",
            "canonical_json",
            "default_key",
            "next_step",
            "step_after_precheck",
            "runner_of",
            "encode_payload",
            "event_from_row",
            "spec_of",
            "check_args",
            "FlowStage",
            "StepStatus",
            "merge_flow",
            "merge_steps",
            "parse_decision",
            "validate_policies",
            "mark_superseded",
            "DECISION_ACTIONS",
        }
        missing = public - internal - set(tp.__all__)
        assert not missing, f"{module}: {sorted(missing)}"


def test_public_errors_are_exported() -> None:
    """Every error class of ``errors.py`` is reachable from the package."""
    for name in errors.__all__:
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
