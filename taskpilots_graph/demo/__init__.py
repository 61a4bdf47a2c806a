"""The ticket-batch demo: a recovery agent against simulated services, under SIGKILL.

Run it with ``make demo`` or ``python -m taskpilots_graph.demo``.
"""

__all__: list[str] = []
