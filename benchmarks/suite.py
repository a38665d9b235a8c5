"""``ckptd bench all``: ckptd against torch DCP on the same state, in one run, with the targets.

    ckptd bench all [--ranks 2] [--state-gib 4] [--tensor-mib 64] [--small-tensors 10000]
                    [--small-gib 1] [--repeats 3] [--scale-ranks 1,2,4] [--scale-gib-per-rank G]
                    [--load-gib G] [--train-every 4] [--train-saves 3] [--train-update 1]
                    [--budget 0.25x] [--soak-saves 20] [--soak-gib 0.25]
                    [--device cpu|cuda] [--dir D] [--json] [--check]

Runs, each rank a spawned process (one gloo group) and ``--state-gib / --ranks`` of float32
tensors of ``--tensor-mib`` per rank (see :mod:`.suite_rank` and :mod:`.suite_train`):

1. reference limits: warm memcpy of the state (all ranks at once), and a sequential write + fsync
   of the node's bytes into ``--dir`` (1 stream, ``writer_threads`` streams, 1 stream with early
   writeback), measured after every ckptd save, so both meet the same disk;
2. saves by ckptd, DCP ``save``, DCP ``async_save`` THREAD and PROCESS with one DefaultStager
   reused (DCP's fastest settings) and PROCESS as called (a stager per call), DCP writing with
   ``FileSystemWriter(thread_count=N)``, ``N`` = ckptd's ``writer_threads`` / ranks (at least 1):
   the first save's stall, then stall per save (median, max), time until durable (ckptd:
   committed; DCP: its ``.metadata`` written), persist GiB/s = bytes / (durable - stall) for
   every method (DCP ``save`` blocks: bytes / durable); ckptd's daemon write window (writer wait,
   write, fsync) is held against the sequential write + fsync reference;
3. ckptd saves with ``snapshot="lazy"`` (stall = planning; the fence before the update waits);
   ckptd saves through a staging ring of ``--budget`` of a save, loaded back and compared;
4. ``--soak-saves`` back-to-back ckptd saves: rank, daemon and staging memory after each;
5. a CPU training loop saving every ``--train-every`` steps, the first save included: steps/s
   without checkpointing, with DCP async THREAD and PROCESS (stager reused), with ckptd;
6. a state of ``--small-tensors`` tensors, ``--small-gib`` in all: stall of ckptd and DCP async;
7. ckptd's stall at 1, 2, 4 ranks (``--scale-ranks``) with constant bytes per rank;
8. load throughput, same layout and resharded, ckptd and DCP ``load`` (:mod:`.load`);
9. peak RSS, shared memory and CPU time of trainers, DCP's checkpoint process and the daemon,
   and the node's ``/dev/shm`` (:mod:`.memory`).

Everything it creates (temporary directories, daemons, /dev/shm segments) is removed at the end;
the JSON's ``cleanup`` section says what was left behind before that. Targets and the table:
:mod:`.suite_report`; ``--check`` exits 1 when one is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

from ckptd.config import CkptdConfig, parse_budget
from tools.harness.ports import free_port

from .harness import DCP_METHODS, GIB, dcp_thread_count
from .memory import MemorySampler, daemon_pids
from .suite_report import evaluate, render

MIB = 1 << 20


def _log(msg: str) -> None:
    print(f"[bench all {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Suite:
    """One invocation: its directories, sampler, jobs and cleanup."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.token = secrets.token_hex(3)
        self.job_prefix = f"bn{self.token}-"
        parent = args.dir or os.environ.get("TMPDIR", "/tmp")
        Path(parent).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir=parent))
        self.runtime = Path(tempfile.mkdtemp(prefix="ckb", dir="/tmp"))  # short: ipc paths <= 107 bytes
        self.phase_file = self.runtime / "phase"
        self.sampler = MemorySampler(self.runtime, self.phase_file, shm_prefix=f"ckptd-{self.job_prefix}")
        self._env_saved: dict[str, str | None] = {}
        # The node daemon's writer threads, which DCP's write threads per rank are matched to.
        self.writer_threads = CkptdConfig.from_env().writer_threads

    # --- environment ------------------------------------------------------------------------
    def __enter__(self) -> Suite:
        env = {"CKPTD_RUNTIME_DIR": str(self.runtime), "CKPTD_IDLE_EXIT_S": "30"}
        for k, v in env.items():
            self._env_saved[k] = os.environ.get(k)
            os.environ[k] = v
        self.sampler.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sampler.stop()
        for k, v in self._env_saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    # --- jobs -----------------------------------------------------------------------------------
    def spec(self, name: str, ranks: int, parts: list[str], **extra: Any) -> dict[str, Any]:
        a = self.args
        spec = {
            "name": name,
            "dir": str(self.dir / name),
            "phase_file": str(self.phase_file),
            "out_file": str(self.runtime / f"{name}.json"),
            "job_id": f"{self.job_prefix}{name}",
            "log_dir": str(self.runtime),
            "parts": parts,
            "repeats": a.repeats,
            "state_bytes": int(a.state_gib * GIB),
            "tensor_bytes": int(a.tensor_mib * MIB),
            "methods": a.methods,
            "small_methods": [m for m in a.methods if m in ("ckptd", "dcp_async_process")],
            "small_tensors": a.small_tensors,
            "small_bytes": int(a.small_gib * GIB),
            "train_every": a.train_every,
            "train_saves": a.train_saves,
            "train_update": a.train_update,
            "device": a.device,
            "budget": a.budget,
            "soak_bytes": int(a.soak_gib * GIB),
            "soak_saves": a.soak_saves,
            "ref_streams": None,
            "profile_dir": a.profile,
            "dcp_thread_count": dcp_thread_count(self.writer_threads, ranks),
        }
        spec.update(extra)
        Path(spec["dir"]).mkdir(parents=True)
        return spec

    def run_job(self, ranks: int, spec: dict[str, Any], entry: Callable[..., None] | None = None) -> dict[str, Any]:
        """Run ``ranks`` spawned processes of ``entry(rank, ranks, port, spec)`` (default: the
        suite's :func:`.suite_rank.rank_main`) beside the job's daemon; rank 0's JSON results."""
        import torch.multiprocessing as mp

        _log(f"job {spec['name']}: {ranks} ranks, parts {spec.get('parts', '-')}")
        daemon = self._start_daemon(spec)
        ctx = mp.start_processes(
            entry or _rank_entry, args=(ranks, free_port(), spec), nprocs=ranks, start_method="spawn", join=False
        )
        self.sampler.watch(lambda: [p.pid for p in ctx.processes])
        deadline = time.monotonic() + self.args.timeout_s
        try:
            while not ctx.join(0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {spec['name']} ran past --timeout-s {self.args.timeout_s:.0f}")
        except BaseException:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            self._show_daemon_logs()
            raise
        finally:
            self.sampler.watch(lambda: ())
            if daemon is not None:
                daemon.wait()
            self.stop_daemons()
        return json.loads(Path(spec["out_file"]).read_text())

    def _start_daemon(self, spec: dict[str, Any]) -> subprocess.Popen | None:
        """Start the job's node daemon (``ckptd daemon --detach``) while the ranks start, as a
        scheduler would; the ranks' Checkpointers find it (or start it themselves if this lost)."""
        if "ckptd" not in spec["methods"] + spec["small_methods"]:
            return None
        cmd = [
            sys.executable,
            "-m",
            "ckptd.cli",
            "daemon",
            "--detach",
            "--exit-when-idle",
            "--root",
            str(Path(spec["dir"]) / "ckptd"),
            "--job",
            spec["job_id"],
            "--node",
            "0",
            "--nnodes",
            "1",
        ]
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _show_daemon_logs(self) -> None:
        for log in sorted(self.runtime.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-15:]
            _log(f"{log.name} (last lines):\n  " + "\n  ".join(tail))

    # --- cleanup ----------------------------------------------------------------------------------
    def _config(self, job: str) -> Any:
        from ckptd import CkptdConfig

        return CkptdConfig.from_env(job_id=job, runtime_dir=str(self.runtime))

    def stop_daemons(self) -> list[str]:
        """``ckptd daemon stop`` for every daemon of this run; the jobs that did not stop."""
        from ckptd.client.admin import stop_all

        left = []
        for pid_file in sorted(self.runtime.glob("*.pid")):
            job = pid_file.stem.rsplit("-n", 1)[0]
            if stop_all(self.dir, self._config(job), timeout_s=60):
                left.append(job)
        return left

    def shm_left(self) -> list[str]:
        from ckptd.staging.segment import list_segments

        return list_segments(f"ckptd-{self.job_prefix}")

    def cleanup(self) -> dict[str, Any]:
        """Stop daemons, then report and remove whatever is left (nothing, normally)."""
        from ckptd.control.pidfile import daemon_alive

        report: dict[str, Any] = {"daemons_not_stopped": self.stop_daemons()}
        report["processes_left"] = self.sampler.kill_leftovers()
        report["daemons_alive"] = [p.name for p in self.runtime.glob("*.pid") if daemon_alive(p)]
        for pid in daemon_pids(self.runtime):
            if report["daemons_alive"]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        report["shm_left"] = self.shm_left()
        for name in report["shm_left"]:
            Path("/dev/shm", name).unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.runtime, ignore_errors=True)
        report["dir_removed"] = not self.dir.exists()
        report["runtime_removed"] = not self.runtime.exists()
        report["shm_after"] = self.shm_left()
        return report


