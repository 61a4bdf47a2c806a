"""``python -m taskpilots_graph.demo``: the ticket batch, killed and resumed, vs plain LangGraph."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from taskpilots_graph.demo.batch import DrillReport, drill, make_batch
from taskpilots_graph.demo.services import Phase

# Where the worker dies: inside the effect window of every side-effecting service, and once
# before an effect is sent. Both runs (ours and plain LangGraph) get the same kill points.
KILL_POINTS: list[tuple[str, Phase]] = [
    ("create_ticket", "after"),
    ("send_email", "after"),
    ("issue_refund", "after"),
    ("crm_tag", "after"),
    ("send_email", "before"),
    ("create_ticket", "after"),
    ("issue_refund", "after"),
]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m taskpilots_graph.demo",
        description="Process a batch of support tickets with the recovery agent while its "
        "worker is SIGKILLed mid side effect; resume every thread by id; count duplicates, "
        "and compare with plain LangGraph under the same kills.",
    )
    parser.add_argument("--tickets", type=int, default=12, help="tickets in the batch")
    parser.add_argument("--seed", type=int, default=7, help="seed of the batch and kill times")
    parser.add_argument("--timed-kills", type=int, default=2, help="extra kills at random moments")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the databases here")
    parser.add_argument("--postgres", metavar="URL", default=None, help="store runs in PostgreSQL")
    parser.add_argument("--json", action="store_true", help="print a machine-readable summary")
    parser.add_argument("--skip-plain", action="store_true", help="do not run the contrast")
    return parser.parse_args(argv)


def _table(reports: list[DrillReport]) -> str:
    names = {"agent": "taskpilots agent", "plain": "plain LangGraph"}
    rows = [("", *(names[r.mode] for r in reports))]
    rows.append(("tickets closed", *(f"{r.closed}/{r.tickets}" for r in reports)))
    rows.append(("stopped for a person", *(str(len(r.stopped_uncertain)) for r in reports)))
    for service in reports[0].effects:
        rows.append((f"  {service}", *(str(r.effects[service]) for r in reports)))
    rows.append(("duplicate side effects", *(str(r.duplicates) for r in reports)))
    rows.append(("SIGKILLs survived", *(str(r.kills) for r in reports)))
    rows.append(("resumes (worker restarts)", *(str(r.worker_runs - 1) for r in reports)))
    rows.append(("seconds", *(f"{r.seconds:.1f}" for r in reports)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def main(argv: list[str] | None = None) -> int:
    """Run the demo; exit 1 if the recovery agent performed any duplicate side effect."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    customers, tickets = make_batch(args.tickets, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="taskpilots-demo-") as tmp:
        workdir = args.workdir or Path(tmp)
        if not args.json:
            print(
                f"Processing {len(tickets)} tickets; the worker is SIGKILLed "
                f"{len(KILL_POINTS)} times mid side effect (+{args.timed_kills} at random)."
            )
        reports = [
            drill(
                "agent",
                workdir,
                tickets,
                customers,
                kill_points=KILL_POINTS,
                timed_kills=args.timed_kills,
                conn_string=args.postgres,
                seed=args.seed,
            )
        ]
        if not args.skip_plain:
            reports.append(
                drill(
                    "plain",
                    workdir,
                    tickets,
                    customers,
                    kill_points=KILL_POINTS,
                    timed_kills=args.timed_kills,
                    seed=args.seed,
                )
            )
    summary: dict[str, Any] = {r.mode: r.as_dict() for r in reports}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(_table(reports))
        agent = reports[0]
        print(
            f"\nduplicate side effects: {agent.duplicates} (taskpilots agent)"
            + (f", {reports[1].duplicates} (plain LangGraph)" if len(reports) > 1 else "")
        )
        for key in agent.uncertain_keys:
            print(f"waiting for a person: uncertain effect {key}")
    return 1 if reports[0].duplicates else 0


if __name__ == "__main__":
    raise SystemExit(main())
