"""The recovery map's flow chart as an SVG image, drawn on the server.

The inbox serves it as ``/map.svg`` and shows it with an ``<img>``: the page needs no script
(its Content-Security-Policy allows none), and an SVG loaded as an image cannot run one
either. Every label comes from tool names and policies, so all text is XML-escaped.

Each tool is a box on the left (its name, its kind of side effect, whether abandon can undo
it, its fallbacks); an arrow per distinct outcome leads to a box on the right saying what
happens, labelled with the failure kinds that lead there.
"""

from __future__ import annotations

import textwrap
from xml.sax.saxutils import escape, quoteattr

from taskpilots_graph.recovery_map import MAP_KINDS, RecoveryMap, ToolRecovery

__all__ = ["map_svg"]

WIDTH = 960
_LINE = 15  # px per text line
_PAD = 10
_TOOL_X, _TOOL_W = 10, 210
_LABEL_X, _LABEL_W = 240, 250
_OUT_X, _OUT_W = 510, 440
_GAP = 18  # between tools

_COLOURS = (  # first match on the outcome's words: (fill, stroke)
    ("ask a person", ("#fff4e5", "#b54708")),
    ("fail", ("#fdecea", "#b42318")),
    ("degrade", ("#eef5ff", "#1d4ed8")),
    ("retry", ("#ecfdf3", "#1a7f37")),
    ("run again", ("#ecfdf3", "#1a7f37")),
)
_NEUTRAL = ("#f4f4f5", "#71717a")


def _colour(outcome: str) -> tuple[str, str]:
    # The last step of an outcome ("retry ..., then ask a person") is what a reader must see.
    last = outcome.rsplit("then ", 1)[-1]
    return next((c for words, c in _COLOURS if words in last), _NEUTRAL)


def _lines(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width=width, break_long_words=True) or [""]


def _text(
    x: int,
    y: int,
    lines: list[str],
    *,
    bold_first: bool = False,
    size: int = 12,
    anchor: str = "start",
) -> str:
    spans = "".join(
        f'<tspan x="{x}" dy="{0 if i == 0 else _LINE}"'
        + (' font-weight="bold"' if bold_first and i == 0 else "")
        + f">{escape(line)}</tspan>"
        for i, line in enumerate(lines)
    )
    return f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}">{spans}</text>'


def _tool_block(tool: ToolRecovery, top: int) -> tuple[list[str], int]:
    """The SVG of one tool and its outcomes, and the block's height."""
    grouped: dict[str, list[str]] = {}
    for kind in MAP_KINDS:
        grouped.setdefault(tool.outcomes[kind], []).append(kind.value.replace("_", " "))
    rows = []
    for outcome, kinds in grouped.items():
        label, words = _lines(", ".join(kinds), 38), _lines(outcome, 66)
        rows.append((label, words, outcome, max(len(label), len(words)) * _LINE + 2 * _PAD))
    head = [
        *_lines(tool.tool, 28),
        tool.effect,
        "abandon undoes it" if tool.compensable else "no undo",
        *([f"fallback: {', '.join(tool.fallback)}"] if tool.fallback else []),
    ]
    height = max(sum(r[3] for r in rows) + _PAD * (len(rows) - 1), len(head) * _LINE + 2 * _PAD)
    out = [
        f'<rect x="{_TOOL_X}" y="{top}" width="{_TOOL_W}" height="{height}" rx="6" '
        'fill="#ffffff" stroke="#222222"/>',
        _text(_TOOL_X + _PAD, top + _PAD + 12, head, bold_first=True),
    ]
    y = top
    middle = top + height // 2
    for label, words, outcome, row_h in rows:
        fill, stroke = _colour(outcome)
        centre = y + row_h // 2
        out += [
            f'<path d="M{_TOOL_X + _TOOL_W} {middle} C{_LABEL_X} {middle} {_LABEL_X} {centre} '
            f'{_OUT_X - 8} {centre}" fill="none" stroke="{stroke}" stroke-width="1.5"/>',
            f'<path d="M{_OUT_X - 8} {centre - 4} L{_OUT_X} {centre} L{_OUT_X - 8} {centre + 4} Z" '
            f'fill="{stroke}"/>',
            # Above the arrow's straight end, right before the box it points to.
            _text(_OUT_X - 14, centre - 5 - (len(label) - 1) * _LINE, label, size=11, anchor="end"),
            f'<rect x="{_OUT_X}" y="{y}" width="{_OUT_W}" height="{row_h}" rx="6" '
            f'fill="{fill}" stroke="{stroke}"/>',
            _text(_OUT_X + _PAD, y + _PAD + 11, words),
        ]
        y += row_h + _PAD
    return out, height


def map_svg(rmap: RecoveryMap) -> str:
    """The recovery map as a standalone SVG document (no script, every label escaped).

    Example:
        >>> svg = map_svg(recovery_map(graph))  # doctest: +SKIP
    """
    parts: list[str] = []
    top = _PAD + 24
    for tool in rmap.tools:
        block, height = _tool_block(tool, top)
        parts += block
        top += height + _GAP
    if not rmap.tools:
        parts.append(_text(_PAD, top + 12, ["no tools"]))
        top += 24
    title = "Recovery map: what each kind of tool failure leads to"
    label = quoteattr(title)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{top}" '
        f'viewBox="0 0 {WIDTH} {top}" role="img" aria-label={label} '
        'font-family="system-ui, sans-serif">'
        f"<title>{escape(title)}</title>"
        f'<rect width="{WIDTH}" height="{top}" fill="#ffffff"/>'
        + _text(_PAD, 20, ["tool (side effect)   →   failure kinds   →   what happens"], size=12)
        + "".join(parts)
        + "</svg>"
    )
