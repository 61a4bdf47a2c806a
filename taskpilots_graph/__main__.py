"""``python -m taskpilots_graph``: the ``taskpilots`` command, under another name.

One app serves every entry point (see :mod:`taskpilots_graph.cli`): ``python -m
taskpilots_graph supervise --graph module:attr`` is ``taskpilots supervise --graph
module:attr``, with the same options, help and exit statuses.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: the process's) and return its exit status."""
    from taskpilots_graph.cli import run_cli

    return run_cli(sys.argv[1:] if argv is None else argv, prog_name="python -m taskpilots_graph")


if __name__ == "__main__":
    raise SystemExit(main())
