"""Failure taxonomy: what kind of failure an exception is, decided by its type and codes.

Classification looks at facts, never at message text alone: user rules first, then the
exception's type, its HTTP status (httpx, requests, or any ``status_code`` attribute), its
PostgreSQL SQLSTATE, and a ``Retry-After`` hint. Each kind has its own default recovery
path (see :mod:`taskpilots_graph.policy` and the recovery router).

This module is I/O free.
"""

from __future__ import annotations

import math
import socket
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from taskpilots_graph.errors import LockBackendUnavailable
from taskpilots_graph.ledger import SideEffectUncertain

__all__ = [
    "Failure",
    "FailureKind",
    "Rule",
    "classify",
    "classify_http_status",
    "classify_sqlstate",
    "failure_payload",
]

SUMMARY_CHARS = 2048


class FailureKind(StrEnum):
    """The classes of failure, each with its own recovery path."""

    TRANSIENT = "transient"  # retry that step only, with backoff and jitter
    RATE_LIMITED = "rate_limited"  # retry after the hinted delay
    EXTERNAL_OUTAGE = "external_outage"  # wait a window, then degrade, then a person
    AUTH = "auth"  # credentials expired or refused: a person (or a refresh hook)
    CONTRACT = "contract"  # schema / version drift: degrade or a person
    DATA_UNCERTAIN = "data_uncertain"  # the data cannot be trusted: a person
    SIDE_EFFECT_UNCERTAIN = "side_effect_uncertain"  # effect may have happened: pre-check path
    MODEL = "model"  # context overflow, content filter, provider 5xx: fallback model
    STUCK = "stuck"  # the same failure again and again, or the step budget is spent
    FATAL = "fatal"  # nothing will fix it: fail the run


Rule = tuple[type[BaseException] | Callable[[BaseException], bool], FailureKind]
"""A user rule: an exception type (matched with ``isinstance``) or a predicate, and a kind."""


@dataclass(frozen=True, slots=True)
class Failure:
    """A classified failure.

    Attributes:
        kind: The failure class.
        error_type: Qualified name of the exception type.
        message: The error text, truncated to 2 KB.
        retry_after: Seconds the service asked to wait, if it said so.
        status: HTTP status, if the error carried one.
        sqlstate: PostgreSQL SQLSTATE, if the error carried one.
    """

    kind: FailureKind
    error_type: str
    message: str
    retry_after: float | None = None
    status: int | None = None
    sqlstate: str | None = None


def classify_http_status(status: int) -> FailureKind:
    """The kind of an HTTP error status."""
    if status == 429:
        return FailureKind.RATE_LIMITED
    if status in (401, 403, 407):
        return FailureKind.AUTH
    if status in (408, 425, 500):
        return FailureKind.TRANSIENT
    if status in (409, 412):
        return FailureKind.DATA_UNCERTAIN
    if status >= 500:
        return FailureKind.EXTERNAL_OUTAGE  # 502, 503, 504 and the other server errors
    return FailureKind.CONTRACT  # 400, 404, 405, 410, 415, 422, ...: the request is wrong


_SQLSTATE_EXACT: Mapping[str, FailureKind] = {
    "40001": FailureKind.TRANSIENT,  # serialization_failure
    "40P01": FailureKind.TRANSIENT,  # deadlock_detected
    "55P03": FailureKind.TRANSIENT,  # lock_not_available
    "57014": FailureKind.TRANSIENT,  # query_canceled (statement timeout)
    "57P01": FailureKind.EXTERNAL_OUTAGE,  # admin_shutdown
    "57P02": FailureKind.EXTERNAL_OUTAGE,  # crash_shutdown
    "57P03": FailureKind.EXTERNAL_OUTAGE,  # cannot_connect_now
}
_SQLSTATE_CLASS: Mapping[str, FailureKind] = {
    "08": FailureKind.EXTERNAL_OUTAGE,  # connection exception
    "53": FailureKind.EXTERNAL_OUTAGE,  # insufficient resources
    "58": FailureKind.EXTERNAL_OUTAGE,  # system error (I/O)
    "28": FailureKind.AUTH,  # invalid authorization
    "42": FailureKind.CONTRACT,  # syntax error or access rule violation
    "0A": FailureKind.CONTRACT,  # feature not supported
    "22": FailureKind.DATA_UNCERTAIN,  # data exception
    "23": FailureKind.DATA_UNCERTAIN,  # integrity constraint violation
    "40": FailureKind.TRANSIENT,  # transaction rollback
}


def classify_sqlstate(sqlstate: str) -> FailureKind:
    """The kind of a PostgreSQL SQLSTATE code."""
    exact = _SQLSTATE_EXACT.get(sqlstate)
    if exact is not None:
        return exact
    return _SQLSTATE_CLASS.get(sqlstate[:2], FailureKind.FATAL)


@dataclass(frozen=True, slots=True)
class _Foreign:
    """Exception types of an optional library, looked up only once that library is loaded.

    An exception of a library nobody imported cannot have been raised, so classifying never
    imports one (``import taskpilots_graph`` stays light; redis alone costs a quarter second).
    """

    module: str
    names: tuple[str, ...]

    def types(self) -> tuple[type[BaseException], ...]:
        mod = sys.modules.get(self.module)
        if mod is None:
            return ()
        found = (getattr(mod, name, None) for name in self.names)
        return tuple(t for t in found if isinstance(t, type) and issubclass(t, BaseException))


