"""`gpuvigil quarantine hold|release NODE`: a person's moves on a node's quarantine record.

- `hold`: the node is the operator's (`operator_held`): gpuvigil never returns it to service and
  leaves new causes on it to the operator (their hints are nacked with the reason).
- `release`: an `operator_held` or `rma` node is healthy again in gpuvigil's records (the person
  has returned it, or will: gpuvigil changes nothing on the scheduler for it).

Written to the quarantine file beside the hint store (`--hint-db`, as `serve` and `gpuvigil act`
take it), each move recorded with who made it; `gpuvigil why NODE` shows them.
"""

from __future__ import annotations

import argparse
import getpass
import time
from pathlib import Path

from gpuvigil.errors import UserError
from gpuvigil.util.textsafe import printable


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("quarantine", help="a person's moves on a node's quarantine record: hold, release", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["hold", "release"])
    p.add_argument("node")
    p.add_argument("--gpu", type=int, default=None, help="a GPU's record instead of the node's")
    p.add_argument("--hint-db", default="gpuvigil-hints.sqlite", help="the hint store serve/act use; the records live beside it (default ./gpuvigil-hints.sqlite)")
    p.add_argument("--who", default=None, help="who (default: the login name), recorded")
    p.add_argument("--note", default="", help="why (recorded)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from gpuvigil.scheduler.quarantine import IllegalTransition, QuarantineMachine, State, store_beside

    db = Path(args.hint_db)
    side = db.with_name(db.stem + ".quarantine.db")
    if not side.exists():
        raise UserError(f"{side}: no quarantine state (gpuvigil has not acted with --hint-db {db})")
    who = f"operator:{args.who or getpass.getuser()}"
    with store_beside(db) as store:
        m = QuarantineMachine(store)
        rec = m.get(args.node, args.gpu)
        if args.action == "release" and rec.state not in (State.OPERATOR_HELD, State.RMA):
            raise UserError(f"{printable(rec.key, 200)} is {rec.state.value}: only an operator_held or rma record is released (gpuvigil returns its own)")
        to = State.OPERATOR_HELD if args.action == "hold" else State.HEALTHY
        try:
            t = m.transition(rec, to, now=time.time(), rule=f"operator_{args.action}", who=who, cause=args.note or f"{args.action} by {who}", finding_ids=list(rec.causes))
        except IllegalTransition as exc:
            raise UserError(str(exc)) from exc
    print(f"{rec.key}: {t.line()}")
    return 0
