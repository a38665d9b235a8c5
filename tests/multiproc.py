"""Run a function on N real processes joined in a gloo process group (spawned, with a timeout).

``run_ranks(fn, world_size, *args)`` returns every rank's return value in rank order, or raises
with each failed rank's traceback. ``fn(rank, world_size, *args)`` must be a module-level
function (it is pickled by reference for the spawned interpreters). A hung rank is killed after
``timeout_s`` so a deadlock fails the test instead of stalling CI.

A test that is a single process instead clears torchrun's variables (:data:`TORCHRUN_VARS`): the
``single_process`` fixture (tests/conftest.py), :func:`clear_torchrun_env`, or
:func:`without_torchrun` for the environment of a subprocess.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch.multiprocessing as mp

# What makes a process a rank of a launched job (ckptd.control.endpoints.JobEnv.detect reads them).
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def without_torchrun(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without torchrun's variables: a subprocess started with it is a single process."""
    return {k: v for k, v in environ.items() if k not in TORCHRUN_VARS}


def clear_torchrun_env(monkeypatch: Any) -> None:
    """Make this test process a single process for ckptd until ``monkeypatch`` undoes it."""
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, env: dict, queue: Any, args: tuple) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    daemon: bool = True,
) -> list[Any]:
    """``daemon=False`` lets ranks start processes of their own (Megatron-Core's save forks
    writer processes and starts a multiprocessing Manager); they are still killed on timeout."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, env or {}, queue, args), daemon=daemon)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {timeout_s}s"
                )
            try:
                rank, ok, value = queue.get(timeout=min(remaining, 1.0))
                results[rank] = (ok, value)
            except queue_mod.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive() and r not in results and p.exitcode not in (0, None)
                ]
                if dead:
                    raise RuntimeError(
                        f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    failures = {r: v for r, (ok, v) in results.items() if not ok}
    if failures:
        raise AssertionError("\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in sorted(failures.items())))
    return [results[r][1] for r in range(world_size)]
