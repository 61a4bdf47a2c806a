"""The think node: one model decision, replayed from the record when a run is repeated.

If the act node recorded the decision taken on exactly this conversation (it does when the
checkpoint holding the decision might not be durable yet), the model is not asked again: a
new answer would carry new tool-call ids, so new invocation keys, and the ledger could no
longer recognise effects already performed. A model generation that drove execution is never
re-generated.

After ``resume`` or ``decide`` (the *resume context*), the node closes tool calls left
without an answer and, on the first decision of the run that really calls the model, runs
the registered refreshers when the pause was longer than ``refresh_after`` and gives the
model the resume prompt of :mod:`taskpilots_graph.prompts.resume` (optionally asking it to
restate the state first). Only that call marks the resume handled (``flow.resumed_seq``).

A decision replayed from the record is not such a call, and the prompt is not given then:
the replayed step must repeat the crashed run's decision exactly (same tool calls, same
ids, so the same ledger keys, and committed effects are recognised, not repeated); asking
the model instead, even with the prompt, would make a new decision with new ids. So the
resume stays pending through every replayed step, and the prompt reaches the model at the
first real call after them, with the state that the replayed steps rebuilt: under
``checkpoint_density="milestones"`` (every decision recorded, a resume starting from an
early checkpoint) that is the call after the last recorded decision; under ``every_step``
and ``tool_boundary`` usually the first decision after the resume.

A model call that fails (no answer at all) follows the :class:`ModelPolicy`: a few attempts
with backoff, then the next fallback model. When every model failed the error propagates and
the run stops before this node; ``resume`` asks again. A turn that needs more than
``max_steps`` decisions is STUCK and goes to a person.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
)
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.errors import GraphBubbleUp
from langgraph.graph import END
from langgraph.types import Command, StateSnapshot

from taskpilots_graph import _clock
from taskpilots_graph._twins import Steps, arun_steps, io, run_steps
from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.conversation import close_dangling, valid_conversation
from taskpilots_graph.engine._records import SUMMARY_CHARS
from taskpilots_graph.engine._run import (
    answer_text,
    answered,
    resume_context,
    run_finished,
    run_started,
)
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.events import EventKind, EventRecord, prepare_event
from taskpilots_graph.failures import classify, failure_payload
from taskpilots_graph.ledger import LedgerEntry
from taskpilots_graph.nodes._context import RunContext, load_message, messages_digest, run_context
from taskpilots_graph.policy import ModelPolicy
from taskpilots_graph.prompts.resume import DEFAULT_MAX_CHARS, RESUME_NAME, resume_message
from taskpilots_graph.prompts.templates import Language
from taskpilots_graph.window import (
    MemoryWindow,
    TokenCounter,
    decisions_this_turn,
    model_input,
    model_token_counter,
)

__all__ = ["RESUME_KEY", "ResumeContext", "ThinkNode", "resume_marker", "resumed_config"]

RESUME_KEY = "__taskpilots_resume__"
"""Config key set by ``resume`` / ``decide``: ``{"seq": <run_resumed event>, "age": <s>}``."""


def resumed_config(config: RunnableConfig, seq: int, snapshot: StateSnapshot) -> RunnableConfig:
    """``config`` telling the think node this run continues an earlier one (it re-anchors
    the model): the ``run_resumed`` event's ``seq`` and how long the thread was paused."""
    age = 0.0
    if snapshot.created_at:
        created = datetime.fromisoformat(snapshot.created_at)
        age = max(0.0, _clock.now() - created.timestamp())
    configurable = {**(config.get("configurable") or {}), RESUME_KEY: {"seq": seq, "age": age}}
    return cast(RunnableConfig, {**config, "configurable": configurable})


def resume_marker(state: Mapping[str, Any], config: RunnableConfig) -> Mapping[str, Any] | None:
    """The resume marker of ``config`` while the model was not asked since the resume (the
    last model message was decided before it, so its calls may have run)."""
    marker = (config.get("configurable") or {}).get(RESUME_KEY)
    if not isinstance(marker, Mapping):
        return None
    if (state.get("flow") or {}).get("resumed_seq") == marker.get("seq"):
        return None  # this resume was already handled by an earlier decision
    return marker


