"""Every branch of the ledger's reconcile rules, driven through a real compiled agent.

Each test leaves the ledger the way an earlier run would have left it (finished, crashed
mid-call, failed), by writing an entry under the business key the executor will compute
(``biz:<order>``), and then runs ``create_recovery_agent`` with a scripted chat model on a real
SQLite file or PostgreSQL database. The assertions look at three things: what the in-process
payment service saw, what the ledger now holds, and which events were logged.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool, tool
from langgraph.graph.state import CompiledStateGraph
from pydantic import Field

from taskpilots_graph import (
    Done,
    EventKind,
    Invocation,
    LedgerEntry,
    LedgerStatus,
    NotDone,
    PendingTakeover,
    RecoveryCheckpointer,
    Unknown,
    create_recovery_agent,
    current_invocation,
    resume,
    side_effect,
)
from taskpilots_graph.ledger import PrecheckOutcome, args_digest
from taskpilots_graph.policy import ToolPolicy

ARGS: dict[str, Any] = {"order": "o-1", "amount": 40}
KEY = "biz:o-1"

# --- backends ---------------------------------------------------------------------------------


# The backend fixtures (conn_string, cp) are in conftest.py.


# --- the scripted model and the simulated service ---------------------------------------------


class ScriptedModel(BaseChatModel):
    """Calls ``charge`` once, then answers; decides from the messages, never from a counter."""

    asked: list[int] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "scripted-reconcile-test"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedModel:  # type: ignore[override]
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        self.asked.append(len(messages))
        results = [m for m in messages if isinstance(m, ToolMessage)]
        if results:
            message = AIMessage(f"done: {results[-1].content}")
        else:
            call = {"name": "charge", "args": dict(ARGS), "id": f"call_{uuid.uuid4().hex[:12]}"}
            message = AIMessage("", tool_calls=[call])
        return ChatResult(generations=[ChatGeneration(message=message)])


class AmountRejected(ValueError):
    """The client's own check, before any request: it declares that nothing was sent."""

    maybe_sent = False


@dataclass
class PaymentService:
    """In-process payment service: receipts by idempotency key, and every execution seen.

    ``behaviours`` is consumed one per execution (default ``"ok"``): ``"refused"`` and
    ``"invalid"`` fail before anything is charged (the latter says so: ``maybe_sent`` is
    false on :class:`AmountRejected`), ``"timeout"`` charges and then times out.
    """

    behaviours: list[str] = field(default_factory=list)
    receipts: dict[str, str] = field(default_factory=dict)
    executions: list[Invocation] = field(default_factory=list)
    prechecks: list[str] = field(default_factory=list)

    def charge(self, order: str, amount: int) -> str:
        inv = current_invocation()
        self.executions.append(inv)
        behaviour = self.behaviours.pop(0) if self.behaviours else "ok"
        if behaviour == "refused":
            raise ConnectionRefusedError("payment gateway refused the connection")
        if behaviour == "invalid":
            raise AmountRejected("amount rejected by client-side validation")
        receipt = self.receipts.setdefault(inv.key, f"receipt-{order}-{amount}")
        if behaviour == "timeout":
            raise TimeoutError("no response from the payment gateway within 5 s")
        return receipt

    def find(self, key: str, args: dict[str, Any]) -> PrecheckOutcome:
        self.prechecks.append(key)
        if key in self.receipts:
            return Done(result=self.receipts[key], proof={"receipt": self.receipts[key]})
        return NotDone()

    def cannot_tell(self, key: str, args: dict[str, Any]) -> PrecheckOutcome:
        self.prechecks.append(key)
        return Unknown("the gateway's search API is down")


def charge_tool(service: PaymentService, **options: Any) -> BaseTool:
    @tool
    def charge(order: str, amount: int) -> str:
        """Charge a customer's order."""
        return service.charge(order, amount)

    return side_effect(charge, key=lambda a: f"biz:{a['order']}", **options)


# One attempt, then the run fails: these tests look at what the ledger does with a single
# execution; retries belong to the recovery router (tests/test_drills.py).
SINGLE_ATTEMPT = ToolPolicy(max_attempts=1, on_exhausted="fail")


def stopped_on_uncertain(result: dict[str, Any]) -> dict[str, Any]:
    """The run stopped on a takeover that names the uncertain effect by its key."""
    (pending,) = result["__interrupt__"]
    request: dict[str, Any] = pending.value
    assert [e["key"] for e in request["uncertain_effects"]] == [KEY]
    assert request["failure"]["kind"] == "side_effect_uncertain"
    return request


