"""Test seams: fault-injecting tool wrappers, a clock that does not really sleep, and a
scripted chat model for offline examples and tests.

Example:
    >>> import taskpilots_graph as tp
    >>> from taskpilots_graph import testing
    >>> flaky = testing.failing(search_tool, times=2, exc=TimeoutError("read timed out"))
    ... # doctest: +SKIP
    >>> with testing.fake_clock() as clock:  # backoff waits advance a virtual clock
    ...     graph.invoke(...)  # doctest: +SKIP
    ...     clock.slept  # doctest: +SKIP
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Self

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool

from taskpilots_graph import _clock
from taskpilots_graph.tools import SideEffectTool, twin

__all__ = [
    "FakeClock",
    "FaultyTool",
    "ScriptedModel",
    "answered_calls",
    "down_for",
    "fail_after_effect",
    "failing",
    "fake_clock",
]

ExcFactory = BaseException | Callable[[], BaseException]


def _make(exc: ExcFactory) -> BaseException:
    return exc if isinstance(exc, BaseException) else exc()


@dataclass
class FakeClock:
    """A virtual clock: ``sleep`` advances it instantly and records the wait."""

    time: float = 1_700_000_000.0
    slept: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def now(self) -> float:
        with self._lock:
            return self.time

    def advance(self, seconds: float) -> None:
        """Move the clock forward, as if ``seconds`` passed."""
        with self._lock:
            self.time += seconds

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.slept.append(seconds)
            self.time += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


@contextmanager
def fake_clock(start: float = 1_700_000_000.0) -> Iterator[FakeClock]:
    """Install a :class:`FakeClock` for the library (turns real sleeping off)."""
    clock = FakeClock(time=start)
    previous = _clock.set_clock(_clock.Clock(now=clock.now, sleep=clock.sleep, asleep=clock.asleep))
    try:
        yield clock
    finally:
        _clock.set_clock(previous)


class FaultyTool:
    """Counts the calls of a wrapped tool and decides, per call, whether it fails.

    Attributes:
        tool: The tool to give the model (same name, description and schema as the original;
            a ``@side_effect`` declaration is kept).
        calls: How many times the tool was called.
        effects: How many times the original tool actually ran.
    """

    def __init__(
        self,
        original: BaseTool,
        decide: Callable[[int], tuple[bool, bool]],
        exc: ExcFactory,
    ) -> None:
        self.calls = 0
        self.effects = 0
        self._decide = decide  # call number -> (fail before running, fail after running)
        self._exc = exc
        self._lock = threading.Lock()
        inner = original.tool if isinstance(original, SideEffectTool) else original

        def run(config: RunnableConfig, **kwargs: Any) -> Any:
            with self._lock:
                self.calls += 1
                before, after = self._decide(self.calls)
            if before:
                raise _make(self._exc)
            result = inner.invoke(kwargs, config=config)
            with self._lock:
                self.effects += 1
            if after:
                raise _make(self._exc)
            return result

        self.tool = twin(original, run)


def failing(tool: BaseTool, *, times: int, exc: ExcFactory) -> FaultyTool:
    """The tool fails with ``exc`` on its first ``times`` calls, then works."""
    return FaultyTool(tool, lambda n: (n <= times, False), exc)


def fail_after_effect(
    tool: BaseTool, *, times: int = 1, exc: ExcFactory = TimeoutError
) -> FaultyTool:
    """The tool performs its effect, then raises ``exc`` (default: a timeout) ``times`` times.

    The classic uncertain failure: the request reached the service, the answer was lost.
    """
    return FaultyTool(tool, lambda n: (False, n <= times), exc)


def down_for(
    tool: BaseTool, seconds: float, *, exc: ExcFactory = ConnectionRefusedError
) -> FaultyTool:
    """The tool is down for ``seconds`` of the library clock from its first call."""
    started: list[float] = []

    def decide(_n: int) -> tuple[bool, bool]:
        now = _clock.now()
        if not started:
            started.append(now)
        return (now - started[0] < seconds, False)

    return FaultyTool(tool, decide, exc)


_FOLDED = re.compile(r"^- (\d+) earlier tool call\(s\) not listed$", re.MULTILINE)
_LISTED = re.compile(r"^- \w+\(.*\) -> (?:ok|failed): ", re.MULTILINE)


def answered_calls(messages: Sequence[BaseMessage]) -> int:
    """Tool calls answered since the last user message, as a model would count them.

    Counts the answers in the conversation and, in a conversation of one user turn, the
    calls the agent's memory window folded into the system message (those lines do not say
    which turn they belong to).
    """
    users = [
        i
        for i, m in enumerate(messages)
        if isinstance(m, HumanMessage) and m.name != "taskpilots_resume"
    ]
    last_user = users[-1] if users else -1
    done = sum(isinstance(m, ToolMessage) for m in messages[last_user + 1 :])
    if len(users) > 1:
        return done
    for m in messages:
        if isinstance(m, SystemMessage):
            text = str(m.content)
            done += sum(int(n) for n in _FOLDED.findall(text)) + len(_LISTED.findall(text))
    return done


class _ConversationModel(BaseChatModel):
    """A chat model that answers from the conversation alone (``_next``), offline."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> Self:
        """Tools are named by the script; binding changes nothing."""
        return self

    def _next(self, messages: list[BaseMessage]) -> AIMessage:
        raise NotImplementedError

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=self._next(messages))])


class ScriptedModel(_ConversationModel):
    """A chat model that calls the planned tools one after the other, then answers.

    It stands in for an LLM in examples and tests (no network, no key). Like a real model it
    decides from the conversation it is shown, not from a counter, so a run resumed in a
    fresh process continues where the conversation stands: a planned call counts as done
    once an answer to it follows the last user message, including the calls the agent's
    memory window folded into the system message. Every call gets a fresh random id.

    Example:
        >>> model = ScriptedModel(plan=[("lookup", {"customer_id": "c-1"}),
        ...                             ("create_ticket", {"customer_id": "c-1"})])
    """

    plan: list[tuple[str, dict[str, Any]]]
    answer: str = "Done."

    @property
    def _llm_type(self) -> str:
        return "taskpilots-scripted"

    def _next(self, messages: list[BaseMessage]) -> AIMessage:
        done = answered_calls(messages)
        if done >= len(self.plan):
            return AIMessage(self.answer)
        name, args = self.plan[done]
        call_id = f"call_{uuid.uuid4().hex[:16]}"
        return AIMessage("", tool_calls=[{"name": name, "args": dict(args), "id": call_id}])
