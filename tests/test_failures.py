"""Classification of exceptions into failure kinds: by type, HTTP status and SQLSTATE."""

from __future__ import annotations

import socket
from datetime import UTC, datetime

import httpx
import psycopg.errors
import pytest
import redis.exceptions
import requests
from pydantic import BaseModel, ValidationError

from taskpilots_graph.failures import FailureKind, classify, classify_http_status, classify_sqlstate

K = FailureKind


def _validation_error() -> ValidationError:
    class M(BaseModel):
        x: int

    try:
        M(x="nope")  # type: ignore[arg-type]
    except ValidationError as exc:
        return exc
    raise AssertionError("unreachable")


def _http_error(status: int, headers: dict[str, str] | None = None) -> httpx.HTTPStatusError:
    request = httpx.Request("GET", "https://crm.invalid/customers/1")
    response = httpx.Response(status, headers=headers, request=request)
    return httpx.HTTPStatusError("boom", request=request, response=response)


def _requests_error(status: int) -> requests.HTTPError:
    response = requests.Response()
    response.status_code = status
    return requests.HTTPError("boom", response=response)


# Every exception class the classifier claims to handle, with the kind it must map to.
CLAIMED: list[tuple[BaseException, FailureKind]] = [
    (TimeoutError("read timed out"), K.TRANSIENT),
    (ConnectionRefusedError(), K.EXTERNAL_OUTAGE),
    (socket.gaierror(), K.EXTERNAL_OUTAGE),
    (ConnectionResetError(), K.TRANSIENT),
    (ConnectionAbortedError(), K.TRANSIENT),
    (BrokenPipeError(), K.TRANSIENT),
    (ConnectionError(), K.EXTERNAL_OUTAGE),
    (PermissionError(), K.AUTH),
    (ValueError("bad"), K.CONTRACT),
    (TypeError("bad"), K.CONTRACT),
    (_validation_error(), K.CONTRACT),
    (KeyError("k"), K.DATA_UNCERTAIN),
    (LookupError("no customer"), K.DATA_UNCERTAIN),
    (NotImplementedError(), K.FATAL),
    (AssertionError(), K.FATAL),
    (RecursionError(), K.FATAL),
    (MemoryError(), K.FATAL),
    (httpx.ReadTimeout("slow"), K.TRANSIENT),
    (httpx.ConnectTimeout("slow"), K.TRANSIENT),
    (httpx.ConnectError("down"), K.EXTERNAL_OUTAGE),
    (httpx.ReadError("reset"), K.TRANSIENT),
    (httpx.RemoteProtocolError("eof"), K.TRANSIENT),
    (httpx.DecodingError("gzip"), K.CONTRACT),
    (requests.Timeout(), K.TRANSIENT),
    (requests.ConnectionError(), K.EXTERNAL_OUTAGE),
    (redis.exceptions.TimeoutError(), K.TRANSIENT),
    (redis.exceptions.ConnectionError(), K.EXTERNAL_OUTAGE),
    (psycopg.errors.SerializationFailure(), K.TRANSIENT),
    (psycopg.errors.DeadlockDetected(), K.TRANSIENT),
    (psycopg.errors.LockNotAvailable(), K.TRANSIENT),
    (psycopg.errors.QueryCanceled(), K.TRANSIENT),
    (psycopg.errors.AdminShutdown(), K.EXTERNAL_OUTAGE),
    (psycopg.errors.CannotConnectNow(), K.EXTERNAL_OUTAGE),
    (psycopg.errors.TooManyConnections(), K.EXTERNAL_OUTAGE),
    (psycopg.errors.InvalidPassword(), K.AUTH),
    (psycopg.errors.UndefinedTable(), K.CONTRACT),
    (psycopg.errors.UniqueViolation(), K.DATA_UNCERTAIN),
    (psycopg.errors.NumericValueOutOfRange(), K.DATA_UNCERTAIN),
    (RuntimeError("something new"), K.TRANSIENT),
]