# Ordered: the first matching row wins, so subclasses come before their bases.
_TYPE_TABLE: tuple[tuple[tuple[type[BaseException], ...] | _Foreign, FailureKind], ...] = (
    ((SideEffectUncertain,), FailureKind.SIDE_EFFECT_UNCERTAIN),
    # A business lock that cannot be taken: the effect did not run; wait, then escalate.
    ((LockBackendUnavailable,), FailureKind.EXTERNAL_OUTAGE),
    (_Foreign("httpx", ("TimeoutException",)), FailureKind.TRANSIENT),
    (_Foreign("httpx", ("ConnectError",)), FailureKind.EXTERNAL_OUTAGE),
    (_Foreign("httpx", ("NetworkError", "RemoteProtocolError")), FailureKind.TRANSIENT),
    (_Foreign("httpx", ("DecodingError",)), FailureKind.CONTRACT),
    (_Foreign("requests", ("Timeout",)), FailureKind.TRANSIENT),
    (_Foreign("requests", ("ConnectionError",)), FailureKind.EXTERNAL_OUTAGE),
    (_Foreign("redis.exceptions", ("TimeoutError",)), FailureKind.TRANSIENT),
    (_Foreign("redis.exceptions", ("ConnectionError",)), FailureKind.EXTERNAL_OUTAGE),
    ((TimeoutError,), FailureKind.TRANSIENT),
    ((ConnectionRefusedError, socket.gaierror), FailureKind.EXTERNAL_OUTAGE),
    ((ConnectionResetError, ConnectionAbortedError, BrokenPipeError), FailureKind.TRANSIENT),
    ((ConnectionError,), FailureKind.EXTERNAL_OUTAGE),
    ((PermissionError,), FailureKind.AUTH),
    ((ValidationError, TypeError, ValueError), FailureKind.CONTRACT),
    ((LookupError,), FailureKind.DATA_UNCERTAIN),
    ((NotImplementedError, AssertionError, RecursionError, MemoryError), FailureKind.FATAL),
)


def _status_of(exc: BaseException) -> int | None:
    for holder in (exc, getattr(exc, "response", None)):
        for attr in ("status_code", "status"):
            value = getattr(holder, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
                return value
    return None


def _retry_after(exc: BaseException, now: datetime | None) -> float | None:
    hint = getattr(exc, "retry_after", None)
    if isinstance(hint, int | float) and not isinstance(hint, bool) and math.isfinite(hint):
        return max(0.0, float(hint))
    headers = getattr(getattr(exc, "response", None), "headers", None)
    raw = headers.get("retry-after") if headers is not None else None
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:  # HTTP-date form
        when = parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    current = now or datetime.now(when.tzinfo)
    return max(0.0, (when - current).total_seconds())


def _sqlstate_of(exc: BaseException) -> str | None:
    for attr in ("sqlstate", "pgcode"):
        value = getattr(exc, attr, None)
        if isinstance(value, str) and len(value) == 5:
            return value
    return None


def classify(
    exc: BaseException, rules: Iterable[Rule] = (), *, now: datetime | None = None
) -> Failure:
    """Classify an exception.

    Order: user ``rules`` (first match wins); an explicit ``failure_kind`` attribute on the
    exception; HTTP status; SQLSTATE; the exception type table. An exception nothing
    recognises is ``TRANSIENT``: it is retried within the policy's budget, then escalated.

    Args:
        exc: The exception raised by a tool or model call.
        rules: User rules, tried first.
        now: The current time, for ``Retry-After`` dates (tests pass a fixed clock).
    """
    status = _status_of(exc)
    sqlstate = _sqlstate_of(exc)
    kind = _by_rules(exc, rules)
    if kind is None:
        declared = getattr(exc, "failure_kind", None)
        kind = FailureKind(declared) if declared is not None else None
    if kind is None and status is not None:
        kind = classify_http_status(status)
    if kind is None and sqlstate is not None:
        kind = classify_sqlstate(sqlstate)
    if kind is None:
        kind = _by_type(exc)
    text = str(exc)
    return Failure(
        kind=kind,
        error_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=text if len(text) <= SUMMARY_CHARS else text[:SUMMARY_CHARS] + "…",
        retry_after=_retry_after(exc, now),
        status=status,
        sqlstate=sqlstate,
    )


def _by_type(exc: BaseException) -> FailureKind:
    for row, kind in _TYPE_TABLE:
        types = row.types() if isinstance(row, _Foreign) else row
        if types and isinstance(exc, types):
            return kind
    return FailureKind.TRANSIENT


def _by_rules(exc: BaseException, rules: Iterable[Rule]) -> FailureKind | None:
    for match, kind in rules:
        if isinstance(exc, match) if isinstance(match, type) else match(exc):
            return kind
    return None


def failure_payload(failure: Failure) -> dict[str, Any]:
    """The JSON form of a failure for events and step records."""
    return {
        **{f.name: getattr(failure, f.name) for f in fields(failure)},
        "kind": failure.kind.value,
    }
