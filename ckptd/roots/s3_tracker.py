"""Moving an ``s3://`` root's ``latest`` tracker to a step, and settling a move that failed.

The tracker moves by compare-and-swap: ``If-Match`` of the ETag read (a HEAD's when the read
failed), ``If-None-Match: *`` when it is absent; another writer in between makes it read again,
:data:`TRACKER_TRIES` times. A commit counts once the tracker can name its step
(:func:`point_tracker_at_commit`, step 5 of ckptd.roots.s3_root's commit): a move that failed at
the client may still have been applied by the store (its response lost, or the last try timed
out), so the tracker is read back. The commit stands when ``latest`` names the step, is taken back
(its commit object deleted) only when ``latest`` provably names another, and is kept (the save
fails, the next coordinator start names it latest) when ``latest`` cannot be read.
"""

from __future__ import annotations

import contextlib
import logging

from ..errors import CorruptCheckpointError, StorageError
from ..format.commitrecord import COMMIT_RECORD
from ..format.rootlayout import TRACKER_FILE, TRACKER_MAX_NBYTES, tracker_bytes
from ..s3catalog import read_s3_tracker
from ..storage.s3client import S3Client
from ..storage.url import S3Location

log = logging.getLogger(__name__)

TRACKER_TRIES = 5  # compare-and-swaps a move tries before it says another process writes the tracker


def point_tracker_at_commit(client: S3Client, location: S3Location, name: str) -> None:
    """``latest`` := ``name``, whose commit object was just created. A move that failed is read
    back: when the tracker names ``name`` all the same the step is committed and this returns;
    else the failure is raised, the commit taken back first when the tracker provably names
    another step (see the module docstring)."""
    try:
        point_tracker(client, location, name)
    except Exception as exc:  # noqa: BLE001 - whatever failed, the write may have been applied
        _settle(client, location, name, exc)  # returns when the tracker names the step all the same
    except BaseException:
        with contextlib.suppress(StorageError):  # unreadable: keep the commit (see _settle)
            if not _names(client, name):
                _uncommit(client, location, name)
        raise


def point_tracker(client: S3Client, location: S3Location, name: str) -> None:
    """``latest`` := ``name`` by compare-and-swap (another writer in between: read again)."""
    for _ in range(TRACKER_TRIES):
        exists, _current, _problem, etag = read_s3_tracker(client)
        if exists and etag is None:
            # The read failed (a timeout, throttling) or found it damaged: its ETag from a HEAD,
            # whose failure fails the move. A PUT without a precondition would overwrite
            # whatever another writer put there meanwhile.
            info = client.head(TRACKER_FILE)
            exists, etag = info is not None, None if info is None else info.etag
        try:
            if exists and etag is not None:
                client.put(TRACKER_FILE, tracker_bytes(name), if_match=etag)
            else:
                client.put(TRACKER_FILE, tracker_bytes(name), create_only=not exists)
            return
        except FileExistsError:
            continue
    raise StorageError(
        f"{location.url(TRACKER_FILE)} changed {TRACKER_TRIES} times while it was being moved to "
        f"{name}: another process writes this root's tracker (two jobs on one root?)"
    )


def _settle(client: S3Client, location: S3Location, name: str, error: Exception) -> None:
    """After moving ``latest`` to ``name`` failed with ``error``: return when the tracker names
    ``name`` all the same (committed), else take the commit back and raise.

    The failed request may have been applied (its response lost, or the last retry timed out
    after the store wrote it). Removing the commit object then leaves ``latest`` naming a
    removed step, which the coordinator's abort then empties: recovery finds no commit to name
    and retention refuses. So the tracker is read back, and the commit is taken back only when
    it provably names something else. A tracker naming ``name`` names this commit: its commit
    object was created by this call (a replaced commit of the step was retired before)."""
    try:
        named = _names(client, name)
    except StorageError as unread:
        log.error(
            "kept the commit of %s although moving %s to it failed: the tracker cannot be read back",
            location.url(name),
            location.url(TRACKER_FILE),
        )
        raise StorageError(
            f"moving {location.url(TRACKER_FILE)} to {name} failed ({error}) and reading it back failed "
            f"too ({unread}), so whether {name} is latest is unknown. Its commit object is kept (removing "
            "it could leave the tracker naming a removed step): the step is committed though this save "
            "fails, and the next coordinator start names it latest if it is the newest commit; check the "
            "store (AWS_ENDPOINT_URL, the network)"
        ) from error
    if not named:
        _uncommit(client, location, name)
        raise error
    log.warning("committed %s: %s names it, though its update reported: %s", location.url(name), TRACKER_FILE, error)


def _names(client: S3Client, name: str) -> bool:
    """Whether ``latest`` names ``name`` now; StorageError when it cannot be read."""
    try:
        got = client.get(TRACKER_FILE, TRACKER_MAX_NBYTES, "tracker")
    except CorruptCheckpointError:  # oversized: not a name this root wrote
        return False
    return got is not None and got[0].strip() == name.encode()


def _uncommit(client: S3Client, location: S3Location, name: str) -> None:
    """Take back a commit whose tracker could not be written and provably does not name it:
    the step is not committed until the tracker can name it, and its ranks are told it
    aborted. Never with the tracker naming it (see :func:`_settle`)."""
    try:
        client.delete([f"{name}/{COMMIT_RECORD}"])
    except StorageError as exc:
        log.error(
            "the tracker update of %s failed and its commit object could not be removed (%s); it is "
            "complete but not named by the tracker (the next coordinator start names it)",
            location.url(name),
            exc,
        )
