"""The README's first command: train, get hard-killed, resume, and prove nothing was lost.

Runs ``tools/train_demo.py`` under torchrun three times in a fresh directory:

1. an uninterrupted reference run;
2. the same run, SIGKILLed at ``--kill-at`` while the last save before it is still in flight: it
   returned, and the daemon holds it unwritten because its disk stops answering (a hang rule in
   the daemon's fault file, ckptd.daemon.faults) until the job is dead;
3. ``--resume`` from the last committed checkpoint: the disk answers again, the daemon commits
   that save without its trainer, and the resume starts from it.

Then it checks that the resumed run's losses equal the reference bit for bit, and exits non-zero
if they do not (or if any step is missing, or the in-flight save was not the one resumed from).
It prints the story of the three runs; what torchrun and the ranks print (torchrun's report of
the SIGKILL it was asked for included) goes to one log file per run in the work directory, shown
only when a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root (tools.harness)

DEMO = Path(__file__).with_name("train_demo.py")


def torchrun(nproc: int, log: Path, *args: str, env: dict[str, str] | None = None) -> int:
    """Run train_demo.py under torchrun, its output into ``log``; the exit code. ``env``: more
    variables."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        str(DEMO),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    with log.open("w") as out:
        out.write("$ " + " ".join(cmd[2:]) + "\n")
        out.flush()
        return subprocess.run(cmd, check=False, stdout=out, stderr=subprocess.STDOUT, env=full_env).returncode


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(recs: list[dict]) -> list[tuple[int, str]]:
    """(step, loss as float.hex) per trained step; a resumed run logs re-run steps again."""
    return [(r["step"], r["loss"]) for r in recs if "loss" in r]


def event(recs: list[dict], name: str) -> dict | None:
    return next((r for r in reversed(recs) if r.get("event") == name), None)


def stalls_ms(recs: list[dict]) -> str:
    stalls = [1e3 * r["save_stall_s"] for r in recs if r.get("save_stall_s") is not None]
    if not stalls:
        return "no saves"
    return f"{len(stalls)} saves, each stalled training {statistics.median(stalls):.0f} ms (median)"


def failed(what: str, log: Path) -> int:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    # A rank's own traceback tells why (torchrun prefixes it with [rankN]:); torchrun's report of
    # the failed child, which ends the log, does not.
    ranks = [line for line in lines if line.startswith("[rank")]
    shown = ranks[-40:] if ranks else lines[-40:]
    print(f"\nFAIL: {what}. From {log}:\n  " + "\n  ".join(shown), file=sys.stderr)
    return 1


def stop_daemons(root: Path) -> None:
    """Stop the daemons the ranks started for ``root`` (imported here: ``--help`` stays instant)."""
    from tools.harness.daemons import DaemonsDidNotStop, stop_root_daemons

    try:
        stop_root_daemons(root)
    except DaemonsDidNotStop as exc:
        print(f"FAIL: the daemons of {root} did not stop: {exc}; see their logs", file=sys.stderr)


