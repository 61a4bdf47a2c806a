"""The takeover inbox: a small server-rendered Starlette app (no JavaScript).

Pages: the inbox (``/``: every thread waiting on a person, with its
:class:`~taskpilots_graph.takeover.TakeoverRequest` and a form per decision), a thread
(``/threads/<id>``: status, takeover, timeline from the event log, ledger, and the outcome
of a decision just sent) and the recovery map (``/map``). A decision is a POST to
``/decide/<id>``; it is carried out in the background (:mod:`~taskpilots_graph.web.jobs`)
and the browser is sent to the thread page, which refreshes itself (an HTML ``meta``
refresh) until the outcome is known. Every value shown is HTML-escaped by Jinja2's
autoescaping; the guards are in :mod:`~taskpilots_graph.web.security`.
"""

from __future__ import annotations

import getpass
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

from jinja2 import Environment, PackageLoader, select_autoescape
from langgraph.pregel import Pregel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from taskpilots_graph.errors import ConfigurationError, InvalidDecision, ThreadNotFound
from taskpilots_graph.ledger import PAUSED, LedgerStatus
from taskpilots_graph.recovery_map import RecoveryMap, recovery_map
from taskpilots_graph.replay import replay
from taskpilots_graph.runner import pending_takeovers
from taskpilots_graph.takeover import Decision, parse_decision
from taskpilots_graph.threads import recovery_api, thread_info
from taskpilots_graph.web.jobs import DecisionJobs
from taskpilots_graph.web.security import (
    ACCESS_COOKIE,
    CSRF_COOKIE,
    CsrfGuard,
    check_bind,
    same_token,
)

__all__ = ["LOOPBACK_HOSTS", "create_app", "os_user"]

LOOPBACK_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost", "::1", "[::1]")
"""Host headers accepted by default (a page on another site cannot rebind its name here)."""


