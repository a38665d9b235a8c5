"""Spawned processes for tests and harnesses: started together, never outliving their bound.

Two ways in, one lifecycle (:func:`spawned`):

- ``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on ``world_size``
  spawned processes joined in a gloo process group and returns every rank's return value in rank
  order, or raises with each failed rank's traceback. ``fn`` must be a module-level function (it
  is pickled by reference for the spawned interpreters). A hung rank is killed after ``timeout_s``
  (the others soon after one rank failed) so a deadlock fails the test, with the hung ranks'
  stacks, instead of stalling CI.
- ``with spawned([(fn, args), ...], join_timeout_s=...) as procs:`` starts one spawned process
  per target (no process group: the target sets up what it needs) for a test that watches the
  processes itself (exit codes, a queue of its own from :func:`spawn_queue`).

Either way, on leaving, the processes get ``join_timeout_s`` (together) to exit; the ones still
running are SIGKILLed and reaped, and listed in ``procs.killed``.

The processes are forkserver children (:func:`process_context`): the server imported torch, DCP
and ckptd once, so a process starts in milliseconds where a spawned interpreter spent 3 CPU-seconds
importing them (most of the suite's process tests are such ranks). Each starts with the caller's
environment as it is at the start, as a spawned process would (the server's is from its own start).
Where a CUDA device is visible they are spawned interpreters instead: on the H100 machine the
server's preloaded imports (Megatron-Core's, it seems) initialised CUDA, and a child forked from a
process with CUDA initialised cannot use it ("Cannot re-initialize CUDA in forked subprocess").
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from multiprocessing.context import ForkServerContext, ForkServerProcess, SpawnContext, SpawnProcess
from multiprocessing.queues import Queue
from typing import Any

from tools.harness.ports import LOOPBACK

REAP_TIMEOUT_S = 10.0  # a SIGKILLed process is gone at once; this only bounds the reaping


# What the forkserver imports once for all its children: what a rank, a crash trial's trainer and
# most test targets import anyway.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "ckptd", "tools.harness.crash_job"]
# And, where it is installed (a test dependency), the Megatron-Core modules the interop tests'
# ranks import: about 2 CPU-s per rank otherwise, 20 ranks in the suite. The import starts no
# thread and changes no torch setting (checked), so the other children are as before.
_PRELOAD_MEGATRON = [
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.optimizer",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.optimizer",
    "megatron.core.distributed",
]


def process_context() -> ForkServerContext | SpawnContext:
    """Forkserver children with torch, DCP, ckptd (and Megatron-Core, where installed) preloaded:
    a process starts in milliseconds. One server per interpreter, started on first use;
    :func:`stop_process_context` ends it. Spawned interpreters where a CUDA device is visible (see
    the module docstring; the check itself initialises no CUDA)."""
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    megatron = importlib.util.find_spec("megatron.core") is not None
    ctx.set_forkserver_preload(_PRELOAD + (_PRELOAD_MEGATRON if megatron else []))
    return ctx


def stop_process_context() -> None:
    """Stop the forkserver process (it would otherwise live as long as this interpreter); the next
    use starts a fresh one."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def follow_std_fds() -> None:
    """Rebuild ``sys.stdin``/``stdout``/``stderr`` on fds 0, 1 and 2 once a child dup2'ed what it
    wants there: multiprocessing gave it an empty stdin, and its streams stay on the old files."""
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - the process's stream
    sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115


def spawn_queue() -> Queue:
    """A queue the spawned processes can put their results on."""
    return process_context().Queue()


def _in_env(env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in ``env``: the caller's environment when it started the process (a
    forkserver child inherits the server's, from the server's own start)."""
    os.environ.clear()
    os.environ.update(env)
    return fn(*args)


class Spawned(list[ForkServerProcess | SpawnProcess]):
    """The processes of :func:`spawned`, in the order of their targets."""

    killed: list[int]  # indices of the processes that had to be SIGKILLed on leaving


@contextlib.contextmanager
def spawned(
    targets: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]],
    *,
    join_timeout_s: float,
    daemon: bool = True,
    env: Mapping[str, str] | None = None,
) -> Iterator[Spawned]:
    """Start a spawned process per ``(fn, args)`` with ``env`` (default: this process's
    environment); on leaving, wait ``join_timeout_s`` for them all, then SIGKILL and reap the ones
    still running.

    ``daemon=False`` lets the processes start processes of their own (Megatron-Core's save forks
    writer processes and starts a multiprocessing Manager)."""
    ctx, env = process_context(), dict(os.environ if env is None else env)
    procs = Spawned(ctx.Process(target=_in_env, args=(env, fn, *args), daemon=daemon) for fn, args in targets)
    procs.killed = []
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        deadline = time.monotonic() + join_timeout_s
        for p in procs:
            if p.pid is not None:  # started
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for i, p in enumerate(procs):
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(timeout=REAP_TIMEOUT_S)
                procs.killed.append(i)


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """torchrun's variables for ``rank`` of a one-node job whose rendezvous store listens on ``port``."""
    return {
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


# How long the other ranks get to report once one rank failed: the failed rank's peers are most
# likely waiting for it in a collective (until the process group's timeout), and its traceback is
# what the test needs, not the peers' wait.
FAILED_RANK_GRACE_S = 15.0
# How long a hung rank gets to write its stacks (SIGUSR1, faulthandler) before it is killed.
STACK_DUMP_WAIT_S = 1.0
_STACK_DUMP_BYTES = 64 * 1024  # the end of a rank's dump is reported, no more


STORE_START_TIMEOUT_S = 10.0  # a store connects to itself when it starts: a bound on that
STORE_START_TRIES = 3


def launch_store() -> Any:
    """A launch's rendezvous store, held by this process as torchrun's agent holds it: the ranks
    connect to its ``port`` as clients (``TORCHELASTIC_USE_AGENT_STORE=True`` for an ``env://``
    init). It listens on a port the kernel chose for it, for as long as it lives: a port found free
    here and bound later by rank 0 could be taken meanwhile (by any connection's source port), and
    rank 0 then failed while the others waited for it until the test's own timeout. A store that
    cannot reach itself while it starts is made again (stores made and dropped in quick
    succession sometimes did not, within their timeout: 1 to 11 in 300 here)."""
    import torch.distributed as dist

    def start() -> Any:
        timeout = timedelta(seconds=STORE_START_TIMEOUT_S)
        return dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False, timeout=timeout)

    for _ in range(STORE_START_TRIES - 1):
        with contextlib.suppress(RuntimeError):  # DistNetworkError
            return start()
    return start()


