"""The control-plane codec and the config: what is accepted, what is rejected, and why."""

from __future__ import annotations

import dataclasses
import os
import re
import warnings

import msgpack
import pytest

from ckptd.config import CkptdConfig, parse_budget
from ckptd.control.codec import Codec
from ckptd.control.itemchecks import check_record
from ckptd.control.protocol import (
    FRAME_NBYTES,
    PROTOCOL_VERSION,
    REGISTRY,
    Abandon,
    AttemptInFlight,
    Failed,
    Hello,
    InFlight,
    InFlightReply,
    LayoutOk,
    MsgType,
    Ping,
    RegisterLayout,
    Save,
    SaveItem,
    Skip,
    StatusReply,
    StepAborted,
    Written,
)
from ckptd.daemon.intake import decode_items
from ckptd.errors import CkptdError, ProtocolError, StagingError
from ckptd.format.records import BYTES, TENSOR, ItemRecord
from ckptd.staging.ring import Placement
from tests.messages import ATTEMPT, a_save, a_written

codec = Codec("job1", max_nbytes=1 << 16)


def _frames(obj: object) -> list[bytes]:
    return [msgpack.packb(obj, use_bin_type=True)]


def _save_fields(**changes: object) -> dict:
    """The wire fields of a valid SAVE (those the codec sends: the message's own), with ``changes``."""
    return {**dataclasses.asdict(a_save()), **changes}


def test_every_message_type_round_trips():
    samples = [
        Ping(nonce=7),
        Hello(rank=3, pid=1234, root="/ckpts/run1", coordinator="tcp://10.0.0.1:29501"),
        a_save(
            step=100,
            rank=3,
            world_size=4,
            generation="abcd",
            block=1,
            items=[SaveItem(record=ItemRecord(fqn="w", kind=BYTES, rank=3), offset=0, nbytes=8)],
            common=b"\x00\x01",
            common_digest="digest",
            layout="l1",
            snapshot_pid=4242,
            seal=b"s" * 16,
            seal_offset=4096,
        ),
        a_save(step=100, rank=3, world_size=4, generation="abcd", block=1),
        RegisterLayout(
            rank=3,
            generation="abcd",
            layout="l1",
            items=[SaveItem(record=ItemRecord(fqn="w", kind=BYTES, rank=3), offset=0, nbytes=8)],
            held=["replica"],
        ),
        LayoutOk(layout="l1"),
        a_written(
            step=100, rank=3, world_size=4, node=1, records=[ItemRecord(fqn="w", kind=BYTES, rank=3)], file_nbytes=4096
        ),
        a_written(report_id=2**64 - 1),  # a seal's 8 bytes, all set
        Failed(step=100, attempt="fedcba987654-12", rank=-1, world_size=0, node=1, reason="lost the coordinator"),
        StepAborted(step=10**9 - 1, attempt=ATTEMPT, reason="why"),
        StepAborted(step=7, attempt=ATTEMPT, reason="rank 1 skipped it", skipped=True),
        Skip(step=7, attempt=ATTEMPT, rank=1, world_size=2, reason="its ring was busy", skipped=True),
        Failed(step=7, attempt=ATTEMPT, rank=1, world_size=2, node=0, reason="skipped the save", skipped=True),
        StatusReply(info={"rings": [], "x": 1.5}),
        InFlight(),
        InFlightReply(
            attempts=[
                AttemptInFlight(
                    step=10, attempt=ATTEMPT, world_size=4, writing=(0,), written=(1, 2), failed=(3,), live=False
                )
            ]
        ),
        Abandon(step=10, attempt=ATTEMPT, reason="a rank never handed its save off", handed_off=[0, 2]),
        Failed(step=10, attempt=ATTEMPT, rank=-1, world_size=0, node=0, reason="abandoned", handed_off=[0, 2]),
    ]
    for msg in samples:
        frames = codec.encode(msg)
        assert len(frames) == 1 and codec.decode(frames) == msg
        assert codec.decode([memoryview(frames[0])]) == msg  # zero-copy buffers of received frames
    assert len(REGISTRY) == len(MsgType) and all(REGISTRY[t].TYPE is t for t in MsgType)