@pytest.mark.parametrize(("exc", "kind"), CLAIMED, ids=lambda v: type(v).__name__)
def test_every_claimed_exception_maps_to_its_kind(exc: BaseException, kind: FailureKind) -> None:
    """Each exception class the classifier claims to handle gets the documented kind."""
    assert classify(exc).kind is kind


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (429, K.RATE_LIMITED),
        (401, K.AUTH),
        (403, K.AUTH),
        (408, K.TRANSIENT),
        (500, K.TRANSIENT),
        (502, K.EXTERNAL_OUTAGE),
        (503, K.EXTERNAL_OUTAGE),
        (504, K.EXTERNAL_OUTAGE),
        (409, K.DATA_UNCERTAIN),
        (400, K.CONTRACT),
        (404, K.CONTRACT),
        (422, K.CONTRACT),
    ],
)
def test_http_status_from_httpx_and_requests(status: int, kind: FailureKind) -> None:
    """HTTP errors are classified by status code, for httpx and requests alike."""
    assert classify_http_status(status) is kind
    assert classify(_http_error(status)).kind is kind
    assert classify(_requests_error(status)).kind is kind
    assert classify(_http_error(status)).status == status


def test_status_wins_over_exception_type() -> None:
    """A 503 is an outage even though httpx raises the same type for a 404."""
    assert classify(_http_error(503)).kind is K.EXTERNAL_OUTAGE
    assert classify(_http_error(404)).kind is K.CONTRACT


def test_retry_after_seconds_and_http_date() -> None:
    """``Retry-After`` is read as seconds or as an HTTP date against the given clock."""
    assert classify(_http_error(429, {"Retry-After": "7"})).retry_after == 7.0
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    dated = _http_error(503, {"Retry-After": "Thu, 01 Jan 2026 12:00:30 GMT"})
    assert classify(dated, now=now).retry_after == 30.0
    assert classify(_http_error(429, {"Retry-After": "soon"})).retry_after is None


def test_sqlstate_classes() -> None:
    """SQLSTATE codes map by exact code first, then by class; unknown classes are fatal."""
    assert classify_sqlstate("08006") is K.EXTERNAL_OUTAGE
    assert classify_sqlstate("40001") is K.TRANSIENT
    assert classify_sqlstate("28P01") is K.AUTH
    assert classify_sqlstate("XX000") is K.FATAL
    assert classify(psycopg.errors.SerializationFailure()).sqlstate == "40001"


def test_user_rules_come_first() -> None:
    """A user rule (type or predicate) overrides every default."""
    rules = [(TimeoutError, K.EXTERNAL_OUTAGE), (lambda e: "quota" in str(e), K.RATE_LIMITED)]
    assert classify(TimeoutError(), rules).kind is K.EXTERNAL_OUTAGE
    assert classify(RuntimeError("quota exceeded"), rules).kind is K.RATE_LIMITED
    assert classify(RuntimeError("other"), rules).kind is K.TRANSIENT


def test_message_text_alone_never_decides() -> None:
    """Without a rule, the words of a message do not change the kind."""
    assert classify(RuntimeError("503 service unavailable")).kind is K.TRANSIENT
    assert classify(ValueError("timeout")).kind is K.CONTRACT


def test_declared_failure_kind_and_retry_after_attribute() -> None:
    """An exception may carry ``failure_kind`` and ``retry_after`` attributes."""

    class QuotaError(Exception):
        failure_kind = "rate_limited"
        retry_after = 12

    failure = classify(QuotaError("slow down"))
    assert (failure.kind, failure.retry_after) == (K.RATE_LIMITED, 12.0)


def test_long_messages_are_truncated_to_2kb() -> None:
    """The recorded message is at most 2 KB (plus an ellipsis)."""
    failure = classify(RuntimeError("x" * 10_000))
    assert len(failure.message) == 2049
    assert failure.error_type == "builtins.RuntimeError"