def os_user() -> str:
    """The OS user name: the default "decided by"."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        return "unknown"


def _pretty(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2, ensure_ascii=False, default=str, sort_keys=True)


def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("taskpilots_graph.web", "templates"),
        autoescape=select_autoescape(("html",), default=True),
    )
    env.filters["pretty"] = _pretty
    env.filters["url"] = lambda text: quote(str(text), safe="")
    return env


class _Inbox:
    """The app's state and endpoints."""

    def __init__(
        self,
        graph: Pregel[Any, Any],
        checkpointer: Any,
        token: str | None,
        csrf: CsrfGuard,
        rmap: RecoveryMap | None,
    ) -> None:
        self.graph = graph
        self.checkpointer = checkpointer
        self.token = token
        self.csrf = csrf
        self.map = rmap
        self.jobs = DecisionJobs(graph, checkpointer)
        self.env = _environment()

    # -- guards ----------------------------------------------------------------------------

    def _denied(self, request: Request) -> Response | None:
        """401 without the access token (when one is set); a ``?token=`` visit sets it."""
        if self.token is None:
            return None
        header = request.headers.get("authorization", "")
        bearer = header[7:] if header.lower().startswith("bearer ") else None
        if same_token(bearer, self.token) or same_token(
            request.cookies.get(ACCESS_COOKIE), self.token
        ):
            return None
        if request.method == "GET" and same_token(request.query_params.get("token"), self.token):
            back = RedirectResponse(request.url.path, status_code=303)
            back.set_cookie(ACCESS_COOKIE, self.token, httponly=True, samesite="strict")
            return back
        return HTMLResponse(
            "<h1>401</h1><p>This inbox needs its access token: open it once with "
            "?token=... or send an Authorization: Bearer header.</p>",
            status_code=401,
        )

    def _render(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        cookie = request.cookies.get(CSRF_COOKIE)
        fresh = cookie is None
        if cookie is None:
            cookie = self.csrf.new_cookie()
        body = self.env.get_template(name).render(
            csrf=self.csrf.token_for(cookie), default_user=os_user(), **context
        )
        response = HTMLResponse(body, status_code=status)
        if fresh:
            response.set_cookie(CSRF_COOKIE, cookie, httponly=True, samesite="strict")
        # No script may run, whatever a value contains; no framing by other sites.
        response.headers["content-security-policy"] = (
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
            "frame-ancestors 'none'"
        )
        response.headers["x-content-type-options"] = "nosniff"
        return response

    def _error(self, request: Request, status: int, message: str) -> Response:
        return self._render(
            request, "error.html", status=status, status_code=status, message=message
        )

    # -- pages -----------------------------------------------------------------------------

    def inbox(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        requests = sorted(pending_takeovers(self.checkpointer), key=lambda r: r.thread_id)
        # Nothing hidden: effects left intended by a stopped run, or that nobody could
        # confirm, are listed even where no takeover asks about them (yet).
        unsettled = [
            e
            for e in recovery_api(self.checkpointer).ledger(None)
            if e.status is LedgerStatus.UNCERTAIN
            or (e.status is LedgerStatus.INTENDED and not e.extra.get(PAUSED))
        ]
        return self._render(
            request,
            "inbox.html",
            requests=requests,
            unsettled=unsettled,
            jobs=self.jobs.recent(),
            rmap=self.map,
        )

    def thread(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        thread_id = request.path_params["thread_id"]
        cp = recovery_api(self.checkpointer)
        try:
            info = thread_info(cp, thread_id)
        except ThreadNotFound:
            return self._error(request, 404, f"no thread {thread_id!r} in this store")
        job = self.jobs.get(request.query_params.get("job", ""))
        if job is not None and job.thread_id != thread_id:
            job = None
        return self._render(
            request,
            "thread.html",
            info=info,
            requests=pending_takeovers(cp, thread_ids=[thread_id]),
            steps=replay(cp, thread_id).steps,
            ledger=cp.ledger(thread_id),
            job=job,
            refresh=1 if job is not None and job.status == "running" else None,
        )

    def map_page(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        return self._render(request, "map.html", rmap=self.map)

    async def decide(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        form = await request.form()
        token = form.get("csrf")
        if not self.csrf.valid(
            request.cookies.get(CSRF_COOKIE), token if isinstance(token, str) else None
        ):
            return self._error(
                request, 403, "the form's CSRF token is missing or wrong; reload the inbox"
            )
        thread_id = request.path_params["thread_id"]
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        try:
            decision = _decision(fields)
        except InvalidDecision as exc:
            return self._error(request, 400, str(exc))
        if not pending_takeovers(self.checkpointer, thread_ids=[thread_id]):
            return self._error(request, 409, f"thread {thread_id!r} waits on nobody (any more)")
        job = self.jobs.submit(thread_id, decision)
        return RedirectResponse(
            f"/threads/{quote(thread_id, safe='')}?job={job.job_id}", status_code=303
        )


def _decision(form: dict[str, str]) -> Decision:
    """The decision a form describes (result as JSON, else as text; args as a JSON object).

    Raises:
        InvalidDecision: For a malformed decision or argument JSON.
    """
    fields: dict[str, Any] = {"action": form.get("action", "")}
    result = form.get("result", "").strip()
    if result and fields["action"] == "provide_result":
        try:
            fields["result"] = json.loads(result)
        except json.JSONDecodeError:
            fields["result"] = result  # plain text is a result too
    args = form.get("args", "").strip()
    if args and fields["action"] == "edit_args":
        try:
            fields["args"] = json.loads(args)
        except json.JSONDecodeError as exc:
            raise InvalidDecision(f"the arguments are not valid JSON: {exc.msg}") from exc
    for name in ("tool_call_id", "decided_by", "note"):
        value = form.get(name, "").strip()
        if value:
            fields[name] = value
    fields.setdefault("decided_by", os_user())
    return parse_decision(fields)


def _lifespan(inbox: _Inbox) -> Any:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        inbox.jobs.close()  # let a decision being carried out finish

    return lifespan


def create_app(
    graph: Pregel[Any, Any],
    *,
    checkpointer: Any = None,
    token: str | None = None,
    host: str = "127.0.0.1",
    allowed_hosts: Sequence[str] | None = None,
    csrf_secret: bytes | None = None,
) -> Starlette:
    """The takeover inbox for ``graph`` (a recovery agent with its checkpointer).

    Example:
        >>> app = create_app(graph)  # doctest: +SKIP
        >>> uvicorn.run(app, host="127.0.0.1", port=8765)  # doctest: +SKIP

    Args:
        graph: The compiled graph whose threads are decided (``tp.decide`` runs it).
        checkpointer: The store to read (default: the graph's checkpointer).
        token: Access token; required when ``host`` is not loopback.
        host: The address the app will be served on (checked, and allowed as Host header).
        allowed_hosts: Host headers accepted (default: loopback names and ``host``).
        csrf_secret: Key of the CSRF tokens (default: random per process).

    Raises:
        InsecureBind: ``host`` is not loopback and there is no ``token``.
        ConfigurationError: The graph has no recovery checkpointer.
    """
    check_bind(host, token)
    store: Any = checkpointer if checkpointer is not None else graph.checkpointer
    recovery_api(store)  # the pages read its event log and ledger
    try:
        rmap: RecoveryMap | None = recovery_map(graph)
    except ConfigurationError:
        rmap = None  # not a recovery agent: the inbox works, the map page says so
    inbox = _Inbox(graph, store, token, CsrfGuard(csrf_secret), rmap)
    hosts = list(allowed_hosts) if allowed_hosts is not None else [*LOOPBACK_HOSTS, host]
    app = Starlette(
        routes=[
            Route("/", inbox.inbox),
            Route("/map", inbox.map_page),
            Route("/threads/{thread_id:path}", inbox.thread),
            Route("/decide/{thread_id:path}", inbox.decide, methods=["POST"]),
        ],
        middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts)],
        lifespan=_lifespan(inbox),
    )
    app.state.inbox = inbox
    return app