@pytest.mark.parametrize(
    "frames, why",
    [
        ([], "empty message"),
        (
            _frames({"v": PROTOCOL_VERSION, "t": 1, "job": "job1", "f": {"nonce": 1}}) + [b"an old HMAC frame"],
            "undecodable",
        ),
        ([b"\xc1"], "undecodable"),
        (_frames([1, 2, 3]), "not a {v, t, job, f} map"),
        (_frames({"v": PROTOCOL_VERSION - 1, "t": 1, "job": "job1", "f": {"nonce": 1}}), "protocol version"),
        (_frames({"v": PROTOCOL_VERSION, "t": 1, "job": "job2", "f": {"nonce": 1}}), "for job 'job2'"),
        (_frames({"v": PROTOCOL_VERSION, "t": 999, "job": "job1", "f": {}}), "unknown message type"),
        (_frames({"v": PROTOCOL_VERSION, "t": "PING", "job": "job1", "f": {}}), "Expected `int`, got `str` - at `$.t`"),
        # Nested past the decoder's depth: a RecursionError escaped the daemon's loop (2 KiB did it).
        ([b"\x91" * 3000 + b"\x01"], "not a {v, t, job, f} map"),
        (
            [
                _frames({"v": PROTOCOL_VERSION, "t": int(MsgType.STATUS_REPLY), "job": "job1", "f": {"info": {}}})[0][
                    :-1
                ]
                + b"\x81\xa1k" * 3000
                + b"\x01"
            ],
            "undecodable message body: maximum recursion depth",
        ),
        (_frames({"v": PROTOCOL_VERSION, "t": 1, "job": "job1", "f": {}}), "fields [], expected ['nonce']"),
        (_frames({"v": PROTOCOL_VERSION, "t": 1, "job": "job1", "f": {"nonce": 1, "x": 2}}), "fields"),
        (
            _frames({"v": PROTOCOL_VERSION, "t": 1, "job": "job1", "f": {"nonce": "1"}}),
            "PING: Expected `int`, got `str` - at `$.nonce`",
        ),
        (
            _frames({"v": PROTOCOL_VERSION, "t": 1, "job": "job1", "f": {"nonce": True}}),
            "Expected `int`, got `bool` - at `$.nonce`",
        ),
        (
            _frames({"v": PROTOCOL_VERSION, "t": int(MsgType.SAVE), "job": "job1", "f": _save_fields(items=[1, 2])}),
            "SAVE: Expected `object`, got `int` - at `$.items[0]`",
        ),
        # World sizes are bounded (a coordinator counted 10^12 ranks on its loop), ranks inside them.
        (
            _frames(
                {"v": PROTOCOL_VERSION, "t": int(MsgType.SAVE), "job": "job1", "f": _save_fields(world_size=2**40)}
            ),
            "SAVE: world size 1099511627776 is outside 0..1048576",
        ),
        (
            _frames({"v": PROTOCOL_VERSION, "t": int(MsgType.SAVE), "job": "job1", "f": _save_fields(rank=2)}),
            "SAVE: rank 2 is outside the world size 1",
        ),
        # Rank -1 is a node daemon's own FAILED only: a SKIP as rank -1 was sent on as the node's.
        (
            _frames({"v": PROTOCOL_VERSION, "t": int(MsgType.SAVE), "job": "job1", "f": _save_fields(rank=-1)}),
            "SAVE: rank -1 is outside the world size 1",
        ),
        # Steps are bounded: a step of 2**64 - 1 would pin `latest` forever.
        (
            _frames({"v": PROTOCOL_VERSION, "t": int(MsgType.SAVE), "job": "job1", "f": _save_fields(step=2**64 - 1)}),
            "SAVE: step 18446744073709551615 is outside 0..999999999",
        ),
        (
            _frames(
                {
                    "v": PROTOCOL_VERSION,
                    "t": int(MsgType.STEP_ABORTED),
                    "job": "job1",
                    "f": {"step": -1, "attempt": ATTEMPT, "reason": "", "skipped": False},
                }
            ),
            "STEP_ABORTED: step -1 is outside",
        ),
        # A report id is kept as an unsigned 64-bit number: a negative one let a commit land on disk
        # and then failed before its verdict went out (the attempt hung forever, nobody told).
        (
            _frames(
                {
                    "v": PROTOCOL_VERSION,
                    "t": int(MsgType.WRITTEN),
                    "job": "job1",
                    "f": {**dataclasses.asdict(a_written()), "report_id": -1},
                }
            ),
            "WRITTEN: report id -1 is outside 0..18446744073709551615",
        ),
        (
            _frames(
                {
                    "v": PROTOCOL_VERSION,
                    "t": int(MsgType.FAILED),
                    "job": "job1",
                    "f": {
                        "step": 1,
                        "attempt": ATTEMPT,
                        "rank": -1,
                        "world_size": 0,
                        "node": 1,
                        "reason": "",
                        "skipped": False,
                        "coordinator_instance": "",
                        "handed_off": [],
                        "abandoned_by": [-2],
                    },
                }
            ),
            "FAILED: abandoning rank -2 is outside",
        ),
        # A node judges whether its report fits before it addresses it to the coordinator's instance.
        (
            _frames({"v": PROTOCOL_VERSION, "t": 2, "job": "job1", "f": {"nonce": 1, "instance": "9" * 65, "pid": 1}}),
            "PONG: instance '99999",
        ),
        # Attempt ids name directories: nothing but <12 hex>-<n> passes.
        (
            _frames(
                {"v": PROTOCOL_VERSION, "t": int(MsgType.SAVE), "job": "job1", "f": _save_fields(attempt="../../x-1")}
            ),
            "attempt id '../../x-1'",
        ),
        (
            _frames(
                {
                    "v": PROTOCOL_VERSION,
                    "t": int(MsgType.SAVE),
                    "job": "job1",
                    "f": _save_fields(attempt=ATTEMPT + "\n"),
                }
            ),
            "attempt id",
        ),
        (
            _frames(
                {
                    "v": PROTOCOL_VERSION,
                    "t": int(MsgType.SAVE),
                    "job": "job1",
                    "f": _save_fields(attempt="0123456789ab-0"),
                }
            ),
            "attempt id",
        ),
        (
            _frames(
                {
                    "v": PROTOCOL_VERSION,
                    "t": int(MsgType.IN_FLIGHT_REPLY),
                    "job": "job1",
                    "f": {
                        "attempts": [
                            {
                                "step": -1,
                                "attempt": ATTEMPT,
                                "world_size": 1,
                                "writing": [],
                                "written": [0],
                                "failed": [],
                                "live": False,
                            }
                        ]
                    },
                }
            ),
            "IN_FLIGHT_REPLY: step",
        ),
    ],
)
def test_malformed_messages_are_rejected(frames, why):
    with pytest.raises(ProtocolError, match=re.escape(why)):
        codec.decode(frames)


