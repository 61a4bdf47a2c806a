"""What a node learns from its LangGraph config, and stable fingerprints of messages."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from langchain_core.messages import AIMessage, BaseMessage, message_to_dict, messages_from_dict
from langchain_core.runnables import RunnableConfig

from taskpilots_graph._compat import task_durability
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.events import EventKind, EventRecord, prepare_event

if TYPE_CHECKING:
    from taskpilots_graph.checkpointers import RecoveryAPI

__all__ = [
    "RunContext",
    "astored_input",
    "awaits_input",
    "dump_message",
    "load_message",
    "messages_digest",
    "run_context",
    "stored_input",
]


@dataclass(frozen=True, slots=True)
class RunContext:
    """Where a node runs.

    Attributes:
        thread_id: The thread of the run.
        graph_ns: The namespace of the graph containing the node, without task ids, so it is
            the same on every resume (``""`` for the root graph).
        durability: LangGraph's durability mode of the run.
        checkpoint_id: The checkpoint the node runs from (its graph's latest), if known.
        input_stored: That checkpoint is on disk before the node acts: under
            ``durability="sync"``, or once :func:`stored_input` found it stored.
    """

    thread_id: str
    graph_ns: str
    durability: str
    checkpoint_id: str | None = None
    input_stored: bool = False

    def event(self, kind: EventKind, **payload: Any) -> EventRecord:
        """An event of this run, in its graph's namespace."""
        return prepare_event(
            self.thread_id, kind, payload, checkpoint_id=None, checkpoint_ns=self.graph_ns
        )


def run_context(config: RunnableConfig) -> RunContext:
    """Read the thread id, graph namespace and durability from a node's config.

    Raises:
        ConfigurationError: If the run has no ``thread_id`` (recovery needs a checkpointer
            and a thread).
    """
    conf = config.get("configurable") or {}
    thread_id = conf.get("thread_id")
    if not thread_id:
        raise ConfigurationError(
            "the recovery agent needs a thread: invoke it with "
            "config={'configurable': {'thread_id': '...'}}"
        )
    task_ns = str(conf.get("checkpoint_ns") or "")
    # "parent:<task id>|act:<task id>" -> "parent": task ids change on replay, names do not.
    graph_ns = "|".join(part.split(":", 1)[0] for part in task_ns.split("|")[:-1])
    # checkpoint_map holds the checkpoint each enclosing graph runs from, outermost first.
    parents = list((conf.get("checkpoint_map") or {}).values())
    durability = task_durability(config)
    return RunContext(
        str(thread_id),
        graph_ns,
        durability,
        str(parents[-1]) if parents else None,
        durability == "sync",
    )


def awaits_input(ctx: RunContext) -> bool:
    """Whether the checkpoint ``ctx`` runs from is being written in the background (LangGraph's
    default ``durability="async"``): a step about to act may wait for it."""
    return not ctx.input_stored and ctx.durability == "async" and ctx.checkpoint_id is not None


def stored_input(ctx: RunContext, cp: RecoveryAPI) -> RunContext:
    """``ctx``, marked ``input_stored`` if its checkpoint is on disk or reaches it soon."""
    if awaits_input(ctx) and cp.checkpoint_stored(ctx.thread_id, str(ctx.checkpoint_id)):
        return replace(ctx, input_stored=True)
    return ctx


async def astored_input(ctx: RunContext, cp: RecoveryAPI) -> RunContext:
    """Async form of :func:`stored_input`."""
    if awaits_input(ctx) and await cp.acheckpoint_stored(ctx.thread_id, str(ctx.checkpoint_id)):
        return replace(ctx, input_stored=True)
    return ctx


def _fingerprint(message: BaseMessage) -> list[Any]:
    # Message ids are left out on purpose: add_messages gives new ids to the same input when
    # a run is started again, while the content the model sees is unchanged.
    item: list[Any] = [message.type, message.content]
    if isinstance(message, AIMessage):
        item.append([[c["name"], c["args"], c.get("id")] for c in message.tool_calls])
    item.append(getattr(message, "tool_call_id", None))
    return item


def messages_digest(messages: Sequence[BaseMessage]) -> str:
    """SHA-256 of what a model sees in ``messages``, independent of message ids."""
    text = json.dumps(
        [_fingerprint(m) for m in messages], sort_keys=True, default=str, ensure_ascii=False
    )
    return hashlib.sha256(text.encode()).hexdigest()


def dump_message(message: BaseMessage) -> str:
    """Serialise a message to JSON text."""
    return json.dumps(message_to_dict(message), default=str)


def load_message(text: str) -> BaseMessage:
    """Inverse of :func:`dump_message`."""
    return messages_from_dict([json.loads(text)])[0]
