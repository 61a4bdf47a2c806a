"""The ledger's rules where a flaky client and a forgetful model take a side effect.

* "Not sent" only when it cannot have been sent: a courier client that fails to read the
  reply (``JSONDecodeError``, ``KeyError``, ``TypeError``, pydantic ``ValidationError``) after
  the parcel was booked never books it a second time; arguments the tool's schema rejects
  were never sent and are reported to the model as usual.
* The repeat guard: a model that asks again for a parcel already shipped in the thread gets
  the recorded tracking number back ("already done at step N: ...") instead of a second
  shipment, unless the tool is declared ``repeatable``.

Domain: a courier that ships parcels, simulated on its own SQLite file (outside the agent's
process and database), so shipments are counted where they happened. The model is a scripted
stand-in that decides only from the messages it is handed (never from the library's state or
summaries). Both agent forms run on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Annotated, Any

import pytest
from _models import RESUME_MESSAGE, ScriptedChatModel, tool_call
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, InjectedToolCallId, Tool, tool
from pydantic import BaseModel, ValidationError, field_validator

import taskpilots_graph as tp
from taskpilots_graph.checkpointers._records import TenureMemo
from taskpilots_graph.engine._protocol import may_have_reached_service
from taskpilots_graph.events import EventKind
from taskpilots_graph.leases import THREAD_HOLD, thread_lease_name
from taskpilots_graph.ledger import LedgerStatus, SideEffectSpec
from taskpilots_graph.testing import fake_clock
from taskpilots_graph.tools import check_args

FORMS = ["create_recovery_agent", "create_agent+RecoveryMiddleware"]
FAULTS = ["json", "key", "type", "validation"]
ERRORS = {
    "json": "JSONDecodeError",
    "key": "KeyError",
    "type": "TypeError",
    "validation": "ValidationError",
}


# --- the courier: a service with its own database ---------------------------------------------


class Label(BaseModel):
    """What the courier client expects back: a tracking number and a label."""

    tracking: str
    label_url: str


class Courier:
    """A parcel courier on its own SQLite file: every booking is a row (the effect).

    ``faults`` are consumed one per booking by the *client* (the tool body), after the
    courier has booked the parcel: the reply it cannot read is the reply of a done booking.
    """

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.faults: list[str] = []
        with closing(sqlite3.connect(self.path)) as db, db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS bookings "
                "(key TEXT, parcel TEXT, address TEXT, tracking TEXT)"
            )

    def book(self, key: str, parcel: str, address: str) -> str:
        """Book the shipment (the side effect) and answer with the raw reply body."""
        with closing(sqlite3.connect(self.path)) as db, db:
            (n,) = db.execute("SELECT count(*) + 1 FROM bookings").fetchone()
            tracking = f"TRK-{parcel}-{n}"
            db.execute("INSERT INTO bookings VALUES (?, ?, ?, ?)", (key, parcel, address, tracking))
        return json.dumps({"tracking": tracking, "label_url": f"https://labels/{tracking}"})

    def bookings(self, parcel: str | None = None) -> int:
        with closing(sqlite3.connect(self.path)) as db:
            if parcel is None:
                (n,) = db.execute("SELECT count(*) FROM bookings").fetchone()
            else:
                (n,) = db.execute(
                    "SELECT count(*) FROM bookings WHERE parcel = ?", (parcel,)
                ).fetchone()
        return int(n)

    def find(self, key: str, args: dict[str, Any]) -> tp.Done | tp.NotDone:
        """The pre-check: the courier's search by booking key."""
        with closing(sqlite3.connect(self.path)) as db:
            row = db.execute("SELECT tracking FROM bookings WHERE key = ?", (key,)).fetchone()
        return tp.NotDone() if row is None else tp.Done(result=row[0], proof={"tracking": row[0]})

    def read_reply(self, reply: str) -> str:
        """The client reading the reply, failing the way ``faults`` says."""
        fault = self.faults.pop(0) if self.faults else None
        if fault == "json":
            return str(json.loads(reply[:-3]))  # a truncated body: JSONDecodeError
        if fault == "key":
            return str(json.loads(reply)["tracking_number"])  # a renamed field: KeyError
        if fault == "type":
            return str("ETA " + json.loads(reply).get("eta"))  # a missing field: TypeError
        if fault == "validation":
            return Label.model_validate_json(reply.replace("label_url", "label")).tracking
        return Label.model_validate_json(reply).tracking