def build(cp: RecoveryCheckpointer, tool_: BaseTool) -> CompiledStateGraph[Any, Any, Any, Any]:
    return create_recovery_agent(
        ScriptedModel(), [tool_], checkpointer=cp, default_policy=SINGLE_ATTEMPT
    )


def run(graph: CompiledStateGraph[Any, Any, Any, Any], thread_id: str) -> dict[str, Any]:
    config = {"configurable": {"thread_id": thread_id}}
    result: dict[str, Any] = graph.invoke({"messages": [HumanMessage("charge order o-1")]}, config)
    return result


def seed(
    cp: RecoveryCheckpointer,
    status: LedgerStatus,
    *,
    result: Any = None,
    error: dict[str, Any] | None = None,
) -> LedgerEntry:
    """Write the entry an earlier run (thread ``earlier``) left under ``KEY``."""
    now = datetime.now(UTC)
    entry = LedgerEntry(
        key=KEY,
        thread_id="earlier",
        tool="charge",
        status=status,
        args=ARGS,
        args_digest=args_digest(ARGS),
        attempt=1,
        created_at=now,
        updated_at=now,
        tool_call_id="call_earlier",
        result=result,
        error=error,
    )
    cp.write_ledger(entry, expect=None)
    return entry


def entry(cp: RecoveryCheckpointer) -> LedgerEntry:
    found = cp.ledger_entry(KEY)
    assert found is not None
    return found


def kinds(cp: RecoveryCheckpointer, thread_id: str) -> list[str]:
    return [e.kind.value for e in cp.events(thread_id)]


def payloads(cp: RecoveryCheckpointer, thread_id: str, kind: EventKind) -> list[dict[str, Any]]:
    return [dict(e.payload) for e in cp.events(thread_id) if e.kind is kind]


def tool_messages(result: dict[str, Any]) -> list[ToolMessage]:
    return [m for m in result["messages"] if isinstance(m, ToolMessage)]


# --- no entry ---------------------------------------------------------------------------------


def test_no_entry_intends_executes_and_commits(cp: RecoveryCheckpointer) -> None:
    """Without an entry the tool runs once (attempt 1, business key) and its result is committed."""
    service = PaymentService()
    result = run(build(cp, charge_tool(service)), "t")

    assert [(i.key, i.attempt) for i in service.executions] == [(KEY, 1)]
    committed = entry(cp)
    assert (committed.status, committed.attempt) == (LedgerStatus.COMMITTED, 1)
    assert committed.result == "receipt-o-1-40"
    assert [m.content for m in tool_messages(result)] == ["receipt-o-1-40"]
    assert "tool_skipped" not in kinds(cp, "t")


# --- committed / compensated ------------------------------------------------------------------


@pytest.mark.parametrize("status", [LedgerStatus.COMMITTED, LedgerStatus.COMPENSATED])
def test_finished_entry_returns_recorded_result_without_calling(
    cp: RecoveryCheckpointer, status: LedgerStatus
) -> None:
    """A committed/compensated entry hands back its recorded result; the tool is not called."""
    service = PaymentService()
    seed(cp, status, result="receipt-from-earlier")
    result = run(build(cp, charge_tool(service)), "t")

    assert service.executions == []
    assert [m.content for m in tool_messages(result)] == ["receipt-from-earlier"]
    assert tool_messages(result)[0].status == "success"
    assert [p["key"] for p in payloads(cp, "t", EventKind.TOOL_SKIPPED)] == [KEY]
    assert "tool_invoked" not in kinds(cp, "t")
    after = entry(cp)
    assert (after.status, after.attempt, after.thread_id) == (status, 1, "earlier")


# --- intended (crashed mid-call) --------------------------------------------------------------


def test_intended_with_precheck_done_commits_with_its_proof(cp: RecoveryCheckpointer) -> None:
    """Intended + pre-check Done: committed with the pre-check's result and proof, no call."""
    service = PaymentService(receipts={KEY: "receipt-made-before-crash"})
    seed(cp, LedgerStatus.INTENDED)
    result = run(build(cp, charge_tool(service, precheck=service.find)), "t")

    assert service.executions == []
    assert service.prechecks == [KEY]
    done = entry(cp)
    assert done.status is LedgerStatus.COMMITTED
    assert done.result == "receipt-made-before-crash"
    assert done.proof == {"receipt": "receipt-made-before-crash"}
    assert done.extra["reconciled"] == "precheck_done"
    assert [m.content for m in tool_messages(result)] == ["receipt-made-before-crash"]
    (reconciled,) = payloads(cp, "t", EventKind.EFFECT_RECONCILED)
    assert reconciled["outcome"] == "done"
    assert reconciled["proof"] == {"receipt": "receipt-made-before-crash"}
    assert "tool_invoked" not in kinds(cp, "t")


