"""Results nothing can serialise, and pre-checks that answer garbage or never answer.

* A courier client whose reply object is cyclic (or whose ``str()`` raises) after the
  parcel was booked: the effect happened, so the entry is committed with a faithful
  placeholder and flagged (``result_reduced``, ``result_unserialisable``), never left
  ``intended``; the model reads the placeholder; nothing is booked again.
* A pre-check answering ``None`` or a string: :class:`PrecheckError` names the tool and
  the answer in the takeover; the effect is uncertain (even for an idempotent tool) and is
  never executed on it.
* A pre-check that hangs: after ``precheck_timeout`` it counts as ``Unknown("pre-check
  timed out ...")``; the run stops for a person and releases its thread lease.

Domain, model and builders: the parcel courier of :mod:`test_ledger_rules`. Both agent
forms on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.tools import BaseTool, tool
from test_ledger_rules import (
    FORMS,
    ClerkModel,
    Courier,
    aask,
    ask,
    build,
    stopped_for_a_person,
)

import taskpilots_graph as tp
from taskpilots_graph.drift import is_placeholder, placeholder, result_digest, unserialisable
from taskpilots_graph.engine._call import CallContext
from taskpilots_graph.engine._precheck import acall_precheck, call_precheck
from taskpilots_graph.engine._records import recordable, tool_content
from taskpilots_graph.engine._requests import RunPrecheck
from taskpilots_graph.errors import PrecheckError
from taskpilots_graph.events import EventKind
from taskpilots_graph.ledger import LedgerStatus, SideEffectSpec
from taskpilots_graph.testing import fake_clock

LIMIT = 0.3  # seconds a hanging pre-check is given in these tests


@pytest.fixture(autouse=True)
def _no_backoff() -> Iterator[None]:
    with fake_clock():
        yield


@pytest.fixture
def courier(tmp_path: Path) -> Courier:
    return Courier(tmp_path / "courier.db")


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """What a hanging pre-check waits for; set at teardown so its thread ends."""
    event = threading.Event()
    yield event
    event.set()


class _NoText:
    """A client's reply object whose text cannot be built."""

    def __str__(self) -> str:
        raise RuntimeError("reply object has no text")

    __repr__ = __str__


def _cyclic(tracking: str) -> dict[str, Any]:
    reply: dict[str, Any] = {"tracking": tracking}
    reply["self"] = reply
    return reply


def odd_ship_tool(courier: Courier, kind: str, **options: Any) -> BaseTool:
    """Books the parcel, then returns a reply object nothing can serialise."""

    @tool
    def ship_parcel(parcel: str, address: str) -> Any:
        """Ship a parcel to an address; returns the courier's reply."""
        courier.book(tp.current_invocation().key, parcel, address)
        return _cyclic(f"TRK-{parcel}") if kind == "cyclic" else _NoText()

    return tp.side_effect(ship_parcel, **options)


def failing_ship_tool(courier: Courier, precheck: Any, **options: Any) -> BaseTool:
    """Books the parcel, then fails to read the reply: the pre-check is asked."""

    @tool
    def ship_parcel(parcel: str, address: str) -> str:
        """Ship a parcel to an address; returns its tracking number."""
        courier.book(tp.current_invocation().key, parcel, address)
        raise KeyError("tracking_number")  # reading the reply failed, after the booking

    return tp.side_effect(ship_parcel, precheck=precheck, **options)


# --- item 5: results that cannot be serialised ------------------------------------------------

