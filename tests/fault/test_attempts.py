"""Attempts and replays across nodes: 2 simulated nodes x 1 rank, real daemons, real sockets, real files.

- A step aborted because one node was slow is saved again at once and commits with the retry's
  data, while the slow node's late write of the aborted attempt lands during that commit: it goes
  to its own attempt's directory and is discarded, never mixed into the committed checkpoint.
- A node's session to the coordinator, captured on the wire by a TCP relay and re-sent on a new
  connection while a step collects, is refused (a CurveZMQ session cannot be replayed) and counted;
  the step commits with every rank's file. (With an HMAC over each message, the replayed WRITTEN
  was accepted again and aborted the step.)

The decision rules alone (a late report of a decided attempt, ranks that disagree on the attempt,
commit timeouts) are tested event by event in tests/unit/test_commit_state.py; a disagreement
under real daemons is in tests/fault/test_commit_integrity.py.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ckptd
from ckptd import ShardedTensor
from ckptd.client import admin
from tests.fault.single_job import tmp_leftovers
from tools.harness.ports import free_port
from tools.harness.ranks import run_ranks
from tools.harness.waiting import wait_until


def _sd(rank: int, step: int, value: float | None = None) -> dict:
    w = torch.full((4, 8), float(step * 10 + rank) if value is None else value)
    return {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, 2)), "iteration": step}


def _check(ckpt: ckptd.Checkpointer, rank: int, step: int) -> None:
    out = ckpt.load(_sd(rank, -1, 0.0), step=step)
    assert torch.equal(out["w"], torch.full((4, 8), float(step * 10 + rank))) and out["iteration"] == step


def _failure(h: ckptd.SaveHandle, timeout_s: float) -> str:
    with pytest.raises(ckptd.SaveFailedError) as err:
        h.wait(timeout_s=timeout_s)
    return str(err.value)


def _node_env(rank: int, env: dict[str, str], faults: str) -> Path:
    os.environ.update(env)
    os.environ.update(
        LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), CKPTD_DEBUG_FAULT_FILE=f"{faults}/node{rank}"
    )
    return Path(faults) / f"node{rank}"


def _env(runtime: Path, **extra: str) -> dict[str, str]:
    return {
        "CKPTD_RUNTIME_DIR": str(runtime),
        "CKPTD_COORDINATOR_PORT": str(free_port()),
        "CKPTD_HEARTBEAT_S": "0.1",
        "CKPTD_IDLE_EXIT_S": "60",
        **extra,
    }


# --- a retry right after an abort, with the aborted attempt's write landing late ----------------
# Node 1's writes of one ring run in order, so its write of attempt 2 waits for the late write of
# attempt 1: attempt 1 aborts at ~COMMIT_TIMEOUT_S, attempt 2 is saved at once, node 1's late write
# lands SLOW_S - COMMIT_TIMEOUT_S (2 s) after that while attempt 2 collects, node 1 writes attempt 2
# right after it and node 0 COMMIT_DELAY_S (3 s) after the save: at least 2 s within its commit
# timeout either way (8 s of a late write against 4 s left 0.1-0.3 s: it failed under load).
COMMIT_TIMEOUT_S = 5.0
SLOW_S = 7.0  # node 1's first write of step 2: longer than the commit timeout
COMMIT_DELAY_S = 3.0  # node 0's files while step 2 is saved again: its commit spans the late write


def _retry_after_abort(rank: int, world: int, env: dict[str, str], root: str, faults: str) -> dict:
    fault = _node_env(rank, env, faults)
    ckpt = ckptd.Checkpointer(root)
    try:
        ckpt.save(_sd(rank, 1), step=1).wait(timeout_s=60)
        if rank == 1:
            fault.write_text(f"delay {SLOW_S}\n")
        dist.barrier()
        first = ckpt.save(_sd(rank, 2, value=-1.0), step=2)  # attempt 1, with other values
        reason = _failure(first, 30)
        dist.barrier()
        if rank == 1:
            fault.unlink()
        else:
            fault.write_text(f"delay {COMMIT_DELAY_S}\n")
        dist.barrier()
        second = ckpt.save(_sd(rank, 2), step=2)  # at once: no pause after the abort
        assert second.wait(timeout_s=60) == Path(root) / "iter_0000002"
        dist.barrier()
        fault.unlink(missing_ok=True)
        _check(ckpt, rank, 2)
        return {"reason": reason, "attempts": [first.attempt, second.attempt]}
    finally:
        ckpt.close(wait=False)


@pytest.mark.timeout(180)
def test_a_step_saved_again_after_its_abort_never_takes_the_late_write_of_the_aborted_attempt(tmp_path, runtime_dir):
    root = tmp_path / "ckpts"
    env = _env(runtime_dir, CKPTD_COMMIT_TIMEOUT_S=str(COMMIT_TIMEOUT_S), CKPTD_COORDINATOR_TIMEOUT_S="30")
    out = run_ranks(_retry_after_abort, 2, env, str(root), str(tmp_path), timeout_s=150)
    # The slow write of attempt 1 ends after all that (its directory is gone: it fails, or it
    # re-creates it and is reported late); either way it is discarded.
    cfg = ckptd.CkptdConfig.from_env(env)
    wait_until(
        lambda: all(not admin.daemon_status(d, cfg)["jobs_in_flight"] for d in admin.local_daemons(root, cfg)),
        30,
        "the late write to end",
    )
    wait_until(lambda: not tmp_leftovers(root), 20, f"{tmp_leftovers(root)} to be removed")
    for o in out:
        # Whichever clock ends first: the coordinator's, or node 1's for its rank's unfinished write.
        slow = r"ranks \[1\] did not report|rank 1 \(node 1\): its data file \S+ was not written"
        assert re.search(slow, o["reason"]), o["reason"]
        first, second = o["attempts"]
        assert first.endswith("-1") and second.endswith("-2") and first[:12] == second[:12]
    plain = ckptd.load_plain_tensors(root / "iter_0000002")["w"]
    assert torch.equal(plain, torch.cat([torch.full((4, 8), 20.0), torch.full((4, 8), 21.0)]))


# --- a captured session replayed to the coordinator ---------------------------------------------------
class CaptureRelay:
    """A TCP relay in front of the coordinator's port; what its first client sends is appended to
    ``capture`` as it passes (what anyone on the network path could record)."""

    def __init__(self, target_port: int, capture: Path) -> None:
        self.target_port = target_port
        self.capture = capture
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # the coordinator is not up yet: the node daemon connects again
                client.close()
                continue
            self.sockets += [client, upstream]
            record = self.connections == 0
            self.connections += 1
            threading.Thread(target=self._pump, args=(client, upstream, record), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    with open(self.capture, "ab") as f:
                        f.write(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        for s in self.sockets:
            s.close()


ZMTP_GREETING_NBYTES = 64


def _step_written_by(ckpt: ckptd.Checkpointer, step: int, ranks: list[int]) -> bool:
    steps = ckpt.status()["coordinator"]["steps"]
    return any(str(k).split("/")[0] == str(step) and v["written"] == ranks for k, v in steps.items())


def _replay(rank: int, world: int, env: dict[str, str], root: str, faults: str, capture: str, relay_port: int) -> dict:
    fault = _node_env(rank, env, faults)
    coordinator_port = int(os.environ["CKPTD_COORDINATOR_PORT"])
    if rank == 1:
        os.environ["CKPTD_COORDINATOR_PORT"] = str(relay_port)  # node 1 reaches the coordinator via the relay
    ckpt = ckptd.Checkpointer(root)
    out: dict = {}
    try:
        ckpt.save(_sd(rank, 1), step=1).wait(timeout_s=60)
        if rank == 0:
            fault.write_text("delay 4\n")  # node 0 writes step 2 late: the step collects meanwhile
        dist.barrier()
        h = ckpt.save(_sd(rank, 2), step=2)
        if rank == 0:
            wait_until(lambda: _step_written_by(ckpt, 2, [1]), 20, "rank 1's WRITTEN of step 2")
            before = ckpt.status()["coordinator"]["rejected_messages"]
            # Node 1's session from its first byte. An attacker rewrites what is not authenticated:
            # under an HMAC of message bodies that included the routing id in the handshake (the
            # coordinator's ROUTER drops a second connection with the id of a connected node).
            # Under CurveZMQ everything after the greeting is ciphertext: there is nothing to edit.
            replayed = Path(capture).read_bytes().replace(b"node1-", b"nodeX-")
            with socket.create_connection(("127.0.0.1", coordinator_port), timeout=10) as raw:
                raw.sendall(replayed[:ZMTP_GREETING_NBYTES])  # libzmq takes the greeting on its own
                greeting = b""
                while len(greeting) < ZMTP_GREETING_NBYTES:
                    greeting += raw.recv(ZMTP_GREETING_NBYTES - len(greeting)) or b"?" * ZMTP_GREETING_NBYTES
                raw.sendall(replayed[ZMTP_GREETING_NBYTES:])
                wait_until(
                    lambda: ckpt.status()["coordinator"]["rejected_messages"] > before or h.done(),
                    20,
                    "the coordinator to deal with the replayed session",
                )
            out["rejected"] = ckpt.status()["coordinator"]["rejected_messages"] - before
            fault.unlink()
        assert h.wait(timeout_s=60) == Path(root) / "iter_0000002"
        _check(ckpt, rank, 2)
        return out
    finally:
        ckpt.close(wait=False)


@pytest.mark.timeout(120)
def test_a_captured_session_replayed_to_the_coordinator_is_refused_and_the_step_commits(tmp_path, runtime_dir):
    root = tmp_path / "ckpts"
    env = _env(runtime_dir, CKPTD_COMMIT_TIMEOUT_S="30", CKPTD_COORDINATOR_TIMEOUT_S="30")
    capture = tmp_path / "node1-session.bin"
    relay = CaptureRelay(int(env["CKPTD_COORDINATOR_PORT"]), capture)
    try:
        out = run_ranks(_replay, 2, env, str(root), str(tmp_path), str(capture), relay.port, timeout_s=100)
    finally:
        relay.close()
    assert out[0]["rejected"] >= 1
    assert capture.stat().st_size > 0 and b"__1_0.distcp" not in capture.read_bytes()  # ciphertext only
    plain = ckptd.load_plain_tensors(root / "iter_0000002")["w"]
    assert torch.equal(plain, torch.cat([torch.full((4, 8), 20.0), torch.full((4, 8), 21.0)]))
