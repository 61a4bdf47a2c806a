"""Leases in Redis: one key per name with a TTL, and a fencing counter beside it.

Not redis-py's ``Lock``: it never expires by default, is not renewed by itself and its token
is random, not a fencing token. Each operation here is one Lua script, so it is atomic on
the server and takes one round trip:

* acquire: ``SET lease-key token NX PX ttl`` with the fencing token from ``INCR`` of the
  name's counter *in the same script*, so no other client can slip in between;
* renew: compare the stored token, then ``PEXPIRE``;
* release: compare the stored token, then ``DEL`` (never someone else's lease).

The stored token is ``<fencing>:<owner>``, so the lease key alone says who holds it with
which token. The counter is raised to the server clock in microseconds when it is behind
it: a Redis that restarts without its data (or fails over to a replica that missed the last
``INCR``) still hands out tokens above every earlier one, instead of starting again at 1.
For the same reason the counter may expire after ``fence_retention`` of disuse.

Both keys carry the name in a hash tag (``{...}``), so they share a slot in Redis Cluster.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ReadOnlyError
from redis.retry import Retry

from taskpilots_graph._twins import IO, Steps, asynced, both, synced
from taskpilots_graph.errors import ConfigurationError, CorruptRecordError, LeaseLost
from taskpilots_graph.errors import LockBackendUnavailable as Unavailable
from taskpilots_graph.leases import Lease, LeaseBackendBase, check_lease_args

__all__ = ["ACQUIRE_LUA", "HOLDER_LUA", "RELEASE_LUA", "RENEW_LUA", "RedisLeaseBackend"]

ACQUIRE_LUA: Final = """
-- KEYS[1] lease key, KEYS[2] fencing counter; ARGV[1] owner, ARGV[2] ttl ms,
-- ARGV[3] how long the counter outlives its last use, ms
local now = redis.call('TIME')
local held = redis.call('GET', KEYS[1])
if held then
  if string.match(held, '^%d+:(.*)$') == ARGV[1] then
    -- a retry of our own acquire whose reply was lost: refresh it, keep its token
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, held, tonumber(ARGV[2]), now[1], now[2]}
  end
  return {0, held, redis.call('PTTL', KEYS[1]), now[1], now[2]}
end
local fencing = redis.call('INCR', KEYS[2])
local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
if fencing < floor then
  fencing = floor
  redis.call('SET', KEYS[2], string.format('%.0f', fencing))
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
local token = string.format('%.0f', fencing) .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], token, 'NX', 'PX', ARGV[2])
return {1, token, tonumber(ARGV[2]), now[1], now[2]}
"""

RENEW_LUA: Final = """
-- KEYS[1] lease key; ARGV[1] stored token, ARGV[2] ttl ms
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local now = redis.call('TIME')
return {1, now[1], now[2]}
"""

RELEASE_LUA: Final = """
-- KEYS[1] lease key; ARGV[1] stored token
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

HOLDER_LUA: Final = """
-- KEYS[1] lease key
local held = redis.call('GET', KEYS[1])
if not held then return {0} end
local now = redis.call('TIME')
return {1, held, redis.call('PTTL', KEYS[1]), now[1], now[2]}
"""

_UNREACHABLE: Final = (redis.ConnectionError, redis.TimeoutError, ReadOnlyError)