def _rank_entry(rank: int, world: int, port: int, spec: dict[str, Any]) -> None:
    from .suite_rank import rank_main

    rank_main(rank, world, port, spec)


# --- load ----------------------------------------------------------------------------------------
def load_part(suite: Suite, load_bytes: int, repeats: int) -> dict[str, Any]:
    """ckptd and DCP load of a GPT-like model of about ``load_bytes`` (:mod:`.load`), in this process."""
    from .load import measure_loads, model_spec, write_checkpoint

    hidden = max(64, int((load_bytes / 160) ** 0.5) // 64 * 64)  # ~ (16 + 12 * 2) * hidden^2 floats
    spec = model_spec(hidden, 2, 8 * hidden)
    data = {k: torch.empty(shape).fill_(0.5) for k, (shape, _) in spec.items()}
    total = sum(t.numel() * 4 for t in data.values())
    root = suite.dir / "load"
    for tp in (1, 2):
        write_checkpoint(root / f"tp{tp}", spec, data, tp)
    del data
    cases, best, stats = measure_loads(
        spec, torch.float32, root, total, repeats, reshard_layouts=("tp1", "tp4", "tp2dp2-flat")
    )
    gibps = {name: best[name][0] * 1e9 / GIB for _, name, _, _ in cases}
    shutil.rmtree(root, ignore_errors=True)
    return {
        "bytes": total,
        "hidden": hidden,
        "tensors": len(spec),
        "ckptd_same_layout_gibps": gibps["ckptd same layout (tp2)"],
        "ckptd_reshard_gibps": {k: gibps[f"ckptd reshard -> {k}"] for k in ("tp1", "tp4", "tp2dp2-flat")},
        "dcp_load_gibps": gibps["torch DCP load (-> tp1)"],
        "ckptd_same_layout_tp1_gibps": gibps["ckptd same layout (tp1)"],
        "dcp_same_layout_tp1_gibps": gibps["torch DCP load (tp1)"],
    }


def _machine(directory: Path) -> dict[str, Any]:
    import psutil

    fs = "?"
    best = ""
    real = os.path.realpath(directory)
    for part in psutil.disk_partitions(all=True):
        if (real + "/").startswith(part.mountpoint.rstrip("/") + "/") and len(part.mountpoint) >= len(best):
            best, fs = part.mountpoint, f"{part.fstype} ({part.device} on {part.mountpoint})"
    return {
        "cpus": os.cpu_count(),
        "mem_gib": psutil.virtual_memory().total / GIB,
        "torch": torch.__version__,
        "filesystem": fs,
        "python": sys.version.split()[0],
    }


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    from ckptd import CkptdConfig

    cfg = CkptdConfig.from_env()
    writer_threads = cfg.writer_threads
    res: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k not in ("json",)}}
    with Suite(args) as suite:
        res["machine"] = _machine(suite.dir)
        res["config"]["dir"] = str(suite.dir)
        res["config"]["shm_prefix"] = f"ckptd-{suite.job_prefix}"  # of every segment this run makes
        res["config"]["writer_threads"] = writer_threads
        res["config"]["dcp_thread_count"] = dcp_thread_count(writer_threads, args.ranks)
        try:
            train = args.train_saves and args.device == "cpu"  # the training loop is a CPU loop
            ckptd_parts = ["lazy"] + (["budget"] if args.budget else []) + (["soak"] if args.soak_saves else [])
            parts = (
                ["memcpy", "save"]
                + (ckptd_parts if "ckptd" in args.methods else [])
                + (["train"] if train else [])
                + (["small"] if args.small_tensors else [])
            )
            streams = max(1, min(args.ranks, writer_threads))
            main = suite.run_job(args.ranks, suite.spec("main", args.ranks, parts, ref_streams=streams))
            res["main"] = main
            per_rank = _scale_bytes_per_rank(args, cfg.staging_budget)
            scaling = []
            for n in args.scale_ranks:
                if n == args.ranks and per_rank * n == int(args.state_gib * GIB):
                    point = main
                else:
                    spec = suite.spec(f"scale{n}", n, ["memcpy", "save"], methods=["ckptd"], state_bytes=per_rank * n)
                    point = suite.run_job(n, spec)
                ck = point["save"]["ckptd"]
                scaling.append(
                    {
                        "ranks": n,
                        "bytes_per_rank": point["state_bytes"] // n,
                        "stall_s_median": ck["stall_s_median"],
                        "stall_s_max": ck["stall_s_max"],
                        "durable_s_median": ck["durable_s_median"],
                        "memcpy_s": point["memcpy_s"],
                    }
                )
            res["scaling"] = scaling
            if args.load_gib:
                suite.phase_file.write_text("load")
                _log("load")
                res["load"] = load_part(suite, int(args.load_gib * GIB), max(2, args.repeats))
        finally:
            res["memory"] = suite.sampler.peaks()
            res["cleanup"] = suite.cleanup()
    res["targets"] = evaluate(res)
    return res


