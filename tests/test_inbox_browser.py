"""The takeover inbox in a real browser (headless Chromium driven by Playwright).

A thread stops on an uncertain ``charge``; the inbox, served by uvicorn on a free loopback
port, lists it; a click on "skip" resumes it in the background; the thread page then shows
it closed, and the simulated service (its own SQLite file) shows ``charge`` ran only once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from _inbox_scenario import THREAD, FileService, build, stop_on_takeover
from _services import free_port
from playwright.sync_api import expect, sync_playwright

import taskpilots_graph as tp
from taskpilots_graph.web import create_app
from taskpilots_graph.web.app import os_user

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture
def served(cp: tp.RecoveryCheckpointer, tmp_path: Path) -> Iterator[tuple[str, FileService]]:
    """The inbox of a thread stopped on an uncertain effect, served on loopback."""
    service = FileService(tmp_path / "service.db")
    graph = build(cp, service)
    stop_on_takeover(graph)
    port = free_port()
    config = uvicorn.Config(
        create_app(graph), host="127.0.0.1", port=port, log_level="warning", ws="none"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        threading.Event().wait(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}", service
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_skip_in_the_browser_closes_the_thread_without_repeating_the_effect(
    cp: tp.RecoveryCheckpointer, served: tuple[str, FileService], tmp_path: Path
) -> None:
    """One pending takeover listed; "skip" resumes it; closed, and charge ran only once."""
    url, service = served
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url + "/")

            cards = page.locator("section.card")
            expect(cards).to_have_count(1)
            card = cards.first
            expect(card.locator("h2")).to_have_text(f"Thread {THREAD}")
            expect(card.locator(".uncertain")).to_contain_text("Uncertain effect: charge")
            expect(card.locator("input[name=decided_by]").first).to_have_value(os_user())
            page.screenshot(path=str(tmp_path / "inbox.png"), full_page=True)

            skip = card.locator("form.decision").filter(has=page.locator("input[value=skip]"))
            skip.get_by_role("button", name="skip").click()

            # The thread page refreshes itself until the decision has been carried out.
            expect(page.locator("#status")).to_have_text("closed", timeout=30_000)
            expect(page.locator("#outcome")).to_contain_text("skip")
            expect(page.locator("section.card")).to_have_count(0)
            expect(page.locator("#timeline")).to_contain_text("decided skip")
            page.screenshot(path=str(tmp_path / "thread-after-skip.png"), full_page=True)
        finally:
            browser.close()

    assert (tmp_path / "thread-after-skip.png").stat().st_size > 0
    assert service.count("charge") == 1  # the uncertain effect was not repeated
    assert service.count("reserve") == 1
    assert tp.thread_info(cp, THREAD).status == "closed"
    assert tp.pending_takeovers(cp) == []
    (decided,) = [e for e in cp.events(THREAD) if e.kind is tp.EventKind.DECISION_RECORDED]
    assert decided.payload["decided_by"] == os_user()