def _save_frames(items: list, rank: int = 0) -> list[bytes]:
    return _frames(
        {"v": PROTOCOL_VERSION, "t": int(MsgType.SAVE), "job": "job1", "f": _save_fields(rank=rank, items=items)}
    )


def _written_frames(records: list) -> list[bytes]:
    fields = dataclasses.asdict(a_written(rank=1, world_size=2))
    return _frames(
        {"v": PROTOCOL_VERSION, "t": int(MsgType.WRITTEN), "job": "job1", "f": {**fields, "records": records}}
    )


_W = {"fqn": "w", "kind": TENSOR, "rank": 0, "dtype": "float32", "global_shape": [4], "offsets": [0], "sizes": [4]}


@pytest.mark.parametrize(
    "frames, error, why",
    [
        (
            _save_frames([{"record": _W, "offset": 0}]),
            ProtocolError,
            "missing required field `nbytes` - at `$.items[0]`",
        ),
        (
            _save_frames([{"record": {"fqn": "w"}, "offset": 0, "nbytes": 8}]),
            ProtocolError,
            "`kind` - at `$.items[0].record`",
        ),
        (
            _save_frames([{"record": {**_W, "path": [1.5]}, "offset": 0, "nbytes": 16}]),
            ProtocolError,
            "at `$.items[0].record.path[0]`",
        ),
        (
            _save_frames([{"record": {**_W, "dtype": "float7"}, "offset": 0, "nbytes": 16}]),
            ProtocolError,
            "dtype name 'float7'",
        ),
        (
            _save_frames([{"record": {**_W, "sizes": [2, 2]}, "offset": 0, "nbytes": 16}]),
            ProtocolError,
            "rank mismatch",
        ),
        (
            _save_frames([{"record": {**_W, "kind": "blob"}, "offset": 0, "nbytes": 16}]),
            ProtocolError,
            "unknown kind 'blob'",
        ),
        (
            _save_frames([{"record": {**_W, "rank": 1}, "offset": 0, "nbytes": 16}]),
            ProtocolError,
            "sent a record of rank 1",
        ),
        (_save_frames([{"record": _W, "offset": 0, "nbytes": 12}]), StagingError, "has 12 bytes, its shape needs 16"),
        (
            _save_frames([{"record": _W, "offset": 64, "nbytes": 16}, {"record": _W, "offset": 0, "nbytes": 16}]),
            StagingError,
            "overlaps the one before it",
        ),
        (_save_frames([{"record": _W, "offset": -1, "nbytes": 16}]), StagingError, "overlaps the one before it"),
        (
            _written_frames([{"fqn": "x"}]),
            ProtocolError,
            "WRITTEN: Object missing required field `kind` - at `$.records[0]`",
        ),
        (_written_frames([{**_W, "rank": 1, "dtype": "nope"}]), ProtocolError, "dtype name 'nope'"),
        (
            _written_frames([{**_W, "length": 9 << 20, "block_crcs": bytes(8)}]),
            ProtocolError,
            "8 bytes of block checksums for 9437184 stored bytes",
        ),
        (
            _save_frames([{"record": {**_W, "block_crcs": bytes(4)}, "offset": 0, "nbytes": 16}]),
            ProtocolError,
            "4 bytes of block checksums for -1 stored bytes",
        ),
    ],
    ids=[
        "item field missing",
        "record field missing",
        "path part",
        "dtype",
        "shape ranks",
        "kind",
        "another rank's record",
        "size",
        "order",
        "negative offset",
        "WRITTEN record field missing",
        "WRITTEN dtype",
        "WRITTEN block checksums",
        "SAVE block checksums",
    ],
)
def test_items_and_records_are_checked_by_their_types_then_by_the_checks_after(frames, error, why):
    """msgspec refuses what the types say (with the value's path); check_save_items, called by
    the daemon on a SAVE, and check_record, by the coordinator on a WRITTEN's records, the rest."""
    with pytest.raises(error) as info:
        msg = codec.decode(frames)
        if isinstance(msg, Save):
            decode_items(msg.rank, msg.items, capacity=1 << 20)
        elif isinstance(msg, Written):
            for rec in msg.records:
                check_record(rec)
    assert why in str(info.value)