def _scale_bytes_per_rank(args: argparse.Namespace, budget: str) -> int:
    """Bytes per rank of the scaling curve: as asked, else the main job's, capped to fit in RAM.

    Each rank holds its state plus its staging ring (the budget) in shared memory; at the
    largest rank count that must stay within 60% of the machine's memory (the rest: the page
    cache, DCP's and the daemon's own memory), or the kernel kills a rank.
    """
    if args.scale_gib_per_rank:
        return int(args.scale_gib_per_rank * GIB)
    want = int(args.state_gib / args.ranks * GIB)
    fraction, node_nbytes = parse_budget(budget)
    ring = fraction if fraction else 1.25  # a bytes budget: assume the default's share
    fit = int(psutil.virtual_memory().total * 0.6 / (max(args.scale_ranks) * (ring + 1)))
    if fit < want:
        _log(
            f"scaling curve: {fit / GIB:.2f} GiB per rank (the main job's {want / GIB:.2f} GiB would "
            f"not fit {max(args.scale_ranks)} ranks in memory; --scale-gib-per-rank sets it)"
        )
    return min(want, fit)


def _ranks_list(text: str) -> list[int]:
    out = sorted({int(x) for x in text.split(",") if x.strip()})
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive rank counts")
    return out


def _methods(text: str) -> list[str]:
    out = [m.strip() for m in text.split(",") if m.strip()]
    bad = set(out) - {"ckptd", *DCP_METHODS}
    if bad or not out:
        raise argparse.ArgumentTypeError(f"choose from ckptd,{','.join(DCP_METHODS)}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ckptd bench all", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=2, help="rank processes of the main job (default 2)")
    p.add_argument("--state-gib", type=float, default=4.0, help="state of the whole job, GiB (default 4)")
    p.add_argument("--tensor-mib", type=float, default=64.0, help="size of one tensor, MiB (default 64)")
    p.add_argument(
        "--small-tensors",
        type=int,
        default=10000,
        help="tensors of the many-small-tensors state, over all ranks (0: skip; default 10000)",
    )
    p.add_argument("--small-gib", type=float, default=1.0, help="bytes of that state, GiB (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed saves per method, after one warm-up (default 3)")
    p.add_argument("--scale-ranks", type=_ranks_list, default=[1, 2, 4], help="rank counts of the scaling curve")
    p.add_argument(
        "--scale-gib-per-rank",
        type=float,
        default=None,
        help="bytes per rank of the scaling curve (default: the main job's, capped to fit in memory)",
    )
    p.add_argument(
        "--load-gib", type=float, default=None, help="model size of the load part (default min(1, state); 0: skip)"
    )
    p.add_argument("--train-every", type=int, default=4, help="training loop: save every K steps (default 4)")
    p.add_argument("--train-saves", type=int, default=3, help="training loop: timed saves (0: skip; default 3)")
    p.add_argument(
        "--train-update",
        type=float,
        default=1.0,
        help="training loop: fraction of the saved state each step rewrites in place, as an "
        "optimizer step does (default 1: all of it; 0: the state is only read)",
    )
    p.add_argument(
        "--budget",
        default="0.25x",
        help="staging budget of the budget part: ckptd saves through a ring this small, each "
        "loaded back and compared (default 0.25x: a quarter of a save; empty: skip)",
    )
    p.add_argument(
        "--soak-saves",
        type=int,
        default=20,
        help="back-to-back ckptd saves of the soak part, memory sampled after each (0: skip)",
    )
    p.add_argument("--soak-gib", type=float, default=0.25, help="state of the soak part, GiB (default 0.25)")
    p.add_argument(
        "--methods",
        type=_methods,
        default=["ckptd", *DCP_METHODS],
        help="save methods to compare (default: ckptd," + ",".join(DCP_METHODS) + ")",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the state lives (cuda: ranks share the visible GPUs round-robin; "
        "ckptd stages by device-to-host DMA into its pinned ring, DCP into pinned "
        "memory; no training loop)",
    )
    p.add_argument("--dir", default=None, help="checkpoint filesystem to test (a temp dir is made inside)")
    p.add_argument("--timeout-s", type=float, default=3600, help="limit per job (default 3600)")
    p.add_argument("--profile", default=None, metavar="DIR", help="write cProfile summaries of rank 0's saves here")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    p.add_argument("--out", default=None, help="also write the JSON results to this file")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.state_gib <= 0 or args.repeats < 1 or args.train_every < 1:
        p.error("--ranks, --state-gib, --repeats and --train-every must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    if args.load_gib is None:
        args.load_gib = min(1.0, args.state_gib)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", module="torch.distributed")
    res = run_suite(args)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(render(res))
    missed = [t for t in res["targets"] if t["ok"] is False]
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
