"""Checkpoint density: which of LangGraph's per-step checkpoints reach storage.

LangGraph writes a checkpoint after every super-step. The source documents name three
densities, chosen per graph (``create_recovery_agent(checkpoint_density=...)``):

* ``every_step`` (default): every checkpoint is stored.
* ``tool_boundary``: stored are the checkpoints before a step that may run a side effect and
  after its observation, at business milestones, wherever the run stops (an interrupt for a
  person, a tool error, waiting, the end), and the input. Pure steps in between (model
  decisions that only call read tools, and those reads) are replayed after a crash.
* ``milestones``: only the input, business milestones and wherever the run stops. Every step
  since the last stored checkpoint is replayed after a crash; the agent then records every
  model decision before acting on it, so a replayed step repeats the same tool calls with the
  same ledger keys and the ledger returns committed effects instead of repeating them.
  Read tools are run again on replay, so they should answer the same for the same call.

A checkpoint that is not stored is *held*: kept in memory until the next one replaces it, or
stored after all when the run stops on it (an error or interrupt is written for it) or when it
is read in this process. Storing a checkpoint after held ones stores the channel values the
held ones changed too, so no version a stored checkpoint refers to is ever missing.

The policy reads the agent's channels (``messages``, ``flow``); on other graphs only the
input, interrupts and errors are recognised and ``every_step`` is the safe choice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import ChannelVersions, Checkpoint, CheckpointMetadata

from taskpilots_graph.errors import ConfigurationError

__all__ = ["CheckpointDensity", "Density", "HeldCheckpoints"]

Density = Literal["every_step", "tool_boundary", "milestones"]

# LangGraph's channels for a task's error and a pending interrupt (langgraph._internal).
_STOPS = frozenset({"__error__", "__interrupt__"})


@dataclass(frozen=True, slots=True)
class CheckpointDensity:
    """Which checkpoints of a recovery agent are stored.

    Attributes:
        kind: ``"every_step"``, ``"tool_boundary"`` or ``"milestones"``.
        side_effect_tools: Tools whose step may run a side effect (side-effecting tools,
            and tools with such a fallback).
        milestones: The agent's business milestones (predicates of the state).
    """

    kind: Density = "every_step"
    side_effect_tools: frozenset[str] = frozenset()
    milestones: Mapping[str, Callable[[Mapping[str, Any]], bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in get_args(Density):
            raise ConfigurationError(
                f"checkpoint density must be one of {', '.join(get_args(Density))}; "
                f"got {self.kind!r}"
            )

    def stores(self, checkpoint: Checkpoint, metadata: CheckpointMetadata) -> bool:
        """Whether ``checkpoint`` is stored (rather than held) under this density."""
        if self.kind == "every_step" or metadata.get("source") != "loop":
            return True  # the input, and a person's or a rewind's update_state
        values = checkpoint.get("channel_values") or {}
        flow = values.get("flow") or {}
        if flow.get("stage", "running") != "running":
            return True  # waiting, with a person, compensating, closed or failed
        messages = values.get("messages") or []
        last = messages[-1] if messages else None
        if isinstance(last, AIMessage) and not last.tool_calls:
            return True  # the final answer
        if self._milestone(values, flow):
            return True
        if self.kind == "milestones":
            return False
        return self._at_boundary(messages)

    def _milestone(self, values: Mapping[str, Any], flow: Mapping[str, Any]) -> bool:
        reached = set(flow.get("milestones") or ())
        for name, holds in self.milestones.items():
            if name in reached:
                continue
            try:
                if holds(values):
                    return True
            except Exception:
                return True  # the think node will report it; store rather than guess
        return False

    def _at_boundary(self, messages: Sequence[Any]) -> bool:
        # Before a step that may run a side effect, and after its observations.
        for message in reversed(messages):
            if isinstance(message, ToolMessage):
                if message.name in self.side_effect_tools:
                    return True
                continue
            if isinstance(message, AIMessage):
                return any(c["name"] in self.side_effect_tools for c in message.tool_calls)
            return False
        return False


@dataclass
class _Held:
    config: RunnableConfig
    checkpoint: Checkpoint
    metadata: CheckpointMetadata
    versions: dict[str, Any]
    writes: list[tuple[RunnableConfig, Sequence[tuple[str, Any]], str, str]]

    def put_args(self) -> tuple[RunnableConfig, Checkpoint, CheckpointMetadata, ChannelVersions]:
        return self.config, self.checkpoint, self.metadata, _current(self.checkpoint, self.versions)


def _current(checkpoint: Checkpoint, versions: Mapping[str, Any]) -> ChannelVersions:
    # Channels changed by held checkpoints are stored at the version this one has.
    channel_versions = checkpoint["channel_versions"]
    return {ch: channel_versions.get(ch, v) for ch, v in versions.items()}


def _key(config: RunnableConfig) -> tuple[str, str]:
    conf = config.get("configurable") or {}
    return str(conf.get("thread_id", "")), str(conf.get("checkpoint_ns", ""))


class HeldCheckpoints:
    """The held (not yet stored) checkpoint of each thread and namespace, for one graph.

    The decisions are made here; the caller performs the storage calls it returns, on the
    sync or async face of the saver. Thread-safe.
    """

    def __init__(self, density: CheckpointDensity) -> None:
        self.density = density
        self._held: dict[tuple[str, str], _Held] = {}
        self._lock = threading.Lock()

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> tuple[
        tuple[RunnableConfig, Checkpoint, CheckpointMetadata, ChannelVersions] | None,
        RunnableConfig,
    ]:
        """``(arguments for the saver's put, or None when held; the config to return)``."""
        key = _key(config)
        store = self.density.stores(checkpoint, metadata)
        with self._lock:
            before = self._held.pop(key, None)
            versions = {**(before.versions if before else {}), **new_versions}
            held = _Held(config, checkpoint, metadata, versions, [])
            if not store:
                self._held[key] = held
        thread_id, ns = key
        next_config: RunnableConfig = {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint["id"],
            }
        }
        return (held.put_args() if store else None), next_config

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str,
    ) -> list[Any]:
        """The storage calls for these writes: ``[]`` when they wait with a held checkpoint;
        else ``[("put", args)...]`` (a held checkpoint the run stops on) then the writes."""
        key = _key(config)
        wanted = (config.get("configurable") or {}).get("checkpoint_id")
        with self._lock:
            held = self._held.get(key)
            if held is None or held.checkpoint["id"] != wanted:
                return [("writes", (config, writes, task_id, task_path))]
            if not any(channel in _STOPS for channel, _ in writes):
                held.writes.append((config, writes, task_id, task_path))
                return []
            del self._held[key]
        return [*_flush(held), ("writes", (config, writes, task_id, task_path))]

    def release(self, config: RunnableConfig | None) -> list[Any]:
        """Storage calls that store held checkpoints before a read (of one thread, or all)."""
        thread_id = ((config or {}).get("configurable") or {}).get("thread_id")
        with self._lock:
            keys = [k for k in self._held if thread_id is None or k[0] == thread_id]
            released = [self._held.pop(k) for k in keys]
        return [call for held in released for call in _flush(held)]


def _flush(held: _Held) -> list[Any]:
    return [("put", held.put_args()), *(("writes", w) for w in held.writes)]