def test_the_daemon_takes_decoded_items_only_if_each_fits_its_ring():
    msg = codec.decode(_save_frames([{"record": _W, "offset": 0, "nbytes": 16}]))
    assert isinstance(msg, Save)
    record = ItemRecord(fqn="w", kind=TENSOR, rank=0, dtype="float32", global_shape=(4,), offsets=(0,), sizes=(4,))
    assert decode_items(msg.rank, msg.items, capacity=16) == ([record], [Placement(0, 16)])
    with pytest.raises(StagingError, match="item 'w' at 0 \\(16 bytes\\) .* does not fit the 8-byte ring"):
        decode_items(msg.rank, msg.items, capacity=8)


def test_size_limit_applies_before_anything_is_unpacked():
    big = a_save(common=b"x" * (1 << 16))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        codec.encode(big)
    roomy = Codec("job1", max_nbytes=1 << 20)
    frames = roomy.encode(big)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        codec.decode(frames)


def test_big_messages_travel_in_frames_no_socket_needs_to_accept_whole():
    roomy = Codec("job1", max_nbytes=8 << 20)
    big = a_save(common=os.urandom(3 * FRAME_NBYTES + 5))
    frames = roomy.encode(big)
    assert len(frames) == 4 and all(len(f) <= FRAME_NBYTES for f in frames)
    assert roomy.decode([bytes(f) for f in frames]) == big
    with pytest.raises(ProtocolError, match="exceeds the limit"):  # the total counts, before joining
        codec.decode(frames)


def test_no_pickle_on_the_wire():
    body = codec.encode(Hello(rank=0, pid=1, root="/r"))[0]
    assert b"\x80\x04" not in body and b"\x80\x05" not in body  # no pickle protocol headers
    assert msgpack.unpackb(body)["t"] == int(MsgType.HELLO)


