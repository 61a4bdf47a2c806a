"""The inbox's guards: CSRF on every POST (bound to its takeover), escaped values, loopback
unless a token is set, "decided by" never guessed, and a stale form refused with 409."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _inbox_scenario import (
    CARRIER_PORTAL,
    SHIP_PLAN,
    THREAD,
    FileService,
    build,
    stop_on_shipping,
    stop_on_takeover,
    warehouse_tools,
)
from starlette.testclient import TestClient
from typer.testing import CliRunner

import taskpilots_graph as tp
from taskpilots_graph import testing
from taskpilots_graph.cli import app as cli_app
from taskpilots_graph.recovery_map import MAP_KINDS, RecoveryMap, ToolRecovery
from taskpilots_graph.web import InsecureBind, check_bind, create_app
from taskpilots_graph.web.chart import map_svg

SCRIPT = "<script>alert('owned')</script>"
TOKEN = "a-long-enough-access-token"


@pytest.fixture
def service(tmp_path: Path) -> FileService:
    return FileService(tmp_path / "service.db", note=SCRIPT)


@pytest.fixture
def graph(cp: tp.RecoveryCheckpointer, service: FileService) -> Any:
    graph = build(cp, service)
    stop_on_takeover(graph)
    return graph


@pytest.fixture
def client(graph: Any) -> Iterator[TestClient]:
    with TestClient(create_app(graph), base_url="http://127.0.0.1") as c:
        yield c


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found is not None, "the page has no CSRF field"
    return found.group(1)


def form_of(client: TestClient, thread_id: str = THREAD) -> dict[str, str]:
    """The hidden fields of a decision form on the thread page (token, takeover, step)."""
    page = client.get(f"/threads/{thread_id}").text
    fields = {"csrf": csrf_of(page)}
    for name in ("interrupt_id", "tool_call_id"):
        found = re.search(rf'name="{name}" value="([^"]+)"', page)
        assert found is not None, f"the form does not name its {name}"
        fields[name] = found.group(1)
    return fields


def decisions(cp: tp.RecoveryCheckpointer) -> list[Any]:
    return [e for e in cp.events(THREAD) if e.kind is tp.EventKind.DECISION_RECORDED]


def wait_for_job(client: TestClient, location: str) -> str:
    for _ in range(200):
        page = client.get(location).text
        if 'http-equiv="refresh"' not in page:
            return page
        time.sleep(0.05)
    raise AssertionError("the decision did not finish")


@pytest.mark.parametrize(
    "form",
    [
        {"action": "skip"},
        {"action": "skip", "csrf": ""},
        {"action": "skip", "csrf": "0" * 64},
    ],
    ids=["missing", "empty", "forged"],
)
def test_post_without_a_valid_csrf_token_is_refused_and_decides_nothing(
    cp: tp.RecoveryCheckpointer, service: FileService, client: TestClient, form: dict[str, str]
) -> None:
    """403, and the thread still waits: no decision event, no call, the takeover is there."""
    client.get("/")  # the browser has its CSRF cookie; the form lacks the matching token

    response = client.post(f"/decide/{THREAD}", data=form, follow_redirects=False)

    assert response.status_code == 403
    assert "CSRF" in response.text
    assert decisions(cp) == []
    assert len(tp.pending_takeovers(cp)) == 1
    assert service.count("charge") == 1
    assert tp.thread_info(cp, THREAD).status == "awaiting_human"


def test_a_token_from_another_browser_is_refused(cp: tp.RecoveryCheckpointer, graph: Any) -> None:
    """A token is bound to its browser's cookie: a valid token with another cookie is 403."""
    app = create_app(graph)
    with (
        TestClient(app, base_url="http://127.0.0.1") as alice,
        TestClient(app, base_url="http://127.0.0.1") as mallory,
    ):
        form = form_of(alice)
        mallory.get("/")
        response = mallory.post(
            f"/decide/{THREAD}", data={**form, "action": "skip", "decided_by": "mallory"}
        )
    assert response.status_code == 403
    assert decisions(cp) == []


def test_a_valid_post_decides_and_the_thread_page_shows_the_outcome(
    cp: tp.RecoveryCheckpointer, service: FileService, client: TestClient
) -> None:
    """The control: with the page's token the decision runs in the background and closes it."""
    form = form_of(client)

    response = client.post(
        f"/decide/{THREAD}",
        data={**form, "action": "skip", "decided_by": "dana", "note": "checked by phone"},
        follow_redirects=False,
    )

    assert response.status_code == 303
    page = wait_for_job(client, response.headers["location"])
    assert "the thread is now closed" in page
    (decided,) = decisions(cp)
    assert decided.payload["decided_by"] == "dana"
    assert decided.payload["decision"]["note"] == "checked by phone"
    assert decided.payload["decision"]["interrupt_id"] == form["interrupt_id"]
    assert decided.payload["decision"]["tool_call_id"] == form["tool_call_id"]
    assert service.count("charge") == 1
    assert tp.pending_takeovers(cp) == []