WHY = {"cyclic": "Circular reference detected", "no-text": "reply object has no text"}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["cyclic", "no-text"])
def test_unserialisable_result_is_committed_with_a_placeholder(
    cp: Any, courier: Courier, form: str, kind: str
) -> None:
    model = ClerkModel()
    graph = build(form, cp, [odd_ship_tool(courier, kind)], model)

    result = tp.run(graph, "t-1", {"messages": [("user", "ship P-1 to Berlin")]})

    assert "__interrupt__" not in result
    (entry,) = cp.ledger("t-1")
    assert entry.status is LedgerStatus.COMMITTED
    assert entry.extra["result_reduced"] is True
    assert entry.extra["result_unserialisable"] is True
    assert is_placeholder(entry.result)
    assert WHY[kind] in entry.result
    # The model reads the same truthful text: the call completed, its result is not kept.
    (answer,) = model.received()
    assert answer.content == entry.result
    assert answer.status == "success"
    assert "the call itself completed" in answer.content
    (succeeded,) = [e for e in cp.events("t-1") if e.kind is EventKind.TOOL_SUCCEEDED]
    assert succeeded.payload["result_unserialisable"] is True
    assert courier.bookings() == 1

    # Nothing more happens: a resume finds nothing to do, the same command is a repeat.
    tp.resume(graph, "t-1")
    again = tp.run(graph, "t-1", {"messages": [("user", "ship P-1 to Berlin")]})
    assert "already done" in again["messages"][-2].content
    assert courier.bookings() == 1
    assert [e.status for e in cp.ledger("t-1")] == [LedgerStatus.COMMITTED]


@pytest.mark.parametrize("form", FORMS)
async def test_unserialisable_result_async(acp: Any, courier: Courier, form: str) -> None:
    graph = build(form, acp, [odd_ship_tool(courier, "cyclic")], ClerkModel())

    result = await aask(graph, "t-1", "ship P-1 to Berlin")

    assert "__interrupt__" not in result
    (entry,) = await acp.aledger("t-1")
    assert entry.status is LedgerStatus.COMMITTED
    assert entry.extra["result_unserialisable"] is True
    await tp.aresume(graph, "t-1")
    assert courier.bookings() == 1


@pytest.mark.parametrize("form", FORMS)
def test_precheck_done_with_a_cyclic_result_commits_a_placeholder(
    cp: Any, courier: Courier, form: str
) -> None:
    def found(key: str, args: dict[str, Any]) -> tp.Done:
        return tp.Done(result=_cyclic("TRK-P-1-1"), proof={"tracking": "TRK-P-1-1"})

    model = ClerkModel()
    graph = build(form, cp, [failing_ship_tool(courier, found)], model)

    result = ask(graph, "t-1", "ship P-1 to Berlin")

    assert "__interrupt__" not in result
    (entry,) = cp.ledger("t-1")
    assert entry.status is LedgerStatus.COMMITTED
    assert entry.extra["result_unserialisable"] is True
    assert "Circular reference" in entry.result
    assert [m.content for m in model.received()] == [entry.result]
    assert courier.bookings() == 1


def test_serialisation_helpers_never_raise() -> None:
    cyclic = _cyclic("x")
    assert unserialisable({"a": 1}) is None
    assert unserialisable(object()) is None  # not JSON, but it has a text
    assert unserialisable(cyclic) == "ValueError: Circular reference detected"
    assert unserialisable(_NoText()) == "RuntimeError: reply object has no text"
    for value in (cyclic, _NoText(), [_NoText()]):
        assert len(result_digest(value)) == 64
        text = tool_content(value)
        assert is_placeholder(text)
        recorded, reduced = recordable(value)
        assert reduced
        assert is_placeholder(recorded)
    assert "unavailable" in placeholder(_NoText(), "why")


# --- item 6a: pre-checks answering garbage ----------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    ("answer", "idempotent"),
    [(None, False), ("yes", False), (None, True)],
    ids=["none", "string", "none-idempotent"],
)
def test_garbage_precheck_answer_fails_closed(
    cp: Any, courier: Courier, form: str, answer: Any, idempotent: bool
) -> None:
    asked: list[str] = []

    def broken(key: str, args: dict[str, Any]) -> Any:
        asked.append(key)
        return answer

    graph = build(
        form, cp, [failing_ship_tool(courier, broken, idempotent=idempotent)], ClerkModel()
    )

    first = ask(graph, "t-1", "ship P-1 to Berlin")

    (entry,) = cp.ledger("t-1")
    assert entry.status is LedgerStatus.UNCERTAIN
    stopped_for_a_person(first, entry.key)
    message = first["__interrupt__"][0].value["failure"]["message"]
    assert "PrecheckError" in message
    assert "'ship_parcel'" in message
    assert repr(answer) in message
    (uncertain,) = [e for e in cp.events("t-1") if e.kind is EventKind.EFFECT_UNCERTAIN]
    assert "PrecheckError" in uncertain.payload["reason"]
    assert len(asked) == 1
    with pytest.raises(tp.PendingTakeover):
        tp.resume(graph, "t-1")
    assert courier.bookings() == 1