@dataclass(frozen=True, slots=True)
class ResumeContext:
    """How a resumed run is re-anchored before its next model call.

    Attributes:
        language: Language of the resume prompt (``"en"`` or ``"zh"``).
        max_chars: Size budget of the resume prompt.
        refreshers: Functions of the state returning current values of key data.
        refresh_after: Run the refreshers when the pause lasted longer (seconds).
        acknowledge: Ask the model to restate the state and next action first.
    """

    language: Language = "en"
    max_chars: int = DEFAULT_MAX_CHARS
    refreshers: Mapping[str, Callable[[Mapping[str, Any]], Any]] = field(default_factory=dict)
    refresh_after: float = 3600.0
    acknowledge: bool = False

    def __post_init__(self) -> None:
        if self.language not in ("en", "zh"):
            raise ConfigurationError(
                f"ResumeContext.language must be 'en' or 'zh', got {self.language!r}"
            )
        if not isinstance(self.max_chars, int) or self.max_chars < 1000:
            raise ConfigurationError(
                "ResumeContext.max_chars must be an int ≥ 1000 (room for the exact facts)"
            )


Model = BaseChatModel | Runnable[LanguageModelInput, BaseMessage]


def _bind(model: Model, tools: Sequence[BaseTool]) -> Runnable[LanguageModelInput, BaseMessage]:
    if not tools:
        return model
    if (bind := getattr(model, "bind_tools", None)) is None:
        raise ConfigurationError(
            f"{type(model).__name__} has no bind_tools(); "
            "use a chat model that supports tool calling"
        )
    bound: Runnable[LanguageModelInput, BaseMessage] = bind(list(tools))
    return bound


def _budget_used(state: Mapping[str, Any]) -> int:
    # Counted from the conversation and the memory channel (decisions an earlier version
    # folded out of the state),
    # less what was spent before a person's last decision in this user turn.
    user, used = decisions_this_turn(state["messages"], state.get("memory"))
    flow = state.get("flow") or {}
    if flow.get("budget_turn") == user:
        used -= int(flow.get("budget_from", 0))
    return used


