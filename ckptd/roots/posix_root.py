"""A checkpoint root in a local or shared POSIX directory: rename commits (ckptd.roots.base)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from ..catalog import RootCatalog, WentBack, abandoned_commit, committed_once, left_by, scan_root
from ..errors import CkptdError
from ..format.commitrecord import read_commit_record
from ..format.direct import open_data_file
from ..format.durable import Opener, default_opener, make_dirs_durably
from ..format.layout import data_file_name
from ..format.records import ItemRecord
from ..format.rootlayout import step_dir_name, tmp_dir
from .base import CommitOutcome, Recovery
from .nodelocal import finish_on_node, travelling_files
from .posix import commit_step, damaged_commit, finish_interrupted_commit, remove_all_tmp, remove_tmp, tmp_attempts
from .posix_data import PosixDataTarget

log = logging.getLogger(__name__)


class PosixRoot:
    """``root`` on a filesystem. ``data_opener`` opens data files (O_DIRECT by default),
    ``opener`` the commit's metadata files and trackers: fault tests pass openers that fail or
    slow down writes (ckptd.daemon.faults), the one place faults enter. ``node_local``: the root
    is each node's own disk (ckptd.roots.nodelocal)."""

    def __init__(
        self,
        root: Path,
        *,
        fsync: bool = True,
        keep_last: int = 0,
        megatron_tracker: bool = True,
        data_opener: Opener = open_data_file,
        opener: Opener = default_opener,
        node_local: bool = False,
        message_nbytes: int = 64 << 20,
    ) -> None:
        self.location = Path(root)
        self.fsync = fsync
        self.keep_last = keep_last
        self.megatron_tracker = megatron_tracker
        self.data_opener = data_opener
        self.opener = opener
        self.node_local = node_local
        self.message_nbytes = message_nbytes  # a node-local commit's files travel in one message

    def __repr__(self) -> str:
        return f"PosixRoot({self.location})"

    def display(self, *parts: str) -> str:
        return str(self.location.joinpath(*parts))

    def data_file_name(self, attempt: str, rank: int) -> str:
        return data_file_name(rank)  # the attempt's own directory keeps attempts apart

    def data_target(self, step: int, attempt: str, rank: int) -> PosixDataTarget:
        return PosixDataTarget(tmp_dir(self.location, step, attempt), rank, self.data_opener, self.fsync)

    def commit(
        self,
        step: int,
        attempt: str,
        records: list[ItemRecord],
        common: bytes,
        data_files: Mapping[str, tuple[int, int]],
        *,
        elsewhere: frozenset[str] = frozenset(),
        went_back: WentBack | None = None,
        went_back_agreed: bool = True,
        seq_floor: int = 0,
    ) -> CommitOutcome:
        outcome = commit_step(
            self.location,
            step,
            attempt,
            records,
            common,
            data_files,
            fsync=self.fsync,
            keep_last=self.keep_last,
            megatron_tracker=self.megatron_tracker,
            opener=self.opener,
            elsewhere=elsewhere,
            node_local=self.node_local,
            went_back=went_back,
            went_back_agreed=went_back_agreed,
            seq_floor=seq_floor,
        )
        if not self.node_local:
            return outcome
        files = travelling_files(outcome.files, self.message_nbytes // 2, self.location / outcome.name)
        return replace(outcome, files=files)

    def finish_on_node(self, step: int, attempt: str, files: dict[str, bytes]) -> CommitOutcome:
        """A node-local root: commit on this node's disk what the coordinator committed
        (ckptd.roots.nodelocal.finish_on_node)."""
        return finish_on_node(
            self.location,
            step,
            attempt,
            files,
            fsync=self.fsync,
            keep_last=self.keep_last,
            megatron_tracker=self.megatron_tracker,
            opener=self.opener,
        )

    def abort(self, step: int, attempt: str) -> None:
        remove_tmp(self.location, step, attempt)

    def holds_commit(self, step: int, attempt: str, went_back: WentBack | None = None) -> bool:
        record = read_commit_record(self.location / step_dir_name(step))
        if record is None or record.step != step or record.attempt != attempt:
            return False
        if not self.node_local and left_by(went_back, step, record.committed_unix_s):
            return False
        return not abandoned_commit(self.location, step, record.seq)

    def committed_once(self, step: int, went_back: WentBack | None = None) -> bool:
        """Committed, on the current branch, not one a job that ``went_back`` left, and
        structurally intact: a damaged commit may be saved again (ckptd.roots.posix.damaged_commit,
        which the commit asks again)."""
        if self.node_local:
            return committed_once(self.location, step)
        if not os.path.lexists(self.location / step_dir_name(step)):
            return False
        cat = scan_root(self.location, usage=False)  # one scan for every rule below
        if cat.superseded(step, went_back) is not None:
            return False
        if cat.left_between(step, went_back):
            return True  # not replaced, damaged or not (see commit_step)
        try:
            return damaged_commit(cat, step_dir_name(step), self.location / step_dir_name(step))[0] is None
        except (CkptdError, OSError):  # removed or unreadable meanwhile: the commit decides again
            return False

    def recover(self, *, nnodes: int) -> Recovery:
        """Finish a commit a crash interrupted after its rename; then remove every attempt's
        directory (one node: nothing can be in flight) or adopt them (several nodes: another node
        may still be writing)."""
        make_dirs_durably(self.location, fsync=self.fsync)
        finished = finish_interrupted_commit(self.location, fsync=self.fsync, megatron_tracker=self.megatron_tracker)
        if nnodes == 1:
            return Recovery(finished=finished, removed=remove_all_tmp(self.location))
        return Recovery(finished=finished, adopted=tmp_attempts(self.location))

    def scan(self, *, usage: bool = True) -> RootCatalog:
        return scan_root(self.location, usage=usage)

    def highest_commit_seq(self) -> int:
        return self.scan(usage=False).highest_commit_seq

    def checkpoint_location(self, step: int) -> Path:
        return self.location / step_dir_name(step)

    def exists(self) -> bool:
        return os.path.isdir(self.location)
