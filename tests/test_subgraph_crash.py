"""Sub-agents as subgraphs of a parent LangGraph graph keep the ledger's guarantee under SIGKILL.

The parent graph (PostgreSQL checkpointer) has three nodes, using both of LangGraph's own
subgraph mechanisms:

* ``crm``: a recovery agent added as a node (``add_node(name, compiled_graph)``; it shares
  the parent's ``messages``);
* ``ticketing`` and ``notify``: nodes that invoke a recovery agent with an input of their
  own (the subgraph pattern for different state schemas).

A node re-runs from its first line on resume, and LangGraph re-runs earlier subgraph tasks
on resume (langgraph issue #6792): the ledger has to absorb those repeats. Workers are
forked processes killed with SIGKILL, by kill points planted in the simulated services
(right before or right after an effect is performed) and at random moments; after every
kill a fresh worker resumes every parent thread by id. No effect may happen twice.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

import taskpilots_graph as tp
from taskpilots_graph.demo.multi_agent import CustomerServices, customer_tools
from taskpilots_graph.state import RecoveryState
from taskpilots_graph.testing import ScriptedModel
from taskpilots_graph.tools import SideEffectTool

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

CUSTOMERS = ["c1", "c2", "c3", "c4"]
MIN_KILLS = 20
AFTER_KILLS = {"crm_sync": 2, "open_ticket": 4, "notify": 2}  # <= effects of each service
BEFORE_KILLS = {"crm_sync": 4, "open_ticket": 6, "notify": 4}
TIMED_KILLS = 3
SEED_ENV = "TASKPILOTS_DRILL_SEED"


class Onboarding(RecoveryState, total=False):
    """The parent's state: the crm sub-agent's conversation, and the other results."""

    customer: str
    tickets: str
    notified: str


def build_parent(services: CustomerServices, cp: Any, *, ledger: bool = True) -> Any:
    """crm (a subgraph node) → ticketing → notify (nodes invoking a subgraph).

    Without ``ledger`` the same tools run undeclared (no ``@side_effect``): the contrast
    that shows the drill would catch a repeated effect.
    """
    tools = customer_tools(services)
    if not ledger:
        tools = {n: t.tool if isinstance(t, SideEffectTool) else t for n, t in tools.items()}

    def agent(plan: list[tuple[str, dict[str, Any]]], *names: str) -> Any:
        return tp.create_recovery_agent(
            ScriptedModel(plan=plan, answer="done"), [tools[n] for n in names], checkpointer=cp
        )

    def sync_plan(customer: str) -> list[tuple[str, dict[str, Any]]]:
        return [("crm_sync", {"customer_id": customer, "tier": "gold"})]

    def ticketing(state: Onboarding, config: RunnableConfig) -> dict[str, Any]:
        c = {"customer_id": state["customer"]}
        graph = agent(
            [
                ("open_ticket", {**c, "subject": "Upgrade"}),
                ("open_ticket", {**c, "subject": "Kit"}),
            ],
            "open_ticket",
        )
        out = graph.invoke({"messages": [HumanMessage("open the tickets")]}, config)
        return {"tickets": str(out["messages"][-1].content)}

    def notify(state: Onboarding, config: RunnableConfig) -> dict[str, Any]:
        c = {"customer_id": state["customer"]}
        graph = agent([("notify", {**c, "message": "upgraded"})], "notify")
        out = graph.invoke({"messages": [HumanMessage("tell the customer")]}, config)
        return {"notified": str(out["messages"][-1].content)}

    # The crm sub-agent's plan names the customer; its graph is built per customer so the
    # subgraph node can be added as is. One parent graph per customer keeps that simple.
    graphs = {}
    for customer in CUSTOMERS:
        builder = StateGraph(Onboarding)
        builder.add_node("crm", agent(sync_plan(customer), "crm_sync"))
        builder.add_node("ticketing", ticketing)
        builder.add_node("notify", notify)
        builder.add_edge(START, "crm")
        builder.add_edge("crm", "ticketing")
        builder.add_edge("ticketing", "notify")
        builder.add_edge("notify", END)
        graphs[customer] = builder.compile(checkpointer=cp)
    return graphs


def _thread(customer: str) -> str:
    return f"onboard-{customer}"


def _work(pg: str, services_path: str, ready: Any, ledger: bool) -> None:
    """One worker: start every parent thread, or resume it by id."""
    code = 2
    try:
        services = CustomerServices(services_path)
        with tp.RecoveryCheckpointer.from_conn_string(pg) as cp:
            graphs = build_parent(services, cp, ledger=ledger)
            ready.set()
            for customer in CUSTOMERS:
                cfg: RunnableConfig = {"configurable": {"thread_id": _thread(customer)}}
                if cp.get_tuple(cfg) is None:
                    start = {"messages": [HumanMessage("sync the tier")], "customer": customer}
                    graphs[customer].invoke(start, cfg)
                else:
                    tp.resume(graphs[customer], _thread(customer))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _drill(pg: str, tmp_path: Path, *, ledger: bool) -> tuple[CustomerServices, int, str]:
    """Run the batch under the kill points until it finishes: (services, kills, context)."""
    seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(2**31))
    rng = random.Random(seed)
    ctx = f"seed={seed} (rerun with {SEED_ENV}={seed})"
    services = CustomerServices(str(tmp_path / "services.db"))
    services.seed(dict.fromkeys(CUSTOMERS, "standard"))
    points = [(s, "after") for s, n in AFTER_KILLS.items() for _ in range(n)]
    points += [(s, "before") for s, n in BEFORE_KILLS.items() for _ in range(n)]
    rng.shuffle(points)
    for service, phase in points:
        services.plant_kill(service, phase)  # type: ignore[arg-type]
    with tp.RecoveryCheckpointer.from_conn_string(pg) as cp:
        cp.setup()

    fork = multiprocessing.get_context("fork")
    kills = runs = 0
    timed = TIMED_KILLS
    while runs < 100:
        runs += 1
        ready = fork.Event()
        # Forked from an interpreter that imported everything: a restart takes
        # milliseconds, so the drill can afford many kills.
        proc = fork.Process(target=_work, args=(pg, services.path, ready, ledger))
        proc.start()
        ready.wait(timeout=60)
        if timed > 0:
            proc.join(timeout=rng.uniform(0.05, 0.6))
            if proc.is_alive():
                proc.kill()
                timed -= 1
        proc.join(timeout=120)
        assert proc.exitcode is not None, f"worker hung: {ctx}"
        if proc.exitcode == -signal.SIGKILL:
            kills += 1
            continue
        assert proc.exitcode == 0, f"worker failed ({proc.exitcode}): {ctx}"
        break
    return services, kills, f"{ctx}; {kills} kills over {runs} runs"


def _logical(effects: list[dict[str, Any]]) -> Counter[tuple[str, str, str]]:
    return Counter(
        (e["service"], e["customer_id"], e["tier"])
        if e["service"] == "crm_sync"
        # other identities already name what the effect is about
        else (e["service"], e["identity"], "")
        for e in effects
    )


def test_subgraph_drill_catches_repeats_without_the_ledger(
    postgres_url: str, tmp_path: Path
) -> None:
    """The same tools undeclared: LangGraph alone repeats effects under these kills."""
    services, kills, ctx = _drill(postgres_url, tmp_path, ledger=False)
    assert kills >= MIN_KILLS, ctx
    repeated = {k: n for k, n in _logical(services.effects()).items() if n > 1}
    assert repeated, f"no duplicate without the ledger, the drill proves nothing: {ctx}"


def test_subgraph_crash_and_resume_repeats_no_effect(postgres_url: str, tmp_path: Path) -> None:
    services, kills, ctx = _drill(postgres_url, tmp_path, ledger=True)
    assert services.pending_kills() == 0, f"kill points left unfired: {ctx}"
    assert kills >= MIN_KILLS, f"only {kills} SIGKILLs: {ctx}"
    effects = services.effects()
    logical = Counter(
        (e["service"], e["customer_id"], e["tier"])
        if e["service"] == "crm_sync"
        # other identities already name what the effect is about
        else (e["service"], e["identity"], "")
        for e in effects
    )
    repeated = {k: n for k, n in logical.items() if n > 1}
    assert repeated == {}, f"duplicates {repeated}: {ctx}"
    assert services.duplicates() == 0, ctx
    # Every effect happened: the batch finished.
    assert Counter(e["service"] for e in effects) == {
        "crm_sync": len(CUSTOMERS),
        "open_ticket": 2 * len(CUSTOMERS),
        "notify": len(CUSTOMERS),
    }, ctx
    with tp.RecoveryCheckpointer.from_conn_string(postgres_url) as cp:
        graphs = build_parent(services, cp)
        reconciled = 0
        for customer in CUSTOMERS:
            cfg: RunnableConfig = {"configurable": {"thread_id": _thread(customer)}}
            state = graphs[customer].get_state(cfg)
            assert not state.next, ctx
            assert state.values["tickets"] == "done", ctx
            assert state.values["notified"] == "done", ctx
            # One ledger entry per effect, each committed, keyed by subgraph namespace.
            entries = cp.ledger(_thread(customer))
            assert sorted(e.tool for e in entries) == [
                "crm_sync",
                "notify",
                "open_ticket",
                "open_ticket",
            ], ctx
            assert {e.status for e in entries} == {"committed"}, ctx
            assert {e.checkpoint_ns for e in entries} == {"crm", "ticketing", "notify"}, ctx
            reconciled += sum(
                e.kind is tp.EventKind.EFFECT_RECONCILED and e.payload.get("outcome") == "done"
                for e in cp.events(_thread(customer))
            )
    # The kills right after an effect really were absorbed by the pre-checks (the effect
    # was found done, not performed again).
    assert reconciled >= AFTER_KILLS["crm_sync"] + AFTER_KILLS["open_ticket"], ctx
    print(f"subgraph drill: 0 duplicates; {ctx}")
