"""Child process of the differential test's crash drill: one agent form, one action.

Run as ``python tests/_forms_worker.py FORM ACTION CONN WORLD THREAD`` where ``FORM`` is one
of ``_forms_harness.FORMS``, ``ACTION`` is ``start`` (the user's "go"; the service SIGKILLs
this process in the middle of the run) or ``resume`` (``tp.resume`` in a fresh process),
``CONN`` the checkpointer's connection string and ``WORLD`` the service's SQLite file. It
prints the run's last message as one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _forms_harness import KILLED, build
from _forms_world import World

import taskpilots_graph as tp


def main(argv: list[str]) -> int:
    form, action, conn, world_path, thread_id = argv
    with tp.RecoveryCheckpointer.from_conn_string(conn) as cp:
        graph = build(form, KILLED, cp, World(world_path))
        if action == "start":
            out = tp.run(graph, thread_id, {"messages": [("user", "go")]})
        else:
            out = tp.resume(graph, thread_id)
    last = out["messages"][-1]
    print(json.dumps({"type": last.type, "content": str(last.content)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
