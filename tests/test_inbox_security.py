"""The inbox's guards: CSRF on every POST, escaped values, loopback unless a token is set."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _inbox_scenario import THREAD, FileService, build, stop_on_takeover
from starlette.testclient import TestClient
from typer.testing import CliRunner

import taskpilots_graph as tp
from taskpilots_graph.cli import app as cli_app
from taskpilots_graph.web import InsecureBind, check_bind, create_app

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
        token = csrf_of(alice.get("/").text)
        mallory.get("/")
        response = mallory.post(f"/decide/{THREAD}", data={"action": "skip", "csrf": token})
    assert response.status_code == 403
    assert decisions(cp) == []


def test_a_valid_post_decides_and_the_thread_page_shows_the_outcome(
    cp: tp.RecoveryCheckpointer, service: FileService, client: TestClient
) -> None:
    """The control: with the page's token the decision runs in the background and closes it."""
    token = csrf_of(client.get("/").text)

    response = client.post(
        f"/decide/{THREAD}",
        data={"action": "skip", "csrf": token, "decided_by": "dana", "note": "checked by phone"},
        follow_redirects=False,
    )

    assert response.status_code == 303
    page = wait_for_job(client, response.headers["location"])
    assert "the thread is now closed" in page
    (decided,) = decisions(cp)
    assert decided.payload["decided_by"] == "dana"
    assert decided.payload["decision"]["note"] == "checked by phone"
    assert service.count("charge") == 1
    assert tp.pending_takeovers(cp) == []


def test_an_invalid_decision_is_a_400_and_changes_nothing(
    cp: tp.RecoveryCheckpointer, client: TestClient
) -> None:
    """edit_args with arguments that are not JSON: 400 with the reason; nothing decided."""
    token = csrf_of(client.get("/").text)
    response = client.post(
        f"/decide/{THREAD}", data={"action": "edit_args", "args": "{bad", "csrf": token}
    )
    assert response.status_code == 400
    assert "not valid JSON" in response.text
    assert decisions(cp) == []


def test_values_from_tools_are_escaped(client: TestClient) -> None:
    """A tool result holding a script tag is shown as text on the inbox and thread pages."""
    for path in ("/", f"/threads/{THREAD}"):
        page = client.get(path).text
        assert "<script>" not in page
        assert "&lt;script&gt;alert(&#39;owned&#39;)&lt;/script&gt;" in page
    assert "script-src" not in client.get("/").headers["content-security-policy"]


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
    """The map page: one row per tool, the warnings, the Mermaid text (escaped)."""
    page = client.get("/map").text
    assert "<td>may become uncertain</td>" in page
    assert "charge: a non-idempotent side effect" in page
    assert "flowchart LR" in page
    assert "&lt;br/&gt;read&#34;]" in page  # the Mermaid text is shown, not interpreted