def ship_tool(courier: Courier, **options: Any) -> BaseTool:
    @tool
    def ship_parcel(parcel: str, address: str) -> str:
        """Ship a parcel to an address; returns its tracking number."""
        reply = courier.book(tp.current_invocation().key, parcel, address)
        return courier.read_reply(reply)

    return tp.side_effect(ship_parcel, **options)


# --- the model: decides from the messages it is handed ----------------------------------------


class ClerkModel(ScriptedChatModel):
    """A shipping clerk: "ship <parcel> to <address>" becomes one ``ship_parcel`` call.

    After the last user message: no answer of ``ship_parcel`` yet → call it; an answer →
    report it. A request without an address ("ship P-9") is passed on as it stands.
    """

    def decide(self, messages: list[BaseMessage]) -> AIMessage:
        last = max(
            i
            for i, m in enumerate(messages)
            if isinstance(m, HumanMessage) and m.name != RESUME_MESSAGE
        )
        answers = [m for m in messages[last:] if isinstance(m, ToolMessage)]
        if answers:
            return AIMessage(f"{answers[-1].status}: {answers[-1].content}")
        words = str(messages[last].content).split()
        args = {"parcel": words[1]}
        if "to" in words:
            args["address"] = " ".join(words[words.index("to") + 1 :])
        return tool_call("ship_parcel", args)

    def received(self) -> list[ToolMessage]:
        """Every tool answer in the conversations the model was handed, in order, once."""
        seen: dict[str, ToolMessage] = {}
        for conversation in self.inputs:
            for m in conversation:
                if isinstance(m, ToolMessage):
                    seen.setdefault(m.tool_call_id, m)
        return list(seen.values())


# --- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture
def courier(tmp_path: Path) -> Courier:
    return Courier(tmp_path / "courier.db")


def build(form: str, cp: Any, tools: list[BaseTool], model: ClerkModel) -> Any:
    if form == FORMS[0]:
        return tp.create_recovery_agent(model, tools, checkpointer=cp)
    return create_agent(model, tools, checkpointer=cp, middleware=[tp.RecoveryMiddleware(cp)])


def ask(graph: Any, thread_id: str, text: str) -> dict[str, Any]:
    config = {"configurable": {"thread_id": thread_id}}
    result: dict[str, Any] = graph.invoke({"messages": [("user", text)]}, config)
    return result


async def aask(graph: Any, thread_id: str, text: str) -> dict[str, Any]:
    config = {"configurable": {"thread_id": thread_id}}
    result: dict[str, Any] = await graph.ainvoke({"messages": [("user", text)]}, config)
    return result


def stopped_for_a_person(result: dict[str, Any], key: str | None = None) -> None:
    """The run waits on a takeover for an uncertain effect (named by its key, if given)."""
    (pending,) = result["__interrupt__"]
    request = pending.value
    assert request["failure"]["kind"] == "side_effect_uncertain"
    if key is not None:
        assert [e["key"] for e in request["uncertain_effects"]] == [key]


def kinds(cp: Any, thread_id: str) -> list[EventKind]:
    return [e.kind for e in cp.events(thread_id)]


@pytest.fixture(autouse=True)
def _no_backoff() -> Iterator[None]:
    """In-process retries would only slow the tests down; the rules do not depend on them."""
    with fake_clock():
        yield


