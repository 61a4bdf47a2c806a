"""The coordinator's pure logic: the plan of sub-tasks, the shared objects and their
policies, attribution records, recovery decisions and wait-for cycles. No I/O: the loop in
:mod:`._drive` (with :mod:`._recover`) reads the stores and acts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Literal

from taskpilots_graph.errors import ConfigurationError

__all__ = [
    "CoordinationPlan",
    "FailureAttribution",
    "Share",
    "SharePolicy",
    "SharedEffect",
    "SubAgentState",
    "SubTask",
    "SubTaskRecovery",
    "attempt_thread_id",
    "find_cycle",
    "plan_recovery",
]

Effect = tuple[str, str, str | None]
"""A committed effect as recovery sees it: ``(ledger key, tool, business object or None)``."""


class SubAgentState(StrEnum):
    """Where one sub-agent stands in a coordination."""

    PENDING = "pending"  # not started: waits for its dependencies
    RUNNING = "running"  # running here, or elsewhere (its thread lease is held)
    DONE = "done"  # its thread closed
    FAILED = "failed"  # its thread failed and may not be rebuilt any more
    TAKEOVER = "takeover"  # waits on a person
    STUCK = "stuck"  # part of a dependency cycle or a mutual wait
    BLOCKED = "blocked"  # a dependency failed or is stuck: it cannot start


class SharePolicy(StrEnum):
    """What a failure that touched a shared object does to the effects committed on it.

    ``KEEP`` (the default): every committed effect on the object stays as it is, nothing is
    undone and only the failed sub-agent runs again; its repeated calls get their recorded
    results. ``COMPENSATE``: the committed effects on the object of the failed sub-agent
    *and* of every sharer that ran are undone, each exactly once (newest first), then the
    failed sub-agent and those sharers run again, told what was undone.
    """

    KEEP = "keep"
    COMPENSATE = "compensate"


@dataclass(frozen=True, slots=True, init=False)
class Share:
    """A business object sub-agents share, with the policy for failures that touch it.

    Name it in ``shares=`` wherever a plain object id would go; the policy belongs to the
    object, so every sub-agent naming it agrees (a plain id takes the policy declared
    elsewhere, :attr:`SharePolicy.KEEP` if none is).

    Example:
        >>> order = Share("order-1", policy="compensate")
        >>> shares = {"picker": [order], "packer": [order], "shipper": [order]}

    Attributes:
        object_id: The object, as its tools' ``lock=`` names it (``order-1`` for the lock
            name ``order-1:reserve``).
        policy: :class:`SharePolicy` (or its value).

    Raises:
        ConfigurationError: For an empty object id or an unknown policy.
    """

    object_id: str
    policy: SharePolicy

    def __init__(
        self,
        object_id: str,
        policy: SharePolicy | Literal["keep", "compensate"] = SharePolicy.KEEP,
    ) -> None:
        if not isinstance(object_id, str) or not object_id:
            raise ConfigurationError(
                f"Share needs a non-empty business object id, got {object_id!r}"
            )
        try:
            checked = SharePolicy(policy)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in SharePolicy)
            raise ConfigurationError(
                f"Share({object_id!r}) policy must be one of {choices}, got {policy!r}"
            ) from None
        object.__setattr__(self, "object_id", object_id)
        object.__setattr__(self, "policy", checked)


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


def _shares(
    owner: str, values: Iterable[str | Share], policies: dict[str, SharePolicy]
) -> tuple[str, ...]:
    """The object ids of one sub-agent's ``shares`` entry; explicit policies go to
    ``policies`` (one per object: two different ones are refused)."""
    if isinstance(values, str | Share):
        raise ConfigurationError(
            f"shares of {owner!r} must be a list of object ids or Share(...), not one value"
        )
    out = []
    for value in values:
        if isinstance(value, Share):
            known = policies.setdefault(value.object_id, value.policy)
            if known is not value.policy:
                raise ConfigurationError(
                    f"shared object {value.object_id!r} has two policies ({known.value!r} and "
                    f"{value.policy.value!r}); declare one Share and name it everywhere"
                )
            out.append(value.object_id)
        elif isinstance(value, str) and value:
            out.append(value)
        else:
            raise ConfigurationError(
                f"shares of {owner!r} must be non-empty object ids or Share(...): {value!r}"
            )
    return tuple(out)


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
    policies: Mapping[str, SharePolicy] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        names: Iterable[str],
        depends_on: Mapping[str, Iterable[str]] | None = None,
        shares: Mapping[str, Iterable[str | Share]] | None = None,
    ) -> CoordinationPlan:
        """Validate the declarations.

        Args:
            names: The sub-agents, in plan order.
            depends_on: ``{name: [sub-agents it needs done first]}``.
            shares: ``{name: [object id or Share(object id, policy)]}``.

        Raises:
            ConfigurationError: For an empty or ``/``-containing name, or a dependency or
                share declared for an unknown sub-agent, or a dependency on one, or two
                policies for one shared object.
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
        policies: dict[str, SharePolicy] = {}
        for name in order:
            needs = _names("depends_on", name, deps.get(name, ()))
            missing = sorted(set(needs) - known)
            if missing:
                raise ConfigurationError(f"{name!r} depends on unknown sub-agents {missing}")
            if name in needs:
                raise ConfigurationError(f"{name!r} cannot depend on itself")
            tasks[name] = SubTask(name, needs, _shares(name, objs.get(name, ()), policies))
        return cls(tasks, policies)

    def policy(self, obj: str) -> SharePolicy:
        """The policy of a shared object (:attr:`SharePolicy.KEEP` unless declared)."""
        return self.policies.get(obj, SharePolicy.KEEP)

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
        """JSON form, as recorded in the ``plan_created`` event (per sub-agent)."""
        return {
            n: {"depends_on": list(t.depends_on), "shares": list(t.shares)}
            for n, t in self.tasks.items()
        }

    def policy_payload(self) -> dict[str, str]:
        """The policy of every shared object, as recorded in the ``plan_created`` event."""
        objs = sorted({o for t in self.tasks.values() for o in t.shares})
        return {o: self.policy(o).value for o in objs}


