"""The coordinator's pure logic: the plan of sub-tasks, attribution records, recovery
decisions and wait-for cycles. No I/O: the drivers in :mod:`._run` read the stores and act.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from taskpilots_graph.errors import ConfigurationError

__all__ = [
    "CoordinationPlan",
    "FailureAttribution",
    "RecoveryDecision",
    "SubAgentState",
    "SubTask",
    "attempt_thread_id",
    "find_cycle",
    "plan_recovery",
]


class SubAgentState(StrEnum):
    """Where one sub-agent stands in a coordination."""

    PENDING = "pending"  # not started: waits for its dependencies
    RUNNING = "running"  # running here, or elsewhere (its thread lease is held)
    DONE = "done"  # its thread closed
    FAILED = "failed"  # its thread failed and may not be rebuilt any more
    TAKEOVER = "takeover"  # waits on a person
    STUCK = "stuck"  # part of a dependency cycle or a mutual wait
    BLOCKED = "blocked"  # a dependency failed or is stuck: it cannot start


@dataclass(frozen=True, slots=True)
class SubTask:
    """One sub-agent of a coordination.

    Attributes:
        name: The sub-agent's name (its thread is ``<parent>/<name>``).
        depends_on: Sub-tasks that must be done before this one starts.
        shares: Business objects (ids as in their ``lock=`` names, e.g. ``customer-7``)
            this sub-task reads or writes. A committed effect on one of them by another
            sub-task is data this one depends on.
    """

    name: str
    depends_on: tuple[str, ...] = ()
    shares: tuple[str, ...] = ()


def _names(what: str, owner: str, values: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, str):
        raise ConfigurationError(f"{what} of {owner!r} must be a list of names, not a string")
    out = tuple(values)
    for value in out:
        if not isinstance(value, str) or not value:
            raise ConfigurationError(f"{what} of {owner!r} must be non-empty strings: {value!r}")
    return out


def find_cycle(edges: Mapping[str, Iterable[str]]) -> tuple[str, ...]:
    """A cycle of ``a -> b`` edges (``a`` waits for / depends on ``b``), or ``()``.

    The cycle is returned starting from its smallest name, so the same cycle is always
    named the same way.
    """
    graph = {node: sorted(set(targets)) for node, targets in edges.items()}
    color: dict[str, int] = {}  # 1: on the current path, 2: explored
    path: list[str] = []

    def visit(node: str) -> tuple[str, ...]:
        color[node] = 1
        path.append(node)
        for nxt in graph.get(node, ()):
            if color.get(nxt) == 1:
                cycle = path[path.index(nxt) :]
                start = cycle.index(min(cycle))
                return tuple(cycle[start:] + cycle[:start])
            if color.get(nxt) is None and (found := visit(nxt)):
                return found
        color[node] = 2
        path.pop()
        return ()

    for node in sorted(graph):
        if color.get(node) is None and (found := visit(node)):
            return found
    return ()


@dataclass(frozen=True, slots=True)
class CoordinationPlan:
    """The sub-tasks of a coordination, validated.

    A dependency cycle is *not* refused here: the coordinator reports it as STUCK, naming
    the sub-agents, and still runs every sub-task outside it.
    """

    tasks: Mapping[str, SubTask]

    @classmethod
    def build(
        cls,
        names: Iterable[str],
        depends_on: Mapping[str, Iterable[str]] | None = None,
        shares: Mapping[str, Iterable[str]] | None = None,
    ) -> CoordinationPlan:
        """Validate the declarations.

        Raises:
            ConfigurationError: For an empty or ``/``-containing name, or a dependency or
                share declared for an unknown sub-agent, or a dependency on one.
        """
        order = list(names)
        known = set(order)
        for name in order:
            if not isinstance(name, str) or not name or "/" in name:
                raise ConfigurationError(
                    f"sub-agent names must be non-empty strings without '/', got {name!r}"
                )
        deps = dict(depends_on or {})
        objs = dict(shares or {})
        for what, table in (("depends_on", deps), ("shares", objs)):
            unknown = sorted(set(table) - known)
            if unknown:
                raise ConfigurationError(f"{what} names unknown sub-agents: {unknown}")
        tasks = {}
        for name in order:
            needs = _names("depends_on", name, deps.get(name, ()))
            missing = sorted(set(needs) - known)
            if missing:
                raise ConfigurationError(f"{name!r} depends on unknown sub-agents {missing}")
            if name in needs:
                raise ConfigurationError(f"{name!r} cannot depend on itself")
            tasks[name] = SubTask(name, needs, _names("shares", name, objs.get(name, ())))
        return cls(tasks)

    def cycle(self) -> tuple[str, ...]:
        """A dependency cycle, or ``()``."""
        return find_cycle({n: t.depends_on for n, t in self.tasks.items()})

    def dependents(self, name: str) -> tuple[str, ...]:
        """Sub-tasks depending on ``name``, directly or through others (plan order)."""
        found: set[str] = set()
        frontier = {name}
        while frontier:
            frontier = {
                n
                for n, t in self.tasks.items()
                if n not in found and n != name and frontier & set(t.depends_on)
            }
            found |= frontier
        return tuple(n for n in self.tasks if n in found)

    def sharing(self, objects: Iterable[str], *, besides: str) -> tuple[str, ...]:
        """Sub-tasks other than ``besides`` that share one of ``objects`` (plan order)."""
        wanted = set(objects)
        return tuple(n for n, t in self.tasks.items() if n != besides and wanted & set(t.shares))

    def shared_objects(self, *, besides: str) -> frozenset[str]:
        """Every business object some sub-task other than ``besides`` shares."""
        return frozenset(o for n, t in self.tasks.items() if n != besides for o in t.shares)

    def payload(self) -> dict[str, Any]:
        """JSON form, as recorded in the ``plan_created`` event."""
        return {
            n: {"depends_on": list(t.depends_on), "shares": list(t.shares)}
            for n, t in self.tasks.items()
        }


def attempt_thread_id(parent: str, name: str, attempt: int) -> str:
    """The thread of a sub-agent's attempt: ``<parent>/<name>``, then ``<parent>/<name>~2``."""
    return f"{parent}/{name}" if attempt <= 1 else f"{parent}/{name}~{attempt}"


