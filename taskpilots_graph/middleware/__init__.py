"""``RecoveryMiddleware``: the recovery agent's guarantees for langchain ``create_agent``.

Add one middleware and give the agent the same recovery checkpointer::

    from langchain.agents import create_agent
    import taskpilots_graph as tp

    with tp.RecoveryCheckpointer.from_conn_string("sqlite:///runs.db") as cp:
        recovery = tp.RecoveryMiddleware(cp, policies={"kb_search": tp.ToolPolicy(max_attempts=3)})
        agent = create_agent(model, [kb_search, create_ticket], checkpointer=cp,
                             middleware=[recovery])
        agent.invoke({"messages": [("user", goal)]}, {"configurable": {"thread_id": "t-1"}})
    # after a crash, in any process: tp.resume(agent, "t-1")

In a graph you build yourself, ``tp.ToolNode`` (:mod:`taskpilots_graph.middleware.toolnode`)
gives LangGraph's ``ToolNode`` the same tool-call driver.

What every tool call gets (through ``wrap_tool_call`` / ``awrap_tool_call``):

* **the side-effect ledger** for ``@tp.side_effect`` tools: the intent is written durably
  before the tool runs and the commit (with the result) after, under the key the recovery
  agent's executor derives (thread id, namespace, tool-call id, tool, arguments; or the
  tool's business ``key=``); ``tp.current_invocation()`` works inside the tool. A re-run
  (retry, resume after a crash) returns a committed result without calling the tool, asks
  the pre-check about an effect of unknown outcome (``Done`` → recorded, skipped;
  ``NotDone`` → executed with the same key), executes again only an ``idempotent`` tool,
  and otherwise stops for a person;
* **classification** of the tool's exception (:func:`~taskpilots_graph.classify`) and the
  tool's :class:`~taskpilots_graph.ToolPolicy`: retry with backoff and jitter in process
  (a wait longer than ``max_in_process_wait`` stops the run with
  :class:`~taskpilots_graph.ToolWaiting`; ``tp.resume`` continues it), degrade to a
  ``fallback`` tool, report a contract error to the model, fail the run (``on_exhausted=
  "fail"``) or compensate committed effects first (``"compensate"``);
* **takeover**: an effect nobody can confirm, and the failures the policy hands to a person,
  pause the run on LangGraph's ``interrupt()`` with a
  :class:`~taskpilots_graph.TakeoverRequest`; answer it with ``tp.decide(agent, thread_id,
  tp.Decision(...))`` (retry, skip, provide_result, abandon) or
  ``Command(resume=...)`` (also edit_args);
* **events** in ``cp.events(thread_id)``, as the recovery agent logs them:
  ``agent_started``, ``llm_decided``, ``tool_invoked``, ``tool_succeeded``/``tool_failed``,
  ``effect_reconciled``/``effect_uncertain``, ``retry_scheduled``, ``degraded``,
  ``takeover_requested``, ``decision_recorded``, ``compensated``, ``resume_context``,
  ``agent_finished`` (``closed`` when the agent ends, ``failed`` before a fatal tool error
  leaves ``invoke``), so ``tp.thread_info`` and ``taskpilots show`` tell where it stands;
* the **resume prompt**: after ``tp.decide`` or ``tp.resume``, the first model call gets
  the recovery agent's resume prompt (:mod:`taskpilots_graph.prompts.resume`) after the
  conversation (only the model sees it; a replayed decision leaves it for the next call);
* a **recorded model decision** when the run is not ``durability="sync"``: the model's
  message with side-effecting calls is recorded before the first of them runs, and
  ``wrap_model_call`` replays it if a crash lost the checkpoint holding it (otherwise the
  model would decide again with new tool-call ids, hence new keys).

LangGraph control flow (``GraphBubbleUp``: interrupts, parent commands) always passes through.

Composing with langchain's own middleware (the first in the list is the outermost):

* ``ToolRetryMiddleware``: **one retry owner**. When both would retry a tool,
  :func:`check_middleware` (called by you where the agent is built, and by the middleware
  itself on the first call of each tool) raises
  :class:`~taskpilots_graph.ConfigurationError`. To let ``ToolRetryMiddleware`` own a
  tool's retries, give that tool ``tp.ToolPolicy(max_attempts=1)`` and place
  ``ToolRetryMiddleware`` *before* ``RecoveryMiddleware``: each of its retries then passes
  through the ledger again. Placed after it, it is refused for side-effecting tools (its
  retries would repeat the effect inside one ledger attempt).
* ``ToolErrorMiddleware``: place it before ``RecoveryMiddleware``; after it, it is refused
  for side-effecting tools (turning a timeout into a message hides that the request may
  have reached the service).
* ``HumanInTheLoopMiddleware``: composes as is. It asks a person *before* a call runs
  (approve, edit, reject, in ``after_model``); ``RecoveryMiddleware`` asks *after* a call
  failed in a way a machine cannot settle. Edited arguments give a new ledger key; a
  rejected call never reaches the tool.
* ``ModelRetryMiddleware`` / ``ModelFallbackMiddleware`` own model failures; this
  middleware only replays recorded decisions and never retries a model call.

**Leases**: each model call and tool call holds the thread's lease (``thread:<thread_id>``),
in the backend named with ``leases=`` or else in the checkpointer's own database, so a
second runner of the thread gets :class:`~taskpilots_graph.ThreadBusy` while a step runs
(``tp.run`` / ``tp.resume`` / ``tp.decide`` hold it for the whole run). ``lock=`` tools run
under their business lock (fail closed), and an ``intended`` entry whose writer still holds
its thread lease is waited for, never reconciled (:class:`~taskpilots_graph.EffectInProgress`
when the wait runs out).
"""

from __future__ import annotations

try:
    import langchain.agents  # noqa: F401 - the optional dependency this package builds on
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "RecoveryMiddleware and tp.ToolNode need langchain 1.x: "
        "pip install 'taskpilots-graph[langchain]'"
    ) from exc

from taskpilots_graph.middleware._middleware import RecoveryMiddleware
from taskpilots_graph.middleware._owner import check_middleware

__all__ = ["RecoveryMiddleware", "check_middleware"]