def main() -> int:
    from ckptd.format.rootlayout import step_dir_name

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=None, help="where to put checkpoints and logs (default: a temp dir)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--kill-at", type=int, default=23)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptd-demo-"))
    if work.exists() and any(work.iterdir()):
        print(f"{work} is not empty; pick a new --workdir", file=sys.stderr)
        return 2
    work.mkdir(parents=True, exist_ok=True)
    common = ["--steps", str(args.steps), "--save-every", str(args.save_every)]
    ref_log, run_log = work / "reference.jsonl", work / "run.jsonl"
    logs = [work / f"{i}-{name}.log" for i, name in ((1, "reference"), (2, "killed"), (3, "resumed"))]
    try:
        print(
            f"ckptd demo: {args.nproc} ranks train a small Transformer language model (FSDP2, AdamW) for "
            f"{args.steps} steps, saving asynchronously through the ckptd daemon every {args.save_every} "
            f"steps. Work directory: {work}"
        )
        print("\n1/3 The reference run, uninterrupted ...", flush=True)
        if torchrun(args.nproc, logs[0], "--ckpt-dir", str(work / "ref"), "--loss-log", str(ref_log), *common):
            return failed("the reference run failed", logs[0])
        ref = records(ref_log)
        start = event(ref, "start") or {}
        print(
            f"    {start.get('params', '?'):,} parameters on {start.get('device', '?')}; trained steps "
            f"1..{args.steps}; {stalls_ms(ref)}"
        )

        held = args.kill_at // args.save_every * args.save_every  # the last save before the kill
        if held < args.save_every:
            print(f"--kill-at {args.kill_at} comes before the first save (step {args.save_every})", file=sys.stderr)
            return 2
        faults = work / "disk-faults"  # the daemon reads it at every open (ckptd.daemon.faults)
        print(
            f"\n2/3 The same run, killed with SIGKILL at step {args.kill_at} (on purpose) while the save of "
            f"step {held} is still in flight (the daemon's disk is made to stop answering until the kill) ...",
            flush=True,
        )
        rc = torchrun(
            args.nproc, logs[1], "--ckpt-dir", str(work / "run"), "--loss-log", str(run_log), "--kill-at",
            str(args.kill_at), "--hold-writes-at", str(held), *common, env={"CKPTD_DEBUG_FAULT_FILE": str(faults)},
        )  # fmt: skip
        killed = event(records(run_log), "killed")
        if rc == 0 or killed is None:
            return failed(f"the run was to be killed at step {args.kill_at}, but it exited with {rc}", logs[1])
        if held not in killed["in_flight"] or (work / "run" / step_dir_name(held)).exists():
            return failed(f"the save of step {held} was to be in flight at the kill, but it was not", logs[1])
        kept = args.keep or args.workdir
        print(
            f"    killed at step {killed['step']} as intended (torchrun reports the SIGKILL as a failure: "
            f"{logs[1] if kept else 'see it with --keep'}); the save of step {held} had returned but was not "
            "committed yet"
        )
        faults.unlink()  # the disk answers again; the daemon writes the save its trainer left

        print("\n3/3 Resume from the last committed checkpoint ...", flush=True)
        before = len(records(run_log))
        if torchrun(
            args.nproc, logs[2], "--ckpt-dir", str(work / "run"), "--loss-log", str(run_log), "--resume", *common
        ):
            return failed("the resumed run failed", logs[2])
        resumed = records(run_log)[before:]
        frm = (event(resumed, "start") or {}).get("resumed_from")
        if frm != held:
            return failed(f"the resume was to start from step {held}, but it started from {frm}", logs[2])
        print(
            f"    resumed from step {frm}, which the daemon committed after its trainer was killed, and "
            f"trained steps {frm + 1}..{args.steps}"
        )

        ref_losses, run_losses = dict(losses(ref)), losses(records(run_log))
        missing = sorted(set(ref_losses) - {s for s, _ in run_losses})
        differ = sorted({s for s, loss in run_losses if ref_losses.get(s) != loss})
        print(
            f"\nreference steps: {len(ref_losses)}; killed+resumed runs logged {len(run_losses)} steps "
            f"(re-run steps included); missing {missing}; differing {differ}"
        )
        if missing or differ:
            print("FAIL: the resumed run does not reproduce the uninterrupted run", file=sys.stderr)
            return 1
        print(
            f"OK: killed at step {args.kill_at}, resumed from the last committed checkpoint (step {frm}), and "
            f"every loss of steps 1..{args.steps} equals the uninterrupted run bit for bit"
        )
        return 0
    finally:
        # A failed or interrupted run 2 leaves the hang rule: the daemon's writes would hang its stop.
        (work / "disk-faults").unlink(missing_ok=True)
        stop_daemons(work / "ref")
        stop_daemons(work / "run")
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
