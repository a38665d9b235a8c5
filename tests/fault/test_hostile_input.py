"""Guarantee 5 against a live daemon: strangers cannot talk to it, and the job's own peers cannot
make it misbehave.

- Without the job token's CurveZMQ keys nobody completes a handshake, on the ranks' ``ipc://``
  socket or on the coordinator's ``tcp://`` port: a perfectly valid plaintext message, a foreign
  client key, a wrong server key, bytes that are not ZeroMQ, an oversized handshake frame. Each is
  refused and counted (``ckptd status``, ``ckptd_rejected_messages_total``).
- From an authenticated connection: malformed, truncated, oversized, wrong-version, foreign-job,
  pickled messages, out-of-range steps and attempt ids are rejected and logged; a HELLO must name
  the connecting process; a connection saves only from its own rings and waits only on its own
  snapshot child.
- Sockets, the runtime directory and shared memory are owner-only.
The daemon keeps serving a real Checkpointer throughout.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zmq

import ckptd
from ckptd.client import admin
from ckptd.control.codec import Codec
from ckptd.control.endpoints import load_token
from ckptd.control.keys import CurveKeys, derive_keys
from ckptd.control.protocol import (
    PROTOCOL_VERSION,
    Abandon,
    Bye,
    ErrorReply,
    Hello,
    LayoutOk,
    MsgType,
    Ping,
    Pong,
    RegisterLayout,
    RegisterRing,
    RingOk,
    SaveItem,
    Status,
    StatusReply,
    Welcome,
)
from ckptd.control.security import make_client_secure
from ckptd.daemon.metrics import prometheus_text
from ckptd.daemon.snapshot import boottime_s
from ckptd.format.records import BYTES, ItemRecord
from ckptd.staging.rankside import StagingRing
from ckptd.staging.ring import block_offset
from ckptd.staging.segment import SHM_DIR, list_segments
from tests.fault.single_job import single_job
from tests.messages import ATTEMPT, a_save
from tools.harness.waiting import wait_until

LIMIT = 256 << 10  # the daemon's message size limit in this module


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with (
        pytest.MonkeyPatch.context() as mp,
        single_job(tmp_path_factory.mktemp("hostile"), mp, max_message_nbytes=LIMIT) as j,
    ):
        j.committed(1)
        yield j


def _random_keys() -> CurveKeys:
    spub, ssec = zmq.curve_keypair()
    cpub, csec = zmq.curve_keypair()
    return CurveKeys(server_public=spub, server_secret=ssec, client_public=cpub, client_secret=csec)


class Peer:
    """A raw DEALER socket to a daemon endpoint: with the job's keys (``keys``), other keys, or none."""

    def __init__(self, address: str, job: str, keys: CurveKeys | None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            make_client_secure(self.sock, keys)
        self.sock.connect(address)
        self.codec = Codec(job, LIMIT)

    def body(self, obj: object) -> list[bytes]:
        return [msgpack.packb(obj, use_bin_type=True)]

    def envelope(self, t: int, f: dict, v: int = PROTOCOL_VERSION, job: str | None = None) -> dict:
        return {"v": v, "t": t, "job": job or self.codec.job, "f": f}

    def ask(self, frames: list[bytes], timeout_s: float = 10.0) -> object | None:
        self.sock.send_multipart(frames)
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self.codec.decode(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _keys(job) -> CurveKeys:
    return derive_keys(load_token(job.ckpt.endpoints, job.config))


def _log(job) -> str:
    return job.ckpt.endpoints.log_path.read_text()


def _rejected(job, where: str) -> dict[str, int]:
    info = job.ckpt.status()
    return info["rejected"] if where == "daemon" else info["coordinator"]["rejected"]


def _wait_for_counts(job, where: str, before: dict[str, int], **at_least: int) -> dict[str, int]:
    """Poll the daemon's status until each named counter rose by at least the given amount."""
    now: dict[str, int] = {}

    def reached() -> bool:
        now.update(_rejected(job, where))
        return all(now[k] - before[k] >= n for k, n in at_least.items())

    wait_until(reached, 20, f"{where} rejection counts {at_least} (now {now}, before {before})")
    return now


def _strangers(address: str, job) -> None:
    """Everyone without the job's keys: each sends a valid plaintext PING and must get no answer."""
    ep = job.ckpt.endpoints
    valid = Codec(ep.job, LIMIT).encode(Ping(nonce=1))  # what a captured plaintext message would be
    mine, other = _keys(job), _random_keys()
    foreign_client = CurveKeys(
        server_public=mine.server_public,
        server_secret=b"",
        client_public=other.client_public,
        client_secret=other.client_secret,
    )
    wrong_server = CurveKeys(
        server_public=other.server_public,
        server_secret=b"",
        client_public=mine.client_public,
        client_secret=mine.client_secret,
    )
    for keys in (None, foreign_client, wrong_server):  # plaintext; another job's client; a fake server
        peer = Peer(address, ep.job, keys)
        try:
            assert peer.ask(valid, timeout_s=1.0) is None, "a stranger got an answer"
        finally:
            peer.close()


def _raw_junk(connect: object) -> None:
    """Bytes that are not ZeroMQ, and a CurveZMQ greeting followed by a 1 GiB handshake frame."""
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + b"\0" * 32
    for data in (
        b"GET / HTTP/1.0\r\n\r\n" + os.urandom(2048),
        greeting + b"\x06" + struct.pack(">Q", 1 << 30) + b"x" * 4096,
    ):
        with connect() as raw:  # type: ignore[operator]
            raw.sendall(data)
            try:
                raw.recv(4096)  # until the daemon hangs up (or sent its own greeting)
                raw.recv(4096)
            except OSError:
                pass


@pytest.mark.timeout(90)
def test_strangers_cannot_talk_to_the_daemon_and_are_counted(job):
    ep = job.ckpt.endpoints
    before = _rejected(job, "daemon")
    _strangers(ep.ipc_address, job)

    def unix() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(str(ep.socket_path))
        return s

    _raw_junk(unix)
    _wait_for_counts(job, "daemon", before, unauthenticated=3, dropped=2)
    assert "not the job's client key" in _log(job), _log(job)[-3000:]
    job.committed(2)


@pytest.mark.timeout(90)
def test_coordinator_port_refuses_strangers_counts_them_and_keeps_committing(job):
    coordinator = job.ckpt.status()["coordinator"]
    before = coordinator["rejected"]
    _strangers(coordinator["address"], job)
    host, port = coordinator["address"].removeprefix("tcp://").rsplit(":", 1)
    _raw_junk(lambda: socket.create_connection((host, int(port)), timeout=5))
    now = _wait_for_counts(job, "coordinator", before, unauthenticated=3, dropped=2)
    info = job.ckpt.status()
    assert info["coordinator"]["rejected_messages"] == sum(now.values())
    # The node's total (status, Prometheus) includes its coordinator's port.
    assert info["rejected_messages"] >= sum(now.values()) + sum(info["rejected"].values())
    text = prometheus_text([admin.daemon_status(admin.local_daemons(job.root, job.config)[0], job.config)])
    total = next(line for line in text.splitlines() if line.startswith("ckptd_rejected_messages_total{"))
    assert float(total.rsplit(" ", 1)[1]) >= sum(now.values())
    shown = subprocess.run(
        [sys.executable, "-m", "ckptd.cli", "status", str(job.root)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CKPTD_RUNTIME_DIR": str(job.runtime)},
    )
    assert (
        "rejected: ranks' socket: " in shown.stdout
        and "coordinator's port: " in shown.stdout
        and "unauthenticated" in shown.stdout
    ), shown.stdout + shown.stderr
    job.committed(3)


@pytest.mark.timeout(60)
def test_bad_messages_from_an_authenticated_peer_are_rejected_and_logged(job, tmp_path):
    ep = job.ckpt.endpoints
    before = job.ckpt.status()["rejected"]["malformed"]
    marker = tmp_path / "pickle-ran"
    evil = pickle.dumps(_MarkerOnUnpickle(str(marker)))
    peer = Peer(ep.ipc_address, ep.job, _keys(job))
    good = peer.codec.encode(Ping(nonce=1))[0]
    # The wire fields of a valid SAVE (the message's own), with a step outside the protocol's bound.
    valid = a_save()
    save = {**dataclasses.asdict(valid), "step": 2**64 - 1}
    try:
        rejected = {
            "malformed: an old HMAC frame after the body": [good, b"m" * 32],
            "malformed: empty frame": [b""],
            "malformed: not msgpack": [b"\xc1\xc1"],
            "malformed: not a map": peer.body([1, 2, 3]),
            "malformed: unknown type": peer.body(peer.envelope(99, {})),
            "malformed: field of the wrong type": peer.body(peer.envelope(int(MsgType.PING), {"nonce": "x"})),
            "pickle": [evil],
            "truncated body": [good[:-3]],
            "oversized (just above the limit)": peer.body(
                peer.envelope(int(MsgType.PING), {"nonce": 1, "pad": b"x" * LIMIT})
            ),
            "wrong version": peer.body(peer.envelope(int(MsgType.PING), {"nonce": 1}, v=PROTOCOL_VERSION - 1)),
            "other job": peer.body(peer.envelope(int(MsgType.PING), {"nonce": 1}, job="otherjob")),
            "step 2**64-1": peer.body(peer.envelope(int(MsgType.SAVE), save)),
            "attempt id as a path": peer.body(
                peer.envelope(int(MsgType.SAVE), {**save, "step": 1, "attempt": "../../x-1"})
            ),
            # 3,000 nested arrays (6 KiB): the decoder's RecursionError left the daemon's loop.
            "nested past the decoder's depth": [
                b"\x84"
                + msgpack.packb({"v": PROTOCOL_VERSION, "t": int(MsgType.PING), "job": peer.codec.job})[1:]
                + msgpack.packb("f")
                + b"\x91" * 3000
                + b"\x01"
            ],
            "world size 2**40": peer.body(peer.envelope(int(MsgType.SAVE), {**save, "step": 1, "world_size": 2**40})),
        }
        for frames in rejected.values():
            peer.sock.send_multipart(frames)
        # None of them is answered; the next good request is, on the same connection.
        reply = peer.ask(peer.codec.encode(Ping(nonce=7)))
        assert isinstance(reply, Pong) and reply.nonce == 7, reply
        assert not marker.exists(), "a pickle from the socket was decoded"
        # Authenticated but impossible requests get an ERROR reply naming the problem.
        reply = peer.ask(peer.codec.encode(Hello(rank=0, pid=1, root=str(job.root))))
        assert (
            isinstance(reply, ErrorReply)
            and f"HELLO says pid 1, but the connecting process is pid {os.getpid()}" in reply.reason
        ), reply
        reply = peer.ask(peer.codec.encode(Hello(rank=0, pid=os.getpid(), root="/elsewhere")))
        assert "serves" in str(reply), reply
        # A root far beyond PATH_MAX was resolved on the daemon's loop (minutes for megabytes).
        reply = peer.ask(peer.codec.encode(Hello(rank=0, pid=os.getpid(), root="/x" * 40000)))
        assert isinstance(reply, ErrorReply) and "HELLO names a root of 80000 characters" in reply.reason, reply
        status = peer.ask(peer.codec.encode(Status()))
        assert isinstance(status, StatusReply)
        assert status.info["rejected"]["malformed"] - before >= len(rejected)
    finally:
        peer.close()

    # Far above the limit, libzmq drops the frame and the connection before Python sees it.
    huge = Peer(ep.ipc_address, ep.job, _keys(job))
    try:
        huge.sock.send_multipart([b"x" * (4 * LIMIT)])
    finally:
        huge.close()
    fresh = Peer(ep.ipc_address, ep.job, _keys(job))
    try:
        assert isinstance(fresh.ask(fresh.codec.encode(Ping(nonce=8))), Pong)
    finally:
        fresh.close()
    log = _log(job)
    for why in (
        "undecodable message body",
        "not a {v, t, job, f} map",
        "unknown message type",
        "Expected `int`, got `str` - at `$.nonce`",
        "exceeds the limit",
        "protocol version",
        "for job 'otherjob'",
        "is outside 0..999999999",
        "attempt id '../../x-1'",
        "HELLO says pid",
        "maximum recursion depth",
        "world size 1099511627776 is outside",
    ):
        assert why in log, f"no log line says {why!r}"
    with pytest.raises(ckptd.CkptdError, match="step must be an int in 0..999999999"):
        job.ckpt.save({"x": 1}, step=2**64 - 1)
    job.committed(4)  # a real Checkpointer is still served


@pytest.mark.timeout(60)
def test_a_connection_saves_only_from_its_own_pools_and_waits_only_on_its_own_child(job):
    """Another connection of the same job (here: the test process, saying HELLO as rank 0 with its
    true pid) can neither save from, register an item layout for, nor retire the Checkpointer's
    ring, nor speak for rank 1, nor make a writer wait on a process that is not its own snapshot
    child."""
    ep = job.ckpt.endpoints
    victim = job.ckpt._ring.current
    assert victim is not None
    old_child = subprocess.Popen(["sleep", "60"])  # a child of this process, older than its ring
    started = boottime_s()
    wait_until(lambda: boottime_s() > started + 0.1, 5, "the clock to move past the child's start")
    own = StagingRing.create(ep.shm_prefix, 0, 1 << 20, timeout_s=5)
    peer = Peer(ep.ipc_address, ep.job, _keys(job))
    try:
        ask = lambda msg: peer.ask(peer.codec.encode(msg))  # noqa: E731
        assert isinstance(ask(Hello(rank=0, pid=os.getpid(), root=str(job.root))), Welcome)
        reply = ask(a_save(step=5, generation=victim.generation))
        assert isinstance(reply, ErrorReply) and "registered by another connection" in reply.reason, reply
        reply = ask(RegisterRing(rank=1, generation=own.generation, ring_nbytes=own.capacity, names=own.names))
        assert isinstance(reply, ErrorReply) and "said HELLO as rank 0, not rank 1" in reply.reason, reply
        reply = ask(Abandon(step=5, attempt=ATTEMPT, reason="r", handed_off=[], abandoning_rank=1))
        assert isinstance(reply, ErrorReply) and "said HELLO as rank 0, not rank 1" in reply.reason, reply
        # Its own ring of rank 0 does not retire the Checkpointer's ring of rank 0.
        assert isinstance(
            ask(RegisterRing(rank=0, generation=own.generation, ring_nbytes=own.capacity, names=own.names)), RingOk
        )
        # An item list registered ahead (prepare()) is checked as a SAVE's, for its own ring only.
        item = SaveItem(record=ItemRecord(fqn="x", kind=BYTES, rank=0), offset=0, nbytes=8)
        for gen, layout, items, why in (
            (victim.generation, "l1", [item], "registered by another connection"),
            (own.generation, "", [item], "without a layout id"),
            (
                own.generation,
                "l1",
                [SaveItem(record=ItemRecord(fqn="x", kind=BYTES, rank=1), offset=0, nbytes=8)],
                "sent a record of rank 1",
            ),
            (own.generation, "l1", [SaveItem(record=item.record, offset=0, nbytes=own.capacity + 1)], "does not fit"),
        ):
            reply = ask(RegisterLayout(rank=0, generation=gen, layout=layout, items=items, held=[]))
            assert isinstance(reply, ErrorReply) and why in reply.reason, reply
        reply = ask(RegisterLayout(rank=0, generation=own.generation, layout="l1", items=[item], held=[]))
        assert reply == LayoutOk(layout="l1")
        # Its progress and seal are read in the block the seal names: another save's would be followed.
        reply = ask(a_save(step=5, generation=own.generation, block=2, seal_offset=block_offset(3), seal=b"s" * 16))
        assert isinstance(reply, ErrorReply) and "names control block 2 but its seal at header offset" in reply.reason
        for pid, why in (
            (1, "is not a child of the rank's process"),
            (old_child.pid, "is older than the rank's staging ring"),
        ):
            reply = ask(a_save(step=5, generation=own.generation, snapshot_pid=pid, seal=b"s" * 16))
            assert isinstance(reply, ErrorReply) and why in reply.reason, reply
        peer.sock.send_multipart(peer.codec.encode(Bye()))  # retires its own ring only
        assert isinstance(ask(Ping(nonce=3)), Pong)
    finally:
        peer.close()
        own.close(unlink=False)  # the daemon owns it since RING_OK
        old_child.kill()
        old_child.wait()
    job.committed(5)
    assert job.ckpt._ring.current is victim  # the Checkpointer never had to register a new ring


@pytest.mark.timeout(60)
def test_sockets_runtime_dir_and_shared_memory_are_owner_only(job):
    ep = job.ckpt.endpoints
    assert stat.S_IMODE(ep.runtime_dir.stat().st_mode) == 0o700
    for path in (ep.socket_path, ep.pid_path, ep.log_path, ep.token_path):
        st = path.stat()
        assert st.st_uid == os.getuid() and not stat.S_IMODE(st.st_mode) & 0o077, (path, oct(st.st_mode))
    assert stat.S_ISSOCK(ep.socket_path.stat().st_mode)
    segments = list_segments(ep.shm_prefix)
    assert segments, "the Checkpointer's staging ring should exist"
    for name in segments:
        st = (SHM_DIR / name).stat()
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o600, (name, oct(st.st_mode))
    # The daemon attaches only owner-only segments: a group-readable one is refused.
    name = f"{ep.shm_prefix}r0-open-s0"
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        os.fchmod(fd, 0o640)
        peer = Peer(ep.ipc_address, ep.job, _keys(job))
        try:
            assert isinstance(peer.ask(peer.codec.encode(Hello(rank=0, pid=os.getpid(), root=str(job.root)))), Welcome)
            reply = peer.ask(peer.codec.encode(RegisterRing(rank=0, generation="open", ring_nbytes=4096, names=[name])))
            assert isinstance(reply, ErrorReply) and "not a private (0600) file" in reply.reason, reply
        finally:
            peer.close()
    finally:
        os.close(fd)
        Path(SHM_DIR / name).unlink(missing_ok=True)
    job.committed(6)


class _MarkerOnUnpickle:
    """Unpickling this creates a file: proof that a pickle was decoded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (Path(self.path),))