# --- 1. "not sent" only when it cannot have been sent -----------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("business_key", [False, True], ids=["default-key", "business-key"])
def test_reply_parse_failure_after_booking_never_books_twice(
    cp: Any, courier: Courier, form: str, fault: str, business_key: bool
) -> None:
    """A reply the client cannot read after the booking: the run stops for a person with
    the shipment named, and neither a resume nor the same request again books it twice."""
    key = (lambda a: f"ship:{a['parcel']}") if business_key else None
    graph = build(form, cp, [ship_tool(courier, key=key)], ClerkModel())
    courier.faults = [fault]

    first = ask(graph, "t-1", "ship P-1 to Berlin")

    (entry,) = cp.ledger("t-1")
    assert entry.status is LedgerStatus.UNCERTAIN
    assert entry.error is not None
    assert entry.error["maybe_sent"] is True
    if form == FORMS[1] and fault == "validation":
        # LangGraph's tool node turns a ValidationError into an error answer, which the
        # middleware records as such: raised after the arguments passed, so possibly sent.
        assert entry.error["type"].endswith("ErrorAnswer")
        assert "label_url: Field required" in entry.error["message"]
    else:
        assert entry.error["type"].endswith(ERRORS[fault])
    stopped_for_a_person(first, entry.key)
    assert courier.bookings() == 1
    with pytest.raises(tp.PendingTakeover):
        tp.resume(graph, "t-1")
    if business_key:
        # The same operation from another thread meets the uncertain entry: no second booking.
        stopped_for_a_person(ask(graph, "t-2", "ship P-1 to Berlin"))
    assert courier.bookings() == 1


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fault", FAULTS)
def test_reply_parse_failure_reconciles_through_the_precheck(
    cp: Any, courier: Courier, form: str, fault: str
) -> None:
    """With a pre-check, the booking the client could not read is found and committed: the
    model receives its tracking number, the parcel is booked once, nobody is asked."""
    model = ClerkModel()
    tools = [ship_tool(courier, key=lambda a: f"ship:{a['parcel']}", precheck=courier.find)]
    graph = build(form, cp, tools, model)
    courier.faults = [fault]

    result = ask(graph, "t-1", "ship P-1 to Berlin")

    assert "__interrupt__" not in result
    assert courier.bookings() == 1
    (entry,) = cp.ledger("t-1")
    assert (entry.status, entry.result) == (LedgerStatus.COMMITTED, "TRK-P-1-1")
    assert [m.content for m in model.received()] == ["TRK-P-1-1"]
    assert result["messages"][-1].content == "success: TRK-P-1-1"


@pytest.mark.parametrize("form", FORMS)
async def test_reply_parse_failure_async(acp: Any, courier: Courier, form: str) -> None:
    """The async drivers apply the same rule: a JSONDecodeError after the booking stops the
    run for a person, and a resume does not book again."""
    graph = build(form, acp, [ship_tool(courier)], ClerkModel())
    courier.faults = ["json"]

    first = await aask(graph, "t-1", "ship P-1 to Berlin")

    (entry,) = await acp.aledger("t-1")
    assert entry.status is LedgerStatus.UNCERTAIN
    stopped_for_a_person(first, entry.key)
    with pytest.raises(tp.PendingTakeover):
        await tp.aresume(graph, "t-1")
    assert courier.bookings() == 1


@pytest.mark.parametrize("form", FORMS)
def test_declared_not_sent_error_runs_again_under_its_key(
    cp: Any, courier: Courier, form: str
) -> None:
    """An error type declared ``not_sent`` (raised before the request leaves) is retried
    under the same key without asking anyone: one booking in the end."""

    class QuotaExceeded(Exception):
        """The client's own daily quota check, before any request: nothing was sent."""

    refusals = ["over quota"]

    @tool
    def ship_parcel(parcel: str, address: str) -> str:
        """Ship a parcel to an address; returns its tracking number."""
        if refusals:
            raise QuotaExceeded(refusals.pop())
        return courier.read_reply(courier.book(tp.current_invocation().key, parcel, address))

    shipping = tp.side_effect(
        ship_parcel, key=lambda a: f"ship:{a['parcel']}", not_sent=(QuotaExceeded,)
    )
    first = ask(build(form, cp, [shipping], ClerkModel()), "t-1", "ship P-1 to Berlin")
    (entry,) = cp.ledger("t-1")
    failed = [e for e in cp.events("t-1") if e.kind is EventKind.TOOL_FAILED]
    assert failed
    assert failed[0].payload["maybe_sent"] is False
    assert "__interrupt__" not in first
    assert (entry.status, courier.bookings()) == (LedgerStatus.COMMITTED, 1)


