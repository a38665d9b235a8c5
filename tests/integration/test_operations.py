"""Operating a live daemon: per-save stats, `ckptd status` (text, JSON, Prometheus), the metrics
endpoint, `ckptd daemon stop`, and policy="auto". Real daemon, real sockets, real files.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.request

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.client import admin
from ckptd.client.handle import SaveFuture
from ckptd.control.endpoints import JobEnv
from ckptd.control.protocol import Pong, Status, StatusReply
from ckptd.errors import DaemonError, DaemonLostError, RequestNotTaken
from ckptd.tune import recommend
from tests.cli import ckptd_cli
from tools.harness.ports import free_port


@pytest.mark.timeout(120)
def test_stats_status_metrics_and_stop(single):
    root, runtime, env = single
    port = free_port()
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, metrics_port=port)
    w = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
    with ckptd.Checkpointer(root, config=cfg, env=JobEnv()) as ckpt:
        for step in (1, 2, 3):
            h = ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, step=step)
            h.wait(60)
        stats = ckpt.stats()
        assert (stats["saves"], stats["committed"], stats["aborted"], stats["pending"]) == (3, 3, 0, 0)
        assert stats["staged_nbytes"] == 3 * w.nbytes
        for rec in stats["recent"]:
            assert rec["status"] == "committed" and rec["nbytes"] == w.nbytes
            assert rec["stall_s"] > 0 and 0 <= rec["queue_wait_s"] <= rec["stall_s"]
            # Where the stall went: parts of it, each measured (planning and the daemon's round trip
            # take time at every save).
            parts = [rec[k] for k in ("queue_wait_s", "plan_s", "copy_s", "handoff_s")]
            assert rec["plan_s"] > 0 and rec["handoff_s"] > 0 and rec["copy_s"] >= 0
            assert sum(parts) <= rec["stall_s"]
            # The daemon starts writing before save() returns, so persist may exceed the latency.
            assert rec["persist_s"] > 0 and rec["commit_latency_s"] > 0
        assert stats["stall_s"]["max"] == max(r["stall_s"] for r in stats["recent"])

        run = ckptd_cli(env, "status", str(root), "--json")
        assert run.returncode == 0, run.stderr
        (info,) = json.loads(run.stdout)["daemons"]
        m = info["metrics"]
        assert info["clients"] == [{"rank": 0, "pid": os.getpid()}]
        assert (m["saves_received"], m["writes_ok"], m["steps_committed"]) == (3, 3, 3)
        assert m["bytes_written"] == 3 * w.nbytes and m["last_committed"]["step"] == 3
        assert [s["outcome"] for s in m["recent_steps"]] == ["committed"] * 3
        # Memory, sampled every heartbeat: the ring holds at most the default budget (1.25 x the
        # first save) in /dev/shm; the trainer's RSS includes at least the state it trains.
        mem = info["memory"]
        assert 0 < mem["staging_shm"]["peak"] <= 1.25 * w.nbytes + 4096  # + the ring's header page
        assert mem["daemon_rss"]["peak"] >= mem["daemon_rss"]["current"] > 0
        assert mem["dev_shm"]["peak"] >= mem["staging_shm"]["peak"]
        (me,) = mem["ranks_rss"]
        assert (me["rank"], me["pid"]) == (0, os.getpid()) and me["peak"] >= me["current"] > w.nbytes

        run = ckptd_cli(env, "status", str(root))
        assert run.returncode == 0 and "saves received 3, committed 3" in run.stdout
        # Where its log is (README: Troubleshooting), the job id in the file's name.
        log = os.path.join(runtime, f"{info['job']}-n0.log")
        assert f"of job {info['job']}" in run.stdout and f"  log: {log}\n" in run.stdout, run.stdout
        assert os.path.isfile(log) and info["log"] == log
        assert "memory: daemon RSS" in run.stdout and "rank 0 " in run.stdout, run.stdout
        # The daemon refuses what it does not serve: its ERROR reaches the caller at once (the
        # wait allowed is far beyond this test's timeout), with the daemon's reason.
        (d,) = admin.local_daemons(root, cfg)
        with pytest.raises(RequestNotTaken, match=f"the daemon of {root} node 0 refused PONG: .*does not accept PONG"):
            admin.request(d.endpoints, cfg, Pong(nonce=1, instance="x", pid=1), StatusReply, timeout_s=600)
        run = ckptd_cli(env, "status", str(root), "--prometheus")
        assert run.returncode == 0 and "ckptd_steps_committed_total{" in run.stdout
        served = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        samples = dict(line.rsplit(" ", 1) for line in served.splitlines() if not line.startswith("#"))
        key = next(k for k in samples if k.startswith("ckptd_written_bytes_total"))
        assert float(samples[key]) == 3 * w.nbytes
        assert served.count("# TYPE ckptd_writes_total counter") == 1
        assert float(samples[next(k for k in samples if k.startswith("ckptd_staging_shm_peak_bytes"))]) > 0

    run = ckptd_cli(env, "daemon", "stop", "--root", str(root))
    assert run.returncode == 0 and "stopped the daemon of node 0" in run.stdout
    run = ckptd_cli(env, "status", str(root))
    assert run.returncode == 1 and "no ckptd daemon" in run.stdout
    with pytest.raises(DaemonLostError, match=f"the daemon of {root} node 0 is not running"):
        admin.request(d.endpoints, cfg, Status(), StatusReply, timeout_s=600)  # no wait for a dead one
    job = info["job"]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ckptd-{job}-")]
    assert ckptd_cli(env, "daemon", "stop", "--root", str(root)).returncode == 0  # nothing to stop
    # A node the job cannot have is a usage error, not a daemon that fails later (a traceback in its log).
    for node, nnodes in (("3", "1"), ("0", "0"), ("-1", "2")):
        run = ckptd_cli(env, "daemon", "--root", str(root), "--node", node, "--nnodes", nnodes)
        assert run.returncode == 2 and f"--node {node} --nnodes {nnodes}: give at least 1 node" in run.stderr


@pytest.mark.timeout(120)
def test_stop_and_status_name_the_daemon_of_a_job_launched_with_its_own_job_id(single):
    """A job launched with CKPTD_JOB_ID: a shell without it derives another job id from the root.
    `ckptd daemon stop` said no daemon runs (exit 0) and left it running; both commands now name it
    and say what to run."""
    root, runtime, env = single
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, job_id="trainjob7")
    w = torch.arange(1024, dtype=torch.float32)
    with ckptd.Checkpointer(root, config=cfg, env=JobEnv()) as ckpt:
        ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, step=1).wait(60)
    # The daemon outlives the Checkpointer (it exits when idle).
    advice = f"CKPTD_RUNTIME_DIR={runtime} ckptd daemon stop --root {root} --job trainjob7"
    run = ckptd_cli(env, "daemon", "stop", "--root", str(root))
    assert run.returncode == 1 and "node 0 (pid " in run.stderr and advice in run.stderr, run.stderr
    run = ckptd_cli(env, "status", str(root), "--json")
    assert run.returncode == 1 and f"ckptd status {root} --job trainjob7" in json.loads(run.stdout)["advice"]
    assert admin.local_daemons(root, cfg)  # still running: nothing was stopped
    run = ckptd_cli({**env, "CKPTD_JOB_ID": "trainjob7"}, "daemon", "stop", "--root", str(root))
    assert run.returncode == 0 and "stopped the daemon of node 0" in run.stdout, run.stderr
    # Gone: the lock's record of it names a daemon no longer alive.
    run = ckptd_cli(env, "daemon", "stop", "--root", str(root))
    assert run.returncode == 0 and "no ckptd daemon" in run.stdout


@pytest.mark.timeout(120)
def test_policy_auto_agrees_on_the_interval_whatever_the_save_did(single, monkeypatch):
    """policy="auto": every rank joins the interval's agreement (a collective) after every save,
    also one whose save raised or was skipped; before, such a rank left the others in it and
    the ranks' next collectives mismatched. The first save's outcome is waited for once inside
    save(), but a save that did not commit in that wait no longer raises from save() (its handle
    does), and the time waited bounds the commit latency from below."""
    root, runtime, _ = single
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, policy="auto", mtbf_s=6.0, restart_s=0.5)
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(16))}
    with ckptd.Checkpointer(root, config=cfg, env=JobEnv()) as ckpt:
        agreed: list[int] = []
        ckpt._policy.agree = lambda interval: agreed.append(interval) or interval
        with pytest.raises(ckptd.CkptdError, match="must be a dict"):
            ckpt.save(["not a dict"], step=0)  # type: ignore[arg-type]
        assert agreed == [1] and ckpt._policy.persist_floor_s is None
        with monkeypatch.context() as patched:
            patched.setattr(SaveFuture, "wait", lambda self, timeout_s: time.sleep(0.2))  # the wait ran out
            h = ckpt.save(state, step=0)
        assert agreed == [1, 1] and ckpt._policy.persist_floor_s >= 0.2
        assert h.wait(60) == root / "iter_0000000"
        ckpt.save(state, step=1).wait(60)  # no second wait inside save(): the floor is set
        assert len(agreed) == 3
        ckpt._policy.persist_floor_s = None  # as if no save had been measured yet ...
        ckpt._stats.committed = 0

        def copy_timed_out(self, timeout_s):  # ... and its wait raised (a lazy copy that timed out)
            raise ckptd.CkptdError("the snapshot of step 2 did not finish (simulated)")

        with monkeypatch.context() as patched, pytest.raises(ckptd.CkptdError, match="simulated"):
            patched.setattr(SaveFuture, "wait", copy_timed_out)
            ckpt.save(state, step=2)
        assert len(agreed) == 4 and ckpt._policy.persist_floor_s is not None
        ckpt.wait_all(60)


@pytest.mark.timeout(120)
def test_policy_auto_applies_the_young_daly_interval(single):
    root, runtime, _ = single
    mtbf_s = 6.0
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, policy="auto", mtbf_s=mtbf_s, restart_s=0.5)
    w = torch.ones(1 << 16)
    saved: list[tuple[int, int]] = []  # (step, interval in effect after it)
    with ckptd.Checkpointer(root, config=cfg, env=JobEnv()) as ckpt:
        for step in range(80):
            time.sleep(0.01)  # the "training step" whose time the policy measures: under test, not a wait
            if ckpt.due(step):
                ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, step=step)
                saved.append((step, ckpt._policy.interval_steps))
        ckpt.wait_all(60)
        policy = ckpt._policy
    # The first call saves and is waited for; with no step time yet the next step saves too.
    assert saved[:2] == [(0, 1), (1, saved[1][1])] and len(saved) >= 3
    # Every later save happens exactly when the interval chosen at the previous save says.
    for (a, interval), (b, _) in zip(saved, saved[1:]):
        assert b == a + interval
    inp, rec = policy.inputs, policy.recommendation
    assert (inp.mtbf_s, inp.restart_s) == (mtbf_s, 0.5) and 0.009 < inp.step_s < 0.2
    assert rec == recommend(inp) and rec.interval_steps == saved[-1][1]
    # Young's formula on the measured stall, never below the commit latency.
    assert rec.young_s == pytest.approx(math.sqrt(2 * inp.stall_s * mtbf_s))
    assert rec.interval_s >= inp.persist_s and rec.interval_steps == math.ceil(
        max(rec.daly_s, inp.persist_s) / inp.step_s
    )


@pytest.mark.timeout(120)
def test_policy_auto_saves_an_interval_after_the_step_a_rollback_went_back_to(single):
    """Saved every 7 steps up to 40, went back to 14 (a loss spike) and trained on: due() kept
    the branch it left's next save step, 42, so 28 steps went unsaved; it is 21 now."""
    root, runtime, _ = single
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, policy="auto", mtbf_s=6.0, restart_s=0.5)

    def state(step: int) -> dict:
        return {"w": ShardedTensor.from_rank_offsets("w", torch.full((16,), float(step)))}

    with ckptd.Checkpointer(root, config=cfg, env=JobEnv()) as ckpt:
        ckpt._policy.agree = lambda interval: 7  # the interval the ranks agree on, fixed for the test

        def train(start: int, stop: int) -> list[int]:
            saved = []
            for step in range(start, stop):
                if ckpt.due(step):
                    ckpt.save(state(step), step=step).wait(60)
                    saved.append(step)
            return saved

        assert train(0, 41) == [0, 7, 14, 21, 28, 35]
        w = state(-1)
        ckpt.load(w, step=14)
        assert float(w["w"].data[0]) == 14.0
        assert train(15, 30) == [21, 28]  # replacing the left 21 and 28 (README: Going back)