def test_precheck_error_is_typed() -> None:
    err = PrecheckError("ship_parcel", None)
    assert isinstance(err, tp.ConfigurationError)
    assert (err.tool, err.returned) == ("ship_parcel", "None")
    assert "'ship_parcel'" in str(err)
    assert "tp.Done" in str(err)


# --- item 6b: pre-checks that never answer ----------------------------------------------------


@pytest.mark.parametrize("limit", [0, -1, float("nan"), float("inf"), "3", True])
def test_precheck_timeout_is_validated(limit: Any) -> None:
    with pytest.raises(tp.ConfigurationError, match="precheck_timeout"):
        SideEffectSpec(precheck_timeout=limit)
    assert SideEffectSpec().precheck_timeout == 30.0
    assert SideEffectSpec(precheck_timeout=None).precheck_timeout is None
    assert SideEffectSpec(precheck_timeout=2).precheck_timeout == 2.0


def _hung_sync(gate: threading.Event) -> Any:
    def hung(key: str, args: dict[str, Any]) -> tp.NotDone:
        gate.wait(30)
        return tp.NotDone()  # a late "not done" must never let the booking run again

    return hung


@pytest.mark.parametrize("form", FORMS)
def test_hanging_precheck_times_out_and_frees_the_thread(
    cp: Any, courier: Courier, form: str, gate: threading.Event
) -> None:
    tools = [failing_ship_tool(courier, _hung_sync(gate), precheck_timeout=LIMIT)]
    graph = build(form, cp, tools, ClerkModel())

    started = time.monotonic()
    first = tp.run(graph, "t-1", {"messages": [("user", "ship P-1 to Berlin")]})

    assert time.monotonic() - started < 10
    (entry,) = cp.ledger("t-1")
    assert entry.status is LedgerStatus.UNCERTAIN
    stopped_for_a_person(first, entry.key)
    assert (
        f"pre-check timed out after {LIMIT:g} s"
        in first["__interrupt__"][0].value["failure"]["message"]
    )
    # The lease is free: another runner (a supervisor) gets the person's question, not
    # ThreadBusy; and nothing was booked again.
    with pytest.raises(tp.PendingTakeover):
        tp.resume(graph, "t-1")
    gate.set()  # the late answer (NotDone) changes nothing
    with pytest.raises(tp.PendingTakeover):
        tp.resume(graph, "t-1")
    assert courier.bookings() == 1
    assert cp.ledger("t-1")[0].status is LedgerStatus.UNCERTAIN


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("style", ["coroutine", "blocking"])
async def test_hanging_precheck_async(
    acp: Any, courier: Courier, form: str, style: str, gate: threading.Event
) -> None:
    async def hung_coroutine(key: str, args: dict[str, Any]) -> tp.NotDone:
        await asyncio.sleep(30)
        return tp.NotDone()

    precheck = hung_coroutine if style == "coroutine" else _hung_sync(gate)
    tools = [failing_ship_tool(courier, precheck, precheck_timeout=LIMIT)]
    graph = build(form, acp, tools, ClerkModel())

    first = await tp.arun(graph, "t-1", {"messages": [("user", "ship P-1 to Berlin")]})

    (entry,) = await acp.aledger("t-1")
    assert entry.status is LedgerStatus.UNCERTAIN
    stopped_for_a_person(first, entry.key)
    assert "timed out" in first["__interrupt__"][0].value["failure"]["message"]
    with pytest.raises(tp.PendingTakeover):
        await tp.aresume(graph, "t-1")
    assert courier.bookings() == 1


