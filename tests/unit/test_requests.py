"""The control plane's request client (ckptd.control.requests): how a reply is read, pure, and
over a real CurveZMQ DEALER -> ROUTER pair on ipc:// (real keys, real codec)."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from ckptd.control.channel import Channel, make_socket
from ckptd.control.codec import Codec
from ckptd.control.keys import derive_keys
from ckptd.control.protocol import (
    ErrorReply,
    Message,
    MsgType,
    Ping,
    Pong,
    Save,
    SaveAck,
    Status,
    StatusReply,
    StepCommitted,
)
from ckptd.control.requests import RequestClient, answer
from ckptd.control.security import ZapHandler
from ckptd.daemon.loop import serve_requests
from ckptd.errors import CkptdError, DaemonError, DaemonLostError, ProtocolError, RequestNotTaken, UnknownClientError
from tests.messages import ATTEMPT, a_save

# ------------------------------------------------------------------------------ answer(), pure


def test_the_expected_reply_answers_and_anything_else_does_not():
    assert answer(Status(), StatusReply(info={"x": 1}), StatusReply) == StatusReply(info={"x": 1})
    assert (
        answer(Status(), Pong(nonce=1, instance="i", pid=2), StatusReply) is None
    )  # not an answer: the caller decides
    ack = SaveAck(step=2, attempt=ATTEMPT)
    assert answer(a_save(step=2), ack, SaveAck, match=lambda a: a.step == 2) == ack
    assert answer(a_save(step=3), ack, SaveAck, match=lambda a: a.step == 3) is None  # an earlier request's


@pytest.mark.parametrize(
    "request_, error, refused",
    [
        (Status(), ErrorReply(reason="no", step=None), True),  # a request without a step: any ERROR is its
        (a_save(step=3), ErrorReply(reason="no", step=None), True),  # an ERROR without a step refuses any request
        (a_save(step=3), ErrorReply(reason="no", step=3), True),
        (a_save(step=3), ErrorReply(reason="no", step=1), False),  # the late refusal of step 1's SAVE
        (a_save(step=3), ErrorReply(reason="no", step=3, request=MsgType.SAVE), True),
        (a_save(step=3), ErrorReply(reason="no", step=None, request=MsgType.REGISTER_LAYOUT), False),  # a late one
        (Status(), ErrorReply(reason="no", step=1, request=MsgType.SAVE), False),
        (Status(), ErrorReply(reason="no", step=None, request=MsgType.STATUS), True),
        (a_save(step=3), ErrorReply(reason="no", step=3, request=MsgType.SAVE, refused_attempt=ATTEMPT), True),
        (
            a_save(step=3),
            ErrorReply(reason="no", step=3, request=MsgType.SAVE, refused_attempt="0123456789ab-7"),
            False,
        ),
    ],
)
def test_an_error_refuses_the_request_it_names(request_: Message, error: ErrorReply, refused: bool):
    if not refused:
        assert answer(request_, error, SaveAck) is None
        return
    with pytest.raises(RequestNotTaken, match=f"the daemon refused {request_.TYPE.name}: no"):
        answer(request_, error, SaveAck)


def test_a_refusal_carries_its_code():
    with pytest.raises(RequestNotTaken) as info:
        answer(
            a_save(step=1),
            ErrorReply(reason="forgot you", step=1, code=UnknownClientError.code),
            SaveAck,
            peer="node 3's daemon",
        )
    assert info.value.unknown_client and info.value.code == "unknown_client"
    assert str(info.value) == "node 3's daemon refused SAVE: forgot you"


# ----------------------------------------------------------------- RequestClient, real sockets


class FakeServer:
    """A CurveZMQ ROUTER on ipc:// that answers each request with ``replies[request type]``
    (a list of messages, possibly empty: no answer)."""

    def __init__(self, path: Path, replies: dict[type[Message], list[Message]] | Callable[..., None]) -> None:
        self.keys = derive_keys(secrets.token_bytes(32))
        self.codec = Codec("job1")
        self.address = f"ipc://{path}"
        self.ctx = zmq.Context()
        self.zap = ZapHandler(self.ctx, self.keys)
        self.server = Channel(
            make_socket(self.ctx, zmq.ROUTER, self.codec, self.keys, server=True), self.codec, "fake daemon"
        )
        self.server.sock.bind(self.address)
        self.replies = replies
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.zap.sock, zmq.POLLIN)
        poller.register(self.server.sock, zmq.POLLIN)
        while not self.stop.is_set():
            events = dict(poller.poll(20))
            if self.zap.sock in events:
                self.zap.on_readable()
            if self.server.sock in events and callable(self.replies):  # a daemon's request handler
                serve_requests(self.server, self.replies)
            elif self.server.sock in events:
                identity, msg, _ = self.server.recv()
                for reply in self.replies[type(msg)]:
                    self.server.send(reply, identity)

    def client(self, **kwargs) -> RequestClient:
        sock = make_socket(self.ctx, zmq.DEALER, self.codec, self.keys, server=False)
        sock.setsockopt(zmq.SNDTIMEO, 5000)
        sock.connect(self.address)
        return RequestClient(Channel(sock, self.codec, "test"), "the test daemon", "see its log", **kwargs)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.server.close()
        self.zap.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator:
    servers: list[FakeServer] = []

    def start(replies: dict[type[Message], list[Message]] | Callable[..., None]) -> FakeServer:
        servers.append(FakeServer(tmp_path / f"s{len(servers)}.sock", replies))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.mark.timeout(60)
def test_an_error_reply_is_raised_with_its_reason_and_code(serve):
    """The wait is 10 minutes: an ERROR that were ignored would time the test out."""
    server = serve({Status: [ErrorReply(reason="the daemon is shutting down", step=None, code="busy")]})
    with pytest.raises(RequestNotTaken, match="the test daemon refused STATUS: the daemon is shutting down") as info:
        server.client().request(Status(), StatusReply, timeout_s=600)
    assert info.value.code == "busy"


@pytest.mark.timeout(60)
def test_a_refusal_built_from_a_huge_request_is_cut_to_fit(serve):
    """A refusal quoting a request's strings (a 9 MiB root, four times as long in repr) exceeded
    the message limit: its encoding raised out of the daemon's request loop."""

    def refuse(identity: bytes, msg: Message, peer: str | None) -> None:
        raise CkptdError("bad root " + "x" * (80 << 20))

    server = serve(refuse)
    with pytest.raises(RequestNotTaken) as info:
        server.client().request(Status(), StatusReply, timeout_s=30)
    text = str(info.value)  # (never matched whole: a failure would print 80 MiB)
    assert len(text) < 20000 and text.endswith("x... (83869753 more bytes)")


