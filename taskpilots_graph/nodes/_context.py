"""What a node learns from its LangGraph config, and stable fingerprints of messages (under
which both agent forms record a model decision)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from langchain_core.messages import AIMessage, BaseMessage, message_to_dict, messages_from_dict
from langchain_core.runnables import RunnableConfig

from taskpilots_graph._compat import task_durability
from taskpilots_graph._twins import Steps, io
from taskpilots_graph.engine._records import step_event
from taskpilots_graph.errors import ConfigurationError
from taskpilots_graph.events import EventKind, EventRecord

if TYPE_CHECKING:
    from taskpilots_graph.checkpointers import RecoveryAPI

__all__ = [
    "RunContext",
    "awaits_input",
    "decision_record",
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
        return step_event(self.thread_id, self.graph_ns, kind, **payload)


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


def stored_input(ctx: RunContext, cp: RecoveryAPI) -> Steps[RunContext]:
    """``ctx``, marked ``input_stored`` if its checkpoint is on disk or reaches it soon (a
    body for :mod:`taskpilots_graph._twins`)."""
    if awaits_input(ctx) and (
        yield io(cp, "checkpoint_stored", ctx.thread_id, str(ctx.checkpoint_id))
    ):
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


def decision_record(
    ctx: RunContext, messages: Sequence[BaseMessage], call_id: str | None
) -> tuple[str, str, str, str] | None:
    """(thread, namespace, input digest, message) recording the model message that made the
    call ``call_id``, under the digest of the conversation before it (what a replay asks)."""
    for index in range(len(messages) - 1, -1, -1):
        if any(c.get("id") == call_id for c in getattr(messages[index], "tool_calls", None) or []):
            digest = messages_digest(messages[:index])
            return ctx.thread_id, ctx.graph_ns, digest, dump_message(messages[index])
    return None


def dump_message(message: BaseMessage) -> str:
    """Serialise a message to JSON text."""
    return json.dumps(message_to_dict(message), default=str)


def load_message(text: str) -> BaseMessage:
    """Inverse of :func:`dump_message`."""
    return messages_from_dict([json.loads(text)])[0]
