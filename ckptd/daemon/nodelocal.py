"""A node daemon's part of commits on a node-local root (the protocol: ckptd.roots.nodelocal), on
every node but the coordinator's, whose directory the commit itself renamed.

Order, for each verdict the coordinator sends (:meth:`NodeLocalCommits.takes`, called by the
link before the verdict reaches the uplink's state machine):

- STEP_COMMITTED is held back from the ranks while the commit thread writes the commit's files
  next to this node's data files and renames the directory (``PosixRoot.finish_on_node``); when
  it is done (:meth:`NodeLocalCommits.done`) the verdict goes on to the ranks, with a warning if
  this node's disk could not take the commit (the step is committed: node 0 renamed its
  directory; this node's files stay in the attempt's directory, where the mirror and a resume
  find them);
- STEP_ABORTED goes on at once, and this node's files of the attempt are removed (the commit
  thread: after any commit of the step queued before). A node's own local abort (it lost the
  coordinator) never comes here: the coordinator may still commit that attempt.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

from ..control.protocol import Message, StepAborted, StepCommitted
from ..errors import CkptdError
from ..format.rootlayout import step_dir_name, tmp_dir_name
from ..roots.base import CommitOutcome
from ..roots.posix_root import PosixRoot
from .workers import NodeCommitFinished, WorkerPools

log = logging.getLogger(__name__)


class NodeLocalCommits:
    def __init__(self, store: PosixRoot, workers: WorkerPools) -> None:
        self.store = store
        self.workers = workers

    def takes(self, verdict: Message) -> bool:
        """Act on a coordinator's verdict; True when it is held back until :meth:`done`."""
        if isinstance(verdict, StepAborted):
            step, attempt = verdict.step, verdict.attempt
            self.workers.cleanup(step, attempt, functools.partial(self.store.abort, step, attempt))
            return False
        if isinstance(verdict, StepCommitted):
            self.workers.node_commit(verdict, functools.partial(self._finish, verdict))
            return True
        return False

    def _finish(self, verdict: StepCommitted) -> CommitOutcome:
        step, attempt = verdict.step, verdict.attempt
        if verdict.local_files:
            return self.store.finish_on_node(step, attempt, verdict.local_files)
        if self.store.holds_commit(step, attempt):
            return CommitOutcome(name=step_dir_name(step))
        raise CkptdError(
            "the coordinator's verdict came without the commit's files (a repeated verdict of an old "
            "commit, or metadata larger than half of CKPTD_MAX_MESSAGE_NBYTES)"
        )

    def done(self, done: NodeCommitFinished) -> StepCommitted:
        """The held verdict, to deliver now (without the files; with a warning on failure)."""
        verdict: StepCommitted = done.verdict
        warnings = list(verdict.warnings)
        if done.error is not None:
            where = self.store.display(tmp_dir_name(verdict.step, verdict.attempt))
            warning = (
                f"step {verdict.step} is committed (on the coordinator's node), but not on this node's disk: "
                f"{done.reason}. This node's files of it stay in {where}, where the mirror copy and a resume "
                "find them"
            )
            log.warning("%s", warning)
            warnings.append(warning)
        elif isinstance(done.result, CommitOutcome):
            warnings += [w for w in done.result.warnings if w not in warnings]  # e.g. this disk's tracker failed
        return replace(verdict, local_files={}, warnings=warnings)
