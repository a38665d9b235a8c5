"""A trainer rank that runs inside a namespace node and does what the test tells it, step by step.

Started by :class:`tests.netns.job.NetnsJob` with torchrun's variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` = node 0's address,
``MASTER_PORT``) and the job's ``CKPTD_*`` settings. It joins the gloo process group across the
namespaces, opens a :class:`ckptd.Checkpointer` (local rank 0 starts the node's daemon), prints
``{"ready": ...}`` and then answers one JSON command per stdin line with one JSON line on stdout:

- ``{"op": "train"}``: an all_reduce over every rank (a training step's collective);
- ``{"op": "save", "step": s}``: ``Checkpointer.save`` of this rank's state of step ``s`` (see
  :func:`state`; ``CKN_COMMON_NBYTES`` and ``CKN_ITEMS_PER_RANK`` make it bigger);
- ``{"op": "wait", "step": s, "timeout_s": t}``: the save's outcome (``committed`` with the
  commit's warnings, ``aborted`` with the reason, or ``pending`` once ``t`` passed);
- ``{"op": "check", "step": s}``: load step ``s`` and compare it bit for bit (``mismatch``);
- ``{"op": "resume"}``: load the latest checkpoint (``Checkpointer.load()``), its ``step`` and ``mismatch``;
- ``{"op": "latest"}``, ``{"op": "status"}`` (the node daemon's), ``{"op": "exit"}``.

Every value of the state is a function of rank and step, so any checkpoint is checked without
remembering what was saved. Replies carry ``ok``; a failed command says why (``error``).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

import torch
import torch.distributed as dist

import ckptd
from ckptd import ShardedObject, ShardedTensor

ROWS_PER_RANK, COLS = 8, 64


def tensor(rank: int, world: int, step: int) -> torch.Tensor:
    full = torch.arange(world * ROWS_PER_RANK * COLS, dtype=torch.float32).reshape(-1, COLS)
    return (full[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK] + step * 1000).clone()


def blob(step: int, nbytes: int) -> torch.Tensor:
    """Common state of ``nbytes`` (rank 0's WRITTEN carries it to the coordinator)."""
    return ((torch.arange(nbytes, dtype=torch.int64) + step) % 251).to(torch.uint8)


def state(
    rank: int, world: int, step: int, common_nbytes: int, items: int = 0, t: torch.Tensor | None = None
) -> dict[str, Any]:
    """This rank's state of ``step``: a row shard of ``w``, an object, ``items`` one-element shards
    (each a record in the rank's WRITTEN), and ``common_nbytes`` of common state."""
    t = tensor(rank, world, step) if t is None else t
    sd: dict[str, Any] = {
        "w": ShardedTensor.from_rank_offsets("w", t, (0, rank, world)),
        "o": ShardedObject("o", {"rank": rank, "step": step}, (world,), (rank,)),
        "iteration": step,
        "blob": blob(step, common_nbytes),
    }
    for i in range(items):
        sd[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", torch.full((1,), float(step + i)), (0, rank, world))
    return sd


class Agent:
    def __init__(self, root: str) -> None:
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.common_nbytes = int(os.environ.get("CKN_COMMON_NBYTES", "0"))
        self.items = int(os.environ.get("CKN_ITEMS_PER_RANK", "0"))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        self.ckpt = ckptd.Checkpointer(root)
        self.handles: dict[int, ckptd.SaveHandle] = {}

    def train(self) -> dict[str, Any]:
        x = torch.ones(4) * (self.rank + 1)
        dist.all_reduce(x)
        return {"sum": float(x[0])}

    def save(self, step: int) -> dict[str, Any]:
        t0 = time.monotonic()
        self.handles[step] = self.ckpt.save(
            state(self.rank, self.world, step, self.common_nbytes, self.items), step=step
        )
        return {"save_s": time.monotonic() - t0}

    def wait(self, step: int, timeout_s: float) -> dict[str, Any]:
        h = self.handles[step]
        try:
            h.wait(timeout_s=timeout_s)
        except (ckptd.SaveFailedError, ckptd.errors.SaveTimeoutError) as exc:
            return {"outcome": h.status.value, "reason": str(exc)}
        return {"outcome": h.status.value, "reason": "", "warnings": h.warnings}

    def check(self, step: int) -> dict[str, Any]:
        return {"mismatch": self._compare(self.ckpt.load(self._request(), step=step), step)}

    def resume(self) -> dict[str, Any]:
        """``Checkpointer.load()`` of the latest checkpoint: the step it resumed from, checked."""
        out = self.ckpt.load(self._request())
        return {"step": out["iteration"], "mismatch": self._compare(out, out["iteration"])}

    def _request(self) -> dict[str, Any]:
        request = state(self.rank, self.world, -1, 0, self.items, torch.zeros(ROWS_PER_RANK, COLS))
        for i in range(self.items):
            request[f"t{i}"].data.zero_()
        return request

    def _compare(self, out: dict[str, Any], step: int) -> str | None:
        want = state(self.rank, self.world, step, self.common_nbytes, self.items)
        for key in ["w"] + [f"t{i}" for i in range(self.items)]:
            if not torch.equal(out[key], want[key].data):
                return f"tensor {key!r} of rank {self.rank} differs from step {step}'s"
        if out["o"] != want["o"].data or out["iteration"] != step or not torch.equal(out["blob"], want["blob"]):
            return f"'o', 'iteration' or 'blob' of rank {self.rank} differs from step {step}'s"
        return None

    def latest(self) -> dict[str, Any]:
        return {"latest": self.ckpt.latest()}

    def status(self) -> dict[str, Any]:
        return {"status": self.ckpt.status()}

    def exit(self) -> dict[str, Any]:
        self.ckpt.close(wait=False)
        dist.destroy_process_group()
        return {"bye": True}


def _reply(out: TextIO, obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def main(root: str) -> int:
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nothing but replies on the reply pipe
    logging.basicConfig(
        filename=os.environ.get("CKN_LOG"),
        level=logging.INFO,
        force=True,
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
    )
    try:
        agent = Agent(root)
    except Exception as exc:  # noqa: BLE001 - reported to the harness, which fails the test
        _reply(out, {"ok": False, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()})
        return 1
    _reply(out, {"ok": True, "ready": agent.rank, "pid": os.getpid()})
    ops: dict[str, Callable[..., dict[str, Any]]] = {
        "train": agent.train,
        "save": agent.save,
        "wait": agent.wait,
        "check": agent.check,
        "resume": agent.resume,
        "latest": agent.latest,
        "status": agent.status,
        "exit": agent.exit,
    }
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            _reply(out, {"ok": True, **ops[op](**cmd)})
        except Exception as exc:  # noqa: BLE001 - reported to the harness, which fails the test
            _reply(out, {"ok": False, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()})
        if op == "exit":
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
