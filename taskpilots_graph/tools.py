"""Declaring side-effecting tools: ``@side_effect`` and ``current_invocation()``."""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack, overload

from langchain_core.callbacks import AsyncCallbackManagerForToolRun, CallbackManagerForToolRun
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, StructuredTool
from pydantic import BaseModel, ConfigDict, ValidationError

from taskpilots_graph.drift import placeholder, unserialisable
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.ledger import (
    Compensate,
    CompensatePrecheck,
    KeyFn,
    LockFn,
    Precheck,
    SideEffectSpec,
)

__all__ = [
    "Invocation",
    "SideEffectTool",
    "check_args",
    "current_invocation",
    "side_effect",
    "spec_of",
]


@dataclass(frozen=True, slots=True)
class Invocation:
    """The ledger's view of the tool call being executed.

    Attributes:
        key: The invocation key; pass it to the service as its idempotency key.
        attempt: 1 for the first execution under this key, then 2, 3, ...
        thread_id: The thread running the call.
        tool_call_id: The model's id for the call, if it came from a model.
        tool: The tool's name.
        fencing: The fencing token of the business lock held for this call (tools declared
            with ``lock=`` on an agent with a lease backend), else ``None``. Pass it to a
            service that can refuse writes from a superseded lock holder. It is also
            recorded on the ledger entry as ``extra["fencing"]``.
    """

    key: str
    attempt: int
    thread_id: str
    tool_call_id: str | None
    tool: str
    fencing: int | None = None


_CURRENT: contextvars.ContextVar[Invocation | None] = contextvars.ContextVar(
    "taskpilots_invocation", default=None
)


def current_invocation() -> Invocation:
    """The invocation being executed, from inside a side-effecting tool.

    Raises:
        ConfigurationError: When called outside a tool run by the recovery executor.
    """
    inv = _CURRENT.get()
    if inv is None:
        raise ConfigurationError(
            "current_invocation() is only available inside a @side_effect tool run through "
            f"the ledger: {_LEDGER_RUNNERS}"
        )
    return inv


def invocation_key() -> str | None:
    """The key of the invocation being executed, or ``None`` outside the ledger (a tool run
    by LangGraph's own ``ToolNode`` has none)."""
    inv = _CURRENT.get()
    return inv.key if inv is not None else None


_LEDGER_RUNNERS = (
    "use tp.ToolNode(tools) instead of LangGraph's ToolNode in your own graph, "
    "taskpilots_graph.nodes.RecoveryExecutor(tools) as its tools node, "
    "tp.create_recovery_agent(...), or "
    "tp.RecoveryMiddleware(cp) in create_agent(..., middleware=[...]); compile or create "
    "the graph with a tp.RecoveryCheckpointer"
)


def _outside_ledger(name: str) -> ConfigurationError:
    return ConfigurationError(
        f"side-effect tool {name!r} was run outside the side-effect ledger (by LangGraph's "
        "own ToolNode, a direct .invoke(), ...): it was not executed, since nothing would "
        "record it and a crash could repeat it. To run it, " + _LEDGER_RUNNERS
    )


def set_invocation(inv: Invocation | None) -> contextvars.Token[Invocation | None]:
    """Make ``inv`` current (executor use); reset with the returned token."""
    return _CURRENT.set(inv)


def reset_invocation(token: contextvars.Token[Invocation | None]) -> None:
    """Restore the invocation that was current before :func:`set_invocation`."""
    _CURRENT.reset(token)


