"""Resume-prompt templates, English and Chinese (the source documents' wording)."""

from __future__ import annotations

from typing import Final, Literal

__all__ = ["TEMPLATES", "Language"]

Language = Literal["en", "zh"]

TEMPLATES: Final[dict[Language, dict[str, str]]] = {
    "en": {
        "header": "You are resuming an interrupted task.",
        "goal": "Goal: {goal}",
        "progress": "Progress: {done} step(s) done{pending}.",
        "pending": ", step {number} in progress",
        "done_title": "Done:",
        "done_item": "- step {number}: {tool}({inputs}) → {output}",
        "done_more": "- … {count} earlier step(s): {tools}",
        "committed_title": "Side effects already committed (never repeat them):",
        "committed_item": "- {tool} [key {key}]",
        "committed_more": "- … and {count} more committed effect(s): {tools}",
        "uncertain_title": "Side effects of UNKNOWN outcome (do not call again; a person decides):",
        "uncertain_item": "- {tool} [key {key}]",
        "todo_title": "Not done:",
        "todo_item": "- {tool}({inputs}): {status}",
        "blockers_title": "Blockers:",
        "refreshed_title": "Refreshed data (the pause was long; these values are current):",
        "refreshed_item": "- {name}: {value}",
        "observation": "Last observation: {observation}",
        "instruction": (
            "Continue from here; do not repeat completed steps or re-call tools that succeeded."
        ),
        "acknowledge": (
            "Before acting, restate in two sentences the state of the task and your next action."
        ),
    },
    "zh": {
        "header": "你正在恢复一个被中断的任务。",
        "goal": "目标：{goal}",
        "progress": "进度：已完成 {done} 步{pending}。",
        "pending": "，第 {number} 步进行中",
        "done_title": "已完成：",
        "done_item": "- 第 {number} 步：{tool}({inputs}) → {output}",
        "done_more": "- … 更早的 {count} 步：{tools}",
        "committed_title": "已提交的副作用（切勿重复）：",
        "committed_item": "- {tool} [键 {key}]",
        "committed_more": "- … 另有 {count} 个已提交的副作用：{tools}",
        "uncertain_title": "结果未知的副作用（不要再次调用，由人工决定）：",
        "uncertain_item": "- {tool} [键 {key}]",
        "todo_title": "未完成：",
        "todo_item": "- {tool}({inputs})：{status}",
        "blockers_title": "阻塞项：",
        "refreshed_title": "已刷新的数据（暂停时间较长，以下为最新值）：",
        "refreshed_item": "- {name}：{value}",
        "observation": "最近一次观察：{observation}",
        "instruction": "请从这里继续；不要重复已完成的步骤，也不要重新调用已成功的工具。",
        "acknowledge": "在行动之前，请用两句话复述任务当前状态和你的下一步行动。",
    },
}