def test_an_invalid_decision_is_a_400_and_changes_nothing(
    cp: tp.RecoveryCheckpointer, client: TestClient
) -> None:
    """edit_args with arguments that are not JSON: 400 with the reason; nothing decided."""
    form = {**form_of(client), "decided_by": "dana"}
    response = client.post(
        f"/decide/{THREAD}", data={**form, "action": "edit_args", "args": "{bad"}
    )
    assert response.status_code == 400
    assert "not valid JSON" in response.text
    assert decisions(cp) == []


def test_values_from_tools_are_escaped(client: TestClient) -> None:
    """A tool result holding a script tag is shown as text on the thread page; no page and no
    chart allows a script."""
    page = client.get(f"/threads/{THREAD}").text
    assert "&lt;script&gt;alert(&#39;owned&#39;)&lt;/script&gt;" in page
    for path in ("/", f"/threads/{THREAD}", "/map", "/map.svg"):
        response = client.get(path)
        assert "<script" not in response.text
        assert "script-src" not in response.headers["content-security-policy"]


def test_non_loopback_host_without_token_refuses_to_start(graph: Any) -> None:
    """create_app and the CLI both refuse 0.0.0.0 without a token, saying why."""
    with pytest.raises(InsecureBind, match="without an access token"):
        create_app(graph, host="0.0.0.0")
    with pytest.raises(InsecureBind, match="at least 16"):
        check_bind("127.0.0.1", "short")
    check_bind("::1", None)
    check_bind("0.0.0.0", TOKEN)

    result = CliRunner().invoke(cli_app, ["inbox", "--graph", "nowhere:graph", "--host", "0.0.0.0"])
    assert result.exit_code == 1
    assert "refusing to serve the takeover inbox on '0.0.0.0'" in result.output
    assert "--token" in result.output