class SideEffectTool(BaseTool):
    """A tool whose calls go through the side-effect ledger when run by the executor.

    It has the wrapped tool's name, description and argument schema, so a model sees no
    difference. Run anywhere the ledger cannot reach (LangGraph's own ``ToolNode``, a
    direct ``.invoke()``) it raises :class:`~taskpilots_graph.ConfigurationError` naming
    what to use instead, before the wrapped tool runs: an effect nobody records could be
    repeated after a crash, which is what the declaration exists to prevent.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    tool: BaseTool
    spec: SideEffectSpec

    def _run(
        self,
        *args: Any,
        config: RunnableConfig,
        run_manager: CallbackManagerForToolRun | None = None,
        **kwargs: Any,
    ) -> Any:
        if _CURRENT.get() is None:
            raise _outside_ledger(self.name)
        return _recordable(self.tool.invoke(args[0] if args else kwargs, config=config))

    async def _arun(
        self,
        *args: Any,
        config: RunnableConfig,
        run_manager: AsyncCallbackManagerForToolRun | None = None,
        **kwargs: Any,
    ) -> Any:
        if _CURRENT.get() is None:
            raise _outside_ledger(self.name)
        return _recordable(await self.tool.ainvoke(args[0] if args else kwargs, config=config))


def _recordable(result: Any) -> Any:
    """A result that cannot be serialised at all, as its placeholder text.

    Run by the tool node (the middleware form), whose message would otherwise fail (an
    object whose ``str()`` raises) or hide the problem: the effect happened, so its answer
    must become a message and a commit, flagged like the executor's.
    """
    why = unserialisable(result)
    return result if why is None else placeholder(result, why)


def check_args(tool: BaseTool, args: Mapping[str, Any]) -> None:
    """Raise the tool's own ``ValidationError`` if its argument schema rejects ``args``.

    Run before a side effect's intent is written, so that arguments the tool would refuse
    before its body starts fail as "not sent", and an error raised once the body runs is
    known to come from the body (where it may follow the effect). It validates as
    ``BaseTool.invoke`` does: against the tool's ``args_schema`` when that is a pydantic
    model (its validators included), not at all otherwise. Fields the tool node injects
    (``InjectedToolArg``, ``ToolRuntime``) are not the model's to give, so their absence
    is no error.
    """
    schema = tool.args_schema
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        return
    try:
        schema.model_validate(dict(args))
    except ValidationError as exc:
        # The model-facing schema lacks the injected fields.
        given = getattr(tool.tool_call_schema, "model_fields", None) or schema.model_fields
        injected = set(schema.model_fields) - set(given)
        if any(
            not (error["type"] == "missing" and error["loc"] and error["loc"][0] in injected)
            for error in exc.errors()
        ):
            raise


def twin(
    original: BaseTool,
    func: Callable[..., Any],
    coroutine: Callable[..., Awaitable[Any]] | None = None,
) -> BaseTool:
    """A tool with the name, description and schema of ``original`` that runs ``func`` (and
    ``coroutine``); a ``@side_effect`` declaration of ``original`` is kept."""
    inner = original.tool if isinstance(original, SideEffectTool) else original
    wrapped: BaseTool = StructuredTool(
        name=inner.name,
        description=inner.description,
        args_schema=inner.args_schema or inner.get_input_schema(),
        func=func,
        coroutine=coroutine,
    )
    if isinstance(original, SideEffectTool):
        wrapped = SideEffectTool(
            name=original.name,
            description=original.description,
            args_schema=original.args_schema,
            tool=wrapped,
            spec=original.spec,
        )
    return wrapped


def spec_of(tool: BaseTool) -> SideEffectSpec | None:
    """The side-effect declaration of ``tool``, or ``None`` for a pure tool."""
    return tool.spec if isinstance(tool, SideEffectTool) else None


class _Options(TypedDict, total=False):
    """The options of :func:`side_effect`, for its typed overloads."""

    precheck: Precheck | None
    compensate: Compensate | None
    idempotent: bool
    key: KeyFn | None
    lock: LockFn | None
    confirm_drift: bool
    drift_comparator: Callable[[Any, Any], bool] | None
    not_sent: tuple[type[BaseException], ...]
    repeatable: bool
    precheck_timeout: float | None
    compensate_precheck: CompensatePrecheck | None


@overload
def side_effect(tool: BaseTool, **options: Unpack[_Options]) -> SideEffectTool: ...


@overload
def side_effect(
    tool: None = None, **options: Unpack[_Options]
) -> Callable[[BaseTool], SideEffectTool]: ...


def side_effect(
    tool: BaseTool | None = None,
    *,
    precheck: Precheck | None = None,
    compensate: Compensate | None = None,
    idempotent: bool = False,
    key: KeyFn | None = None,
    lock: LockFn | None = None,
    confirm_drift: bool = False,
    drift_comparator: Callable[[Any, Any], bool] | None = None,
    not_sent: tuple[type[BaseException], ...] = (),
    repeatable: bool = False,
    precheck_timeout: float | None = 30.0,
    compensate_precheck: CompensatePrecheck | None = None,
) -> SideEffectTool | Callable[[BaseTool], SideEffectTool]:
    """Declare a LangChain tool as side-effecting, so the executor runs it through the ledger.

    Use it above ``@tool`` or call it on a ``BaseTool``::

        @tp.side_effect(precheck=ticket_exists)
        @tool
        def create_ticket(customer_id: str, subject: str) -> str:
            return helpdesk.create(customer_id, subject, request_key=tp.current_invocation().key)

    Args:
        tool: The tool (when called directly rather than as a decorator).
        precheck: ``precheck(key, args) -> Done | NotDone | Unknown`` asks the external system
            whether the effect already happened.
        compensate: ``compensate(key, args, result)`` undoes a committed effect when its run
            is abandoned (or the policy says ``on_exhausted="compensate"``, or a coordinator
            undoes shared work). The undo is a side effect of its own and goes through the
            ledger like one, under the key ``undo:<key>``: an intent is written before the
            compensator runs and a commit after, then the effect is marked
            ``compensated``; a committed undo is never run again. Inside the compensator,
            ``current_invocation().key`` is ``undo:<key>`` (pass it to the service as the
            undo's idempotency key). An undo interrupted mid-way (a crash, an error after
            its request may have left) is asked about with ``compensate_precheck``;
            without one it stops for a person (:class:`~taskpilots_graph.ledger.
            CompensationUncertain`), who decides retry, skip or provide_result: it is
            never run twice blindly. A compensator may be a coroutine function (async
            runs). Its return value is recorded as the undo's result.
        idempotent: The service deduplicates by the invocation key.
        key: ``key(args) -> str`` gives a business key shared across threads and agents.
        lock: ``lock(args) -> str`` names the business object to lock, as
            ``"<object_id>:<operation>"`` (split on the *last* ``:``, e.g.
            ``"order-42:refund"``), or just ``"<object_id>"`` (the operation is then the
            tool's name). The tool runs only while holding that business lock, in the lease
            backend named with ``leases=`` or else in the checkpointer's own database; its
            fencing token goes on the
            ledger entry (``extra["fencing"]``) and into ``current_invocation().fencing``.
            An unreachable backend fails the call closed as an ``EXTERNAL_OUTAGE`` (it is
            never run unlocked); a lock held elsewhere is waited for up to the lease TTL,
            then the call fails as ``TRANSIENT`` and is retried per policy.
        confirm_drift: When the same call runs again (a replayed step, a person's retry)
            and returns a different result than the one logged before, a person confirms
            it (accept, retry, skip, provide the result, abandon) instead of the new result
            silently replacing the old one. Without it a drift is recorded as a
            ``result_drifted`` event and the new result is taken. A committed effect is
            never run again (its recorded result is returned), so for side effects this
            concerns executions whose earlier result was logged but not committed.
        drift_comparator: ``comparator(previous, current) -> bool``, true when two results
            mean the same (e.g. ignore a timestamp field); default: equal JSON.
        not_sent: Exception types the tool raises only *before* its request leaves (its
            own input checks, say): such a failure is "not sent" and the call may run again
            under its key. Anything else raised from the tool's body counts as possibly
            sent (a reply that fails to parse arrives after the service acted), as does
            any exception without a false ``maybe_sent`` attribute. Arguments the tool's
            schema rejects never reach the body and need no declaration.
        repeatable: The same tool with the same arguments, called again in the thread, is
            meant as a second effect. By default such a call (a model that re-plans an
            effect it lost sight of) is not executed: the model gets the earlier result
            with the note "already done at step N".
        precheck_timeout: The longest the pre-check may take, in seconds (default 30;
            ``None``: no limit). A pre-check still running then counts as
            ``Unknown("pre-check timed out after N s")``: a non-idempotent effect goes to a
            person and the run ends (its thread lease is released, so a supervisor or
            another worker can take over). A synchronous pre-check runs in a daemon worker
            thread for this; a hung one cannot be killed and keeps that thread until it
            returns (its late answer is ignored). An async one is cancelled.
        compensate_precheck: ``compensate_precheck(key, args, result) -> Done | NotDone |
            Unknown`` asks the external system whether the *undo* of the effect with this
            key happened (``Done``: it did, so it is recorded and not run again;
            ``NotDone``: the effect still stands, so the compensator runs again;
            ``Unknown``: a person decides). Needs ``compensate=``; shares
            ``precheck_timeout``. This is what makes "compensated exactly once" hold for a
            compensator that is not idempotent, whatever the moment a crash hits.

    Raises:
        ConfigurationError: If the target is not a LangChain ``BaseTool`` or an option is
            of the wrong type.
    """
    spec = SideEffectSpec(
        precheck=precheck,
        compensate=compensate,
        idempotent=idempotent,
        key=key,
        lock=lock,
        confirm_drift=confirm_drift,
        drift_comparator=drift_comparator,
        not_sent=not_sent,
        repeatable=repeatable,
        precheck_timeout=precheck_timeout,
        compensate_precheck=compensate_precheck,
    )

    def wrap(target: BaseTool) -> SideEffectTool:
        if isinstance(target, SideEffectTool):
            raise ConfigurationError(f"tool {target.name!r} is already declared @side_effect")
        if not isinstance(target, BaseTool):
            raise ConfigurationError(
                "@side_effect decorates a LangChain tool: put it above @tool, or call "
                f"side_effect(tool, ...); got {type(target).__name__}"
            )
        return SideEffectTool(
            name=target.name,
            description=target.description,
            args_schema=target.args_schema,
            return_direct=target.return_direct,
            tool=target,
            spec=spec,
        )

    return wrap(tool) if tool is not None else wrap