class ThinkNode:
    """Calls the model with the tools bound; replays a recorded decision instead when one exists.

    Args:
        model: A LangChain chat model that supports ``bind_tools``.
        tools: The tools offered to the model.
        checkpointer: The recovery checkpointer of the graph.
        prompt: An optional system prompt, prepended at call time (not stored in state).
        model_policy: Attempts and fallback models for failed model calls.
        max_steps: Model decisions per user turn before the run counts as STUCK.
        resume_context: How resumed runs are re-anchored.
        milestones: Business milestones by name: predicates of the state, checked before
            each decision; the checkpoint where one first holds is a ``rewind`` target.
        memory_window: A context budget (:class:`~taskpilots_graph.window.MemoryWindow`):
            above it the oldest turns are folded out of what the model sees, counted with
            the called model's own token counter where it has one. ``None`` (default): the
            model sees the whole conversation.
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
        resume_context: ResumeContext | None = None,
        milestones: Mapping[str, Callable[[Mapping[str, Any]], bool]] | None = None,
        memory_window: MemoryWindow | None = None,
    ) -> None:
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ConfigurationError(f"max_steps must be an int ≥ 1, got {max_steps!r}")
        if memory_window is not None and not isinstance(memory_window, MemoryWindow):
            raise ConfigurationError("memory_window must be a MemoryWindow or None")
        self.policy = model_policy or ModelPolicy()
        raw = (model, *self.policy.fallbacks)
        self.models = [_bind(m, tools) for m in raw]
        self.memory_window = memory_window
        # Each model is measured with its own counter: a fallback may tokenize differently.
        self.token_counters: list[TokenCounter | None] = [
            model_token_counter(m, tools) if memory_window is not None else None for m in raw
        ]
        self.checkpointer = checkpointer
        self.prompt = prompt
        self.max_steps = max_steps
        self.resume = resume_context or ResumeContext()
        self.milestones = dict(milestones or {})

    def _input(
        self, state: Mapping[str, Any], messages: Sequence[BaseMessage], index: int
    ) -> list[BaseMessage]:
        # Whatever the state holds (new input on a thread stopped mid-call, a window cut),
        # the provider never gets a tool call without its answer: it would reject the body.
        return valid_conversation(
            model_input(
                self.prompt,
                state.get("memory"),
                messages,
                self.memory_window,
                steps=state.get("steps"),
                count_tokens=self.token_counters[index],
            )
        )

    def _start(
        self, state: Mapping[str, Any], ctx: RunContext
    ) -> tuple[list[EventRecord], Command[str] | None, list[str]]:
        """The run's first events, the takeover of a stuck turn, and the milestones."""
        started = run_started(ctx.thread_id, ctx.graph_ns, state["messages"])
        events = [started] if started is not None else []
        if _budget_used(state) >= self.max_steps:
            reason = f"stuck: {self.max_steps} model decisions in this turn without an answer"
            events.append(ctx.event(EventKind.STUCK_DETECTED, reason=reason))
            events.append(ctx.event(EventKind.TAKEOVER_REQUESTED, reason=reason))
            flow = {"stage": "awaiting_human", "takeover": True, "reason": reason}
            return events, Command(goto="takeover", update={"flow": flow}), []
        reached = set((state.get("flow") or {}).get("milestones", []))
        new = [
            name for name, holds in self.milestones.items() if name not in reached and holds(state)
        ]
        events += [
            prepare_event(
                ctx.thread_id,
                EventKind.MILESTONE_REACHED,
                {"name": name, "checkpoint_id": ctx.checkpoint_id},
                checkpoint_id=ctx.checkpoint_id,
                checkpoint_ns=ctx.graph_ns,
            )
            for name in new
        ]
        return events, None, [*sorted(reached), *new] if new else []

    @staticmethod
    def _may_replay(ctx: RunContext, marker: Mapping[str, Any] | None) -> bool:
        # A recorded decision exists only where a run stopped while its checkpoint was not
        # yet durable: after a resume, or in a run that is not "sync". A fresh "sync" run
        # skips the lookup (one read per decision saved).
        return marker is not None or ctx.durability != "sync"

    def _resume_prompt(
        self,
        ctx: RunContext,
        state: Mapping[str, Any],
        messages: Sequence[BaseMessage],
        marker: Mapping[str, Any],
        ledger: Sequence[LedgerEntry],
        events: list[EventRecord],
    ) -> HumanMessage:
        prompt, refreshed = resume_message(state, messages, ledger, marker, self.resume)
        events.append(resume_context(ctx.thread_id, ctx.graph_ns, str(prompt.content), refreshed))
        return prompt

    def _acknowledged(
        self, ctx: RunContext, ack: BaseMessage, events: list[EventRecord]
    ) -> list[BaseMessage]:
        text = str(ack.content)[:SUMMARY_CHARS]
        events.append(ctx.event(EventKind.LLM_DECIDED, acknowledgement=text))
        return [AIMessage(text), HumanMessage("Continue.", name=RESUME_NAME)]

    def _finish(
        self,
        ctx: RunContext,
        ai: BaseMessage,
        replayed: bool,
        events: list[EventRecord],
        prefix: Sequence[BaseMessage],
        marker: Mapping[str, Any] | None,
        milestones: list[str],
    ) -> Command[str]:
        if not isinstance(ai, AIMessage):
            raise ConfigurationError(
                f"the model returned a {type(ai).__name__}, expected an AIMessage"
            )
        if replayed:
            events.append(
                ctx.event(EventKind.LLM_DECIDED, replayed=True, tool_calls=len(ai.tool_calls))
            )
        update: dict[str, Any] = {"messages": [*prefix, ai]}
        # The resume is handled once the model was called with its context; a replayed
        # decision leaves it pending for the next real call of this run.
        flow = {"resumed_seq": marker.get("seq")} if marker is not None and not replayed else {}
        if milestones:
            flow["milestones"] = milestones
        if flow:
            update["flow"] = flow
        if ai.tool_calls:
            # Decisions with tool calls are logged by the act node with its first write.
            return Command(goto="act", update=update)
        events.append(answered(ctx.thread_id, ctx.graph_ns, ai))
        events.append(run_finished(ctx.thread_id, ctx.graph_ns, "closed", answer=answer_text(ai)))
        update["flow"] = {**update.get("flow", {}), "stage": "closed"}
        return Command(goto=END, update=update)

    def _attempts(self) -> Iterator[tuple[int, int]]:
        """(model index, attempt): every attempt of the model, then of each fallback."""
        return itertools.product(range(len(self.models)), range(1, self.policy.max_attempts + 1))

    def _failed(
        self, ctx: RunContext, index: int, attempt: int, exc: Exception, events: list[EventRecord]
    ) -> float | None:
        """Record a failed model call; the pause before the same model's next attempt."""
        failure = classify(exc)
        payload = failure_payload(failure)
        events.append(
            ctx.event(EventKind.MODEL_FAILED, model=index, attempt=attempt, failure=payload)
        )
        delay = failure.retry_after or self.policy.backoff.delay(attempt)
        return delay if attempt < self.policy.max_attempts else None

    def invoke(self, state: dict[str, Any], config: RunnableConfig) -> Command[str]:
        """Decide the next action synchronously."""
        return run_steps(self._decide(state, config))

    async def ainvoke(self, state: dict[str, Any], config: RunnableConfig) -> Command[str]:
        """Decide the next action asynchronously."""
        return await arun_steps(self._decide(state, config))

    def _decide(self, state: dict[str, Any], config: RunnableConfig) -> Steps[Command[str]]:
        """Both forms' body: the decision replayed or asked; the events written at the end."""
        ctx, cp = run_context(config), self.checkpointer
        events, stuck, milestones = self._start(state, ctx)
        if stuck is not None:
            yield io(cp, "append_records", events)
            return stuck
        marker = resume_marker(state, config)
        dangling = close_dangling(state["messages"]) if marker else []
        messages = [*state["messages"], *dangling]
        extra: list[BaseMessage] = []
        command: Command[str] | None = None
        try:
            recorded = None
            if self._may_replay(ctx, marker):
                digest = messages_digest(messages)
                recorded = yield io(cp, "decision", ctx.thread_id, ctx.graph_ns, digest)
            if recorded is not None:
                ai = load_message(recorded)  # the resume context waits for a real call
            else:
                if marker is not None:
                    ledger = yield io(cp, "ledger", ctx.thread_id)
                    extra = [self._resume_prompt(ctx, state, messages, marker, ledger, events)]
                    if self.resume.acknowledge:
                        ack = yield from self._call(ctx, state, [*messages, *extra], config, events)
                        extra += self._acknowledged(ctx, ack, events)
                ai = yield from self._call(ctx, state, [*messages, *extra], config, events)
            command = self._finish(
                ctx, ai, recorded is not None, events, dangling, marker, milestones
            )
            return command
        finally:
            if command is not None and command.goto == "act":
                # The act step's first durable write carries them (as the middleware's).
                cp.defer_records(events)
            else:
                yield io(cp, "append_records", events)

    def _call(
        self,
        ctx: RunContext,
        state: Mapping[str, Any],
        messages: Sequence[BaseMessage],
        config: RunnableConfig,
        events: list[EventRecord],
    ) -> Steps[BaseMessage]:
        """The model's answer: every attempt of the model, then of each fallback."""
        last: Exception | None = None
        for index, attempt in self._attempts():
            try:
                given = self._input(state, messages, index)
                answer: BaseMessage = yield io(self.models[index], "invoke", given, config)
                return answer
            except GraphBubbleUp:
                raise
            except Exception as exc:
                last = exc
                if (delay := self._failed(ctx, index, attempt, exc, events)) is not None:
                    yield io(_clock, "sleep", delay)
        assert last is not None
        raise last
