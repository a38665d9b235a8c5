"""The control-plane protocol: typed messages, msgpack on CurveZMQ sockets keyed by the job token.

Parties: *rank* (a Checkpointer in a training process), *daemon* (one per node), *coordinator*
(one per job, inside node 0's daemon). Ranks talk to their node's daemon over ``ipc://`` (DEALER
-> ROUTER); daemons talk to the coordinator over ``tcp://`` (DEALER -> ROUTER).

Order of calls for one save of step ``s`` (who sends each message):

1. rank -> daemon ``HELLO`` -> ``WELCOME`` once per connection (handshake: protocol version,
   job, daemon instance; a new instance means the daemon restarted and unacknowledged saves
   are lost; the HELLO's pid must be the connecting process's). Node daemons say no HELLO to
   the coordinator: daemon -> coordinator ``PING`` -> ``PONG`` every heartbeat tells the
   coordinator's liveness and instance (a new one: it restarted). Daemon and coordinator answer
   a ``PING`` from any authenticated peer.
2. rank -> daemon ``REGISTER_RING`` -> ``RING_OK`` once per staging ring: from then on the daemon
   owns its shared-memory segment (and unlinks it); only this connection saves from it.
   ``prepare()`` then sends rank -> daemon ``REGISTER_LAYOUT`` -> ``LAYOUT_OK``: the item list of the
   saves to come, checked and kept as a SAVE's, so that the first SAVE names it by id.
3. rank takes a control block and the next range of its staging ring (ckptd.staging.ring), starts
   producing its shards into it (a fork child, a copier thread, or itself), then rank -> daemon
   ``SAVE`` -> ``SAVE_ACK``; the daemon now owns the save and ``save()`` returns. When the ring
   is busy and the policy is ``skip``, rank -> daemon ``SKIP`` (``skipped``) -> ``SAVE_ACK`` instead;
   a rank that cannot save the step at all (a bad state dict) sends ``SKIP`` without ``skipped``.
   Either way the step aborts everywhere at once, the daemon passing it on as a ``FAILED``.
4. daemon writes ``__<rank>_0.distcp`` into ``<step>.<attempt>.tmp/`` as the items are produced
   (one save per ring at a time, in order, freeing ring space behind it), fsyncs it, then daemon ->
   rank ``WRITE_DONE`` and daemon -> coordinator ``WRITTEN`` (stored records and the file's size,
   the keys the rank holds without storing them, its plain-key digest; rank 0 adds the common
   state). A failed write sends ``FAILED`` instead. Both are addressed to the coordinator
   instance the node's last ``PONG`` named (none goes out before a first ``PONG``); a coordinator
   drops a report addressed to another instance (its predecessor's, sent as it restarted).
5. coordinator, once every rank of the world wrote that attempt: keeps one copy of each plain
   item several ranks wrote, checks that every key some rank holds is stored and validates
   coverage, writes the metadata files, checks every data file's size, renames
   ``<step>.<attempt>.tmp`` -> ``<step>``, fsyncs, replaces the tracker, then coordinator ->
   daemons ``STEP_COMMITTED`` (with the plain-key digest if every rank sent the same one); on any
   failure or timeout ``STEP_ABORTED`` (reason; ``skipped`` when the first report that ended the
   attempt was a rank's policy skip: the ranks resolve their saves of it as SKIPPED, not as
   failures).
6. daemon -> ranks that saved step ``s`` in that attempt: ``STEP_COMMITTED`` / ``STEP_ABORTED``.
7. rank -> daemon ``BYE`` when the Checkpointer closes (the daemon frees its ring once idle).

``IN_FLIGHT`` -> ``IN_FLIGHT_REPLY``: before a resume chooses its checkpoint, every rank asks its
node daemon which attempts it holds undecided, and the ranks wait for those that can still commit
(a relaunch must not resume the step before one its predecessor's daemons are committing); rank 0
sends ``ABANDON`` -> ``SAVE_ACK`` for each that never can (ckptd.client.settle).
``STATUS`` -> ``STATUS_REPLY`` and ``SHUTDOWN`` -> ``SHUTDOWN_ACK`` serve tools and tests. Any
request can be answered with ``ERROR`` (reason).

Every save carries its attempt id (``<incarnation>-<n>``, :mod:`ckptd.control.attempt`) from
SAVE to the outcome: a report is only ever counted for the attempt it names.

Security: every socket runs CurveZMQ with keys derived from the job token
(:mod:`ckptd.control.keys`): peers without the token cannot complete a handshake, and every frame
is encrypted and authenticated within its session (a frame replayed on another connection, or
twice, is refused by the session's nonces). On top of that, a message is a msgpack map
``{"v": version, "t": type, "job": job id, "f": {fields}}``, sent in frames of at most
:data:`FRAME_NBYTES`, so that every socket refuses larger frames, also from peers that have not
authenticated yet. A receiver checks the size limit before it unpacks anything, then the version,
job, type and that the fields are exactly the message's; msgspec then decodes the fields straight
into the message's dataclass (every field's type, down to each SAVE item and WRITTEN record), and
steps and attempt ids are checked to be in range. Anything else is rejected with
:class:`ProtocolError`, which names msgspec's path to the offending value (never pickle, never
eval): :mod:`ckptd.control.codec`. What a record's or an item's types cannot say is checked by
:mod:`ckptd.control.itemchecks`, where the message is handled (so that a SAVE is answered with an
ERROR, and a WRITTEN aborts its attempt, naming the problem).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

from ..format.records import ItemRecord

# 12: WRITTEN and FAILED name the coordinator instance they are addressed to (a coordinator of 11
# would count a report meant for its predecessor). 13: STEP_COMMITTED carries a node-local commit's
# files to the node daemons (a node of 12 would tell its ranks committed without committing on its disk).
# 14: REGISTER_LAYOUT. 15: ERROR names the refused request's type and attempt (a version check refuses
# every message of another version). 16: item records carry block checksums (``block_crcs``).
# 17: IN_FLIGHT and ABANDON (a resume waits for the commits its predecessor left in flight, and
# aborts those that can never commit). 18: HELLO names the coordinator address the rank's launch
# expects (a node daemon left by an earlier launch follows a coordinator that moved);
# WRITTEN names the save it reports (a resend is answered from memory once committed).
# 19: SAVE and WRITTEN say whether the job went back to an older step (``went_back_to``).
# 20: WRITTEN carries its node-local disk's highest commit number (``disk_seq``). 21: item records
# say whether other ranks may store copies of their chunk that must be equal (``replicated``).
PROTOCOL_VERSION = 21
# Written.report_id: 8 bytes of a SAVE's seal, as a number.
MAX_REPORT_ID = (1 << 64) - 1
# A daemon's instance (``<pid>-<8 hex>``), as a PONG or WELCOME names it and a report is addressed
# to it: bounded, so that a node can tell before it addresses a report that it fits the message
# limit (ckptd.daemon.intake.sendable).
MAX_INSTANCE_NBYTES = 64
# Times a message may name (seconds since the epoch; NaN fails the bound).
MAX_UNIX_S = 1e11
# A message's body travels in frames of at most this many bytes (the last one shorter). libzmq
# buffers a whole frame before anyone looks at it, during a handshake too: sockets refuse frames
# above this (ckptd.control.channel), which bounds what a stranger's connection can make the
# daemon hold, whatever the message size limit.
FRAME_NBYTES = 1 << 20


class MsgType(enum.IntEnum):
    PING = 1
    PONG = 2
    HELLO = 3
    WELCOME = 4
    ERROR = 5
    REGISTER_RING = 10
    RING_OK = 11
    SAVE = 12
    SAVE_ACK = 13
    SKIP = 14
    WRITE_DONE = 15
    BYE = 16
    REGISTER_LAYOUT = 17
    LAYOUT_OK = 18
    STEP_COMMITTED = 20
    STEP_ABORTED = 21
    WRITTEN = 30
    FAILED = 31
    STATUS = 40
    STATUS_REPLY = 41
    SHUTDOWN = 42
    SHUTDOWN_ACK = 43
    IN_FLIGHT = 44
    IN_FLIGHT_REPLY = 45
    ABANDON = 46


@dataclass(frozen=True, kw_only=True)
class Message:
    TYPE: ClassVar[MsgType]


@dataclass(frozen=True, kw_only=True)
class Ping(Message):
    TYPE: ClassVar[MsgType] = MsgType.PING
    nonce: int


@dataclass(frozen=True, kw_only=True)
class Pong(Message):
    TYPE: ClassVar[MsgType] = MsgType.PONG
    nonce: int
    instance: str  # the answering daemon's (a new one: it restarted)
    pid: int  # its process (tools check that they talk to the daemon they started)


@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """rank -> daemon, first on a connection: the rank this connection speaks for, its process
    (checked against the connection's kernel credentials) and the checkpoint root it saves into.
    (Node daemons do not say HELLO to the coordinator: their first PING opens the connection.)

    ``coordinator``: where this rank's launch has the coordinator (``tcp://host:port``; the address
    to bind on the coordinator's node, to connect to on the others), "" when it names no port. A
    node daemon an earlier launch started follows it (ckptd.daemon.node: the coordinator moved when
    MASTER_ADDR/MASTER_PORT changed between launches)."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    rank: int
    pid: int
    root: str
    coordinator: str = ""


@dataclass(frozen=True, kw_only=True)
class Welcome(Message):
    TYPE: ClassVar[MsgType] = MsgType.WELCOME
    instance: str
    pid: int  # the daemon's process: the rank watches it (a pid-file lock held by another pid is a new daemon)


@dataclass(frozen=True, kw_only=True)
class ErrorReply(Message):
    TYPE: ClassVar[MsgType] = MsgType.ERROR
    reason: str
    step: int | None  # of the refused request, if it names one: a late error is not taken for another's
    code: str = ""  # what the client must do, when it can act on it (ckptd.errors.ProtocolError.code)
    request: int = 0  # the refused request's MsgType (0: unknown), likewise
    refused_attempt: str = ""  # the refused request's attempt id, if it names one, likewise


@dataclass(frozen=True, kw_only=True)
class RegisterRing(Message):
    """rank -> daemon: the rank's staging ring, one segment (created by the rank, 0600) whose data
    region holds ``ring_nbytes`` bytes (ckptd.staging.ring)."""

    TYPE: ClassVar[MsgType] = MsgType.REGISTER_RING
    rank: int
    generation: str
    ring_nbytes: int
    names: list[str]


@dataclass(frozen=True, kw_only=True)
class RingOk(Message):
    TYPE: ClassVar[MsgType] = MsgType.RING_OK
    generation: str


@dataclass(frozen=True, kw_only=True)
class SaveItem:
    """One item of a SAVE: its record and where its bytes are in the ring, ``offset`` relative to
    the SAVE's ``ring_start``."""

    record: ItemRecord
    offset: int
    nbytes: int


# The ring offsets a SAVE may name: far above any ring, far below an int64's end.
MAX_RING_OFFSET = 1 << 62


@dataclass(frozen=True, kw_only=True)
class Save(Message):
    """rank -> daemon. ``items``: :class:`SaveItem` in write order, offsets relative to
    ``ring_start``, the save's virtual start in the rank's staging ring (ckptd.staging.ring);
    ``block`` is the save's control block in the ring's header;
    ``common`` is the serialized common state (global rank 0 only).

    ``layout``: an id the rank gives this item list ("" for none). The daemon keeps the last
    layout per ring; a later SAVE with the same id and no ``items`` reuses it (same records at
    the same relative offsets: the rank's state kept its structure).

    ``snapshot_pid``: who produces the items into the ring while the daemon writes them: a
    forked child of the rank (ckptd.staging.fork) or the rank's own process (lazy snapshots and
    copies inside ``save()``); it publishes its progress and finally writes ``seal`` in the
    control block at ``seal_offset``.

    ``common_digest``: a digest of this rank's common state ("" when not computed), compared by
    the coordinator across ranks (ckptd.statedict.digest).

    ``plain_digest``: a digest of the rank's DCP-style plain keys ("" for Megatron-style state
    dicts; ckptd.statedict.holdings), compared by the coordinator across ranks. ``held``: the keys
    (unique keys of ShardedObjects) the rank holds but stores no item of (replicas, plain items
    another rank writes), for the coordinator's coverage check (ckptd.format.coverage); sent with
    the items, so a SAVE that reuses a layout reuses its ``held`` too."""

    TYPE: ClassVar[MsgType] = MsgType.SAVE
    step: int
    attempt: str
    rank: int
    world_size: int
    generation: str
    block: int
    items: list[SaveItem]
    common: bytes | None
    common_digest: str
    layout: str
    ring_start: int
    snapshot_pid: int
    seal: bytes
    seal_offset: int
    plain_digest: str = ""
    held: list[str] = field(default_factory=list)
    # The step the rank's job last loaded (-1: none) and when (ckptd.catalog.WentBack): a save of a
    # step above it committed before that replaces the commit (not on node-local disks), and the
    # commit descends from what it loaded (ckptd.lineage); the coordinator takes it from every
    # rank's WRITTEN alike.
    went_back_to: int = -1
    went_back_unix_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class RegisterLayout(Message):
    """rank -> daemon, from ``prepare()``: the item list of the saves to come from ring
    ``generation``, under the id ``layout``, with the keys the rank holds without storing them.
    The daemon checks and keeps it as it does a SAVE's items (see :class:`Save`), so the first
    SAVE of that structure sends only the id: its stall is then a steady save's."""

    TYPE: ClassVar[MsgType] = MsgType.REGISTER_LAYOUT
    rank: int
    generation: str
    layout: str
    items: list[SaveItem]
    held: list[str]


@dataclass(frozen=True, kw_only=True)
class LayoutOk(Message):
    TYPE: ClassVar[MsgType] = MsgType.LAYOUT_OK
    layout: str


@dataclass(frozen=True, kw_only=True)
class Skip(Message):
    """rank -> daemon: this rank will not save ``step``; the step aborts on every rank at once.
    ``skipped``: by the ``on_full="skip"`` policy (the other ranks' saves of the step resolve as
    SKIPPED), not a failure (a state dict the rank could not save: they fail with ``reason``)."""

    TYPE: ClassVar[MsgType] = MsgType.SKIP
    step: int
    attempt: str
    rank: int
    world_size: int
    reason: str
    skipped: bool = False


@dataclass(frozen=True, kw_only=True)
class SaveAck(Message):
    TYPE: ClassVar[MsgType] = MsgType.SAVE_ACK
    step: int
    attempt: str


@dataclass(frozen=True, kw_only=True)
class WriteDone(Message):
    """daemon -> rank: the write of a save finished (or failed); its control block ``block`` and
    its ring space are free again."""

    TYPE: ClassVar[MsgType] = MsgType.WRITE_DONE
    generation: str
    block: int
    step: int
    attempt: str
    write_s: float  # how long the daemon took to write and fsync the rank's data file
    queue_s: float  # how long the write waited for a writer thread
    snapshot_s: float  # how long the write then waited for the rank's snapshot child to finish copying


@dataclass(frozen=True, kw_only=True)
class Bye(Message):
    TYPE: ClassVar[MsgType] = MsgType.BYE


@dataclass(frozen=True, kw_only=True)
class StepCommitted(Message):
    """``warnings``: what the commit noticed but did not refuse (ranks whose common state differed
    from rank 0's, which is the one saved; plain items whose copies differed). ``plain_digest``:
    the plain-key digest every rank sent, "" when they differed (a rank that sent it may leave
    plain items to other ranks from now on: ckptd.statedict.holdings)."""

    TYPE: ClassVar[MsgType] = MsgType.STEP_COMMITTED
    step: int
    attempt: str
    name: str
    warnings: list[str]
    plain_digest: str = ""
    # Node-local roots (ckptd.roots.nodelocal), coordinator -> node daemons only: the commit's
    # files, name -> bytes, which each node writes next to its own data files before its ranks
    # are told (ranks never receive them).
    local_files: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class StepAborted(Message):
    """``skipped``: the attempt ended because a rank skipped the step by policy (``on_full="skip"``);
    its ranks resolve their saves as SKIPPED, never as an error raised later."""

    TYPE: ClassVar[MsgType] = MsgType.STEP_ABORTED
    step: int
    attempt: str
    reason: str
    skipped: bool = False


@dataclass(frozen=True, kw_only=True)
class Written(Message):
    """daemon -> coordinator: rank's data file is durable; ``records`` are its stored items,
    ``file_nbytes`` the size of the data file as written (the coordinator checks it before the
    commit); ``plain_digest`` and ``held`` are the SAVE's. ``coordinator_instance``: the
    coordinator this report is addressed to (see :class:`Failed`)."""

    TYPE: ClassVar[MsgType] = MsgType.WRITTEN
    step: int
    attempt: str
    rank: int
    world_size: int
    node: int
    records: list[ItemRecord]
    common: bytes | None
    common_digest: str
    file_nbytes: int
    plain_digest: str = ""
    held: list[str] = field(default_factory=list)
    went_back_to: int = -1  # the SAVE's (see Save)
    went_back_unix_s: float = 0.0
    coordinator_instance: str = ""
    # Node-local roots: the highest commit number on the node's disk when it wrote. Node 0 numbers
    # its commit above every node's (ckptd.roots.posix.commit_step): a replaced node 0 disk would
    # number from 1 again, below the other disks' commits of the old one. 0: none or not node-local.
    disk_seq: int = 0
    # Which save of the rank this reports: its SAVE's seal (random per save), as a number. A
    # coordinator answers from memory a report it counted for a commit (a node's resend after a lost
    # verdict), also once retention or a rollback retired that commit; any other report of a
    # remembered attempt (a relaunch that repeated the attempt id) asks the root
    # (ckptd.daemon.commitstate.CommitState.asks_holds_commit). 0: none.
    report_id: int = 0


@dataclass(frozen=True, kw_only=True)
class Failed(Message):
    """daemon -> coordinator: ``rank`` (-1: the node itself) will not write this attempt.
    ``skipped``: the rank skipped the step by policy (a :class:`Skip` with ``skipped``).

    ``coordinator_instance``: the coordinator instance the node daemon last heard from (its
    ``PONG``), set by the node's link when it sends the report (ckptd.daemon.uplinkstate; the
    node sends no report before a coordinator answered). A coordinator refuses a report
    addressed to another instance: one sent to its predecessor may reach it after a restart,
    while the node, learning of the restart, aborts that attempt.

    ``handed_off``: of a relaunch's :class:`Abandon` (``rank`` -1): the ranks whose saves of the
    attempt it found at the node daemons. The coordinator keeps an attempt whose reports and these
    ranks make up its world (they report once written), and aborts it on every node otherwise.
    ``abandoned_by``: of the :class:`Abandon` ranks sent for the saves their dead node daemon held:
    those ranks (every one of the node that asked so far). The attempt is kept when every one's
    report was counted (the dead daemon wrote and reported them); [] otherwise."""

    TYPE: ClassVar[MsgType] = MsgType.FAILED
    step: int
    attempt: str
    rank: int
    world_size: int
    node: int
    reason: str
    skipped: bool = False
    coordinator_instance: str = ""
    handed_off: list[int] = field(default_factory=list)
    abandoned_by: list[int] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Status(Message):
    TYPE: ClassVar[MsgType] = MsgType.STATUS


@dataclass(frozen=True, kw_only=True)
class StatusReply(Message):
    TYPE: ClassVar[MsgType] = MsgType.STATUS_REPLY
    info: dict


@dataclass(frozen=True, kw_only=True)
class AttemptInFlight:
    """An attempt a node daemon took saves of and holds no verdict for: the ranks whose data files
    it is still ``writing``, has reported ``written``, or reported ``failed`` (a failed write, a
    skip), of the attempt's ``world_size``; ``live``: a process that handed one of them off is
    still connected (its launch runs: neither waited for nor abandoned by a resume)."""

    step: int
    attempt: str
    world_size: int
    writing: tuple[int, ...]
    written: tuple[int, ...]
    failed: tuple[int, ...]
    live: bool


@dataclass(frozen=True, kw_only=True)
class InFlight(Message):
    """rank -> daemon: which attempts does the node hold undecided? (A resume waits for those that
    can still commit: ckptd.client.settle.)"""

    TYPE: ClassVar[MsgType] = MsgType.IN_FLIGHT


@dataclass(frozen=True, kw_only=True)
class InFlightReply(Message):
    TYPE: ClassVar[MsgType] = MsgType.IN_FLIGHT_REPLY
    attempts: list[AttemptInFlight]


@dataclass(frozen=True, kw_only=True)
class Abandon(Message):
    """rank -> daemon -> ``SAVE_ACK``: attempt ``(step, attempt)`` of an earlier launch looks unable
    to commit: only the ranks ``handed_off`` gave their saves of it to the node daemons, and nobody
    that did is alive. The node daemon asks the coordinator to abort it (a :class:`Failed` of the
    node), which does unless the ranks that reported it make up the rest of its world (a node
    daemon that reported them died since); either way every node learns the verdict, so that the
    relaunch's own save of the step is not refused as a second attempt of it. Sent by a resume's
    rank 0 (ckptd.client.settle; ``abandoning_rank`` -1); and, with no rank ``handed_off``, by a rank
    whose node daemon died holding its save of the attempt, to the next daemon
    (ckptd.client.session; ``abandoning_rank`` that rank): the attempt ends unless its commit began
    or that rank's report of it was counted (the dead daemon wrote and reported it: it commits).
    """

    TYPE: ClassVar[MsgType] = MsgType.ABANDON
    step: int
    attempt: str
    reason: str
    handed_off: list[int]
    abandoning_rank: int = -1


@dataclass(frozen=True, kw_only=True)
class Shutdown(Message):
    TYPE: ClassVar[MsgType] = MsgType.SHUTDOWN


@dataclass(frozen=True, kw_only=True)
class ShutdownAck(Message):
    TYPE: ClassVar[MsgType] = MsgType.SHUTDOWN_ACK


REGISTRY: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Ping,
        Pong,
        Hello,
        Welcome,
        ErrorReply,
        RegisterRing,
        RingOk,
        RegisterLayout,
        LayoutOk,
        Save,
        Skip,
        SaveAck,
        WriteDone,
        Bye,
        StepCommitted,
        StepAborted,
        Written,
        Failed,
        Status,
        StatusReply,
        Shutdown,
        ShutdownAck,
        InFlight,
        InFlightReply,
        Abandon,
    )
}
