"""Scripted chat models for the tests: offline stand-ins for a tool-calling LLM.

They decide from the conversation alone (which answers are already in the messages), never
from a call counter, so a resumed run in a fresh process continues where the conversation
stands, as it would with a real model. Like a real model they give every tool call a new
random id.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import Field

from taskpilots_graph.testing import answered_calls

RESUME_MESSAGE = "taskpilots_resume"  # the name of the resume prompt's message


def tool_call(name: str, args: dict[str, Any]) -> AIMessage:
    """A model message calling one tool, with a fresh random call id."""
    call = {"name": name, "args": dict(args), "id": f"call_{uuid.uuid4().hex[:12]}"}
    return AIMessage("", tool_calls=[call])


class ScriptedChatModel(BaseChatModel):
    """Base of the scripted models: keeps every input; subclasses implement ``decide``."""

    inputs: list[list[BaseMessage]] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "scripted"

    @property
    def asked(self) -> list[int]:
        """The length of each conversation the model was asked about."""
        return [len(m) for m in self.inputs]

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedChatModel:  # type: ignore[override]
        return self

    def decide(self, messages: list[BaseMessage]) -> AIMessage:
        raise NotImplementedError

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        self.inputs.append(list(messages))
        return ChatResult(generations=[ChatGeneration(message=self.decide(messages))])


class PlanModel(ScriptedChatModel):
    """For the latest user message: call the planned tools one after the other, then answer.

    It moves past a planned call once any answer to it (result, error, "skipped") follows
    that message. A planned argument ``"$msg"`` stands for the text of that user message.
    """

    plan: list[tuple[str, dict[str, Any]]]

    def decide(self, messages: list[BaseMessage]) -> AIMessage:
        last = max(
            (
                i
                for i, m in enumerate(messages)
                if isinstance(m, HumanMessage) and m.name != RESUME_MESSAGE
            ),
            default=0,
        )
        # The answers in view, plus the calls the memory window folded away.
        answered = answered_calls(messages)
        if answered >= len(self.plan):
            return AIMessage("done")
        name, args = self.plan[answered]
        text = str(messages[last].content) if messages else ""
        return tool_call(name, {k: text if v == "$msg" else v for k, v in args.items()})