def test_with_a_token_every_request_needs_it(cp: tp.RecoveryCheckpointer, graph: Any) -> None:
    """401 without the token; one visit with ?token= sets the cookie; the Host is checked."""
    app = create_app(graph, host="0.0.0.0", token=TOKEN, allowed_hosts=["127.0.0.1"])
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert client.get("/").status_code == 401
        assert client.post(f"/decide/{THREAD}", data={"action": "skip"}).status_code == 401
        assert client.get("/?token=wrong-token-wrong-token").status_code == 401
        assert client.get(f"/?token={TOKEN}").status_code == 200  # redirected, cookie set
        assert "Takeover inbox" in client.get("/").text
    with TestClient(app, base_url="http://evil.example") as client:
        assert client.get("/", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 400
    assert decisions(cp) == []


def test_map_page_shows_the_recovery_map(client: TestClient) -> None:
    """The map page: one card per tool, the warnings, the chart as a server-drawn image."""
    page = client.get("/map").text
    assert "<dd>may become uncertain</dd>" in page
    assert "charge: a non-idempotent side effect" in page
    assert '<img class="chart" id="chart" src="/map.svg"' in page
    assert "&lt;br/&gt;read&#34;]" in page  # the Mermaid source, escaped, for documentation
    chart = client.get("/map.svg")
    assert chart.headers["content-type"].startswith("image/svg+xml")
    assert chart.text.startswith("<svg ")
    assert ">charge</tspan>" in chart.text
    assert "may become uncertain" in chart.text


def test_chart_labels_are_escaped() -> None:
    """A tool name with markup is text in the SVG, never an element."""
    rmap = RecoveryMap(
        tools=(
            ToolRecovery(
                tool="<script>x</script>",
                effect="read",
                compensable=False,
                confirm_drift=False,
                max_attempts=1,
                backoff="",
                wait_window=0.0,
                fallback=(),
                on_exhausted="takeover",
                outcomes=dict.fromkeys(MAP_KINDS, "ask a person & <then> fail"),
            ),
        )
    )
    svg = map_svg(rmap)
    assert "<script" not in svg
    assert "&lt;script&gt;x&lt;/script&gt;" in svg
    assert "ask a person &amp; &lt;then&gt; fail" in svg


def test_a_form_sent_again_after_its_takeover_was_answered_is_a_409(
    cp: tp.RecoveryCheckpointer, service: FileService, client: TestClient
) -> None:
    """The same valid form twice: the first is applied, the second is refused (409) naming
    the thread's state, and nothing more is recorded or executed."""
    form = {**form_of(client), "action": "retry", "decided_by": "dana"}
    first = client.post(f"/decide/{THREAD}", data=form, follow_redirects=False)
    assert first.status_code == 303
    wait_for_job(client, first.headers["location"])
    assert service.count("charge") == 2  # the retry ran it once more
    after = (cp.ledger(THREAD), len(cp.events(THREAD)))

    again = client.post(f"/decide/{THREAD}", data=form, follow_redirects=False)

    assert again.status_code == 409
    assert "already answered" in again.text
    assert f'href="/threads/{THREAD}"' in again.text
    assert (cp.ledger(THREAD), len(cp.events(THREAD))) == after
    assert service.count("charge") == 2
    assert len(decisions(cp)) == 1


def test_a_token_does_not_move_to_another_takeover(
    cp: tp.RecoveryCheckpointer, client: TestClient
) -> None:
    """The CSRF token is bound to the takeover its form answers: with another takeover id
    (here, one made up) the form is refused with 403 before anything is read."""
    form = {**form_of(client), "action": "skip", "decided_by": "dana"}
    response = client.post(f"/decide/{THREAD}", data={**form, "interrupt_id": "0" * 32})
    assert response.status_code == 403
    assert decisions(cp) == []


def test_decided_by_is_required_and_never_the_os_user(
    cp: tp.RecoveryCheckpointer, client: TestClient
) -> None:
    """Without a name the form is refused (400) and the page never prefills one."""
    page = client.get(f"/threads/{THREAD}").text
    assert re.search(r'name="decided_by" value="" required', page)
    response = client.post(f"/decide/{THREAD}", data={**form_of(client), "action": "skip"})
    assert response.status_code == 400
    assert "decided by" in response.text
    assert decisions(cp) == []


def test_a_personal_token_decides_as_its_user(
    cp: tp.RecoveryCheckpointer, service: FileService, graph: Any
) -> None:
    """With users=, the signed-in user is who decides, whatever the form says; the shared
    token still opens the inbox, and a short personal token is refused at start."""
    app = create_app(graph, users={"dana": TOKEN}, token="a-shared-token-for-the-desk")
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert client.get("/").status_code == 401
        client.get(f"/?token={TOKEN}")
        page = client.get(f"/threads/{THREAD}").text
        assert "signed in as dana" in page
        assert 'name="decided_by"' not in page
        form = {**form_of(client), "action": "skip", "decided_by": "mallory"}
        response = client.post(f"/decide/{THREAD}", data=form, follow_redirects=False)
        assert response.status_code == 303
        wait_for_job(client, response.headers["location"])
    (decided,) = decisions(cp)
    assert decided.payload["decided_by"] == "dana"
    with pytest.raises(InsecureBind, match="at least 16"):
        create_app(graph, users={"erin": "short"})


def test_a_form_sent_twice_before_the_first_answer_is_applied_is_a_409(
    cp: tp.RecoveryCheckpointer,
    service: FileService,
    graph: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A double click: while the first answer is still being carried out, the second is
    refused (409, a link to the first one's outcome); the effect runs once more, not twice."""
    app = create_app(graph)
    jobs = app.state.inbox.jobs
    gate = threading.Event()
    run = jobs._run

    def held(*args: Any) -> None:
        gate.wait(30)  # the first answer is not applied until the second was sent
        run(*args)

    monkeypatch.setattr(jobs, "_run", held)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        form = {**form_of(client), "action": "retry", "decided_by": "dana"}
        first = client.post(f"/decide/{THREAD}", data=form, follow_redirects=False)
        second = client.post(f"/decide/{THREAD}", data=form, follow_redirects=False)
        gate.set()
        assert first.status_code == 303
        assert second.status_code == 409
        assert "being carried out" in second.text
        assert first.headers["location"] in second.text
        wait_for_job(client, first.headers["location"])
    assert service.count("charge") == 2
    assert len(decisions(cp)) == 1


def test_the_inbox_of_a_create_agent_graph_decides_by_takeover(
    cp: tp.RecoveryCheckpointer, tmp_path: Path
) -> None:
    """``create_agent`` + ``RecoveryMiddleware``: the takeover is listed with its tool and
    risk, its page explains the options from the tool node's tools, and a form answers it."""
    from langchain.agents import create_agent

    from taskpilots_graph.middleware import RecoveryMiddleware

    warehouse = FileService(tmp_path / "warehouse.db")
    model = testing.ScriptedModel(plan=SHIP_PLAN, answer="shipped")
    graph = create_agent(
        model, warehouse_tools(warehouse), checkpointer=cp, middleware=[RecoveryMiddleware(cp)]
    )
    stop_on_shipping(graph, "ship-9")
    with TestClient(create_app(graph), base_url="http://127.0.0.1") as client:
        listing = client.get("/").text
        assert '<td data-label="tool">ship_parcel</td>' in listing
        assert "risk-high" in listing
        page = client.get("/threads/ship-9").text
        assert CARRIER_PORTAL in page
        assert "may perform it twice" in page
        assert "no recovery executor" in client.get("/map").text
        form = {**form_of(client, "ship-9"), "action": "skip", "decided_by": "dana"}
        response = client.post("/decide/ship-9", data=form, follow_redirects=False)
        assert response.status_code == 303
        wait_for_job(client, response.headers["location"])
        (mailer,) = tp.pending_takeovers(cp, thread_ids=["ship-9"])
        assert mailer.pending[0]["tool"] == "notify_customer"
        again = client.post("/decide/ship-9", data=form, follow_redirects=False)
        assert again.status_code == 409
        assert f"#takeover-{mailer.interrupt_id}" in again.text
    assert warehouse.count("ship_parcel") == 1
