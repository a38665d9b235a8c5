"""The mirror copy of a commit held by node-local disks: the store I/O of one copy round (the
objects and decisions: ckptd.roots.copyround; the threads: ckptd.daemon.mirror).

With ``node_local`` and several nodes, node k's disk holds only node k's ranks' data files of a
commit C (in ``iter_<step>/`` once it renamed its attempt directory, in
``iter_<step>.<attempt>.tmp/`` if its daemon died before), so every node uploads its own. Order of
one round, coordinated through the mirror itself (no control-plane messages):

1. [node 0] :func:`coordinate_copy` takes a read lease on its ``iter_<step>`` (which must still be
   C), reads the records and ``common.pt`` as :func:`~ckptd.roots.mirror.mirror_step` does,
   chooses a fresh mirror attempt M and writes the request (:data:`REQUEST_KEY`), then uploads the
   data files its own disk holds;
2. [node k >= 1] :func:`poll_request` (a HEAD about once a second, a GET when the request
   changed) finds the request; :func:`answer_request` takes a read lease on where its disk holds
   C's files, uploads each data file of the request found there under M, checking every item
   against the request's recorded checksum on the way (a local bit flip is refused, never
   copied), and writes its manifest (``iter_<step>/ckptd_copy.<M>.node<k>.json``): its objects,
   or its error. It checks that the request still names M before each file, and removes nothing;
3. [node 0] polls the step's listing for the manifests until every node answered, a node reported
   an error, or ``timeout_s`` passed; a complete round is committed with the store's commit
   protocol (one attempt M for every node's objects, ``source`` naming C), unless node 0's
   ``iter_<step>`` was replaced meanwhile (a re-save after a rollback: the round fails, the next
   copies the new commit); the request and the manifests are deleted (best effort).

A failed round (a node's error, a node missing at the deadline, a file no node holds, node 0's
daemon stopping) withdraws the request and aborts M: :meth:`S3Root.abort` removes the objects of
M that every node uploaded. A node that completes an object of M after that (it started the file
before the withdrawal) leaves it behind: :func:`sweep_round` aborts M once more a deadline later
(ckptd.daemon.mirror), and the next start of node 0's daemon removes what is left in a step never
committed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..errors import CheckpointNotFoundError, CkptdError, CopyRoundError, CorruptCheckpointError, StorageError
from ..format.lease import ReadLease
from ..format.rootlayout import step_dir_name, tmp_dir
from ..storage.s3client import S3Client
from .base import CommitOutcome
from .copyround import (
    RECORD_MAX_NBYTES,
    REQUEST_KEY,
    CopyRequest,
    NodeManifest,
    ObjectCopy,
    RoundComplete,
    RoundFailed,
    Waiting,
    build_request,
    manifest_name,
    manifest_node,
    renamed_records,
    round_verdict,
)
from .mirror import (
    CommitRef,
    check_still_leased,
    copy_checked,
    leased_commit_record,
    local_chain,
    new_mirror_attempt,
    note_mirrored,
    read_local_commit,
)
from .s3_root import S3Root

log = logging.getLogger(__name__)

MANIFEST_POLL_S = 0.5  # node 0 lists the step for manifests this often while it waits
REQUEST_POLL_S = 1.0  # node k asks for the request this often (a HEAD; a GET when it changed)


class _Withdrawn(CkptdError):
    """Node 0 withdrew or replaced the request being answered: the round is over, nothing to report."""


def coordinate_copy(
    root: Path,
    commit: CommitRef,
    mirror: S3Root,
    *,
    nnodes: int,
    timeout_s: float,
    poll_s: float = MANIFEST_POLL_S,
    stop: threading.Event | None = None,
    on_request: Callable[[CopyRequest], None] | None = None,
) -> CommitOutcome:
    """Node 0's side of one round (steps 1 and 3 of the module docstring): copy ``commit`` of the
    node-local disks of ``nnodes`` nodes into ``mirror``. Raises :class:`CopyRoundError` naming
    the node that failed (or another CkptdError: the local commit is gone, the store failed);
    nothing of a failed round stays visible. ``stop`` set: the round is given up at once;
    ``on_request``: called with the request once it is written (the round's mirror attempt)."""
    name = step_dir_name(commit.step)
    with ReadLease.acquire(root / name) as lease:
        # Read through the lease's fd, and not committed once the directory was replaced (a
        # re-save of the step after a rollback): as mirror_step.
        records, checksum, common = read_local_commit(lease, commit)
        request = build_request(commit, new_mirror_attempt(commit), nnodes, records, checksum)
        deadline_s = time.monotonic() + timeout_s
        try:
            mirror.client.put(REQUEST_KEY, request.to_bytes())
            if on_request is not None:
                on_request(request)
            own = _own_manifest(lease, request, mirror, 0, lambda: True)
            verdict = _wait_for_nodes(mirror, request, own, deadline_s, timeout_s, poll_s, stop or threading.Event())
            if isinstance(verdict, RoundFailed):
                check_still_leased(lease, commit)  # node 0's own files went with a re-save: say so
                raise CopyRoundError(verdict.reason, node=verdict.node)
            renamed, data_files = renamed_records(records, verdict.copies)
            check_still_leased(lease, commit)
            outcome = mirror.commit(
                commit.step,
                request.mirror_attempt,
                renamed,
                common,
                data_files,
                source=commit.source(),
                source_chain=local_chain(root, commit),
            )
        except BaseException:
            _withdraw(mirror.client)
            sweep_round(mirror, request.step, request.mirror_attempt, nnodes)
            raise
        note_mirrored(root, name)  # under the lease (see mirror_step)
    _withdraw(mirror.client)
    _delete_manifests(mirror, request.step, request.mirror_attempt, nnodes)
    return outcome


def sweep_round(mirror: S3Root, step: int, mirror_attempt: str, nnodes: int) -> None:
    """Remove what a failed round left: its data objects and unfinished uploads (never those of
    a commit: :meth:`S3Root.abort`), and its manifests. Never raises."""
    mirror.abort(step, mirror_attempt)
    _delete_manifests(mirror, step, mirror_attempt, nnodes)


def withdraw_stale_request(mirror: S3Root) -> CopyRequest | None:
    """At node 0's start: delete a request an earlier daemon left (its round ended with that
    daemon) and return it, so that its objects can be swept; None when there is none."""
    try:
        got = mirror.client.get(REQUEST_KEY, RECORD_MAX_NBYTES, "mirror copy request")
    except (StorageError, CorruptCheckpointError) as exc:
        log.warning("mirror %s: could not read a previous copy request (%s)", mirror.display(), exc)
        return None
    if got is None:
        return None
    _withdraw(mirror.client)
    try:
        return CopyRequest.parse(got[0], mirror.display(REQUEST_KEY))
    except CorruptCheckpointError as exc:
        log.warning("%s", exc)
        return None


def poll_request(client: S3Client, seen_etag: str | None) -> tuple[str | None, CopyRequest | None]:
    """Node k's look at the request: ``(etag, request)``; the request is None when there is none,
    when its ETag is ``seen_etag`` (unchanged: one HEAD, nothing read), or when it is damaged
    (logged once: its ETag is returned). Raises StorageError."""
    info = client.head(REQUEST_KEY)
    if info is None:
        return None, None
    if info.etag is not None and info.etag == seen_etag:
        return seen_etag, None
    try:
        got = client.get(REQUEST_KEY, RECORD_MAX_NBYTES, "mirror copy request")
        if got is None:  # withdrawn between the two requests
            return None, None
        return got[1], CopyRequest.parse(got[0], client.url(REQUEST_KEY))
    except CorruptCheckpointError as exc:
        log.warning("%s", exc)
        return info.etag, None


def answer_request(
    root: Path, request: CopyRequest, mirror: S3Root, node: int, still_current: Callable[[], bool]
) -> NodeManifest | None:
    """Node ``node``'s side of a round (step 2 of the module docstring): upload the data files of
    the request its disk holds and write its manifest, which it returns; an error goes into the
    manifest. None when the request was withdrawn meanwhile (``still_current()`` said so before
    a file or the manifest): no manifest is written then."""
    try:
        with _lease_source(root, request, node) as lease:
            manifest = _own_manifest(lease, request, mirror, node, still_current)
    except _Withdrawn:
        return None
    except (CkptdError, OSError) as exc:
        manifest = NodeManifest(node=node, step=request.step, mirror_attempt=request.mirror_attempt, error=str(exc))
    if not still_current():
        return None
    mirror.client.put(request.manifest_key(node), manifest.to_bytes())
    return manifest


def _own_manifest(
    lease: ReadLease, request: CopyRequest, mirror: S3Root, node: int, still_current: Callable[[], bool]
) -> NodeManifest:
    """Upload the request's data files found in the leased directory: the node's manifest, with
    the error that stopped it (_Withdrawn passes through)."""
    blank = NodeManifest(node=node, step=request.step, mirror_attempt=request.mirror_attempt)
    checksum = request.checksum_fn()
    if request.checksum is not None and checksum is None:
        return replace(
            blank,
            error=(
                f"the checksum table {request.checksum} of {request.describe()} is of a newer ckptd "
                f"than node {node}'s; run one ckptd version on every node"
            ),
        )
    held = [f for f in request.files if _holds(lease.fd, f.name)]
    if not held:
        return replace(
            blank,
            error=(
                f"node {node} holds no data file of step {request.step} attempt {request.attempt} in "
                f"{lease.directory} (its disk lost them, or it is not this job's node {node})"
            ),
        )
    objects: list[ObjectCopy] = []
    try:
        for spec in held:
            if not still_current():
                raise _Withdrawn(f"the copy request of {request.describe()} was withdrawn")
            items = [item.record(spec.name, spec.rank) for item in spec.items]
            key = request.object_key(spec.rank)
            nbytes, crcs = copy_checked(lease.directory, spec.name, items, checksum, mirror, key, lease.fd)
            objects.append(
                ObjectCopy(
                    file=spec.name, object=key.rsplit("/", 1)[-1], rank=spec.rank, nbytes=nbytes, crcs=tuple(crcs)
                )
            )
    except _Withdrawn:
        raise
    except (CkptdError, OSError) as exc:
        log.warning("mirror copy of %s on node %d: %s", request.describe(), node, exc)
        return replace(blank, error=str(exc))
    log.info("mirror copy of %s: node %d uploaded %d data files", request.describe(), node, len(objects))
    return replace(blank, objects=tuple(objects))


def _holds(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True  # anything else (a link, a directory) is refused by copy_checked, naming it


def _lease_source(root: Path, request: CopyRequest, node: int) -> ReadLease:
    """A read lease on where this node's disk holds the request's commit: ``iter_<step>`` when
    its commit record is that commit, else the attempt's directory (its daemon died before the
    rename). Looked at twice: the rename may happen in between."""
    committed = root / step_dir_name(request.step)
    attempt_dir = tmp_dir(root, request.step, request.attempt)
    want = (request.step, request.attempt, request.seq)
    for _ in range(2):
        try:
            lease = ReadLease.acquire(committed)
        except CheckpointNotFoundError:
            pass
        else:
            record = leased_commit_record(lease)
            if record is not None and (record.step, record.attempt, record.seq) == want:
                return lease
            lease.release()
        try:
            return ReadLease.acquire(attempt_dir)
        except CheckpointNotFoundError:
            pass
    raise CkptdError(
        f"node {node} holds no file of step {request.step} attempt {request.attempt}: {committed} is not that "
        f"commit (seq {request.seq}) and {attempt_dir} does not exist on its disk (a replaced disk, or the "
        "local checkpoint was removed by hand)"
    )


def _wait_for_nodes(
    mirror: S3Root,
    request: CopyRequest,
    own: NodeManifest,
    deadline_s: float,
    timeout_s: float,
    poll_s: float,
    stop: threading.Event,
) -> RoundFailed | RoundComplete:
    """Poll the step's listing for the other nodes' manifests (each read once) until
    :func:`round_verdict` is no longer Waiting."""
    manifests = {0: own}
    name = step_dir_name(request.step)
    while True:
        missing = [k for k in range(1, request.nnodes) if k not in manifests]
        if missing:
            _, found = mirror.client.list_dir(name)
            for info in found:
                leaf = info.key.rsplit("/", 1)[-1]
                node = manifest_node(leaf, request.mirror_attempt)
                if node is not None and node in missing:
                    manifests[node] = _read_manifest(mirror.client, request, node)
        verdict = round_verdict(request, manifests, expired=time.monotonic() >= deadline_s, timeout_s=timeout_s)
        if not isinstance(verdict, Waiting):
            return verdict
        if stop.wait(poll_s):
            raise CopyRoundError(
                f"the daemon stopped while the mirror copy of {request.describe()} waited for node(s) "
                f"{', '.join(map(str, verdict.missing))}; the next start of node 0's daemon copies again",
                node=None,
            )


def _read_manifest(client: S3Client, request: CopyRequest, node: int) -> NodeManifest:
    key = request.manifest_key(node)
    try:
        got = client.get(key, RECORD_MAX_NBYTES, "mirror copy manifest")
    except CorruptCheckpointError as exc:
        return NodeManifest(node=node, step=request.step, mirror_attempt=request.mirror_attempt, error=str(exc))
    if got is None:  # listed, then gone: not written by this round's node (no node removes its own)
        return NodeManifest(
            node=node,
            step=request.step,
            mirror_attempt=request.mirror_attempt,
            error=f"its manifest {client.url(key)} vanished after it was listed",
        )
    return NodeManifest.parse(got[0], request, node, client.url(key))


def _withdraw(client: S3Client) -> None:
    try:
        client.delete([REQUEST_KEY])
    except StorageError as exc:
        log.warning("could not delete the mirror copy request %s: %s", client.url(REQUEST_KEY), exc)


def _delete_manifests(mirror: S3Root, step: int, mirror_attempt: str, nnodes: int) -> None:
    keys = [f"{step_dir_name(step)}/{manifest_name(mirror_attempt, k)}" for k in range(1, nnodes)]
    try:
        mirror.client.delete(keys)
    except StorageError as exc:
        log.warning("could not delete the manifests of mirror copy %s: %s", mirror_attempt, exc)
