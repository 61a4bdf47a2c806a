"""The recovery agent's ``messages`` reducer: ``add_messages``, appending in O(new messages).

LangGraph's ``add_messages`` copies the conversation and builds an id → position map over
all of it on every call, and a step of the agent calls it about three times (the model's
answer, the tool results, and the conditional edge reading the state with the act node's
writes applied). Over a long run that was the largest per-step cost of the agent's own
graph that grows with the conversation.

:func:`merge_messages` gives the same results (same list contents, the same message objects,
ids assigned to messages without one, same-id replacement) but keeps the id → position map
with each list it returns (a :class:`MessageList`), so the next call looks up only the new
messages. Whatever it cannot prove cheap (a ``left`` it did not build or that was changed in
place, ``RemoveMessage``, ``REMOVE_ALL_MESSAGES``, dicts / tuples / strings / chunks to
coerce, ``None`` arguments) goes through ``add_messages`` itself, so coercion and errors are
LangGraph's own; that result is then indexed once. I/O free.

As with ``add_messages``, message ids are taken to be fixed once a message is in the state
(LangGraph state is updated by returning values, not by mutating them). A list changed in
place is noticed through its methods, and through its length for ``list``'s own unbound
methods (``list.append(value, m)``); only a same-length change made that way
(``list.__setitem__(value, i, m)``) is not.
"""

from __future__ import annotations

import uuid
from typing import Any

from langchain_core.messages import BaseMessage, BaseMessageChunk, RemoveMessage
from langgraph.graph.message import add_messages

__all__ = ["MessageList", "merge_messages"]

_NOT_PLAIN = (BaseMessageChunk, RemoveMessage)


class MessageList(list[BaseMessage]):
    """A conversation built by :func:`merge_messages`, with the id → position map it needs.

    A plain ``list`` to every reader (pickling and ``copy`` give a plain list); the
    checkpointer's message store treats it as one. The map is shared along a run's lists
    (see :func:`merge_messages`); changing the list in place through any ``list`` method
    drops its claim on the map, so the next merge re-indexes it.
    """

    __slots__ = ("_index", "_size")

    _index: dict[Any, int] | None
    _size: int

    def __reduce__(self) -> tuple[type[list[BaseMessage]], tuple[list[BaseMessage]]]:
        # Readers (serializers, pickle, copy) get the plain list they would get from
        # add_messages; the map is rebuilt by the next merge.
        return list, (list(self),)

    def _changed(self) -> None:
        self._index = None


def _dropping_map(name: str) -> Any:
    """``list``'s method ``name``, dropping the list's claim on its map first."""
    method = getattr(list, name)

    def changed(self: MessageList, *args: Any, **kwargs: Any) -> Any:
        self._changed()
        return method(self, *args, **kwargs)

    return changed


# Every ``list`` method that changes the list in place (``__iadd__`` and ``__imul__``
# return the list itself, as ``list``'s do).
for _name in (
    "append",
    "extend",
    "insert",
    "pop",
    "remove",
    "clear",
    "sort",
    "reverse",
    "__setitem__",
    "__delitem__",
    "__iadd__",
    "__imul__",
):
    setattr(MessageList, _name, _dropping_map(_name))


def _indexed(messages: list[Any]) -> MessageList:
    """``messages`` as a :class:`MessageList` with a map of its own (the last position of
    each id, as ``add_messages`` maps them)."""
    indexed = MessageList(messages)
    indexed._index = {m.id: i for i, m in enumerate(indexed)}
    indexed._size = len(indexed)
    return indexed


def _plain(messages: list[Any]) -> bool:
    # Messages that add_messages would take as they are: no coercion, no removal.
    return all(isinstance(m, BaseMessage) and not isinstance(m, _NOT_PLAIN) for m in messages)


def merge_messages(left: Any, right: Any) -> Any:
    """Reducer of the recovery agent's ``messages``: LangGraph's ``add_messages``, with the
    appends of a growing conversation costing O(new messages) instead of O(conversation).

    The map of a returned list is shared with the lists merged from it (only new ids are
    added, so no copy per step). An entry is trusted only where the list at hand holds that
    id at that position; an id appended at different positions by two merges from the same
    list (two branches) gets a private copy of the map, so each list's entries stay exact:
    every id it holds maps to its last position, and any other entry points where it does
    not hold that id.

    ``left`` is never changed; like ``add_messages``, a message of ``right`` without an id
    gets one assigned in place.

    Raises:
        ValueError: As ``add_messages`` does (a ``RemoveMessage`` for an unknown id, a
            ``None`` argument).
    """
    items: list[Any] = right if isinstance(right, list) else [right]
    # A MessageList made by anyone else (a copy, user code) has no map: slots stay unset.
    index = getattr(left, "_index", None) if type(left) is MessageList else None
    if index is None or left._size != len(left) or right is None or not _plain(items):
        value = add_messages(left, right)
        return _indexed(value) if isinstance(value, list) else value
    merged = MessageList(left)
    shared = True
    for message in items:
        if message.id is None:
            message.id = str(uuid.uuid4())
        message_id = message.id
        at = index.get(message_id)
        if at is not None and at < len(merged) and merged[at].id == message_id:
            list.__setitem__(merged, at, message)
            continue
        end = len(merged)
        if at is not None and at != end and shared:
            # Another list merged from the same one holds this id elsewhere: overwriting
            # the shared entry would make that list's lookups wrong.
            index = dict(index)
            shared = False
        index[message_id] = end
        list.append(merged, message)
    merged._index = index
    merged._size = len(merged)
    return merged
