"""The mirror thread of the coordinator's daemon: copies locally committed steps to the
object-store mirror in the background (what to copy and how: ckptd.roots.mirror).

Order: :meth:`MirrorUploader.start` (its first pass removes what a crashed upload left in the
mirror, then copies the local latest if the mirror lacks it); :meth:`MirrorUploader.kick` after
every local commit; :meth:`MirrorUploader.busy` keeps the daemon alive while a copy is due or
running; :meth:`MirrorUploader.stop` at the daemon's exit (an upload still running is abandoned:
the next coordinator start removes its objects and copies the step again).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import CkptdError
from ..roots.mirror import (
    RETRY_AFTER_S,
    CommitRef,
    FailedUpload,
    local_latest,
    mirror_step,
    mirrored_latest,
    next_upload,
)
from ..roots.s3_root import S3Root

log = logging.getLogger(__name__)


class MirrorUploader:
    def __init__(self, root: Path, mirror: S3Root, *, retry_after_s: float = RETRY_AFTER_S) -> None:
        self.root = root
        self.mirror = mirror
        self.retry_after_s = retry_after_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._due = True  # a pass is due (set by kick(), cleared when a pass found nothing to copy)
        self._uploading: CommitRef | None = None
        self._failed: FailedUpload | None = None
        self._mirrored: CommitRef | None = None
        self._last: dict[str, Any] | None = None
        self._error = ""
        self._thread = threading.Thread(target=self._run, name="ckptd-mirror", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def kick(self) -> None:
        """A step committed locally: copy it (or a newer one) next."""
        with self._lock:
            self._due = True
        self._wake.set()

    @property
    def busy(self) -> bool:
        """A copy is running, or a pass is due since a local commit; a copy that failed waits for
        its retry without keeping an idle daemon alive (the next coordinator start copies the step)."""
        with self._lock:
            return self._uploading is not None or self._due

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "url": self.mirror.display(),
                "mirrored_step": None if self._mirrored is None else self._mirrored.step,
                "uploading_step": None if self._uploading is None else self._uploading.step,
                "last_upload": self._last,
                "failed_step": None if self._failed is None else self._failed.commit.step,
                "error": self._error or None,  # the last pass's, until a copy succeeds
            }

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.ident is None:  # never started
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "the mirror upload to %s did not stop within %.0f s; abandoning it", self.mirror.display(), timeout_s
            )

    # --- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            recovered = self.mirror.recover(nnodes=1)  # nothing of this job uploads but this thread
            if recovered.removed:
                log.warning("mirror: removed what an interrupted upload left: %s", recovered.removed)
        except CkptdError as exc:
            log.warning("mirror %s: could not remove what earlier uploads left (%s)", self.mirror.display(), exc)
        while not self._stop.is_set():
            self._pass()
            self._wake.wait(self.retry_after_s)
            self._wake.clear()

    def _pass(self) -> None:
        try:
            local = local_latest(self.root)
            mirrored = mirrored_latest(self.mirror)
        except (CkptdError, OSError) as exc:
            self._fail(None, f"reading the latest commits failed: {exc}")
            return
        with self._lock:
            self._mirrored = mirrored
            commit = next_upload(local, mirrored, self._failed, time.monotonic())
            self._due = commit is not None
            self._uploading = commit
        if commit is None or self._stop.is_set():
            return
        t0 = time.monotonic()
        try:
            outcome = mirror_step(self.root, commit, self.mirror)
        except (CkptdError, OSError) as exc:
            self._fail(commit, str(exc))
            return
        seconds = time.monotonic() - t0
        log.info("mirrored %s to %s in %.1f s", outcome.name, self.mirror.display(outcome.name), seconds)
        with self._lock:
            self._uploading = None
            self._failed = None
            self._error = ""
            self._mirrored = commit
            self._last = {"step": commit.step, "seconds": round(seconds, 3), "unix_s": time.time()}
        self._wake.set()  # a newer step may have committed meanwhile

    def _fail(self, commit: CommitRef | None, error: str) -> None:
        log.warning("mirror %s: %s (retrying in %.0f s)", self.mirror.display(), error, self.retry_after_s)
        with self._lock:
            self._uploading = None
            self._due = False
            self._error = error
            if commit is not None:
                self._failed = FailedUpload(commit=commit, retry_at_s=time.monotonic() + self.retry_after_s)
