"""Rows a ``put`` (or ``put_writes``) carries into the saver's own transaction: a *ride*,
so the savers the checkpointer opened itself commit them with the checkpoint, once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

__all__ = ["Ride", "pending_ride", "riding"]


@dataclass(slots=True, eq=False)
class Ride:
    """A checkpoint's message rows, handed from the store to the saver's own transaction.

    Open around one ``put`` by :func:`riding`: the store's ``messages_write`` finds it and
    leaves the rows here (with the function that inserts them on the saver's cursor or
    connection) instead of committing them; the saver's ``put`` inserts them in the
    transaction that writes the checkpoint and marks the ride ``written`` once it committed.
    A failed attempt leaves them unwritten, and a saver's retry inserts them again (every
    insert ignores rows already there).
    """

    store: object
    """The store whose ``messages_write`` may hand its rows over (the saver's database)."""
    rows: object | None = None
    """The rows held: :class:`~.messages.MessageRows`, or the ledger commits riding a
    put_writes."""
    write: Callable[[Any], None] | None = None
    awrite: Callable[[Any], Awaitable[None]] | None = None
    written: bool = False

    def take(
        self,
        rows: object,
        write: Callable[[Any], None] | None = None,
        awrite: Callable[[Any], Awaitable[None]] | None = None,
    ) -> None:
        """Hold ``rows`` for the saver, with their sync or async insert."""
        self.rows, self.write, self.awrite = rows, write, awrite

    @property
    def stranded(self) -> bool:
        """Rows were handed over, but no saver transaction wrote them."""
        return self.rows is not None and not self.written


_RIDE: ContextVar[Ride | None] = ContextVar("taskpilots_message_ride", default=None)


@contextmanager
def riding(store: object) -> Iterator[Ride]:
    """Within the block, ``store.messages_write`` hands its rows to the saver's next put.

    A context variable, so concurrent puts (threads, tasks) each carry their own rows.
    """
    ride = Ride(store)
    token = _RIDE.set(ride)
    try:
        yield ride
    finally:
        _RIDE.reset(token)


def pending_ride(store: object | None = None) -> Ride | None:
    """The open ride of this context: for ``store`` to hand rows to (``store`` given), or
    for a saver to write (rows held, not yet written)."""
    ride = _RIDE.get()
    if ride is None:
        return None
    if store is not None:
        return ride if ride.store is store and ride.rows is None else None
    return ride if ride.stranded else None
