"""Guarantee 5 against a live daemon: malformed, truncated, oversized, wrong-version,
unauthenticated and pickled messages over its real ipc:// socket (and the coordinator's tcp://
port) are rejected and logged, and the daemon goes on serving a real Checkpointer. Sockets, the
runtime directory and shared memory are owner-only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import socket
import stat
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from ckptd.control.endpoints import load_token
from ckptd.control.protocol import (
    PROTOCOL_VERSION,
    Codec,
    ErrorReply,
    Hello,
    MsgType,
    Ping,
    Pong,
    RegisterPool,
    Status,
    StatusReply,
    Welcome,
)
from ckptd.staging.segment import SHM_DIR, list_segments
from tests.fault.single_job import single_job

LIMIT = 256 << 10  # the daemon's message size limit in this module


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        with single_job(tmp_path_factory.mktemp("hostile"), mp, max_message_nbytes=LIMIT) as j:
            j.committed(1)
            yield j


class Peer:
    """A raw DEALER socket to a daemon endpoint, speaking (or not) the job's protocol."""

    def __init__(self, address: str, codec: Codec) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.codec = codec

    def frames(self, obj: object, token: bytes | None = None) -> list[bytes]:
        """A msgpack body of ``obj`` with a valid MAC (under ``token``, default the job's)."""
        body = msgpack.packb(obj, use_bin_type=True)
        return [body, hmac.new(token or self.codec.token, body, hashlib.sha256).digest()]

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


def _log(job) -> str:
    return job.ckpt.endpoints.log_path.read_text()


@pytest.mark.timeout(60)
def test_bad_messages_are_rejected_logged_and_the_daemon_keeps_serving(job, tmp_path):
    ep, cfg = job.ckpt.endpoints, job.config
    codec = Codec(ep.job, load_token(ep, cfg), LIMIT)
    before = job.ckpt.status()["rejected_messages"]
    good = codec.encode(Ping(1))
    marker = tmp_path / "pickle-ran"
    evil = pickle.dumps(_MarkerOnUnpickle(str(marker)))
    peer = Peer(ep.ipc_address, codec)
    try:
        rejected = {
            "malformed: one frame": [b"\x93garbage"],
            "malformed: three frames": [b"a", b"b", b"c"],
            "malformed: empty frames": [b"", b""],
            "malformed: not msgpack": [b"\xc1\xc1", hmac.new(codec.token, b"\xc1\xc1", hashlib.sha256).digest()],
            "malformed: not a map": peer.frames([1, 2, 3]),
            "malformed: unknown type": peer.frames(peer.envelope(99, {})),
            "malformed: field of the wrong type": peer.frames(peer.envelope(int(MsgType.PING), {"nonce": "x"})),
            "pickle, authenticated": [evil, hmac.new(codec.token, evil, hashlib.sha256).digest()],
            "truncated body": [good[0][:-3], good[1]],
            "truncated body, MAC recomputed": [good[0][:-3], hmac.new(codec.token, good[0][:-3], hashlib.sha256).digest()],
            "truncated MAC": [good[0], good[1][:16]],
            "oversized (just above the limit)": peer.frames(peer.envelope(int(MsgType.PING), {"nonce": 1, "pad": b"x" * LIMIT})),
            "wrong version": peer.frames(peer.envelope(int(MsgType.PING), {"nonce": 1}, v=PROTOCOL_VERSION + 1)),
            "unauthenticated: wrong token": peer.frames(peer.envelope(int(MsgType.PING), {"nonce": 1}), token=b"k" * 64),
            "unauthenticated: other job": peer.frames(peer.envelope(int(MsgType.PING), {"nonce": 1}, job="otherjob")),
        }
        for what, frames in rejected.items():
            peer.sock.send_multipart(frames)
        # None of them is answered; the next good request is, on the same connection.
        reply = peer.ask(codec.encode(Ping(7)))
        assert isinstance(reply, Pong) and reply.nonce == 7, reply
        assert not marker.exists(), "a pickle from the socket was decoded"
        # Authenticated but impossible requests get an ERROR reply naming the problem.
        reply = peer.ask(codec.encode(Hello("rank", 0, 0, 1, -1, str(job.root))))
        assert "could not handle HELLO" in str(reply) and "pid" in str(reply), reply
        reply = peer.ask(codec.encode(Hello("rank", 0, 0, 1, os.getpid(), "/elsewhere")))
        assert "serves" in str(reply), reply
        status = peer.ask(codec.encode(Status()))
        assert isinstance(status, StatusReply)
        assert status.info["rejected_messages"] - before >= len(rejected)
    finally:
        peer.close()

    # Far above the limit, libzmq drops the frame and the connection before Python sees it.
    huge = Peer(ep.ipc_address, codec)
    try:
        huge.sock.send_multipart([b"x" * (4 * LIMIT), b"y" * 32])
        time.sleep(0.2)
    finally:
        huge.close()
    # Bytes that are not even ZeroMQ, on the raw unix socket.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(ep.socket_path))
        raw.sendall(os.urandom(4096))
    log = _log(job)
    for why in ("expected 2 frames", "undecodable message body", "not a {v, t, job, f} map",
                "unknown message type", "has type str", "authentication failed", "exceeds the limit",
                "protocol version", "for job 'otherjob'", "HELLO from"):
        assert why in log, f"no log line says {why!r}"
    job.committed(2)  # a real Checkpointer is still served