def test_what_counts_as_sent() -> None:
    """The rule itself: errors from the body may have been sent unless they say otherwise."""

    class Declared(Exception):
        maybe_sent = False

    for exc in (json.JSONDecodeError("x", "", 0), KeyError("x"), TypeError("x"), ValueError()):
        assert may_have_reached_service(exc)
    assert not may_have_reached_service(ConnectionRefusedError())
    assert not may_have_reached_service(Declared())
    assert not may_have_reached_service(KeyError("x"), (LookupError,))
    assert SideEffectSpec(not_sent=KeyError).not_sent == (KeyError,)  # type: ignore[arg-type]
    with pytest.raises(tp.ConfigurationError, match="not_sent"):
        SideEffectSpec(not_sent=("KeyError",))  # type: ignore[arg-type]
    with pytest.raises(tp.ConfigurationError, match="repeatable"):
        SideEffectSpec(repeatable="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("form", FORMS)
def test_arguments_the_schema_rejects_were_not_sent(cp: Any, courier: Courier, form: str) -> None:
    """Arguments the tool's schema rejects never reach the body: nothing is booked, no
    ledger entry is left, and the model receives the error to correct its call."""
    model = ClerkModel()
    result = ask(build(form, cp, [ship_tool(courier)], model), "t-1", "ship P-9")

    assert "__interrupt__" not in result
    assert courier.bookings() == 0
    assert cp.ledger("t-1") == []
    (answer,) = model.received()
    assert answer.status == "error"
    assert "address" in str(answer.content)
    failed = [e for e in cp.events("t-1") if e.kind is EventKind.TOOL_FAILED]
    assert [e.payload["maybe_sent"] for e in failed] == [False]


# --- 2. the repeat guard ----------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_replanned_shipment_returns_the_recorded_result(
    cp: Any, courier: Courier, form: str
) -> None:
    """The user asks again for a parcel shipped earlier in the thread; the model calls the
    tool again (a new call id, hence a new key): one booking, and the model receives the
    recorded tracking number with a note it can read."""
    model = ClerkModel()
    graph = build(form, cp, [ship_tool(courier)], model)

    ask(graph, "t-1", "ship P-1 to Berlin")
    result = ask(graph, "t-1", "ship P-1 to Berlin")

    assert courier.bookings() == 1
    first, second = model.received()
    assert first.content == "TRK-P-1-1"
    assert second.status == "success"
    assert str(second.content).startswith("already done at step 1: TRK-P-1-1")
    assert result["messages"][-1].content.startswith("success: already done at step 1")
    (entry,) = cp.ledger("t-1")
    caught = [e for e in cp.events("t-1") if e.kind is EventKind.REPEAT_CAUGHT]
    assert [(e.payload["earlier_key"], e.payload["step"]) for e in caught] == [(entry.key, 1)]
    assert tp.recovery_metrics(cp, thread_ids=["t-1"]).repeats_caught == 1


@pytest.mark.parametrize("form", FORMS)
def test_repeat_guard_names_the_step_and_spares_other_arguments(
    cp: Any, courier: Courier, form: str
) -> None:
    """Step N is the earlier effect's place among the thread's effects; the same tool with
    other arguments is a new effect and runs."""
    model = ClerkModel()
    graph = build(form, cp, [ship_tool(courier)], model)

    for text in ("ship P-1 to Berlin", "ship P-2 to Oslo", "ship P-2 to Oslo", "ship P-3 to Rome"):
        ask(graph, "t-1", text)

    assert courier.bookings() == 3
    contents = [str(m.content) for m in model.received()]
    assert contents[0] == "TRK-P-1-1"
    assert contents[1] == "TRK-P-2-2"
    assert contents[2].startswith("already done at step 2: TRK-P-2-2")
    assert contents[3] == "TRK-P-3-3"
    # Another thread is another conversation: the guard looks within one thread only.
    ask(graph, "t-2", "ship P-1 to Berlin")
    assert courier.bookings("P-1") == 2


