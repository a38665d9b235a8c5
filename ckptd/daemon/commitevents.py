"""What the coordinator's state machine (ckptd.daemon.commitstate) takes and gives: the events the
shell feeds it (:class:`NodeSeen`, :class:`ReportIn` with the root's :class:`RootFacts`,
:class:`CommitEnded`, :class:`Tick`), the actions it returns (:class:`Send`, :class:`Commit`,
:class:`Remove`), and the state of one attempt (:class:`AttemptState`, in a :class:`Phase`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..catalog import WentBack
from ..control.protocol import Failed, Message, Written
from ..format.records import ItemRecord
from ..roots.base import CommitOutcome

Key = tuple[int, str]  # (step, attempt)


class Phase(str, enum.Enum):
    COLLECTING = "collecting"
    READY = "ready"  # every rank wrote; committed once the attempts collected before it are decided
    COMMITTING = "committing"
    COMMITTED = "committed"
    ABORTED = "aborted"


# --- events ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RootFacts:
    """What the root says, asked by the shell before a report is handled (only where
    :meth:`CommitState.asks_holds_commit` / :meth:`CommitState.may_start` say so): whether
    ``iter_<step>`` is committed by the remembered attempt, and whether the step is committed
    already (so it may not be saved again)."""

    holds_commit: bool = True
    committed_once: bool = False
    known: bool = True  # False: the root could not be asked (the fields above are guesses)


@dataclass(frozen=True, kw_only=True)
class NodeSeen:
    """A node daemon pinged: it is told every outcome from now on."""

    identity: bytes


@dataclass(frozen=True, kw_only=True)
class ReportIn:
    """A node's ``WRITTEN`` or ``FAILED``, with the root's answers (:class:`RootFacts`)."""

    identity: bytes
    msg: Written | Failed
    facts: RootFacts = RootFacts()


@dataclass(frozen=True, kw_only=True)
class CommitEnded:
    """The commit thread finished committing an attempt: ``outcome`` or ``error``."""

    step: int
    attempt: str
    outcome: CommitOutcome | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class Tick:
    """Time passed: attempts collecting longer than ``commit_timeout_s`` abort."""


Event = NodeSeen | ReportIn | CommitEnded | Tick


# --- actions -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Send:
    """Send ``msg`` to node ``identity`` (``block``: wait for room rather than drop)."""

    identity: bytes
    msg: Message
    block: bool = False


@dataclass(frozen=True, kw_only=True)
class Commit:
    """Commit the attempt on the commit thread (RootStore.commit; its abort on any error), then
    feed back :class:`CommitEnded`."""

    step: int
    attempt: str
    records: list[ItemRecord]
    common: bytes
    files: dict[str, tuple[int, int]]  # data file name -> (rank, bytes its writer reported)
    elsewhere: frozenset[str] = frozenset()  # node-local root: files on other nodes' disks (unchecked)
    went_back: WentBack | None = None  # every rank's job went back to this step (Save.went_back_to)
    # Every rank named the same step loaded, or none: the commit's parent is known (ckptd.lineage).
    went_back_agreed: bool = True
    seq_floor: int = 0  # the commit is numbered above it (node-local: every node's disk's, Written.disk_seq)


@dataclass(frozen=True, kw_only=True)
class Remove:
    """Remove the attempt's files (RootStore.abort on the commit thread, after any commit queued)."""

    step: int
    attempt: str


Action = Send | Commit | Remove


@dataclass
class AttemptState:
    step: int
    attempt: str
    world_size: int
    started_s: float
    records: dict[int, list[ItemRecord]] = field(default_factory=dict)
    file_nbytes: dict[int, int] = field(default_factory=dict)  # rank -> its data file's size
    nodes: dict[int, int] = field(default_factory=dict)  # rank -> node that reported it
    common: bytes | None = None
    digests: dict[int, str] = field(default_factory=dict)  # rank -> digest of its common state
    plain: dict[int, str] = field(default_factory=dict)  # rank -> digest of its plain keys
    held: dict[int, list[str]] = field(default_factory=dict)  # rank -> keys it holds, not stores
    went_back: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> its WRITTEN's (Save)
    disk_seq: int = 0  # the highest Written.disk_seq: node 0 numbers the commit above it
    report_ids: set[int] = field(default_factory=set)  # of the WRITTENs taken (identical repeats too)
    warnings: list[str] = field(default_factory=list)  # what the commit noticed (plain copies)
    phase: Phase = Phase.COLLECTING
    reporters: set[bytes] = field(default_factory=set)
    adopted: bool = False  # found as <step>.<attempt>.tmp when this coordinator started

    @property
    def key(self) -> Key:
        return (self.step, self.attempt)

    def describe(self) -> str:
        ranks = sorted(self.records)
        nodes = sorted(set(self.nodes.values()))
        return f"ranks {ranks} (nodes {nodes}) saved attempt {self.attempt}"