def test_config_env_overrides_in_one_place():
    env = {
        "CKPTD_STAGING_BUDGET": "0.5x",
        "CKPTD_ON_FULL": "skip",
        "CKPTD_FSYNC": "0",
        "CKPTD_COMMIT_TIMEOUT_S": "12.5",
        "CKPTD_WRITER_THREADS": "3",
        "OTHER": "x",
    }
    cfg = CkptdConfig.from_env(env, keep_last=4)
    assert (cfg.staging_budget, cfg.on_full, cfg.fsync, cfg.commit_timeout_s, cfg.keep_last, cfg.writer_threads) == (
        "0.5x",
        "skip",
        False,
        12.5,
        4,
        3,
    )
    assert CkptdConfig.from_env(cfg.to_env()) == cfg
    with pytest.raises(CkptdError, match="CKPTD_WRITER_THREADS='many' is not a valid int"):
        CkptdConfig.from_env({"CKPTD_WRITER_THREADS": "many"})
    with pytest.raises(CkptdError, match="staging_budget='lots'"):
        CkptdConfig(staging_budget="lots")
    assert parse_budget("1.25x") == (1.25, 0) and parse_budget("8GiB") == (0, 8 << 30)
    assert parse_budget("512 MiB") == (0, 512 << 20) and parse_budget("100000") == (0, 100000)
    with pytest.raises(CkptdError, match="on_full='drop'"):
        CkptdConfig(on_full="drop")
    # Values that passed and failed later, obscurely: NaN (compares false with everything: every
    # write reported FAILED at the first tick), infinity, waits of 0 s, an overflowing budget.
    for bad, why in (
        ({"CKPTD_COMMIT_TIMEOUT_S": "nan"}, "commit_timeout_s=nan: must be a finite number"),
        ({"CKPTD_MTBF_S": "inf"}, "mtbf_s=inf: must be a finite number"),
        ({"CKPTD_REQUEST_TIMEOUT_S": "0"}, "request_timeout_s=0.0: must be > 0"),
        ({"CKPTD_HEARTBEAT_S": "0"}, "heartbeat_s=0.0: must be > 0"),
        ({"CKPTD_MAX_MESSAGE_NBYTES": "0"}, "max_message_nbytes=0: .* use at least"),
        ({"CKPTD_STAGING_BUDGET": "infx"}, "staging_budget='infx'"),
        ({"CKPTD_STAGING_BUDGET": "1e400GiB"}, "staging_budget='1e400GiB'"),
        # policy='auto' without a mean time between failures: refused when made, not by the
        # Checkpointer after it created the root directory.
        ({"CKPTD_POLICY": "auto"}, "policy='auto' needs .* set mtbf_s > 0 \\(CKPTD_MTBF_S\\), got 0.0"),
    ):
        with pytest.raises(CkptdError, match=why):
            CkptdConfig.from_env(bad)
    with pytest.raises(CkptdError, match="set mtbf_s > 0"):
        CkptdConfig(policy="auto")
    assert CkptdConfig(policy="auto", mtbf_s=3600.0).mtbf_s == 3600.0
    with pytest.raises(CkptdError, match="unknown config fields"):
        CkptdConfig.from_env({}, pool_size=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.writer_threads = 5  # type: ignore[misc]  # frozen


def test_the_old_name_of_the_in_flight_wait_still_sets_it_with_a_warning():
    """slot_wait_timeout_s (there are no slots any more) is a deprecated alias of
    in_flight_wait_timeout_s: as a keyword, an override and CKPTD_SLOT_WAIT_TIMEOUT_S; the new
    name wins where both are given, and only the new one is passed on to the daemon."""
    deprecated = "slot_wait_timeout_s is deprecated; use in_flight_wait_timeout_s"
    with pytest.warns(FutureWarning, match=deprecated):
        assert CkptdConfig(slot_wait_timeout_s=7.0).in_flight_wait_timeout_s == 7.0
    with pytest.warns(FutureWarning, match=deprecated):
        assert CkptdConfig.from_env({}, slot_wait_timeout_s=8.0).in_flight_wait_timeout_s == 8.0
    with pytest.warns(
        FutureWarning, match="CKPTD_SLOT_WAIT_TIMEOUT_S is deprecated; use CKPTD_IN_FLIGHT_WAIT_TIMEOUT_S"
    ):
        cfg = CkptdConfig.from_env({"CKPTD_SLOT_WAIT_TIMEOUT_S": "9"})
    assert cfg.in_flight_wait_timeout_s == 9.0
    assert "CKPTD_SLOT_WAIT_TIMEOUT_S" not in cfg.to_env() and CkptdConfig.from_env(cfg.to_env()) == cfg
    with pytest.warns(FutureWarning, match="CKPTD_SLOT_WAIT_TIMEOUT_S is deprecated"):
        both = {"CKPTD_SLOT_WAIT_TIMEOUT_S": "9", "CKPTD_IN_FLIGHT_WAIT_TIMEOUT_S": "5"}
        assert CkptdConfig.from_env(both).in_flight_wait_timeout_s == 5.0
    with pytest.warns(FutureWarning, match=deprecated):
        assert (
            CkptdConfig.from_env({}, slot_wait_timeout_s=8.0, in_flight_wait_timeout_s=4.0).in_flight_wait_timeout_s
            == 4.0
        )
    with (
        pytest.raises(CkptdError, match="CKPTD_SLOT_WAIT_TIMEOUT_S='soon' is not a valid float"),
        pytest.warns(FutureWarning),
    ):
        CkptdConfig.from_env({"CKPTD_SLOT_WAIT_TIMEOUT_S": "soon"})
    with pytest.warns(FutureWarning, match=deprecated):
        old = CkptdConfig(slot_wait_timeout_s=3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # replace() keeps the value and warns no more
        assert old.replace(snapshot_timeout_s=1.0).in_flight_wait_timeout_s == 3.0
