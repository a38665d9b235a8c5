"""``ckptd tune``: recommend a save interval from measured stall, persist time and MTBF."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from ..errors import CkptdError
from ..tune import TuneInputs, recommend
from ._common import EXIT_OK, UsageError, add_parser, emit_json, guarded

DESCRIPTION = """\
Recommend how often to checkpoint (Young/Daly): with asynchronous saves a checkpoint costs
training only its stall (time until save() returns), while a failure loses the work since the
last committed checkpoint plus the persist/commit latency and the restart time. The interval
minimizes  stall/interval + (interval/2 + persist + restart)/MTBF, and is never shorter than the
persist time (saves would queue behind each other). Measure the stall and persist times from a
real save (the Checkpointer logs both).

exit status: 0 ok; 2 usage error (missing or invalid numbers)."""


def register(subparsers: Any) -> None:
    p = add_parser(subparsers, "tune", "recommend a checkpoint interval (Young/Daly)", DESCRIPTION)
    p.add_argument(
        "--stall-s",
        type=float,
        required=True,
        metavar="SECONDS",
        help="training time lost per save (time until save() returns)",
    )
    p.add_argument(
        "--persist-s",
        type=float,
        required=True,
        metavar="SECONDS",
        help="time from save() until the checkpoint is committed",
    )
    p.add_argument(
        "--mtbf-s", type=float, required=True, metavar="SECONDS", help="mean time between failures of the whole job"
    )
    p.add_argument(
        "--step-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds per training step (to express the interval in steps)",
    )
    p.add_argument(
        "--restart-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="time to restart and reload after a failure (default: 0)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


@guarded("tune")
def run(args: argparse.Namespace) -> int:
    inputs = TuneInputs(
        stall_s=args.stall_s, persist_s=args.persist_s, mtbf_s=args.mtbf_s, step_s=args.step_s, restart_s=args.restart_s
    )
    try:
        rec = recommend(inputs)
    except CkptdError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        emit_json(
            {"inputs": asdict(inputs), "recommendation": asdict(rec), "explanation": rec.explain(inputs).splitlines()}
        )
    else:
        print(rec.explain(inputs))
    return EXIT_OK
