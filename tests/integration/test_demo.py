"""The README's first command, shortened: an FSDP2 model with AdamW trains under torchrun, is
SIGKILLed mid-run, resumes, and every loss equals the uninterrupted run bit for bit
(tools/run_demo.py checks and exits 1 if not). Then the 2-rank checkpoint resumes at world size 1,
loaded once by ckptd and once by torch DCP's own ``dcp.load``: the next steps' losses are equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.harness.ports import free_port
from tools.harness.ranks import rank_env, spawned

REPO = Path(__file__).resolve().parents[2]


def _train_demo(argv: list[str], env: dict[str, str]) -> None:
    """``tools/train_demo.py ARGV`` as a rank of a torchrun job would run it, in ``env``."""
    os.environ.update(env)
    sys.argv = [str(REPO / "tools" / "train_demo.py"), *argv]
    from tools.train_demo import main

    main()


@pytest.mark.timeout(300)
def test_demo_killed_and_resumed_matches_uninterrupted_run(tmp_path, runtime_dir):
    runtime = str(runtime_dir)
    env = {**os.environ, "CKPTD_RUNTIME_DIR": runtime}
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "run_demo.py"),
            "--workdir",
            str(tmp_path / "demo"),
            "--steps",
            "12",
            "--save-every",
            "3",
            "--kill-at",
            "8",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "OK: killed at step 8" in run.stdout
    assert "missing []; differing []" in run.stdout
    # The story, not torchrun's report of the kill it was asked for, nor warnings nobody can act on.
    assert "killed at step 8 as intended" in run.stdout and "resumed from step 6" in run.stdout
    # The save of step 6 returned before the kill and committed only after it, without its trainer.
    assert "the save of step 6 had returned but was not committed yet" in run.stdout
    assert "resumed from step 6, which the daemon committed after its trainer was killed" in run.stdout
    for noise in ("Traceback", "ChildFailedError", "Warning", "WARNING", "OMP_NUM_THREADS"):
        assert noise not in run.stdout + run.stderr, (noise, run.stdout, run.stderr)
    # The killed run's daemon committed step 6; the resumed run re-ran 7..12 from it.
    assert (tmp_path / "demo" / "run" / "iter_0000012").is_dir()
    jobs = [p.stem for p in Path(runtime).glob("*.token")]  # one per checkpoint root the demo used
    assert len(jobs) == 2
    assert not [n for n in os.listdir("/dev/shm") if any(n.startswith(f"ckptd-{j}-") for j in jobs)]
    assert not list(Path(runtime).glob("*.pid"))  # run_demo stopped both daemons

    root = tmp_path / "demo" / "run"

    def resume_at_one_rank(loader: str) -> list[dict]:
        log = tmp_path / f"one-{loader}.jsonl"
        argv = ["--ckpt-dir", str(root), "--steps", "14", "--save-every", "100", "--resume"]
        argv += ["--loader", loader, "--loss-log", str(log)]
        # torchrun's variables for one rank, in a preloaded process: torchrun itself and a fresh
        # interpreter's imports would double the time of this half of the test.
        env = {"CKPTD_RUNTIME_DIR": runtime, **rank_env(0, 1, free_port())}
        with spawned([(_train_demo, (argv, env))], join_timeout_s=120) as procs:
            procs[0].join(timeout=120)
        assert procs[0].exitcode == 0 and not procs.killed, (loader, procs[0].exitcode)
        return [r for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]

    by_ckptd, by_dcp = resume_at_one_rank("ckptd"), resume_at_one_rank("dcp")
    assert [(r["step"], r["world"]) for r in by_ckptd] == [(13, 1), (14, 1)]
    assert by_ckptd == by_dcp  # bit for bit: ckptd restored what torch's own loader restores