def test_intended_with_precheck_not_done_executes_again_with_same_key(
    cp: RecoveryCheckpointer,
) -> None:
    """Intended + pre-check NotDone: executed once more under the same key, as attempt 2."""
    service = PaymentService()
    seed(cp, LedgerStatus.INTENDED)
    run(build(cp, charge_tool(service, precheck=service.find)), "t")

    assert [(i.key, i.attempt) for i in service.executions] == [(KEY, 2)]
    done = entry(cp)
    assert (done.status, done.attempt) == (LedgerStatus.COMMITTED, 2)
    assert done.result == "receipt-o-1-40"
    assert [p["outcome"] for p in payloads(cp, "t", EventKind.EFFECT_RECONCILED)] == ["not_done"]


@pytest.mark.parametrize("with_precheck", [True, False], ids=["unknown", "no-precheck"])
def test_intended_unknown_idempotent_executes_again_with_same_key(
    cp: RecoveryCheckpointer, with_precheck: bool
) -> None:
    """Intended + Unknown (or no pre-check) + idempotent: re-executed under the same key."""
    service = PaymentService()
    precheck = service.cannot_tell if with_precheck else None
    seed(cp, LedgerStatus.INTENDED)
    run(build(cp, charge_tool(service, precheck=precheck, idempotent=True)), "t")

    assert [(i.key, i.attempt) for i in service.executions] == [(KEY, 2)]
    assert service.prechecks == ([KEY] if with_precheck else [])
    assert (entry(cp).status, entry(cp).attempt) == (LedgerStatus.COMMITTED, 2)
    outcomes = [p["outcome"] for p in payloads(cp, "t", EventKind.EFFECT_RECONCILED)]
    assert outcomes == ["unknown_idempotent"]


@pytest.mark.parametrize("with_precheck", [True, False], ids=["unknown", "no-precheck"])
def test_intended_unknown_non_idempotent_stops_uncertain(
    cp: RecoveryCheckpointer, with_precheck: bool
) -> None:
    """Intended + Unknown (or no pre-check) + not idempotent: SideEffectUncertain, no call."""
    service = PaymentService()
    precheck = service.cannot_tell if with_precheck else None
    seed(cp, LedgerStatus.INTENDED)
    graph = build(cp, charge_tool(service, precheck=precheck))

    request = stopped_on_uncertain(run(graph, "t"))

    assert (request["thread_id"], request["pending"][0]["tool"]) == ("t", "charge")
    assert service.executions == []
    assert entry(cp).status is LedgerStatus.UNCERTAIN
    assert len(payloads(cp, "t", EventKind.EFFECT_UNCERTAIN)) == 1


def test_uncertain_entry_waits_for_a_person_on_resume_without_calling(
    cp: RecoveryCheckpointer,
) -> None:
    """Once uncertain, resuming the thread never executes: it waits on a person."""
    service = PaymentService()
    seed(cp, LedgerStatus.INTENDED)
    graph = build(cp, charge_tool(service, precheck=service.cannot_tell))
    stopped_on_uncertain(run(graph, "t"))

    with pytest.raises(PendingTakeover):
        resume(graph, "t")
    assert kinds(cp, "t").count("run_resumed") == 0  # refused before anything ran

    assert service.executions == []
    assert service.prechecks == [KEY]  # the second attempt does not even ask again
    assert entry(cp).status is LedgerStatus.UNCERTAIN
    assert kinds(cp, "t").count("effect_uncertain") == 1


def test_precheck_that_raises_counts_as_unknown(cp: RecoveryCheckpointer) -> None:
    """A pre-check that raises fails closed: treated as Unknown, the effect is not re-executed."""
    service = PaymentService()

    def broken(key: str, args: dict[str, Any]) -> PrecheckOutcome:
        raise OSError("search endpoint unreachable")

    seed(cp, LedgerStatus.INTENDED)
    stopped_on_uncertain(run(build(cp, charge_tool(service, precheck=broken)), "t"))
    assert "could not tell" in payloads(cp, "t", EventKind.EFFECT_UNCERTAIN)[0]["reason"]

    assert service.executions == []
    assert entry(cp).status is LedgerStatus.UNCERTAIN


# --- failures ---------------------------------------------------------------------------------


