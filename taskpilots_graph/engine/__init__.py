"""Every rule about one tool call, once, for both agent forms.

``create_recovery_agent``'s nodes (:mod:`taskpilots_graph.nodes`) and ``create_agent`` with
``RecoveryMiddleware`` (:mod:`taskpilots_graph.middleware`) are adapters over this package:

* :mod:`._call`: the call context (key, attempt, user rules, drift settings) and the one
  function that builds it;
* :mod:`._protocol`: the I/O-free ledger protocol of one call (intent, run, commit,
  repeat guard, drift), as a generator of requests (:mod:`._requests`);
* :mod:`._records`, :mod:`._reconcile`: what a call leaves on record (the ledger's value of
  a result, the events), and settling an effect of unknown outcome with its pre-check;
* :mod:`._recovery`: applying a recovery decision to a failed call (retry, fallback,
  report, takeover, compensate, fail) from its policy, rules and failure kind;
* :mod:`._drive`: the one sync and the one async driver that carry the
  protocol's requests out (ledger, leases, business locks, pre-checks, the tool);
* :mod:`._run`: the events that open, re-anchor and close a run (``agent_started``,
  ``resume_context``, the final ``llm_decided``, ``agent_finished``);
* :mod:`._locks`, :mod:`._await`, :mod:`._precheck`: what the drivers use for the thread
  lease and business locks, a live intent's owner, and a bounded pre-check.
"""

from taskpilots_graph.engine._call import CallContext, call_context
from taskpilots_graph.engine._drive import AsyncDriver, Driver
from taskpilots_graph.engine._protocol import run_call
from taskpilots_graph.engine._requests import CallOutcome

__all__ = ["AsyncDriver", "CallContext", "CallOutcome", "Driver", "call_context", "run_call"]
