"""``python -m taskpilots_graph.demo``: the same as ``taskpilots demo`` (same options, output)."""

from __future__ import annotations

import sys

from taskpilots_graph.cli import run_command

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the demo; exit 1 if the recovery agent performed any duplicate side effect."""
    args = sys.argv[1:] if argv is None else argv
    return run_command("demo", args, prog_name="python -m taskpilots_graph.demo")


if __name__ == "__main__":
    raise SystemExit(main())