@pytest.mark.parametrize("behaviour", ["refused", "invalid"])
def test_failure_before_send_is_recorded_as_not_sent(
    cp: RecoveryCheckpointer, behaviour: str
) -> None:
    """ConnectionRefusedError / an error with maybe_sent=False: entry failed, not sent."""
    service = PaymentService(behaviours=[behaviour])
    result = run(build(cp, charge_tool(service, precheck=service.find)), "t")

    failed = entry(cp)
    assert failed.status is LedgerStatus.FAILED
    assert failed.error is not None
    assert failed.error["maybe_sent"] is False
    expected = {
        "refused": "builtins.ConnectionRefusedError",
        "invalid": f"{__name__}.AmountRejected",
    }[behaviour]
    assert failed.error["type"] == expected
    (message,) = tool_messages(result)
    assert message.status == "error"
    assert expected.rpartition(".")[2] in str(message.content)
    assert service.prechecks == []  # nothing can have happened: no need to ask
    assert service.receipts == {}
    assert [p["maybe_sent"] for p in payloads(cp, "t", EventKind.TOOL_FAILED)] == [False]


def test_retry_after_failure_before_send_executes_with_same_key(cp: RecoveryCheckpointer) -> None:
    """A later run under the key of a not-sent failure executes again (attempt 2), no pre-check."""
    service = PaymentService(behaviours=["refused"])
    graph = build(cp, charge_tool(service, precheck=service.find))
    run(graph, "first")

    result = run(graph, "retry")

    assert [(i.key, i.attempt) for i in service.executions] == [(KEY, 1), (KEY, 2)]
    assert service.prechecks == []
    done = entry(cp)
    assert (done.status, done.attempt, done.error) == (LedgerStatus.COMMITTED, 2, None)
    assert [m.content for m in tool_messages(result)] == ["receipt-o-1-40"]


def test_failure_after_send_with_precheck_done_commits_without_repeat(
    cp: RecoveryCheckpointer,
) -> None:
    """TimeoutError after the charge: the pre-check runs at once, finds it, and commits it."""
    service = PaymentService(behaviours=["timeout"])
    result = run(build(cp, charge_tool(service, precheck=service.find)), "t")

    assert len(service.executions) == 1
    assert service.prechecks == [KEY]
    done = entry(cp)
    assert (done.status, done.attempt) == (LedgerStatus.COMMITTED, 1)
    assert done.proof == {"receipt": "receipt-o-1-40"}
    (message,) = tool_messages(result)
    assert (message.status, message.content) == ("success", "receipt-o-1-40")
    log = kinds(cp, "t")
    assert log.index("tool_failed") < log.index("effect_reconciled")
    assert payloads(cp, "t", EventKind.TOOL_FAILED)[0]["maybe_sent"] is True


def test_failure_after_send_with_precheck_not_done_reports_error(
    cp: RecoveryCheckpointer,
) -> None:
    """TimeoutError, pre-check NotDone: the model sees the error; entry stays failed, maybe-sent."""
    service = PaymentService(behaviours=["timeout"])

    def nothing_found(key: str, args: dict[str, Any]) -> PrecheckOutcome:
        service.prechecks.append(key)
        return NotDone()

    result = run(build(cp, charge_tool(service, precheck=nothing_found)), "t")

    assert len(service.executions) == 1
    assert service.prechecks == [KEY]
    failed = entry(cp)
    assert failed.status is LedgerStatus.FAILED
    assert failed.error is not None
    assert failed.error["maybe_sent"] is True
    assert tool_messages(result)[0].status == "error"
    assert [p["outcome"] for p in payloads(cp, "t", EventKind.EFFECT_RECONCILED)] == ["not_done"]


def test_failure_after_send_without_precheck_non_idempotent_is_uncertain(
    cp: RecoveryCheckpointer,
) -> None:
    """TimeoutError, no pre-check, not idempotent: SideEffectUncertain, entry uncertain, 1 call."""
    service = PaymentService(behaviours=["timeout"])
    graph = build(cp, charge_tool(service))

    stopped_on_uncertain(run(graph, "t"))
    assert "TimeoutError" in payloads(cp, "t", EventKind.EFFECT_UNCERTAIN)[0]["reason"]

    assert len(service.executions) == 1
    uncertain = entry(cp)
    assert uncertain.status is LedgerStatus.UNCERTAIN
    assert uncertain.error is not None
    assert uncertain.error["maybe_sent"] is True
    with pytest.raises(PendingTakeover):
        resume(graph, "t")
    assert len(service.executions) == 1
