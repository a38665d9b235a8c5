"""Messages of :mod:`ckptd.control.protocol` to and from the bytes a socket carries.

A message is a msgpack map ``{"v": version, "t": type, "job": job id, "f": {fields}}``, sent in
frames of at most :data:`~ckptd.control.protocol.FRAME_NBYTES`. A receiver checks the size limit
before it unpacks anything, then the version, job, type and that the fields are exactly the
message's; msgspec then decodes the fields straight into the message's dataclass, and steps,
attempt ids and the numbers kept in fixed-width places are checked to be in range
(:func:`_check_ids`). Anything else is :class:`~ckptd.errors.ProtocolError`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import msgspec

from ..errors import ProtocolError
from ..format.commitrecord import MAX_COMMIT_SEQ
from .attempt import MAX_WORLD_SIZE, check_attempt, check_step, check_world
from .protocol import (
    FRAME_NBYTES,
    MAX_INSTANCE_NBYTES,
    MAX_REPORT_ID,
    MAX_UNIX_S,
    PROTOCOL_VERSION,
    REGISTRY,
    Failed,
    InFlightReply,
    Message,
)


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    """The map around every message's fields (``f``: left encoded until the type is known)."""

    v: int
    t: int
    job: str
    f: msgspec.Raw


# A Decoder keeps its state of a call on the stack: one per type serves every thread. (An Encoder
# reuses its output buffer between calls: encode() uses msgspec.msgpack.encode, fresh each call.)
_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_FIELD_MAP = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_DECODERS: dict[type[Message], msgspec.msgpack.Decoder[Any]] = {
    cls: msgspec.msgpack.Decoder(cls) for cls in REGISTRY.values()
}
_NAMES: dict[type[Message], frozenset[str]] = {cls: frozenset(f.name for f in fields(cls)) for cls in REGISTRY.values()}


def _check_ids(msg: Message) -> None:
    """Steps and attempt ids in range (they name directories), also those an IN_FLIGHT_REPLY
    lists, the numbers kept in fixed-width arrays (a WRITTEN's report id) and the length of
    daemon instances: ProtocolError otherwise."""
    try:
        for named in (msg, *(msg.attempts if isinstance(msg, InFlightReply) else ())):
            step = getattr(named, "step", None)
            if step is not None:
                check_step(step)
            if hasattr(named, "attempt"):
                check_attempt(named.attempt)
            for instance in (getattr(named, "instance", ""), getattr(named, "coordinator_instance", "")):
                if len(instance.encode("utf-8", "replace")) > MAX_INSTANCE_NBYTES:
                    raise ProtocolError(f"instance {instance[:80]!r} is longer than {MAX_INSTANCE_NBYTES} bytes")
            if not 0 <= getattr(named, "report_id", 0) <= MAX_REPORT_ID:
                # Kept as an unsigned 64-bit number (ckptd.daemon.countedreports): one outside
                # failed the commit that counted it after it was on disk, and nobody was told.
                raise ProtocolError(f"report id {named.report_id} is outside 0..{MAX_REPORT_ID}")
            if not 0 <= getattr(named, "disk_seq", 0) <= MAX_COMMIT_SEQ:
                raise ProtocolError(f"commit number {named.disk_seq} is outside 0..{MAX_COMMIT_SEQ}")
            went_back_to = getattr(named, "went_back_to", -1)
            if went_back_to != -1:
                check_step(went_back_to)
            if not 0.0 <= getattr(named, "went_back_unix_s", 0.0) <= MAX_UNIX_S:
                raise ProtocolError(f"time {named.went_back_unix_s} is outside 0..{MAX_UNIX_S:g}")
            for by in (getattr(named, "abandoning_rank", -1), *getattr(named, "abandoned_by", ())):
                if not -1 <= by < MAX_WORLD_SIZE:
                    raise ProtocolError(f"abandoning rank {by} is outside -1..{MAX_WORLD_SIZE - 1}")
            world_size, rank = getattr(named, "world_size", None), getattr(named, "rank", None)
            if world_size is not None:
                check_world(world_size, rank, node_report=isinstance(named, Failed))
            elif rank is not None:  # a HELLO, a ring's registration: any rank a world can have
                check_world(MAX_WORLD_SIZE, rank)
    except ProtocolError as exc:
        raise ProtocolError(f"{msg.TYPE.name}: {exc}") from None


@dataclass(frozen=True)
class Codec:
    """Encodes messages of one job; decoding rejects anything unexpected.

    Authentication and encryption are the sockets' (CurveZMQ, :mod:`ckptd.control.channel`), so a
    message is the body alone.
    """

    job: str
    max_nbytes: int = 64 << 20

    def encode(self, msg: Message) -> list[bytes | memoryview]:
        # msgspec sends a dataclass (the message, its SaveItems and ItemRecords) as the map of its
        # fields, tuples as arrays: the bytes msgpack.packb gives for dataclasses.asdict(msg).
        body = msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "t": int(msg.TYPE), "job": self.job, "f": msg})
        if len(body) > self.max_nbytes:
            raise ProtocolError(
                f"{msg.TYPE.name} message of {len(body)} bytes exceeds the limit of "
                f"{self.max_nbytes} bytes; raise CKPTD_MAX_MESSAGE_NBYTES or save less common state"
            )
        if len(body) <= FRAME_NBYTES:
            return [body]
        view = memoryview(body)
        return [view[i : i + FRAME_NBYTES] for i in range(0, len(body), FRAME_NBYTES)]

    def decode(self, frames: list[Any]) -> Message:
        """``frames``: bytes or buffers (zero-copy zmq frames) of one message, in order."""
        if not frames:
            raise ProtocolError("empty message (no body frame)")
        nbytes = sum(len(f) for f in frames)
        if nbytes > self.max_nbytes:
            raise ProtocolError(f"message of {nbytes} bytes exceeds the limit of {self.max_nbytes}")
        body = frames[0] if len(frames) == 1 else b"".join(frames)
        try:
            env = _ENVELOPE.decode(body)
        except msgspec.ValidationError as exc:  # a DecodeError too: caught first
            raise ProtocolError(f"message is not a {{v, t, job, f}} map: {exc}") from None
        except (msgspec.DecodeError, RecursionError) as exc:  # nested past the decoder's depth
            raise ProtocolError(f"undecodable message body: {exc}") from None
        if env.v != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {env.v!r}, expected {PROTOCOL_VERSION}; "
                "run the same ckptd version on every process of the job"
            )
        if env.job != self.job:
            raise ProtocolError(f"message for job {env.job!r}, this is job {self.job!r}")
        cls = REGISTRY.get(env.t)
        if cls is None:
            raise ProtocolError(f"unknown message type {env.t!r}")
        names = _NAMES[cls]
        try:
            # Every field present, none unknown (msgspec would fill defaults and skip extras).
            got = _FIELD_MAP.decode(env.f).keys()
            if got != names:
                raise ProtocolError(f"{cls.TYPE.name}: fields {sorted(got)}, expected {sorted(names)}")
            msg = _DECODERS[cls].decode(env.f)
        except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is one
            raise ProtocolError(f"{cls.TYPE.name}: {exc}") from None
        _check_ids(msg)
        return msg
