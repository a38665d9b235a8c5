"""A rank's requests to its node daemon (ckptd.client.link), against a real CurveZMQ ROUTER on the
job's ipc:// socket standing in for the daemon (real keys, real codec, real pid-file lock)."""

from __future__ import annotations

import secrets
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import zmq

from ckptd.client.link import DaemonLink, RequestNotTaken
from ckptd.config import CkptdConfig
from ckptd.control.channel import Channel, make_socket
from ckptd.control.codec import Codec
from ckptd.control.endpoints import Endpoints, JobEnv
from ckptd.control.keys import derive_keys
from ckptd.control.pidfile import PidLock
from ckptd.control.protocol import ErrorReply, SaveAck
from ckptd.control.security import ZapHandler
from tests.messages import ATTEMPT, a_save


@pytest.mark.timeout(60)
def test_a_late_refusal_of_an_earlier_request_is_not_taken_for_this_one(tmp_path: Path):
    """The daemon's ERROR for an earlier SAVE (whose wait gave up) arrives while the rank waits
    for the next SAVE's acknowledgement: it is logged, and the acknowledgement is returned. An
    ERROR naming this request's step still refuses it."""
    # Not the runtime_dir fixture: this process holds the pid file's lock (it plays the daemon),
    # and that fixture SIGTERMs whoever holds a pid file in its directory.
    runtime = Path(tempfile.mkdtemp(prefix="ck", dir="/tmp"))
    cfg = CkptdConfig.from_env({}, runtime_dir=str(runtime), request_timeout_s=10)
    ep = Endpoints.for_job(tmp_path, JobEnv(), cfg)
    keys = derive_keys(secrets.token_bytes(32))
    codec = Codec(ep.job)
    ctx = zmq.Context()
    zap = ZapHandler(ctx, keys)
    lock = PidLock(ep.pid_path)  # this process plays the daemon: the rank checks the lock
    assert lock.acquire()
    server = Channel(make_socket(ctx, zmq.ROUTER, codec, keys, server=True), codec, "fake daemon")
    server.sock.bind(ep.ipc_address)
    stop = threading.Event()

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(zap.sock, zmq.POLLIN)
        poller.register(server.sock, zmq.POLLIN)
        while not stop.is_set():
            events = dict(poller.poll(20))
            if zap.sock in events:
                zap.on_readable()
            if server.sock in events:
                identity, msg, _ = server.recv()
                if msg.step == 2:
                    server.send(ErrorReply(reason="the earlier save of step 1 was refused", step=1), identity)
                    server.send(SaveAck(step=2, attempt=ATTEMPT), identity)
                else:
                    server.send(ErrorReply(reason="step 3 is refused", step=3), identity)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    link = DaemonLink(ep, JobEnv(), cfg, codec, keys, on_notify=lambda _msg: None)
    try:
        link._open_socket()
        ack = link.request(a_save(step=2), SaveAck)
        assert (ack.step, ack.attempt) == (2, ATTEMPT)
        with pytest.raises(RequestNotTaken, match="step 3 is refused"):
            link.request(a_save(step=3), SaveAck)
    finally:
        stop.set()
        thread.join(10)
        link.close()
        server.close()
        zap.close()
        ctx.term()
        lock.release()
        shutil.rmtree(runtime, ignore_errors=True)