@dataclass(frozen=True, slots=True)
class FailureAttribution:
    """Which sub-agent failed, where, and how.

    Attributes:
        parent: The coordinator's (parent) thread.
        subagent: The sub-agent that failed.
        thread_id: The sub-agent's thread (its attempt).
        kind: ``"worker_lost"`` (its process died mid-run) or the failure kind of the
            step that failed it (a ``FailureKind`` value), or ``"error"`` for an exception
            raised out of the run.
        step: The tool call id of the failed step, if a tool step.
        tool: That step's tool.
        key: The ledger key of the effect involved, if any.
        message: The error, shortened.
    """

    parent: str
    subagent: str
    thread_id: str
    kind: str
    step: str | None = None
    tool: str | None = None
    key: str | None = None
    message: str | None = None

    def payload(self) -> dict[str, Any]:
        """JSON form, as recorded in events."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class SharedEffect:
    """A committed effect of the failed sub-task on an object others share."""

    key: str
    tool: str
    obj: str
    readers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RecoveryDecision:
    """What to do about one failed sub-task.

    Attributes:
        compensate: Keys of the shared effects to undo first, newest first.
        rerun: Sub-tasks to run again (as new attempts), the failed one first, then the
            dependents that already ran on the shared data.
        give_up: The failed sub-task used up its attempts: no rebuild.
    """

    compensate: tuple[str, ...] = ()
    rerun: tuple[str, ...] = ()
    give_up: bool = False
    shared: tuple[SharedEffect, ...] = field(default=())


def plan_recovery(
    plan: CoordinationPlan,
    failed: str,
    effects: Sequence[tuple[str, str, str | None]],
    *,
    started: Iterable[str],
    attempts: int,
    max_attempts: int,
) -> RecoveryDecision:
    """Decide how to recover sub-task ``failed``.

    Args:
        plan: The coordination plan.
        failed: The failed sub-task.
        effects: Its committed, compensable effects, oldest first, as
            ``(key, tool, business object or None)``.
        started: Sub-tasks that have started (or finished) so far.
        attempts: Attempts of ``failed`` so far.
        max_attempts: Attempts allowed per sub-task.

    An independent failure is rebuilt alone. A failure whose committed effects touched an
    object other sub-tasks share undoes those effects first; the dependents that already
    ran (on the now undone data) are then run again too.
    """
    if attempts >= max_attempts:
        return RecoveryDecision(give_up=True)
    shared_objs = plan.shared_objects(besides=failed)
    shared = tuple(
        SharedEffect(key, tool, obj, plan.sharing([obj], besides=failed))
        for key, tool, obj in reversed(effects)
        if obj is not None and obj in shared_objs
    )
    ran = set(started)
    readers = {r for e in shared for r in e.readers} | (
        set(plan.dependents(failed)) if shared else set()
    )
    dependents = tuple(n for n in plan.tasks if n in readers and n in ran and n != failed)
    return RecoveryDecision(
        compensate=tuple(e.key for e in shared),
        rerun=(failed, *dependents),
        shared=shared,
    )