def _rank_entry(
    fn: Callable,
    rank: int,
    world_size: int,
    port: int,
    env: dict,
    queue: Any,
    args: tuple,
    timeout_s: float,
    stacks: str,
) -> None:
    os.environ.update(env)
    os.environ.update(rank_env(rank, world_size, port))
    import torch.distributed as dist

    # A hung rank's stacks, written on SIGUSR1 (run_ranks sends it before killing the rank).
    dump = open(os.path.join(stacks, f"rank{rank}.txt"), "w")  # noqa: SIM115 - open while the rank runs
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    try:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(LOOPBACK, port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
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
    timeout_s: float = 90.0,
    env: dict[str, str] | None = None,
    daemon: bool = True,
    failed_rank_grace_s: float = FAILED_RANK_GRACE_S,
) -> list[Any]:
    """Every rank's return value of ``fn(rank, world_size, *args)``, in rank order.

    ``env`` is added to each rank's environment; ``daemon=False`` as for :func:`spawned`. Raises
    TimeoutError when a rank has not finished after ``timeout_s``, RuntimeError when a rank died
    without reporting, AssertionError with the tracebacks of the ranks whose ``fn`` raised (at most
    ``failed_rank_grace_s`` after the first failure: the ranks still running then are killed).
    The stacks of the ranks killed unfinished are in the error. ``timeout_s`` must be below the
    test's own timeout, so that this error, not a killed test worker, reports a hang
    (tests/unit/test_harness_timeouts.py checks the tests)."""
    queue = spawn_queue()
    store = launch_store()
    with tempfile.TemporaryDirectory(prefix="ckptd-ranks-") as stacks:
        targets = [
            (_rank_entry, (fn, r, world_size, store.port, env or {}, queue, args, timeout_s, stacks))
            for r in range(world_size)
        ]
        results: dict[int, tuple[bool, Any]] = {}
        # The ranks reported, so they are only tearing their process group down: 5 s is plenty.
        with spawned(targets, join_timeout_s=5 * world_size, daemon=daemon) as procs:
            deadline = time.monotonic() + timeout_s
            while len(results) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, ok, value = queue.get(timeout=min(remaining, 1.0))
                    results[rank] = (ok, value)
                    if not ok:
                        deadline = min(deadline, time.monotonic() + failed_rank_grace_s)
                except queue_mod.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if not p.is_alive() and r not in results and p.exitcode not in (0, None)
                    ]
                    if dead:
                        failed = "".join(
                            f"\n--- rank {r} failed:\n{v}" for r, (ok, v) in sorted(results.items()) if not ok
                        )
                        raise RuntimeError(
                            f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}{failed}"
                        ) from None
            unfinished = sorted(set(range(world_size)) - set(results))
            hung = _stacks_of(procs, unfinished, stacks)
            for r in unfinished:
                procs[r].kill()  # not worth the join's wait: spawned() reaps it
    failures = {r: v for r, (ok, v) in results.items() if not ok}
    if failures:
        report = "\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in sorted(failures.items()))
        if unfinished:
            report += (
                f"\n--- ranks {unfinished} had not finished {failed_rank_grace_s:g} s after that (waiting"
                f" for the failed rank in a collective, most likely); killed:\n{hung}"
            )
        raise AssertionError(report)
    if unfinished:
        raise TimeoutError(f"ranks {unfinished} did not finish in {timeout_s}s; killed:\n{hung}")
    return [results[r][1] for r in range(world_size)]


def _stacks_of(procs: Spawned, ranks: list[int], stacks: str) -> str:
    """Ask the running ``ranks`` to write their stacks (SIGUSR1) and return what they wrote."""
    for r in ranks:
        pid = procs[r].pid
        with contextlib.suppress(ProcessLookupError):
            if pid is not None and procs[r].is_alive():
                os.kill(pid, signal.SIGUSR1)
    if ranks:
        time.sleep(STACK_DUMP_WAIT_S)
    out = []
    for r in ranks:
        try:
            with open(os.path.join(stacks, f"rank{r}.txt"), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - _STACK_DUMP_BYTES))
                text = f.read(_STACK_DUMP_BYTES).decode(errors="replace")
        except OSError as exc:
            text = f"(no stacks: {exc})"
        out.append(f"--- rank {r}'s stacks:\n{text or '(none written)'}")
    return "\n".join(out)
