"""A rank of a real ``torchrun --max-restarts=1`` job whose first round fails before one rank saved
(tests/integration/test_relaunch_attempts.py runs it: ``-m tests.integration.torchrun_rounds OUT ROOT``).

Round 0: rank 0 hands off step 10 (every value ``100 + rank``) and waits to be stopped; rank 1 dies
once that is done, before its Checkpointer's first save (as a rank that fails while it sets its model
up). torchrun stops rank 0 and starts round 1 on the same agent store. Round 1: rank 1 saves first,
rank 0 a little later; each saves step 10 again, then step 20 (every value ``rank``), and waits for
each. Each rank writes what it saw to ``OUT/round<restart count>-rank<rank>.json``: a rank that
counted one Checkpointer behind the others read the dead round's incarnation there.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import ckptd
from ckptd import ShardedTensor

STEPS = (10, 20)
HANDED_OFF = "round0-rank0-handed-off"
ROUND0_WAIT_S = 60.0  # round 0's ranks wait at most this for each other: torchrun stops them first
LATE_S = 2.0  # round 1's rank 0 agrees after rank 1: the order in which rank 1 read round 0's tag


def _state(rank: int, world_size: int, value: float) -> dict[str, Any]:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), value), (0, rank, world_size))}


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + ROUND0_WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def main(out: Path, root: str) -> int:
    restarts, rank, world_size = (int(os.environ[k]) for k in ("TORCHELASTIC_RESTART_COUNT", "RANK", "WORLD_SIZE"))
    report: dict[str, Any] = {"round": restarts, "rank": rank}
    if restarts == 0 and rank == 1:
        _wait_for(out / HANDED_OFF)
        return 1  # dies before its Checkpointer's first save: torchrun restarts the round
    if restarts > 0 and rank == 0:
        time.sleep(LATE_S)
    with ckptd.Checkpointer(root) as ckpt:
        if restarts == 0:
            handle = ckpt.save(_state(rank, world_size, 100.0 + rank), step=STEPS[0])
            report.update(tag=ckpt._tries.incarnation.tag, attempt=handle.attempt)
            (out / f"round0-rank{rank}.json").write_text(json.dumps(report))
            (out / HANDED_OFF).touch()
            time.sleep(ROUND0_WAIT_S)  # torchrun stops it once rank 1 failed
            return 1
        for step in STEPS:
            try:
                ckpt.save(_state(rank, world_size, float(rank)), step=step).wait(timeout_s=60)
                report[str(step)] = "committed"
            except ckptd.errors.CkptdError as exc:  # what the test reports
                report[str(step)] = f"{type(exc).__name__}: {exc}"
        report["tag"] = ckpt._tries.incarnation.tag
    (out / f"round{restarts}-rank{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