def _ctx(precheck: Any, limit: float | None) -> CallContext:
    spec = SideEffectSpec(precheck=precheck, precheck_timeout=limit)
    return CallContext(
        thread_id="t", checkpoint_ns="", tool="ship", args={}, tool_call_id="c", spec=spec, key="k"
    )


def test_call_precheck_limits(gate: threading.Event) -> None:
    request = RunPrecheck("k", {})
    assert call_precheck(_ctx(_hung_sync(gate), 0.05), request) == tp.Unknown(
        "pre-check timed out after 0.05 s"
    )

    def own_timeout(key: str, args: dict[str, Any]) -> Any:
        raise TimeoutError("courier search timed out")

    answer = call_precheck(_ctx(own_timeout, 5), request)
    assert answer == tp.Unknown("pre-check raised TimeoutError: courier search timed out")
    assert call_precheck(_ctx(lambda k, a: tp.NotDone(), None), request) == tp.NotDone()
    assert call_precheck(_ctx(lambda k, a: tp.NotDone(), 5), request) == tp.NotDone()


async def test_acall_precheck_limits(gate: threading.Event) -> None:
    request = RunPrecheck("k", {})

    async def slow(key: str, args: dict[str, Any]) -> tp.NotDone:
        await asyncio.sleep(30)
        return tp.NotDone()

    async def quick(key: str, args: dict[str, Any]) -> tp.Done:
        return tp.Done(result="r")

    timed_out = tp.Unknown("pre-check timed out after 0.05 s")
    assert await acall_precheck(_ctx(slow, 0.05), request) == timed_out
    assert await acall_precheck(_ctx(_hung_sync(gate), 0.05), request) == timed_out
    assert await acall_precheck(_ctx(quick, 5), request) == tp.Done(result="r")
    assert await acall_precheck(_ctx(lambda k, a: tp.NotDone(), 5), request) == tp.NotDone()


class _Crash(BaseException):
    """The worker dies right after the booking (nothing below the tool catches it)."""


@pytest.mark.parametrize("form", FORMS)
def test_hanging_precheck_on_an_orphan_intent(
    cp: Any, courier: Courier, form: str, gate: threading.Event
) -> None:
    """An intent left by a dead worker is reconciled with the same limit when the thread
    gets new input: the booking is not made again, a person is asked, the lease is free."""
    crashes = [_Crash()]

    @tool
    def ship_parcel(parcel: str, address: str) -> str:
        """Ship a parcel to an address; returns its tracking number."""
        courier.book(tp.current_invocation().key, parcel, address)
        if crashes:
            raise crashes.pop()
        return f"TRK-{parcel}"

    tools: list[BaseTool] = [
        tp.side_effect(ship_parcel, precheck=_hung_sync(gate), precheck_timeout=LIMIT)
    ]
    graph = build(form, cp, tools, ClerkModel())
    with pytest.raises(_Crash):
        tp.run(graph, "t-1", {"messages": [("user", "ship P-1 to Berlin")]})
    assert [e.status for e in cp.ledger("t-1")] == [LedgerStatus.INTENDED]

    try:
        outcome: Any = tp.run(graph, "t-1", {"messages": [("user", "ship P-2 to Paris")]})
    except tp.PendingTakeover as exc:
        outcome = exc
    if isinstance(outcome, dict):
        stopped_for_a_person(outcome)
    (entry,) = [e for e in cp.ledger("t-1") if e.args["parcel"] == "P-1"]
    assert entry.status is LedgerStatus.UNCERTAIN
    (uncertain,) = [e for e in cp.events("t-1") if e.kind is EventKind.EFFECT_UNCERTAIN]
    assert "timed out" in uncertain.payload["reason"]
    with pytest.raises(tp.PendingTakeover):
        tp.resume(graph, "t-1")
    assert courier.bookings("P-1") == 1
