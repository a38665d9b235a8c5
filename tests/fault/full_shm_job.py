"""A trainer in a mount namespace whose /dev/shm holds 16 MiB (run by test_full_shm.py):
saves bigger than /dev/shm, and saves while a co-tenant fills it, fail cleanly and training goes
on; once there is room again, the next save commits. Prints one JSON line of outcomes."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

import ckptd
from ckptd import ShardedTensor


def state(mib: int, step: int) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((mib << 18,), float(step))), "step": step}


def attempt(ckpt: ckptd.Checkpointer, mib: int, step: int) -> str:
    try:
        ckpt.save(state(mib, step), step=step).wait(timeout_s=60)
    except ckptd.CkptdError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "committed"


def main() -> None:
    root, snapshot = sys.argv[1], sys.argv[2]
    runtime = tempfile.mkdtemp(prefix="cks", dir="/tmp")
    cfg = ckptd.CkptdConfig.from_env(
        {}, runtime_dir=runtime, idle_exit_s=1.0, heartbeat_s=0.2, staging_budget="1x", snapshot=snapshot
    )
    out = {}
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        out["too big"] = attempt(ckpt, 24, 1)  # more than /dev/shm holds
        out["fits"] = attempt(ckpt, 4, 2)
        filler = "/dev/shm/co-tenant"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)  # another user fills /dev/shm
        try:
            while os.write(fd, b"x" * (1 << 20)):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        out["full, bigger"] = attempt(ckpt, 8, 3)  # needs pages the co-tenant took
        os.unlink(filler)
        out["room again"] = attempt(ckpt, 8, 4)
        out["latest"] = ckpt.latest()
        loaded = ckpt.load(state(8, 0))
        out["loaded"] = float(loaded["w"][0])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