@pytest.mark.parametrize("form", FORMS)
async def test_replanned_shipment_async(acp: Any, courier: Courier, form: str) -> None:
    """The async drivers answer a repeat from the ledger too."""
    model = ClerkModel()
    graph = build(form, acp, [ship_tool(courier)], model)

    await aask(graph, "t-1", "ship P-1 to Berlin")
    await aask(graph, "t-1", "ship P-1 to Berlin")

    assert courier.bookings() == 1
    assert str(model.received()[1].content).startswith("already done at step 1: TRK-P-1-1")
    metrics = await tp.arecovery_metrics(acp, thread_ids=["t-1"])
    assert metrics.repeats_caught == 1


@pytest.mark.parametrize("form", FORMS)
def test_repeatable_tool_runs_again(cp: Any, courier: Courier, form: str) -> None:
    """``side_effect(repeatable=True)``: a second identical call is meant, and runs."""
    model = ClerkModel()
    graph = build(form, cp, [ship_tool(courier, repeatable=True)], model)

    ask(graph, "t-1", "ship P-1 to Berlin")
    ask(graph, "t-1", "ship P-1 to Berlin")

    assert courier.bookings() == 2
    assert [m.content for m in model.received()] == ["TRK-P-1-1", "TRK-P-1-2"]
    assert EventKind.REPEAT_CAUGHT not in kinds(cp, "t-1")


def test_repeat_guard_reads_once_per_lease_tenure(cp: Any, courier: Courier) -> None:
    """Under the thread's lease the committed effects are read once, with the run's first
    read of the thread's ledger: fresh side effects cost no lookup of their own, and a
    commit made meanwhile is known without a read."""
    calls: list[str] = []
    store = cp.store
    for name in ("ledger", "ledger_repeat", "ledger_committed_digests"):
        original = getattr(store, name)

        def counted(*args: Any, _name: str = name, _original: Any = original) -> Any:
            calls.append(_name)
            return _original(*args)

        setattr(store, name, counted)
    graph = build(FORMS[0], cp, [ship_tool(courier)], ClerkModel())

    ask(graph, "t-1", "ship P-1 to Berlin")
    assert calls.count("ledger_repeat") <= 1  # fresh: at most the one read without a lease
    calls.clear()
    tp.run(graph, "t-1", {"messages": [("user", "ship P-2 to Oslo")]})
    assert calls == ["ledger"]  # one read for the tenure, no lookup
    calls.clear()
    tp.run(graph, "t-1", {"messages": [("user", "ship P-1 to Berlin")]})
    assert calls == ["ledger", "ledger_repeat"]  # a hit is looked up
    assert courier.bookings() == 2


@pytest.mark.parametrize("form", FORMS)
def test_a_fresh_idempotent_call_reads_no_entry_under_the_lease(
    cp: Any, courier: Courier, form: str
) -> None:
    """An idempotent call under its default key, its step stored: the run's one read of the
    thread's ledger tells its key is new, so no lookup of its own precedes the call. A key
    that is on record is still read (the same command, run twice: no second booking)."""
    reads: list[str] = []
    original = cp.store.ledger_get

    def counted(key: str) -> Any:
        reads.append(key)
        return original(key)

    cp.store.ledger_get = counted
    graph = build(form, cp, [ship_tool(courier, idempotent=True)], ClerkModel())
    start = {"messages": [("user", "ship P-1 to Berlin")]}

    tp.run(graph, f"fresh-{form}", start, durability="sync")
    assert reads == []
    assert courier.bookings("P-1") == 1
    (entry,) = cp.ledger(f"fresh-{form}")
    assert entry.status is LedgerStatus.COMMITTED

    # A later tenure of the thread: its first ledger read finds the key, and a lookup of
    # that key reads the entry; a key it did not find is answered without a read.
    token = THREAD_HOLD.set(_Hold(f"fresh-{form}"))
    try:
        cp.ledger(f"fresh-{form}")
        reads.clear()
        assert cp.ledger_entry(entry.key, thread_id=f"fresh-{form}") == entry
        assert cp.ledger_entry("ship_parcel:new", thread_id=f"fresh-{form}") is None
        assert reads == [entry.key]
    finally:
        THREAD_HOLD.reset(token)
    assert cp.ledger_entry("ship_parcel:new", thread_id=f"fresh-{form}") is None
    assert reads == [entry.key, "ship_parcel:new"]  # without the lease: read