def attempt_thread_id(parent: str, name: str, attempt: int) -> str:
    """The thread named for attempt ``attempt`` of a sub-agent.

    The coordinator runs every attempt on the first one's thread, ``<parent>/<name>``, so
    the sub-agent's ledger returns what earlier attempts committed instead of performing it
    again. ``<parent>/<name>~N`` (``attempt`` >= 2) is the thread earlier versions started
    for a re-run: their parent logs still name it, and a coordination they left goes on
    from there.
    """
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
    """A committed effect on an object another sub-task shares.

    Attributes:
        key: Its ledger key.
        tool: Its tool.
        obj: The shared object (the business object of its ``lock=`` name).
        readers: The sub-tasks besides ``owner`` that share ``obj``.
        owner: The sub-task whose effect it is.
    """

    key: str
    tool: str
    obj: str
    readers: tuple[str, ...]
    owner: str = ""

    def payload(self) -> dict[str, Any]:
        """JSON form, as recorded in ``retry_scheduled``."""
        return {
            "key": self.key,
            "subagent": self.owner,
            "tool": self.tool,
            "object": self.obj,
            "readers": list(self.readers),
        }


@dataclass(frozen=True, slots=True)
class SubTaskRecovery:
    """What to do about one failed sub-task.

    Attributes:
        compensate: Keys of the shared effects to undo first (those in ``shared``).
        rerun: Sub-tasks to run again, each continuing its own thread: the failed one
            first, then (after a compensation) the sharers and dependents that already ran.
        give_up: The failed sub-task used up its attempts: no rebuild.
        shared: The effects to undo, in order: the failed sub-task's newest first, then
            each sharer's (latest in plan order first), newest first.
        kept: Committed effects on shared objects left as they are: their objects' policy
            keeps them, or (policy ``compensate``) their tool has no compensator.
    """

    compensate: tuple[str, ...] = ()
    rerun: tuple[str, ...] = ()
    give_up: bool = False
    shared: tuple[SharedEffect, ...] = field(default=())
    kept: tuple[SharedEffect, ...] = field(default=())


def plan_recovery(
    plan: CoordinationPlan,
    failed: str,
    effects: Sequence[Effect],
    *,
    started: Iterable[str],
    attempts: int,
    max_attempts: int,
    sharers: Mapping[str, Sequence[Effect]] | None = None,
    undoable: Iterable[str] | None = None,
) -> SubTaskRecovery:
    """Decide how to recover sub-task ``failed``: only what failed runs again.

    It re-runs alone unless it committed effects on a shared object whose policy is
    :attr:`SharePolicy.COMPENSATE`: those effects, and every sharer's that ran, are then
    undone first (each listed once), and those sharers and its dependents that ran run again.

    Args:
        plan: The coordination plan.
        failed: The failed sub-task.
        effects: Its committed effects, oldest first, as ``(key, tool, business object or
            None)``.
        started: Sub-tasks that have started (or finished) so far.
        attempts: Attempts of ``failed`` so far.
        max_attempts: Attempts allowed per sub-task.
        sharers: The committed effects of the other sub-tasks, by name, oldest first.
        undoable: Keys of the effects (``effects`` and ``sharers``) whose tool has a
            compensator; ``None``: all of them.
    """
    if attempts >= max_attempts:
        return SubTaskRecovery(give_up=True)
    ran = set(started) - {failed}
    can_undo = None if undoable is None else set(undoable)
    shared_objs = plan.shared_objects(besides=failed)
    touched = [(k, t, o) for k, t, o in effects if o is not None and o in shared_objs]
    undo_objs = {o for _, _, o in touched if plan.policy(o) is SharePolicy.COMPENSATE}
    undo: list[SharedEffect] = []
    kept: list[SharedEffect] = []

    def sort(owner: str, found: Sequence[Effect], objs: AbstractSet[str]) -> None:
        for key, tool, obj in reversed(found):
            if obj is None or obj not in objs:
                continue
            effect = SharedEffect(key, tool, obj, plan.sharing([obj], besides=owner), owner)
            if obj in undo_objs and (can_undo is None or key in can_undo):
                undo.append(effect)
            else:
                kept.append(effect)

    sort(failed, effects, shared_objs)
    others = sharers or {}
    for name in reversed(list(plan.tasks)):
        if name in ran and undo_objs & set(plan.tasks[name].shares):
            sort(name, others.get(name, ()), undo_objs)
    # Whoever ran on an object that was undone worked on data that is gone: it runs again
    # (its effects that were kept come back from its ledger). Nothing undone: nobody does.
    readers = (
        set(plan.sharing(undo_objs, besides=failed)) | set(plan.dependents(failed))
        if undo
        else set()
    )
    again = tuple(n for n in plan.tasks if n in readers and n in ran)
    return SubTaskRecovery(
        compensate=tuple(e.key for e in undo),
        rerun=(failed, *again),
        shared=tuple(undo),
        kept=tuple(kept),
    )
