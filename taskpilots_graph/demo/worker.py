"""The drills' worker: ``python -m taskpilots_graph.demo.worker MODE DB SERVICES BATCH
[DENSITY]``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from taskpilots_graph.demo.batch import run_batch


def main(argv: list[str]) -> int:
    """Process the batch file once (start or resume every ticket's thread)."""
    mode, conn_string, services_path, batch_file, *rest = argv
    density = rest[0] if rest else "every_step"
    if mode not in ("agent", "plain"):
        print(f"unknown mode {mode!r}; use 'agent' or 'plain'", file=sys.stderr)
        return 2
    tickets = json.loads(Path(batch_file).read_text())
    run_batch(mode, conn_string, services_path, tickets, density=density)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