@contextmanager
def _reachable() -> Iterator[None]:
    """Turn "cannot talk to Redis" into the typed error callers fail closed on.

    A read-only replica (after a failover) cannot grant leases either, so it counts too.
    Works around ``await`` as well: the exception surfaces where the coroutine is awaited.
    """
    try:
        yield
    except _UNREACHABLE as exc:
        raise Unavailable("redis", f"{type(exc).__name__}: {exc}") from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _millis(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _server_now(sec: bytes | str, usec: bytes | str) -> float:
    return int(sec) + int(usec) / 1_000_000


def _token(lease: Lease) -> str:
    return f"{lease.fencing}:{lease.owner}"


def _split(key: str, token: bytes | str) -> tuple[int, str]:
    fencing, sep, owner = _text(token).partition(":")
    if not sep or not fencing.isdigit():
        raise CorruptRecordError("not a lease token", table="redis", key=key)
    return int(fencing), owner


class _Scripts:
    """The four scripts registered on one client (EVALSHA, reloaded after a restart)."""

    def __init__(self, client: Any) -> None:
        self.acquire = client.register_script(ACQUIRE_LUA)
        self.renew = client.register_script(RENEW_LUA)
        self.release = client.register_script(RELEASE_LUA)
        self.holder = client.register_script(HOLDER_LUA)


class RedisLeaseBackend(LeaseBackendBase):
    """Leases in Redis through redis-py, sync and ``redis.asyncio``.

    Every script is safe to send twice (acquire by the holder itself refreshes, renew and
    release compare the token), so the clients retry a dropped connection briefly. An outage
    still surfaces within about ``timeout`` seconds as ``LockBackendUnavailable``, rather
    than after redis-py's default of retrying with 1-10 s backoffs.

    Args:
        url: ``redis://``, ``rediss://`` or ``unix://`` URL; clients are opened lazily.
        client: A sync client to use instead of one opened from ``url`` (left open).
        aclient: An async client likewise; an async client is bound to the event loop it
            first ran on, so use one backend per loop.
        prefix: Start of every key.
        timeout: Socket connect and read timeout of the clients opened from ``url``.
        fence_retention: Seconds a name's fencing counter outlives its last acquisition.
    """

    kind = "redis"

    def __init__(
        self,
        url: str | None = None,
        *,
        client: redis.Redis | None = None,
        aclient: redis.asyncio.Redis | None = None,
        prefix: str = "taskpilots:",
        timeout: float = 2.0,
        fence_retention: float = 24 * 3600.0,
    ) -> None:
        if url is None and client is None and aclient is None:
            raise ConfigurationError("RedisLeaseBackend needs a url, a client or an aclient")
        self.url = url
        self.prefix = prefix
        self.timeout = timeout
        self.fence_retention = fence_retention
        self._client = client
        self._aclient = aclient
        self._own_client = self._own_aclient = False
        self._scripts: _Scripts | None = None
        self._ascripts: _Scripts | None = None
        self._init_lock = threading.Lock()

    # -- keys and clients ----------------------------------------------------------------------

    def _keys(self, name: str) -> tuple[str, str]:
        return f"{self.prefix}lease:{{{name}}}", f"{self.prefix}fence:{{{name}}}"

    def _options(self, retry: Any) -> dict[str, Any]:
        """Client arguments: the timeouts, and two quick retries of a dropped connection."""
        timeouts = {"socket_timeout": self.timeout, "socket_connect_timeout": self.timeout}
        return {**timeouts, "retry": retry(ExponentialWithJitterBackoff(cap=0.1, base=0.01), 2)}

    def _sync(self) -> _Scripts:
        with self._init_lock:
            if self._scripts is None:
                if self._client is None:
                    self._client = redis.Redis.from_url(
                        self._require_url("client"), **self._options(Retry)
                    )
                    self._own_client = True
                self._scripts = _Scripts(self._client)
            return self._scripts

    def _async(self) -> _Scripts:
        # No await inside: creating the client cannot interleave with another task's.
        if self._ascripts is None:
            if self._aclient is None:
                self._aclient = redis.asyncio.Redis.from_url(
                    self._require_url("client"), **self._options(redis.asyncio.retry.Retry)
                )
                self._own_aclient = True
            self._ascripts = _Scripts(self._aclient)
        return self._ascripts

    # -- decoding (shared by both sides) -------------------------------------------------------

    def _acquire_args(self, name: str, owner: str, ttl: float) -> dict[str, Any]:
        check_lease_args(name, owner, ttl)
        retention = max(_millis(ttl), _millis(self.fence_retention))
        return {"keys": self._keys(name), "args": (owner, _millis(ttl), retention)}

    def _granted(self, name: str, owner: str, ttl: float, raw: Sequence[Any]) -> Lease | None:
        ok, token, _, sec, usec = raw
        if not ok:
            return None
        fencing, _ = _split(self._keys(name)[0], token)
        return Lease(name, owner, fencing, _server_now(sec, usec) + ttl, ttl)

    def _renew_args(self, lease: Lease) -> dict[str, Any]:
        return {"keys": self._keys(lease.name)[:1], "args": (_token(lease), _millis(lease.ttl))}

    @staticmethod
    def _renewed(lease: Lease, raw: Sequence[Any]) -> Lease:
        if not raw[0]:
            raise LeaseLost(lease.name, "it expired or was taken over", fencing=lease.fencing)
        return Lease(
            lease.name, lease.owner, lease.fencing, _server_now(*raw[1:]) + lease.ttl, lease.ttl
        )

    def _release_args(self, lease: Lease) -> dict[str, Any]:
        return {"keys": self._keys(lease.name)[:1], "args": (_token(lease),)}

    def _held(self, name: str, raw: Sequence[Any]) -> Lease | None:
        if not raw[0]:
            return None
        _, token, pttl, sec, usec = raw
        fencing, owner = _split(self._keys(name)[0], token)
        left = max(0, int(pttl)) / 1000
        return Lease(name, owner, fencing, _server_now(sec, usec) + left, left)

    # -- the operations, sync and async --------------------------------------------------------

    def _run(self, script: str, **call: Any) -> Steps[Any]:
        """``script`` (one of :class:`_Scripts`) on the sync or the async client."""
        with _reachable():
            run = getattr((yield IO(self._sync, self._async)), script)
            return (yield both(run, run, **call))

    def _acquire(self, name: str, owner: str, ttl: float) -> Steps[Lease | None]:
        raw = yield from self._run("acquire", **self._acquire_args(name, owner, ttl))
        return self._granted(name, owner, ttl, raw)

    def _renew(self, lease: Lease) -> Steps[Lease]:
        return self._renewed(lease, (yield from self._run("renew", **self._renew_args(lease))))

    def _release(self, lease: Lease) -> Steps[bool]:
        return bool((yield from self._run("release", **self._release_args(lease))))

    def _holder(self, name: str) -> Steps[Lease | None]:
        return self._held(name, (yield from self._run("holder", keys=self._keys(name)[:1])))

    acquire, aacquire = synced(_acquire), asynced(_acquire)
    renew, arenew = synced(_renew), asynced(_renew)
    release, arelease = synced(_release), asynced(_release)
    holder, aholder = synced(_holder), asynced(_holder)

    def close(self) -> None:
        """Close the sync client if this backend opened it."""
        if self._own_client and self._client is not None:
            self._client.close()
        self._client, self._scripts, self._own_client = None, None, False

    async def aclose(self) -> None:
        """Close the clients this backend opened (async and sync)."""
        if self._own_aclient and self._aclient is not None:
            await self._aclient.aclose()
        self._aclient, self._ascripts, self._own_aclient = None, None, False
        self.close()
