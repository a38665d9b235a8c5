"""The mirror thread of a node daemon: copies locally committed steps to the object-store mirror in
the background (what to copy and how: ckptd.roots.mirror; on node-local disks of several nodes:
ckptd.roots.mirror_nodes).

Roles: node 0's thread (the coordinator's daemon) decides what to copy and commits the copies: from
its own root alone (a shared or one-node root), or, with ``node_local`` and several nodes, by
coordinating a copy round with the other nodes' threads through the store. Node k's thread (k >= 1,
``node_local`` only) answers node 0's requests with the files its disk holds, and never removes
anything in the mirror.

Order: :meth:`MirrorUploader.start` (node 0's first pass removes what a crashed upload left in the
mirror, then copies the local latest if the mirror lacks it; node k's polls for requests);
:meth:`MirrorUploader.kick` after every local commit; :meth:`MirrorUploader.busy` keeps the daemon
alive while a copy is due or running; :meth:`MirrorUploader.stop` at the daemon's exit (an upload
still running is abandoned: the next start of node 0's daemon removes its objects and copies the
step again).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import CkptdError, CopyRoundError, CorruptCheckpointError
from ..format.rootlayout import step_dir_name
from ..roots.copyround import REQUEST_KEY, CopyRequest, copier_due, should_answer
from ..roots.mirror import (
    RETRY_AFTER_S,
    CommitRef,
    FailedUpload,
    local_latest,
    mirror_step,
    mirrored_latest,
    next_upload,
    note_mirrored,
)
from ..roots.mirror_nodes import (
    MANIFEST_POLL_S,
    REQUEST_POLL_S,
    answer_request,
    coordinate_copy,
    poll_request,
    sweep_round,
    withdraw_stale_request,
)
from ..roots.s3_root import S3Root
from ..s3catalog import read_s3_commit_record, read_s3_tracker

log = logging.getLogger(__name__)

# How long node 0 waits for every node's manifest in one round, when not told (the daemon passes
# config mirror_timeout_s).
ROUND_TIMEOUT_S = 600.0


class MirrorUploader:
    """The mirror thread of node ``node`` of ``nnodes``. ``node_local``: ``root`` is that node's
    own disk (with several nodes, copies are coordinated rounds: ckptd.roots.mirror_nodes);
    ``round_timeout_s``: node 0's deadline for every node's part of a round (and how long node k
    stays busy after a local commit that no round copied yet); ``poll_s``: how often node k asks
    for a request, or node 0 for the manifests (default :data:`REQUEST_POLL_S` /
    :data:`MANIFEST_POLL_S`)."""

    def __init__(
        self,
        root: Path,
        mirror: S3Root,
        *,
        node: int = 0,
        nnodes: int = 1,
        node_local: bool = False,
        retry_after_s: float = RETRY_AFTER_S,
        round_timeout_s: float = ROUND_TIMEOUT_S,
        poll_s: float | None = None,
    ) -> None:
        if not 0 <= node < max(nnodes, 1) or (node > 0 and not node_local):
            raise CkptdError(
                f"a mirror thread for node {node} of {nnodes}: only node 0 copies unless the root is node-local"
            )
        self.root = root
        self.mirror = mirror
        self.node = node
        self.nnodes = nnodes
        self.coordinated = node_local and nnodes > 1  # copy rounds across the nodes' disks
        self.retry_after_s = retry_after_s
        self.round_timeout_s = round_timeout_s
        self.poll_s = poll_s if poll_s is not None else (REQUEST_POLL_S if node else MANIFEST_POLL_S)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._due = node == 0  # node 0: a pass is due (set by kick(), cleared when a pass found nothing to copy)
        self._kicked_at_s: float | None = None  # node k: when a local commit last happened
        self._uploading: CommitRef | None = None
        self._failed: FailedUpload | None = None
        self._failed_node: int | None = None
        self._mirrored: CommitRef | None = None
        self._marked: str | None = None  # the step name MIRRORED_FILE holds, as this thread wrote it
        self._answered: CommitRef | None = None  # node k: the commit of the last round it answered
        self._last: dict[str, Any] | None = None
        self._error = ""
        self._round: CopyRequest | None = None  # node 0: the round in progress
        # node 0: failed rounds to sweep again, (when, step, mirror attempt, nnodes)
        self._sweeps: list[tuple[float, int, str, int]] = []
        self._thread = threading.Thread(target=self._run, name=f"ckptd-mirror-n{node}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def kick(self) -> None:
        """A step committed locally: copy it (or a newer one) next; on node k, answer its round."""
        with self._lock:
            self._due = True
            if self.node > 0:
                self._kicked_at_s = time.monotonic()
        self._wake.set()

    @property
    def busy(self) -> bool:
        """A copy is running, or a pass is due since a local commit (node k: a local commit no
        round copied yet, for at most ``round_timeout_s``); a copy that failed waits for its retry
        without keeping an idle daemon alive (the next start of node 0's daemon copies the step)."""
        with self._lock:
            return self._uploading is not None or self._due

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "url": self.mirror.display(),
                "node": self.node,
                "mirrored_step": None if self._mirrored is None else self._mirrored.step,
                "uploading_step": None if self._uploading is None else self._uploading.step,
                "last_upload": self._last,
                "failed_step": None if self._failed is None else self._failed.commit.step,
                "failed_node": self._failed_node,  # node-local rounds: the node that failed the last one
                "error": self._error or None,  # the last pass's, until a copy succeeds
            }

    def stop(self, timeout_s: float) -> bool:
        """Stop the thread, waiting up to ``timeout_s``; whether it stopped."""
        self._stop.set()
        self._wake.set()
        if self._thread.ident is None:  # never started
            return True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "the mirror upload to %s did not stop within %.0f s; abandoning it", self.mirror.display(), timeout_s
            )
            return False
        return True

    # --- node 0 -----------------------------------------------------------------------------------
    def _run(self) -> None:
        if self.node > 0:
            self._answer_requests()
            return
        if self.coordinated:
            stale = withdraw_stale_request(self.mirror)
            if stale is not None:  # its nodes may still complete objects: swept again a deadline later
                self._sweeps.append(
                    (time.monotonic() + self.round_timeout_s, stale.step, stale.mirror_attempt, stale.nnodes)
                )
        try:
            recovered = self.mirror.recover(nnodes=1)  # nothing of this job commits here but this thread
            if recovered.removed:
                log.warning("mirror: removed what an interrupted upload left: %s", recovered.removed)
            for why in recovered.kept:
                log.warning("mirror: %s", why)
        except CkptdError as exc:
            log.warning("mirror %s: could not remove what earlier uploads left (%s)", self.mirror.display(), exc)
        while not self._stop.is_set():
            try:
                self._pass()
                self._sweep(time.monotonic())
            except Exception as exc:  # a bug must not end the thread (busy forever)
                log.exception("mirror %s: unexpected error in an upload pass", self.mirror.display())
                self._round_failed()  # a round in progress is swept later, as a failed one is
                self._fail(self._uploading, f"unexpected error: {type(exc).__name__}: {exc}")
            self._wake.wait(self.retry_after_s)
            self._wake.clear()

    def _copied_already(self, commit: CommitRef) -> bool:
        """The mirror holds ``commit``'s copy committed, and only its ``latest`` does not name it
        (its update failed, or could not be read just now): name it, instead of uploading every
        file again to a commit that then refuses the step as committed (every retry, until the
        next local commit)."""
        name = step_dir_name(commit.step)
        try:
            copy = read_s3_commit_record(self.mirror.client, name)
            if CommitRef.copied_by(copy) != commit or copy is None:
                return False
            named = read_s3_tracker(self.mirror.client)[1]
            current = None if named is None else read_s3_commit_record(self.mirror.client, named)
            if current is not None and current.seq >= copy.seq:
                # The mirror's latest was committed after this copy: the local root is behind it
                # (restored from before a rollback, or its newest steps removed). Moving `latest`
                # back would make a resume take the abandoned branch.
                self._fail(
                    commit,
                    f"the local latest, step {commit.step}, was copied to {self.mirror.display(name)} before the "
                    f"mirror's latest, {named}: the local root is behind the mirror (restored from a backup, or its "
                    "newest steps removed); a resume takes the mirror's",
                    permanent=True,
                )
                return True
            self.mirror.name_latest(name)
        except (CkptdError, OSError) as exc:
            self._fail(commit, f"naming the committed copy {self.mirror.display(name)} latest failed: {exc}")
            return True
        log.info("mirror %s: named its committed copy of step %d latest", self.mirror.display(), commit.step)
        self._succeeded(commit)
        return True

    def _pass(self) -> None:
        try:
            local = local_latest(self.root)
            mirrored = mirrored_latest(self.mirror)
        except (CkptdError, OSError) as exc:
            self._fail(None, f"reading the latest commits failed: {exc}")
            return
        if mirrored is not None:
            self._mark_mirrored(mirrored)
        with self._lock:
            self._mirrored = mirrored
            commit = next_upload(local, mirrored, self._failed, time.monotonic())
            self._due = commit is not None
            self._uploading = commit
        if commit is None or self._stop.is_set():
            return
        if self._copied_already(commit):
            return
        t0 = time.monotonic()
        try:
            if self.coordinated:
                outcome = coordinate_copy(
                    self.root,
                    commit,
                    self.mirror,
                    nnodes=self.nnodes,
                    timeout_s=self.round_timeout_s,
                    poll_s=self.poll_s,
                    stop=self._stop,
                    on_request=self._round_started,
                )
            else:
                outcome = mirror_step(self.root, commit, self.mirror)
        except CopyRoundError as exc:
            self._round_failed()
            self._fail(commit, str(exc), exc.node)
            return
        except (CkptdError, OSError) as exc:
            self._round_failed()
            # Local damage (mirror_step's CorruptCheckpointError; a round's errors are its nodes')
            damaged = isinstance(exc, CorruptCheckpointError) and not self.coordinated
            self._fail(commit, str(exc), permanent=damaged)
            return
        seconds = time.monotonic() - t0
        log.info("mirrored %s to %s in %.1f s", outcome.name, self.mirror.display(outcome.name), seconds)
        self._succeeded(commit, {"step": commit.step, "seconds": round(seconds, 3), "unix_s": time.time()})
        self._round = None
        self._wake.set()  # a newer step may have committed meanwhile

    def _succeeded(self, commit: CommitRef, upload: dict[str, Any] | None = None) -> None:
        """The mirror's latest copies ``commit`` now (``upload``: what this pass uploaded)."""
        self._mark_mirrored(commit)
        with self._lock:
            self._uploading = self._failed = self._failed_node = None
            self._error = ""
            self._mirrored = commit
            if upload is not None:
                self._last = upload

    def _mark_mirrored(self, commit: CommitRef) -> None:
        """Name in the local root the step the mirror's latest copies (MIRRORED_FILE: retention
        keeps it until a newer one is mirrored); node 0 only, whose root a resume consults."""
        name = step_dir_name(commit.step)
        if self.node == 0 and self._marked != name and note_mirrored(self.root, name):
            self._marked = name

    def _round_started(self, request: CopyRequest) -> None:
        self._round = request

    def _round_failed(self) -> None:
        """A failed round was aborted at once; a node may still complete an object of it (it
        started the file before the request was withdrawn): swept again a deadline later."""
        request, self._round = self._round, None
        if request is not None:
            self._sweeps.append(
                (time.monotonic() + self.round_timeout_s, request.step, request.mirror_attempt, request.nnodes)
            )

    def _sweep(self, now_s: float) -> None:
        due = [s for s in self._sweeps if s[0] <= now_s]
        self._sweeps = [s for s in self._sweeps if s[0] > now_s]
        for _, step, mirror_attempt, nnodes in due:
            sweep_round(self.mirror, step, mirror_attempt, nnodes)

    def _fail(self, commit: CommitRef | None, error: str, node: int | None = None, *, permanent: bool = False) -> None:
        """``permanent``: the commit can never be copied (its local files are damaged): not retried
        (each retry uploaded everything up to the damage again), until a newer local commit."""
        then = (
            "not retrying it: a newer local commit is copied"
            if permanent
            else f"retrying in {self.retry_after_s:.0f} s"
        )
        log.warning("mirror %s: %s (%s)", self.mirror.display(), error, then)
        with self._lock:
            self._uploading = None
            self._due = False
            self._error = error
            self._failed_node = node
            if commit is not None:
                retry_at_s = math.inf if permanent else time.monotonic() + self.retry_after_s
                self._failed = FailedUpload(commit=commit, retry_at_s=retry_at_s)

    # --- node k >= 1 ------------------------------------------------------------------------------
    def _answer_requests(self) -> None:
        """Poll the request (a HEAD every ``poll_s``, a GET when it changed) and answer each round
        once, or again ``retry_after_s`` after an answer that failed (its manifest not written)."""
        seen_etag: str | None = None
        answered: str | None = None
        retry_at_s = 0.0  # after a failed answer: when to read the request again
        while not self._stop.is_set():
            try:
                if time.monotonic() >= retry_at_s:
                    seen_etag, request = poll_request(self.mirror.client, seen_etag)
                    if request is not None and should_answer(request, self.node, answered):
                        answered = request.mirror_attempt
                        try:
                            self._answer(request, seen_etag)
                        except BaseException:
                            # Node 0 waits for this node's manifest until the round's deadline (no
                            # newer step is copied meanwhile): answer the round again, after a pause.
                            answered = seen_etag = None
                            retry_at_s = time.monotonic() + self.retry_after_s
                            raise
            except Exception as exc:  # a bug too must not end the thread (busy forever)
                with self._lock:
                    self._uploading = None
                    self._error = f"answering node 0's copy request failed: {type(exc).__name__}: {exc}"
                if isinstance(exc, (CkptdError, OSError)):
                    log.warning("mirror %s, node %d: %s", self.mirror.display(), self.node, self._error)
                else:
                    log.exception("mirror %s, node %d: %s", self.mirror.display(), self.node, self._error)
            self._update_due()
            self._wake.wait(self.poll_s)
            self._wake.clear()

    def _answer(self, request: CopyRequest, etag: str | None) -> None:
        with self._lock:
            self._uploading = request.commit
        t0 = time.monotonic()

        def still_current() -> bool:
            if self._stop.is_set():
                return False
            info = self.mirror.client.head(REQUEST_KEY)
            return info is not None and (etag is None or info.etag == etag)

        manifest = answer_request(self.root, request, self.mirror, self.node, still_current)
        seconds = time.monotonic() - t0
        with self._lock:
            self._uploading = None
            self._answered = request.commit
            if manifest is not None:
                self._error = manifest.error or ""
                self._last = {
                    "step": request.step,
                    "seconds": round(seconds, 3),
                    "unix_s": time.time(),
                    "objects": len(manifest.objects),
                    "error": manifest.error,
                }

    def _update_due(self) -> None:
        with self._lock:
            kicked, answered = self._kicked_at_s, self._answered
        local = None
        if kicked is not None:
            try:
                local = local_latest(self.root)
            except (CkptdError, OSError):
                local = None
        due = copier_due(kicked, local, answered, time.monotonic(), self.round_timeout_s)
        with self._lock:
            if self._kicked_at_s == kicked:  # no kick() came meanwhile
                self._due = due
                if not due:
                    self._kicked_at_s = None