class _Hold:
    """Stands for a run's hold of the thread's lease (what the tenure's memo is keyed on)."""

    def __init__(self, thread_id: str) -> None:
        self.name = thread_lease_name(thread_id)


def test_a_record_noted_before_its_scope_is_read_is_kept() -> None:
    """A commit noted while a read of the thread's keys is in flight (parallel tasks) is
    known once the read lands, even when the read did not see it."""
    memo = TenureMemo()
    token = THREAD_HOLD.set(_Hold("t-1"))
    try:
        assert memo.may_hold("t-1", "keys", "k-1")  # not read: every lookup reads
        memo.note("t-1", "keys", "k-1")  # committed meanwhile
        memo.remember("t-1", "keys", ["k-0"])  # the read started before the commit
        assert memo.may_hold("t-1", "keys", "k-1")
        assert not memo.may_hold("t-1", "keys", "k-2")
        memo.note("t-1", "keys", "k-2")
        assert memo.may_hold("t-1", "keys", "k-2")
    finally:
        THREAD_HOLD.reset(token)
    assert memo.may_hold("t-1", "keys", "k-9")  # without the lease nothing is assumed


def test_check_args_validates_as_invoke_does() -> None:
    """The argument check rejects what the tool's schema rejects (validators included),
    ignores the fields a tool node injects, and leaves schema-less tools to the tool."""

    class Booking(BaseModel):
        parcel: str
        weight_kg: float

        @field_validator("weight_kg")
        @classmethod
        def positive(cls, value: float) -> float:
            if value <= 0:
                raise ValueError("a parcel weighs something")
            return value

    @tool(args_schema=Booking)
    def book(parcel: str, weight_kg: float) -> str:
        """Book a parcel."""
        return parcel

    @tool
    def label(parcel: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
        """Print a label."""
        return parcel

    check_args(book, {"parcel": "P-1", "weight_kg": 2})
    with pytest.raises(ValidationError, match="weighs something"):
        check_args(book, {"parcel": "P-1", "weight_kg": 0})
    check_args(label, {"parcel": "P-1"})
    with pytest.raises(ValidationError):
        check_args(label, {})
    check_args(Tool.from_function(func=str.upper, name="up", description="d"), {"q": "x"})


# --- business keys outlive the thread that wrote them -----------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_deleting_a_thread_keeps_its_business_keys(cp: Any, courier: Courier, form: str) -> None:
    """A parcel shipped under a business key by a deleted thread is not shipped again by
    another thread; its default-key effects and the rest of its records are gone, and
    ``forget_effects=True`` forgets the business key too."""
    business = ship_tool(courier, key=lambda a: f"ship:{a['parcel']}")
    ask(build(form, cp, [business], ClerkModel()), "t-1", "ship P-1 to Berlin")
    ask(build(form, cp, [ship_tool(courier)], ClerkModel()), "t-1", "ship P-2 to Rome")
    assert sorted(e.status for e in cp.ledger("t-1")) == [LedgerStatus.COMMITTED] * 2

    cp.delete_thread("t-1")

    (kept,) = cp.ledger()
    assert (kept.key, kept.status) == ("ship:P-1", LedgerStatus.COMMITTED)
    assert cp.events("t-1") == []
    again = ask(build(form, cp, [business], ClerkModel()), "t-2", "ship P-1 to Berlin")
    assert courier.bookings("P-1") == 1
    assert again["messages"][-1].content == "success: TRK-P-1-1"

    cp.delete_thread("t-1", forget_effects=True)
    assert cp.ledger() == []
    ask(build(form, cp, [business], ClerkModel()), "t-3", "ship P-1 to Berlin")
    assert courier.bookings("P-1") == 2  # forgotten on request: the key no longer dedups
