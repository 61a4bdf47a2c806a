"""The takeover inbox: a small server-rendered Starlette app (no JavaScript).

Pages: the inbox (``/``), a thread (``/threads/<id>``: its takeovers as
:mod:`~taskpilots_graph.web.view` describes them, a form per decision, the ledger and the
timeline) and the recovery map (``/map``, its chart drawn on the server, ``/map.svg``). A
decision, a POST to ``/decide/<id>``, is carried out in the background
(:mod:`~taskpilots_graph.web.jobs`); the thread page refreshes itself (an HTML ``meta``
refresh) until the outcome is known.

Every form names the takeover it answers (interrupt id and tool call id), and its CSRF
token is bound to that takeover: a form sent again after its takeover was answered (a
resubmit, a second tab) is refused with 409 and a link to the takeover pending now, and
changes nothing. "Decided by" is the authenticated user (``users=``) or a required field,
never a guess. Every value shown is HTML-escaped by Jinja2's autoescaping; the guards are
in :mod:`~taskpilots_graph.web.security`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
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

from taskpilots_graph.checkpointers import RecoveryAPI
from taskpilots_graph.decisions import pending_takeovers
from taskpilots_graph.errors import ConfigurationError, InvalidDecision, ThreadNotFound
from taskpilots_graph.ledger import PAUSED, LedgerEntry, LedgerStatus
from taskpilots_graph.recovery_map import RecoveryMap, recovery_map
from taskpilots_graph.replay import replay
from taskpilots_graph.takeover import Decision, TakeoverRequest, parse_decision
from taskpilots_graph.threads import recovery_api, thread_info
from taskpilots_graph.tool_tables import graph_tools
from taskpilots_graph.web.chart import map_svg
from taskpilots_graph.web.jobs import DecisionJobs
from taskpilots_graph.web.security import (
    ACCESS_COOKIE,
    CSRF_COOKIE,
    CsrfGuard,
    check_bind,
    same_token,
)
from taskpilots_graph.web.view import (
    RISK_ORDER,
    TakeoverView,
    failed_steps,
    outcome_of,
    takeover_view,
)

__all__ = ["LOOPBACK_HOSTS", "create_app"]

LOOPBACK_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost", "::1", "[::1]")
"""Host headers accepted by default (a page on another site cannot rebind its name here)."""

_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'"
)
"""No script may run, whatever a value contains; images only from the inbox (the chart)."""


def _pretty(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2, ensure_ascii=False, default=str, sort_keys=True)


def _ago(when: datetime | None) -> str:
    if when is None:
        return ""
    minutes = int((datetime.now(UTC) - when).total_seconds() // 60)
    if minutes < 1:
        return "just now"
    if minutes < 120:
        return f"{minutes} min ago"
    hours = minutes // 60
    return f"{hours} h ago" if hours < 48 else f"{hours // 24} days ago"


def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("taskpilots_graph.web", "templates"),
        autoescape=select_autoescape(("html",), default=True),
    )
    env.filters["pretty"] = _pretty
    env.filters["url"] = lambda text: quote(str(text), safe="")
    env.filters["ago"] = _ago
    env.filters["utc"] = lambda when: when.strftime("%Y-%m-%d %H:%M:%S UTC") if when else "?"
    return env


class _Inbox:
    """The app's state and endpoints."""

    def __init__(
        self,
        graph: Pregel[Any, Any],
        checkpointer: Any,
        tokens: Mapping[str, str | None],
        csrf: CsrfGuard,
        rmap: RecoveryMap | None,
    ) -> None:
        self.graph = graph
        self.checkpointer = checkpointer
        self.tokens = tokens  # access token -> the user it names (None: a shared token)
        self.csrf = csrf
        self.map = rmap
        self.tools = graph_tools(graph)
        self.jobs = DecisionJobs(graph, checkpointer)
        self.env = _environment()

    # -- guards ----------------------------------------------------------------------------

    def _presented(self, request: Request) -> str | None:
        """The known access token the request carries (header or cookie), if any."""
        header = request.headers.get("authorization", "")
        bearer = header[7:] if header.lower().startswith("bearer ") else None
        cookie = request.cookies.get(ACCESS_COOKIE)
        # Every token is compared (constant time each), so timing tells nothing.
        matches = [t for t in self.tokens if same_token(bearer, t) | same_token(cookie, t)]
        return matches[0] if matches else None

    def _user(self, request: Request) -> str | None:
        """The authenticated user's name, when the request carries a personal token."""
        token = self._presented(request)
        return self.tokens.get(token) if token is not None else None

    def _denied(self, request: Request) -> Response | None:
        """401 without an access token (when any is set); a ``?token=`` visit sets it."""
        if not self.tokens or self._presented(request) is not None:
            return None
        given = request.query_params.get("token")
        matched = [same_token(given, t) for t in self.tokens]  # each compared: no timing hint
        if request.method == "GET" and any(matched):
            back = RedirectResponse(request.url.path, status_code=303)
            back.set_cookie(ACCESS_COOKIE, str(given), httponly=True, samesite="strict")
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
            # Each form's token is bound to the takeover it answers (see security).
            csrf_for=lambda interrupt_id: self.csrf.token_for(cookie, interrupt_id or ""),
            user=self._user(request),
            **context,
        )
        response = HTMLResponse(body, status_code=status)
        if fresh:
            response.set_cookie(CSRF_COOKIE, cookie, httponly=True, samesite="strict")
        response.headers["content-security-policy"] = _CSP
        response.headers["x-content-type-options"] = "nosniff"
        return response

    def _error(
        self, request: Request, status: int, message: str, link: tuple[str, str] | None = None
    ) -> Response:
        return self._render(
            request, "error.html", status=status, status_code=status, message=message, link=link
        )

    # -- reading ---------------------------------------------------------------------------

    def _ledger(self, cp: RecoveryAPI, request: TakeoverRequest) -> list[LedgerEntry]:
        # The thread's entries, plus a waiting step's entry recorded under a business key
        # by another thread: the person must see the effect in question.
        ledger = cp.ledger(request.thread_id)
        known = {e.key for e in ledger}
        for step in request.pending:
            key = step.get("key")
            if key and key not in known and (entry := cp.ledger_entry(str(key))) is not None:
                ledger.append(entry)
        return ledger

    def _views(self, requests: Sequence[TakeoverRequest]) -> list[TakeoverView]:
        cp = recovery_api(self.checkpointer)
        return [
            takeover_view(
                request,
                tools=self.tools,
                events=cp.events(request.thread_id),
                since=thread_info(cp, request.thread_id).updated_at,
                ledger=self._ledger(cp, request),
            )
            for request in requests
        ]

    # -- pages -----------------------------------------------------------------------------

    def inbox(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        far = datetime.max.replace(tzinfo=UTC)
        views = sorted(
            self._views(pending_takeovers(self.checkpointer)),
            # Oldest first: the longest wait is the first row; then the riskier one.
            key=lambda v: (v.since or far, RISK_ORDER[v.risk], v.request.thread_id),
        )
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
            views=views,
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
        events = cp.events(thread_id)
        ledger = cp.ledger(thread_id)
        return self._render(
            request,
            "thread.html",
            info=info,
            outcome=outcome_of(info, events, ledger),
            failures=failed_steps(events),
            views=self._views(pending_takeovers(cp, thread_ids=[thread_id])),
            steps=replay(cp, thread_id).steps,
            ledger=ledger,
            job=job,
            refresh=1 if job is not None and job.status == "running" else None,
        )

    def map_page(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        return self._render(request, "map.html", rmap=self.map)

    def map_image(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        if self.map is None:
            return Response("no recovery map", status_code=404, media_type="text/plain")
        return Response(
            map_svg(self.map),
            media_type="image/svg+xml",
            headers={"content-security-policy": "default-src 'none'; style-src 'unsafe-inline'"},
        )

    async def decide(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        form = await request.form()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        answers = fields.get("interrupt_id", "")
        if not self.csrf.valid(request.cookies.get(CSRF_COOKIE), fields.get("csrf"), answers):
            return self._error(
                request,
                403,
                "the form's CSRF token is missing, wrong, or not that of the takeover it "
                "answers; reload the thread page",
            )
        thread_id = request.path_params["thread_id"]
        user = self._user(request)
        if user is not None:
            fields["decided_by"] = user  # who signed in decides, whatever the form says
        try:
            decision = _decision(fields)
        except InvalidDecision as exc:
            return self._error(request, 400, str(exc))
        if (running := self.jobs.running_for(answers)) is not None:
            # Sent twice before the first answer was applied: one answer per takeover.
            return self._error(
                request,
                409,
                "An answer to this takeover is being carried out already; this one was not "
                "applied.",
                (f"/threads/{quote(thread_id, safe='')}?job={running.job_id}", "See its outcome"),
            )
        current = pending_takeovers(self.checkpointer, thread_ids=[thread_id])
        if answers not in {r.interrupt_id for r in current}:
            return self._stale(request, thread_id, current)
        job = self.jobs.submit(thread_id, decision)
        return RedirectResponse(
            f"/threads/{quote(thread_id, safe='')}?job={job.job_id}", status_code=303
        )

    def _stale(
        self, request: Request, thread_id: str, current: Sequence[TakeoverRequest]
    ) -> Response:
        """409: the form answers a takeover that was answered already; nothing changes."""
        page = f"/threads/{quote(thread_id, safe='')}"
        answered = f"This form answers a takeover of thread {thread_id!r} that was already answered"
        if not current:
            message = f"{answered}, so it was not applied; the thread waits on nobody now."
            return self._error(request, 409, message, (page, "Open the thread"))
        now = current[0]
        steps = ", ".join(str(p.get("tool")) for p in now.pending) or "a step"
        return self._error(
            request,
            409,
            f"{answered}, so it was not applied. The thread now waits on another takeover "
            f"(about {steps}): read it before deciding.",
            (f"{page}#takeover-{now.interrupt_id}", "Open the current takeover"),
        )


def _decision(form: dict[str, str]) -> Decision:
    """The decision a form describes (result as JSON, else as text; args as a JSON object).

    Raises:
        InvalidDecision: For a malformed decision or argument JSON, or no "decided by".
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
    names = ("interrupt_id", "tool_call_id", "decided_by", "note")
    fields.update({name: value for name in names if (value := form.get(name, "").strip())})
    if "decided_by" not in fields:
        # The log must say who decided; the server's account would name nobody in particular.
        raise InvalidDecision("say who decides: 'decided by' is required")
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
    users: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    allowed_hosts: Sequence[str] | None = None,
    csrf_secret: bytes | None = None,
) -> Starlette:
    """The takeover inbox for ``graph`` (a recovery agent with its checkpointer).

    Example:
        >>> app = create_app(graph, users={"dana": "a-long-enough-token-of-dana"})
        ... # doctest: +SKIP
        >>> uvicorn.run(app, host="127.0.0.1", port=8765)  # doctest: +SKIP

    Args:
        graph: The compiled graph whose threads are decided (``tp.decide`` runs it).
        checkpointer: The store to read (default: the graph's checkpointer).
        token: A shared access token; whoever holds it types their name to decide.
            Required, or ``users``, when ``host`` is not loopback.
        users: Personal access tokens, ``{user name: token}``: a decision sent with one is
            recorded as decided by that user (the form cannot say otherwise).
        host: The address the app will be served on (checked, and allowed as Host header).
        allowed_hosts: Host headers accepted (default: loopback names and ``host``).
        csrf_secret: Key of the CSRF tokens (default: random per process).

    Raises:
        InsecureBind: ``host`` is not loopback and there is no token, or a token is short.
        ConfigurationError: The graph has no recovery checkpointer, or two users share a
            token.
    """
    tokens: dict[str, str | None] = {}
    for name, secret in (users or {}).items():
        check_bind(host, secret)
        if secret in tokens or not name:
            raise ConfigurationError("each inbox user needs a name and a token of their own")
        tokens[secret] = name
    if token is not None or not tokens:
        check_bind(host, token)
    if token is not None:
        tokens.setdefault(token, None)
    store: Any = checkpointer if checkpointer is not None else graph.checkpointer
    recovery_api(store)  # the pages read its event log and ledger
    try:
        rmap: RecoveryMap | None = recovery_map(graph)
    except ConfigurationError:
        rmap = None  # not a recovery agent: the inbox works, the map page says so
    inbox = _Inbox(graph, store, tokens, CsrfGuard(csrf_secret), rmap)
    hosts = list(allowed_hosts) if allowed_hosts is not None else [*LOOPBACK_HOSTS, host]
    app = Starlette(
        routes=[
            Route("/", inbox.inbox),
            Route("/map", inbox.map_page),
            Route("/map.svg", inbox.map_image),
            Route("/threads/{thread_id:path}", inbox.thread),
            Route("/decide/{thread_id:path}", inbox.decide, methods=["POST"]),
        ],
        middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts)],
        lifespan=_lifespan(inbox),
    )
    app.state.inbox = inbox
    return app