@pytest.mark.timeout(60)
def test_coordinator_port_rejects_strangers_and_keeps_committing(job):
    ep, cfg = job.ckpt.endpoints, job.config
    codec = Codec(ep.job, load_token(ep, cfg), LIMIT)
    coordinator = job.ckpt.status()["coordinator"]
    before = coordinator["rejected_messages"]
    peer = Peer(coordinator["address"], codec)
    try:
        peer.sock.send_multipart(Codec(ep.job, b"w" * 64, LIMIT).encode(Ping(1)))  # wrong token
        peer.sock.send_multipart(peer.frames(peer.envelope(int(MsgType.PING), {"nonce": 1}, v=0)))
        peer.sock.send_multipart([b"\x00" * 100])
        reply = peer.ask(codec.encode(Ping(2)))
        assert isinstance(reply, Pong) and reply.nonce == 2
    finally:
        peer.close()
    host, port = coordinator["address"].removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(2048))
    assert job.ckpt.status()["coordinator"]["rejected_messages"] - before >= 3
    job.committed(3)


@pytest.mark.timeout(60)
def test_sockets_runtime_dir_and_shared_memory_are_owner_only(job):
    ep = job.ckpt.endpoints
    assert stat.S_IMODE(ep.runtime_dir.stat().st_mode) == 0o700
    for path in (ep.socket_path, ep.pid_path, ep.log_path, ep.token_path):
        st = path.stat()
        assert st.st_uid == os.getuid() and not stat.S_IMODE(st.st_mode) & 0o077, (path, oct(st.st_mode))
    assert stat.S_ISSOCK(ep.socket_path.stat().st_mode)
    segments = list_segments(ep.shm_prefix)
    assert segments, "the Checkpointer's staging pool should exist"
    for name in segments:
        st = (SHM_DIR / name).stat()
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o600, (name, oct(st.st_mode))
    # The daemon attaches only owner-only segments: a group-readable one is refused.
    name = f"{ep.shm_prefix}r0-open-s0"
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        os.fchmod(fd, 0o640)
        codec = Codec(ep.job, load_token(ep, job.config), LIMIT)
        peer = Peer(ep.ipc_address, codec)
        try:
            assert isinstance(peer.ask(codec.encode(Hello("rank", 0, 0, 1, os.getpid(), str(job.root)))), Welcome)
            reply = peer.ask(codec.encode(RegisterPool(0, "open", 4096, [name])))
            assert isinstance(reply, ErrorReply) and "not a private (0600) file" in reply.reason, reply
        finally:
            peer.close()
    finally:
        os.close(fd)
        Path(SHM_DIR / name).unlink(missing_ok=True)
    job.committed(4)


class _MarkerOnUnpickle:
    """Unpickling this creates a file: proof that a pickle was decoded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (Path(self.path),))
