"""The takeover inbox in a real browser (headless Chromium driven by Playwright).

Two shipments of the warehouse agent stop on an uncertain ``ship_parcel``; the inbox, served
by uvicorn on a free loopback port, lists them oldest first. On the first, a person provides
the carrier's tracking number; the run goes on and stops again on ``notify_customer``. The
same form, sent again from a second tab, is refused (409, a link to the current takeover)
and changes nothing; the mailer's takeover is then answered properly. The second shipment
is abandoned: the stock reservation is released, the printed label stays, and the thread
says so. The recovery map's chart is an image drawn on the server. Each page is
photographed at 1280 px and at phone width; assertions on the DOM check what the pictures
show (nothing wider than the window, the warnings, the abandon preview).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from _inbox_scenario import (
    CARRIER_PORTAL,
    SHIP_ANSWER,
    SHIPMENTS,
    FileService,
    build_warehouse,
    stop_on_shipping,
)
from _services import free_port
from playwright.sync_api import Page, ViewportSize, expect, sync_playwright

import taskpilots_graph as tp
from taskpilots_graph.web import create_app

CHROMIUM = "/usr/bin/chromium"
WIDE = ViewportSize(width=1280, height=900)
PHONE = ViewportSize(width=390, height=844)
STAMP = re.compile(r"^20\d\d-\d\d-\d\dT")  # an ISO 8601 time


@pytest.fixture
def served(cp: tp.RecoveryCheckpointer, tmp_path: Path) -> Iterator[tuple[str, FileService]]:
    """The inbox of two shipments stopped on an uncertain ``ship_parcel``, on loopback."""
    service = FileService(tmp_path / "warehouse.db")
    graph = build_warehouse(cp, service)
    for thread_id in SHIPMENTS:  # ship-1 waits longer than ship-2
        stop_on_shipping(graph, thread_id)
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


def fits(page: Page, shots: Path, name: str) -> None:
    """Photograph the page wide and on a phone; at both widths nothing sticks out."""
    for label, size in (("wide", WIDE), ("phone", PHONE)):
        page.set_viewport_size(size)
        page.screenshot(path=str(shots / f"{name}-{label}.png"), full_page=True)
        assert (shots / f"{name}-{label}.png").stat().st_size > 0
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"{name} is {overflow} px wider than a {label} window"
    page.set_viewport_size(WIDE)
    assert page.locator("script").count() == 0  # the pages run no script at all


def decide(page: Page, action: str, *, by: str = "", result: str = "") -> None:
    form = page.locator(f"form.decision[data-action={action}]")
    if result:
        form.locator("textarea[name=result]").fill(result)
    if by:
        form.locator("input[name=decided_by]").fill(by)
    form.get_by_role("button", name=action).click()


def decisions(cp: tp.RecoveryCheckpointer, thread_id: str) -> list[dict[str, Any]]:
    return [
        dict(e.payload) for e in cp.events(thread_id) if e.kind is tp.EventKind.DECISION_RECORDED
    ]


def test_the_inbox_lists_explains_and_refuses_a_stale_form(
    cp: tp.RecoveryCheckpointer, served: tuple[str, FileService], tmp_path: Path
) -> None:
    """List, warnings, abandon preview, 'decided by', stale resubmit refused, chart drawn."""
    url, service = served
    shots = tmp_path / "shots"
    shots.mkdir()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            context = browser.new_context(viewport=WIDE)
            page = context.new_page()

            # The list: one row per takeover, oldest first, with tool, why, since and risk.
            page.goto(url + "/")
            rows = page.locator("#waiting tr.waiting")
            expect(rows).to_have_count(2)
            for row, thread_id in zip(rows.all(), SHIPMENTS, strict=True):
                cells = row.locator("td")
                expect(cells.nth(0)).to_have_text(thread_id)
                expect(cells.nth(1)).to_have_text("ship_parcel")
                expect(cells.nth(2)).to_contain_text("may or may not have happened")
                expect(cells.nth(3).locator("time")).to_have_attribute("datetime", STAMP)
                expect(cells.nth(4)).to_contain_text("high")
            since = [str(r.locator("time").get_attribute("datetime")) for r in rows.all()]
            assert since == sorted(since)
            fits(page, shots, "inbox")

            # The thread page: what is known about the effect, each option's consequence.
            rows.first.get_by_role("link").click()
            shipping = page.locator("section.takeover")
            expect(shipping).to_have_count(1)
            expect(shipping.locator("h2")).to_contain_text("ship_parcel")
            effect = shipping.locator(".effect.uncertain")
            expect(effect).to_contain_text("ship_parcel:")  # its key
            expect(effect.locator(".verify")).to_have_text(CARRIER_PORTAL)
            expect(effect.locator(".precheck")).to_contain_text("no pre-check")
            expect(page.locator("#failures")).to_have_text("1 failed step(s)")
            retry = shipping.locator("form.decision[data-action=retry]")
            expect(retry.locator(".warning")).to_contain_text("may perform it twice")
            expect(
                shipping.locator("form.decision[data-action=provide_result] .warning")
            ).to_have_count(0)
            abandon = shipping.locator("form.decision[data-action=abandon]")
            expect(abandon.locator(".consequence")).to_contain_text("undoes reserve_stock")
            expect(abandon.locator(".warning")).to_contain_text("print_label")
            expect(abandon.locator(".warning")).to_contain_text("stay(s) done")
            expect(abandon.locator(".consequence")).not_to_contain_text("print_label")
            # "decided by": nobody is guessed; the field is empty and required.
            who = shipping.locator("input[name=decided_by]")
            expect(who.first).to_have_value("")
            expect(who.first).to_have_attribute("required", "")
            fits(page, shots, "thread-shipping")

            stale_tab = context.new_page()  # the same takeover, open in a second tab
            stale_tab.goto(page.url)
            expect(stale_tab.locator("section.takeover h2")).to_contain_text("ship_parcel")

            # Without a name the browser does not send the form: nothing happens.
            decide(page, "provide_result", result='"TRK-1"')
            expect(page.locator("#status")).to_have_text("awaiting_human")
            assert decisions(cp, "ship-1") == []

            decide(page, "provide_result", result='"TRK-1"', by="dana")
            mailer = page.locator("section.takeover h2")
            expect(mailer).to_contain_text("notify_customer", timeout=30_000)
            expect(page.locator("#outcome")).to_contain_text("provide_result by dana")
            waiting = tp.pending_takeovers(cp, thread_ids=["ship-1"])
            assert [r.pending[0]["tool"] for r in waiting] == ["notify_customer"]
            ledger_before = cp.ledger("ship-1")
            events_before = len(cp.events("ship-1"))

            # The stale tab sends its form again: refused, with the way to the current one.
            decide(stale_tab, "provide_result", result='"TRK-1"', by="dana")
            expect(stale_tab.locator("h1")).to_have_text("409")
            expect(stale_tab.locator("#error")).to_contain_text("already answered")
            expect(stale_tab.locator("#error")).to_contain_text("notify_customer")
            stale_tab.screenshot(path=str(shots / "stale-409.png"), full_page=True)
            assert cp.ledger("ship-1") == ledger_before
            assert len(cp.events("ship-1")) == events_before
            assert service.count("notify_customer") == 0
            assert tp.pending_takeovers(cp, thread_ids=["ship-1"]) == waiting
            stale_tab.locator("#error-link").click()
            expect(stale_tab.locator("section.takeover h2")).to_contain_text("notify_customer")
            stale_tab.close()

            # The mailer's takeover: its own warning; retry sends the email once.
            notify = page.locator("section.takeover")
            expect(notify.locator("form.decision[data-action=retry] .warning")).to_contain_text(
                "may perform it twice"
            )
            fits(page, shots, "thread-mailer")
            decide(page, "retry", by="dana")
            expect(page.locator("#status")).to_have_text("closed", timeout=30_000)
            expect(page.locator("#job-outcome")).to_contain_text(SHIP_ANSWER)

            # The second shipment is abandoned: what stays is named, not shown as a success.
            page.goto(url + "/")
            expect(page.locator("#waiting tr.waiting")).to_have_count(1)
            page.locator("#waiting tr.waiting").get_by_role("link").click()
            decide(page, "abandon", by="erin")
            expect(page.locator("#status")).to_have_text("abandoned", timeout=30_000)
            expect(page.locator("#not-undone")).to_contain_text("print_label")
            expect(page.locator("#not-undone")).not_to_contain_text("reserve_stock")
            expect(page.locator("#not-undone")).to_contain_text("ship_parcel")  # uncertain
            fits(page, shots, "thread-abandoned")

            # The recovery map: a chart drawn on the server, shown as an image.
            page.goto(url + "/map")
            chart = page.locator("img#chart")
            expect(chart).to_be_visible()
            natural = chart.evaluate("img => [img.complete, img.naturalWidth, img.naturalHeight]")
            assert natural[0], "the chart did not load"
            assert natural[1] >= 900, natural  # decoded: an image of the map's width
            assert natural[2] > 200, natural
            assert chart.evaluate("img => img.getBoundingClientRect().width") <= WIDE["width"]
            expect(page.locator("section.tool")).to_have_count(4)
            fits(page, shots, "map")
        finally:
            browser.close()

    assert service.count("ship_parcel") == 2  # once per shipment: never repeated
    assert service.count("notify_customer") == 1  # the person's retry, once
    assert service.count("release_stock") == 1  # ship-2's reservation undone
    (provided, retried) = decisions(cp, "ship-1")
    assert provided["decision"]["result"] == "TRK-1"
    assert provided["decided_by"] == "dana"
    assert retried["decision"]["action"] == "retry"
    (abandoned,) = decisions(cp, "ship-2")
    assert abandoned["decided_by"] == "erin"
    tools = {e.tool: e.status for e in cp.ledger("ship-1")}
    assert tools["notify_customer"] is tp.LedgerStatus.COMMITTED
    assert tp.pending_takeovers(cp) == []