@pytest.mark.timeout(60)
def test_a_wrong_reply_type_is_a_protocol_error_unless_the_caller_takes_notifications(serve):
    notification = StepCommitted(step=1, attempt=ATTEMPT, name="iter_0000001", warnings=[])
    server = serve({Status: [notification, StatusReply(info={"ok": 1})]})
    with pytest.raises(
        ProtocolError, match="the test daemon answered STATUS with STEP_COMMITTED, expected STATUS_REPLY"
    ):
        server.client().request(Status(), StatusReply, timeout_s=600)
    seen: list[Message] = []
    assert server.client(on_other=seen.append).request(Status(), StatusReply, timeout_s=600) == StatusReply(
        info={"ok": 1}
    )
    assert seen == [notification]


@pytest.mark.timeout(60)
def test_a_late_refusal_is_logged_and_the_wait_goes_on(serve, caplog):
    server = serve(
        {
            Save: [
                ErrorReply(reason="the save of step 1 was refused", step=1, request=MsgType.SAVE),
                ErrorReply(reason="no room for the layout", step=None, request=MsgType.REGISTER_LAYOUT),
                SaveAck(step=2, attempt=ATTEMPT),
            ]
        }
    )
    assert server.client().request(a_save(step=2), SaveAck, timeout_s=600) == SaveAck(step=2, attempt=ATTEMPT)
    assert "the test daemon refused an earlier SAVE (step 1): the save of step 1 was refused" in caplog.text
    assert "the test daemon refused an earlier REGISTER_LAYOUT (step None): no room" in caplog.text


@pytest.mark.timeout(60)
def test_no_answer_names_the_peer_the_wait_and_what_to_do(serve):
    server = serve({Ping: []})
    with pytest.raises(DaemonError, match=r"the test daemon did not answer PING within 0.3 s; see its log"):
        server.client().request(Ping(nonce=1), Pong, timeout_s=0.3)


@pytest.mark.timeout(60)
def test_a_peer_found_dead_ends_the_wait_at_once(serve):
    server = serve({Ping: []})

    def gone() -> None:
        raise DaemonLostError("the test daemon died")

    with pytest.raises(DaemonLostError, match="the test daemon died"):
        server.client(check_alive=gone).request(Ping(nonce=1), Pong, timeout_s=600)
