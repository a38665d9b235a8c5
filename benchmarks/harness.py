"""What every part of ``ckptd bench all`` shares: a rank's place in the job, states, and the
checkpointers under test (ckptd's Checkpointer; torch DCP's async_save with its stager).

One *job* is ``ranks`` spawned processes in one gloo group (used by torch DCP and for the
benchmark's own barriers and maxima; ckptd's saves use no collective).
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptd.format.rootlayout import STEP_PREFIX
from tools.harness.ranks import rank_env

GIB = 1 << 30
MIB = 1 << 20
# DCP's save methods: sync save; async_save with one stager reused across saves (THREAD and
# PROCESS executors: DCP's fastest settings); async_save PROCESS as called (a stager per call).
DCP_METHODS = ("dcp_save", "dcp_async_thread", "dcp_async_process", "dcp_async_process_new")


class Rank:
    """This process's place in the job, and the collectives the benchmark itself uses."""

    def __init__(self, rank: int, world: int, spec: dict[str, Any], progress_fd: int | None = None) -> None:
        self.rank, self.world, self.spec = rank, world, spec
        self._progress_fd = progress_fd
        self.phase_file = Path(spec["phase_file"])
        self._step = 0
        # One checkpoint root (so one daemon) per job; its Checkpointers are opened per part.
        self.ckptd_root = Path(spec["dir"]) / "ckptd"

    def next_step(self) -> int:
        self._step += 1
        return self._step

    def barrier(self) -> None:
        dist.barrier()

    def max(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def sum(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item())

    def progress(self, msg: str) -> None:
        """A line on the benchmark's own stderr (rank 0): a run stopped by a time limit still says
        how far it got and how long each part took."""
        if self.rank == 0 and self._progress_fd is not None:
            os.write(self._progress_fd, f"[bench {time.strftime('%H:%M:%S')}] {msg}\n".encode())

    def phase(self, name: str) -> None:
        """Tell the memory sampler which phase runs now (rank 0 writes, after a barrier). Phases of
        jobs other than ``main`` (the scaling curve's) are named ``<job>:<phase>``: their peaks
        must not count as the main job's."""
        self.barrier()
        if self.rank == 0:
            job = self.spec["name"]
            self.progress(f"{job}: {name}")
            tmp = self.phase_file.with_suffix(".tmp")
            tmp.write_text(name if job == "main" else f"{job}:{name}")
            os.replace(tmp, self.phase_file)

    def rm_steps(self) -> None:
        """Remove the committed checkpoints of the job's ckptd root."""
        self.barrier()
        if self.rank == 0:
            for d in self.ckptd_root.glob(f"{STEP_PREFIX}*"):
                shutil.rmtree(d, ignore_errors=True)
        self.barrier()

    def rm(self, path: Path) -> None:
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        self.barrier()


def start_rank(rank: int, world: int, port: int, spec: dict[str, Any]) -> Rank:
    """Set up a spawned rank of a job: its output (and that of DCP's checkpoint process, which
    inherits it) into a log of the run's runtime directory, torchrun's variables, one CPU thread,
    its GPU (``spec["device"] == "cuda"``: ranks share the visible GPUs round-robin), one gloo group."""
    import warnings

    warnings.filterwarnings("ignore")
    log = os.open(
        Path(spec["log_dir"]) / f"{spec['name']}-rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
    )
    progress_fd = os.dup(2) if rank == 0 else None
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.update(rank_env(rank, world, port), GROUP_RANK="0")
    torch.set_num_threads(1)
    if spec.get("device", "cpu") == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return Rank(rank, world, spec, progress_fd)


def make_state(
    rank: int, nbytes: int, tensor_nbytes: int, count: int | None = None, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """``nbytes`` of float32 in tensors of ``tensor_nbytes`` (or ``count`` equal tensors) on ``device``.

    Filled with a constant per tensor: contents do not matter to a file write, and filling is
    ~10 x faster than random numbers at these sizes.
    """
    n = count if count is not None else max(1, nbytes // max(4, tensor_nbytes))
    numel = max(1, nbytes // n // 4)
    return {
        f"r{rank}.t{i:05d}": torch.empty(numel, dtype=torch.float32, device=device).fill_(rank + i * 1e-3)
        for i in range(n)
    }


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def sharded(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    from ckptd import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}


def checkpointer(r: Rank, **config: Any) -> Any:
    """A Checkpointer of the job's root (the job id names its shared-memory segments); ``config``:
    settings other than the environment's."""
    import ckptd

    return ckptd.Checkpointer(r.ckptd_root, config=ckptd.CkptdConfig.from_env(job_id=r.spec["job_id"], **config))


# What torch 2.11 and 2.12 do to a DefaultStager given to async_save more than once (pytorch#183413):
# a short cause for the benchmark's report (see _kept_stager_class).
STAGER_CLOSED_CAUSE = (
    "torch 2.11/2.12's DefaultStager._stage closes its StateDictStager after each stage, "
    "emptying its deepcopy table (pytorch#183413, fixed in 2.13)"
)


def dcp_failure(exc: BaseException) -> str:
    """A DCP save's error for the report, with its cause where it is known: the KeyError of a
    DefaultStager staging after its StateDictStager was closed."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, KeyError) and exc.args == (type,):
        text += f" ({STAGER_CLOSED_CAUSE})"
    return text


@functools.cache
def _kept_stager_class() -> Any:
    """A DCP ``DefaultStager`` that stages any number of saves, as torch 2.13's does.

    torch 2.11 and 2.12's ``DefaultStager._stage`` ends with ``self._state_dict_stager.close()``
    (staging.py, added by pytorch#170431 against a leak of the stagers async_save makes itself).
    ``StateDictStager.close()`` clears its cache of staged storages and its deepcopy dispatch
    table, which only ``__init__`` fills: the stager's next ``stage()`` deep-copies the state dict's
    top ``dict`` through its reduction (``copyreg.__newobj__, (dict,)``), meets the class ``dict``
    and looks up ``_deepcopy_dispatch[type]`` in the emptied table: ``KeyError: <class 'type'>``.
    So on those versions no DefaultStager stages twice, whatever the options or the state
    (pytorch#183413; torch 2.13 dropped that ``close()``, pytorch#183424). async_save itself never
    closes a stager it is given (2.11, 2.12), or closes only the one it made (2.13).

    This stager ignores the close inside ``_stage`` (a no-op bound on its StateDictStager, where a
    version has one) and counts it: ``closes_ignored > 0`` says the installed torch would have
    broken the reuse. That is the upstream fix, so DCP's reused stager keeps its staging buffers
    (pinned, shared) across saves as designed on every torch. ``release()`` closes it for real.
    """
    from torch.distributed.checkpoint.staging import DefaultStager

    class KeptStager(DefaultStager):
        def __init__(self, options: Any) -> None:
            super().__init__(options)
            self.closes_ignored = 0
            inner = getattr(self, "_state_dict_stager", None)
            if inner is not None:
                inner.close = self._ignore_close  # shadows StateDictStager.close on this instance

        def _ignore_close(self) -> None:
            self.closes_ignored += 1

        def release(self) -> None:
            inner = getattr(self, "_state_dict_stager", None)
            if inner is not None and "close" in vars(inner):
                del inner.close
            DefaultStager.close(self)

    return KeptStager


def kept_stager(options: Any) -> Any:
    """A DCP ``DefaultStager`` of ``options`` that stays usable across saves on every torch (see
    :func:`_kept_stager_class`); ``release()`` closes it."""
    return _kept_stager_class()(options)


def dcp_stager(kind: str, cuda: bool = False) -> Any:
    """DCP's DefaultStager as async_save would build it, kept across saves so that its staging
    buffers are reused (DCP's fastest CPU setting); shared memory for the PROCESS executor, so the
    staged tensors reach its checkpoint process without another copy. A CUDA state is staged
    into pinned memory with non-blocking copies, DCP's fastest GPU setting. None for
    ``dcp_async_process_new``: async_save then builds a stager per call, as when called plainly.
    Close it with ``release()``."""
    from torch.distributed.checkpoint.staging import StagingOptions

    if kind == "dcp_async_process_new":
        return None
    return kept_stager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=kind == "dcp_async_process",
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
    )


def dcp_thread_count(writer_threads: int, local_ranks: int) -> int:
    """DCP's write threads per rank (``FileSystemWriter(thread_count=)``) matched to ckptd's: the
    node daemon's ``writer_threads`` shared by the node's ranks, at least 1. DCP's default is 1,
    which on a fast filesystem leaves it slower than it can be."""
    return max(1, writer_threads // max(1, local_ranks))


def dcp_writer(directory: Path, thread_count: int) -> Any:
    """DCP's FileSystemWriter of ``directory`` writing with ``thread_count`` threads per rank."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(directory), thread_count=thread_count)


def dcp_async(state: dict[str, Any], directory: Path, kind: str, stager: Any, thread_count: int = 1) -> Any:
    """Start ``async_save`` of ``state`` by method ``kind`` (see :data:`DCP_METHODS`), written with
    ``thread_count`` threads; its future. Without a stager (``dcp_async_process_new``) async_save
    stages through the FileSystemWriter (a BlockingAsyncStager), a new copy per call."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    process = kind in ("dcp_async_process", "dcp_async_process_new")
    ctype = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
    kw: dict[str, Any] = {
        "checkpoint_id": str(directory),
        "storage_writer": dcp_writer(directory, thread_count),
        "async_checkpointer_type": ctype,
    }
    if stager is not None:
        kw["async_stager"] = stager
    fut = dcp.async_save(state, **kw)
    return getattr(fut, "upload_completion", fut)


def stop_dcp_process() -> None:
    """End DCP's checkpoint process now rather than at interpreter exit (private API; best effort)."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as m

        proc, m._CHECKPOINT_PROCESS = m._CHECKPOINT_PROCESS, None
        if proc is not None:
            proc.__del__()
    except Exception:  # noqa: BLE001 - the process is a daemon child: it dies with us anyway
        pass
