"""The think node: one model decision, replayed from the record when a run is repeated.

If the act node recorded the decision taken on exactly this conversation (it does when the
checkpoint holding the decision might not be durable yet), the model is not asked again: a
new answer would carry new tool-call ids, so new invocation keys, and the ledger could no
longer recognise effects already performed. A model generation that drove execution is never
re-generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.tools import BaseTool

from taskpilots_graph.checkpointers._api import RecoveryAPI
from taskpilots_graph.checkpointers.base import EventRecord, prepare_event
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.events import EventKind
from taskpilots_graph.nodes._context import RunContext, load_message, messages_digest, run_context
from taskpilots_graph.nodes._protocol import SUMMARY_CHARS

__all__ = ["ThinkNode"]


class ThinkNode:
    """Calls the model with the tools bound; replays a recorded decision instead when one exists.

    Args:
        model: A LangChain chat model that supports ``bind_tools``.
        tools: The tools offered to the model.
        checkpointer: The recovery checkpointer of the graph.
        prompt: An optional system prompt, prepended at call time (not stored in state).
    """

    def __init__(
        self,
        model: BaseChatModel | Runnable[LanguageModelInput, BaseMessage],
        tools: Sequence[BaseTool],
        *,
        checkpointer: RecoveryAPI,
        prompt: str | None = None,
    ) -> None:
        if tools:
            bind = getattr(model, "bind_tools", None)
            if bind is None:
                raise ConfigurationError(
                    f"{type(model).__name__} has no bind_tools(); "
                    "use a chat model that supports tool calling"
                )
            model = bind(list(tools))
        self.model: Runnable[LanguageModelInput, BaseMessage] = model
        self.checkpointer = checkpointer
        self.prompt = prompt

    def _input(self, messages: Sequence[BaseMessage]) -> list[BaseMessage]:
        return [SystemMessage(self.prompt), *messages] if self.prompt else list(messages)

    @staticmethod
    def _events(
        ctx: RunContext, messages: Sequence[BaseMessage], ai: AIMessage, replayed: bool
    ) -> list[EventRecord]:
        def event(kind: EventKind, **payload: Any) -> EventRecord:
            return prepare_event(
                ctx.thread_id, kind, payload, checkpoint_id=None, checkpoint_ns=ctx.graph_ns
            )

        events = []
        if messages and isinstance(messages[-1], HumanMessage):
            events.append(
                event(EventKind.AGENT_STARTED, goal=str(messages[-1].content)[:SUMMARY_CHARS])
            )
        if replayed:
            events.append(
                event(EventKind.LLM_DECIDED, replayed=True, tool_calls=len(ai.tool_calls))
            )
        if not ai.tool_calls:
            # Decisions with tool calls are logged by the act node with its first write.
            events.append(event(EventKind.LLM_DECIDED, content=str(ai.content)[:SUMMARY_CHARS]))
            events.append(event(EventKind.AGENT_FINISHED, answer=str(ai.content)[:SUMMARY_CHARS]))
        return events

    @staticmethod
    def _as_ai(message: BaseMessage) -> AIMessage:
        if not isinstance(message, AIMessage):
            raise ConfigurationError(
                f"the model returned a {type(message).__name__}, expected an AIMessage"
            )
        return message

    def invoke(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """Decide the next action synchronously."""
        ctx = run_context(config)
        messages = state["messages"]
        recorded = self.checkpointer.decision(
            ctx.thread_id, ctx.graph_ns, messages_digest(messages)
        )
        if recorded is not None:
            ai = self._as_ai(load_message(recorded))
        else:
            ai = self._as_ai(self.model.invoke(self._input(messages), config))
        self.checkpointer.append_records(self._events(ctx, messages, ai, recorded is not None))
        return {"messages": [ai]}

    async def ainvoke(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """Decide the next action asynchronously."""
        ctx = run_context(config)
        messages = state["messages"]
        digest = messages_digest(messages)
        recorded = await self.checkpointer.adecision(ctx.thread_id, ctx.graph_ns, digest)
        if recorded is not None:
            ai = self._as_ai(load_message(recorded))
        else:
            ai = self._as_ai(await self.model.ainvoke(self._input(messages), config))
        await self.checkpointer.aappend_records(
            self._events(ctx, messages, ai, recorded is not None)
        )
        return {"messages": [ai]}
