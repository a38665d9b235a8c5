"""The README's first command: train, get hard-killed, resume, and prove nothing was lost.

Runs ``tools/train_demo.py`` under torchrun three times in a fresh directory:

1. an uninterrupted reference run;
2. the same run, SIGKILLed at ``--kill-at`` (after an asynchronous save returned);
3. ``--resume`` from the last committed checkpoint.

Then it checks that the resumed run's losses equal the reference bit for bit, and exits non-zero
if they do not (or if any step is missing).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEMO = Path(__file__).with_name("train_demo.py")


def torchrun(nproc: int, *args: str) -> int:
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
    print("$", " ".join(cmd[2:]), flush=True)
    return subprocess.run(cmd, check=False).returncode


def losses(path: Path) -> list[tuple[int, str]]:
    """(step, loss as float.hex) per logged line; a resumed run logs re-run steps again."""
    if not path.exists():
        return []
    return [(int(r["step"]), r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


def stop_daemons(root: Path) -> None:
    subprocess.run([sys.executable, "-m", "ckptd.cli", "daemon", "stop", "--root", str(root)], check=False)


def main() -> int:
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
    try:
        print("== 1/3 reference run (uninterrupted)")
        if torchrun(args.nproc, "--ckpt-dir", str(work / "ref"), "--loss-log", str(ref_log), *common):
            print("reference run failed", file=sys.stderr)
            return 1
        print(f"== 2/3 same run, SIGKILLed at step {args.kill_at}")
        rc = torchrun(
            args.nproc,
            "--ckpt-dir",
            str(work / "run"),
            "--loss-log",
            str(run_log),
            "--kill-at",
            str(args.kill_at),
            *common,
        )
        print(f"(killed run exited with code {rc}, as expected)" if rc else "killed run exited 0?!")
        print("== 3/3 resume from the last committed checkpoint")
        if torchrun(args.nproc, "--ckpt-dir", str(work / "run"), "--loss-log", str(run_log), "--resume", *common):
            print("resumed run failed", file=sys.stderr)
            return 1
        ref, run = dict(losses(ref_log)), losses(run_log)
        missing = sorted(set(ref) - {s for s, _ in run})
        differ = sorted({s for s, loss in run if ref.get(s) != loss})
        print(
            f"\nreference steps: {len(ref)}; killed+resumed runs logged {len(run)} steps "
            f"(re-run steps included); missing {missing}; differing {differ}"
        )
        if missing or differ:
            print("FAIL: the resumed run does not reproduce the uninterrupted run", file=sys.stderr)
            return 1
        print(
            f"OK: killed at step {args.kill_at}, resumed from the last committed checkpoint, and "
            f"every loss of steps 1..{args.steps} equals the uninterrupted run bit for bit"
        )
        return 0
    finally:
        stop_daemons(work / "ref")
        stop_daemons(work / "run")
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