def test_due_needs_policy_auto(single):
    root, runtime, _ = single
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime)
    with (
        ckptd.Checkpointer(root, config=cfg, env=JobEnv()) as ckpt,
        pytest.raises(ckptd.CkptdError, match="policy='auto'"),
    ):
        ckpt.due(0)
    with pytest.raises(ckptd.CkptdError, match="mtbf_s"):
        ckptd.Checkpointer(root, config=cfg.replace(policy="auto"), env=JobEnv())


_HOLD_RANK_0 = """
import sys, torch, ckptd
with ckptd.Checkpointer(sys.argv[1]) as ckpt:
    print("ready", flush=True)
    for line in sys.stdin:  # "save <step>" saves and prints where it committed; end of input: exit
        step = int(line.split()[1])
        state = {"w": ckptd.ShardedTensor.from_rank_offsets("w", torch.full((8,), float(step)))}
        print(ckpt.save(state, step=step).wait(60), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_second_launch_on_the_same_machine_cannot_save_while_the_first_runs(single):
    """The same job launched twice on one machine reaches one daemon (the job id is the root's),
    where the root's lock cannot tell the launches apart: its commits would roll back and remove
    the first launch's checkpoints. Every request that saves (a staging ring, a save, a skip) of
    a rank another running process saves as is refused, and the refused save is not announced to
    the other ranks (its abort of the step aborted the first launch's save of it). A process of
    that rank that only loads (an evaluation), with a byte budget too (its ring made before the
    trainer's first save), is not refused, nor does it hold the rank. Once the other process is
    gone the rank saves."""
    import subprocess
    import sys

    root, runtime, env = single
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime)
    first = subprocess.Popen(
        [sys.executable, "-c", _HOLD_RANK_0, str(root)],
        env={**env, "PYTHONPATH": os.getcwd()},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert first.stdin is not None and first.stdout is not None

    def first_saves(step: int) -> str:
        first.stdin.write(f"save {step}\n")
        first.stdin.flush()
        return first.stdout.readline().strip()

    state = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}
    try:
        assert first.stdout.readline() == "ready\n"
        with ckptd.Checkpointer(root, config=cfg.replace(staging_budget="1MiB"), env=JobEnv()) as second:
            assert first_saves(1).endswith("iter_0000001")  # second's ring holds the rank for nobody
            second.load(state)  # loading is fine
            assert torch.equal(state["w"].data, torch.ones(8))
            with pytest.raises(DaemonError, match=rf"is saved by another process that still runs \(pid {first.pid}\)"):
                second.save(state, step=2)
            assert first_saves(2).endswith("iter_0000002")  # not aborted by the refused save of step 2
    finally:
        first.stdin.close()
        first.wait(60)
    assert first.returncode == 0
    with ckptd.Checkpointer(root, config=cfg, env=JobEnv()) as ckpt:
        ckpt.save(state, step=3).wait(60)


@pytest.mark.timeout(120)
def test_status_says_a_foreground_daemon_logs_to_its_stderr(single):
    """`ckptd status` named the log file of every daemon, which only a detached daemon writes: a
    daemon started in the foreground (under Slurm or systemd) logs to its stderr, and says so."""
    import subprocess
    import sys

    from tests.cli import REPO
    from tools.harness.waiting import wait_until

    root, runtime, env = single
    root.mkdir()
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime)
    with open(os.path.join(runtime, "foreground.err"), "w") as err:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "ckptd.cli", "daemon", "--root", str(root)], env=env, cwd=REPO, stderr=err
        )
    try:
        wait_until(lambda: admin.local_daemons(root, cfg), 60, "the foreground daemon to serve")
        run = ckptd_cli(env, "status", str(root))
        assert run.returncode == 0 and "  log: its stderr (started in the foreground)\n" in run.stdout, run.stdout
    finally:
        assert ckptd_cli(env, "daemon", "stop", "--root", str(root)).returncode == 0
        daemon.wait(timeout=60)
