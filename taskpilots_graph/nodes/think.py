"""The think node: one model decision, replayed from the record when a run is repeated.

If the act node recorded the decision taken on exactly this conversation (it does when the
checkpoint holding the decision might not be durable yet), the model is not asked again: a
new answer would carry new tool-call ids, so new invocation keys, and the ledger could no
longer recognise effects already performed. A model generation that drove execution is never
re-generated.

A model call that fails (no answer at all) follows the :class:`ModelPolicy`: a few attempts
with backoff, then the next fallback model. When every model failed the error propagates and
the run stops before this node; ``resume`` asks again. A turn that needs more than
``max_steps`` decisions is STUCK and goes to a person.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.errors import GraphBubbleUp
from langgraph.graph import END
from langgraph.types import Command

from taskpilots_graph import _clock
from taskpilots_graph.checkpointers._api import RecoveryAPI
from taskpilots_graph.checkpointers.base import EventRecord, prepare_event
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.events import EventKind
from taskpilots_graph.failures import classify, failure_payload
from taskpilots_graph.nodes._context import RunContext, load_message, messages_digest, run_context
from taskpilots_graph.nodes._protocol import SUMMARY_CHARS
from taskpilots_graph.policy import ModelPolicy

__all__ = ["ThinkNode"]

Model = BaseChatModel | Runnable[LanguageModelInput, BaseMessage]


def _bind(model: Model, tools: Sequence[BaseTool]) -> Runnable[LanguageModelInput, BaseMessage]:
    if not tools:
        return model
    bind = getattr(model, "bind_tools", None)
    if bind is None:
        raise ConfigurationError(
            f"{type(model).__name__} has no bind_tools(); "
            "use a chat model that supports tool calling"
        )
    bound: Runnable[LanguageModelInput, BaseMessage] = bind(list(tools))
    return bound


def _decisions_this_turn(messages: Sequence[BaseMessage], since: int) -> int:
    count = 0
    for index in range(len(messages) - 1, max(since, 0) - 1, -1):
        message = messages[index]
        if isinstance(message, HumanMessage):
            break
        count += isinstance(message, AIMessage)
    return count


class ThinkNode:
    """Calls the model with the tools bound; replays a recorded decision instead when one exists.

    Args:
        model: A LangChain chat model that supports ``bind_tools``.
        tools: The tools offered to the model.
        checkpointer: The recovery checkpointer of the graph.
        prompt: An optional system prompt, prepended at call time (not stored in state).
        model_policy: Attempts and fallback models for failed model calls.
        max_steps: Model decisions per user turn before the run counts as STUCK.
    """

    def __init__(
        self,
        model: Model,
        tools: Sequence[BaseTool],
        *,
        checkpointer: RecoveryAPI,
        prompt: str | None = None,
        model_policy: ModelPolicy | None = None,
        max_steps: int = 50,
    ) -> None:
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ConfigurationError(f"max_steps must be an int ≥ 1, got {max_steps!r}")
        self.policy = model_policy or ModelPolicy()
        self.models = [_bind(m, tools) for m in (model, *self.policy.fallbacks)]
        self.checkpointer = checkpointer
        self.prompt = prompt
        self.max_steps = max_steps

    def _input(self, messages: Sequence[BaseMessage]) -> list[BaseMessage]:
        return [SystemMessage(self.prompt), *messages] if self.prompt else list(messages)

    @staticmethod
    def _event(ctx: RunContext, kind: EventKind, **payload: Any) -> EventRecord:
        return prepare_event(
            ctx.thread_id, kind, payload, checkpoint_id=None, checkpoint_ns=ctx.graph_ns
        )

    def _start(
        self, state: Mapping[str, Any], ctx: RunContext
    ) -> tuple[list[EventRecord], Command[str] | None]:
        messages = state["messages"]
        events = []
        if messages and isinstance(messages[-1], HumanMessage):
            events.append(
                self._event(
                    ctx, EventKind.AGENT_STARTED, goal=str(messages[-1].content)[:SUMMARY_CHARS]
                )
            )
        since = int((state.get("flow") or {}).get("budget_from", 0))
        if _decisions_this_turn(messages, since) >= self.max_steps:
            reason = f"stuck: {self.max_steps} model decisions in this turn without an answer"
            events.append(self._event(ctx, EventKind.STUCK_DETECTED, reason=reason))
            events.append(self._event(ctx, EventKind.TAKEOVER_REQUESTED, reason=reason))
            flow = {"stage": "awaiting_human", "takeover": True, "reason": reason}
            return events, Command(goto="takeover", update={"flow": flow})
        return events, None

    def _finish(
        self, ctx: RunContext, ai: BaseMessage, replayed: bool, events: list[EventRecord]
    ) -> Command[str]:
        if not isinstance(ai, AIMessage):
            raise ConfigurationError(
                f"the model returned a {type(ai).__name__}, expected an AIMessage"
            )
        if replayed:
            events.append(
                self._event(
                    ctx, EventKind.LLM_DECIDED, replayed=True, tool_calls=len(ai.tool_calls)
                )
            )
        if ai.tool_calls:
            # Decisions with tool calls are logged by the act node with its first write.
            return Command(goto="act", update={"messages": [ai]})
        answer = str(ai.content)[:SUMMARY_CHARS]
        events.append(self._event(ctx, EventKind.LLM_DECIDED, content=answer))
        events.append(self._event(ctx, EventKind.AGENT_FINISHED, status="closed", answer=answer))
        return Command(goto=END, update={"messages": [ai], "flow": {"stage": "closed"}})

    def _failed(
        self, ctx: RunContext, index: int, attempt: int, exc: Exception
    ) -> tuple[EventRecord, float]:
        failure = classify(exc)
        event = self._event(
            ctx,
            EventKind.MODEL_FAILED,
            model=index,
            attempt=attempt,
            failure=failure_payload(failure),
        )
        delay = failure.retry_after or self.policy.backoff.delay(attempt)
        return event, delay

    def invoke(self, state: dict[str, Any], config: RunnableConfig) -> Command[str]:
        """Decide the next action synchronously."""
        ctx = run_context(config)
        events, stuck = self._start(state, ctx)
        if stuck is not None:
            self.checkpointer.append_records(events)
            return stuck
        messages = state["messages"]
        recorded = self.checkpointer.decision(
            ctx.thread_id, ctx.graph_ns, messages_digest(messages)
        )
        try:
            if recorded is not None:
                ai = load_message(recorded)
            else:
                ai = self._call(ctx, messages, config, events)
            return self._finish(ctx, ai, recorded is not None, events)
        finally:
            self.checkpointer.append_records(events)

    def _call(
        self,
        ctx: RunContext,
        messages: Sequence[BaseMessage],
        config: RunnableConfig,
        events: list[EventRecord],
    ) -> BaseMessage:
        last: Exception | None = None
        for index, model in enumerate(self.models):
            for attempt in range(1, self.policy.max_attempts + 1):
                try:
                    return model.invoke(self._input(messages), config)
                except GraphBubbleUp:
                    raise
                except Exception as exc:
                    last = exc
                    event, delay = self._failed(ctx, index, attempt, exc)
                    events.append(event)
                    if attempt < self.policy.max_attempts:
                        _clock.sleep(delay)
        assert last is not None
        raise last

    async def ainvoke(self, state: dict[str, Any], config: RunnableConfig) -> Command[str]:
        """Decide the next action asynchronously."""
        ctx = run_context(config)
        events, stuck = self._start(state, ctx)
        if stuck is not None:
            await self.checkpointer.aappend_records(events)
            return stuck
        messages = state["messages"]
        digest = messages_digest(messages)
        recorded = await self.checkpointer.adecision(ctx.thread_id, ctx.graph_ns, digest)
        try:
            if recorded is not None:
                ai = load_message(recorded)
            else:
                ai = await self._acall(ctx, messages, config, events)
            return self._finish(ctx, ai, recorded is not None, events)
        finally:
            await self.checkpointer.aappend_records(events)

    async def _acall(
        self,
        ctx: RunContext,
        messages: Sequence[BaseMessage],
        config: RunnableConfig,
        events: list[EventRecord],
    ) -> BaseMessage:
        last: Exception | None = None
        for index, model in enumerate(self.models):
            for attempt in range(1, self.policy.max_attempts + 1):
                try:
                    return await model.ainvoke(self._input(messages), config)
                except GraphBubbleUp:
                    raise
                except Exception as exc:
                    last = exc
                    event, delay = self._failed(ctx, index, attempt, exc)
                    events.append(event)
                    if attempt < self.policy.max_attempts:
                        await _clock.asleep(delay)
        assert last is not None
        raise last
