"""Opening one checkpoint for reading, wherever it is: a local (or shared POSIX) directory, held by a
read lease, an ``s3://`` prefix, read through a local view (ckptd.storage.s3view), or a commit of
node-local disks, read from this node's disk and the mirror (ckptd.storage.nodeview).

Every reader of :mod:`ckptd.api` opens a checkpoint here::

    with opened(checkpoint_dir) as ckpt:      # ckpt.directory, ckpt.has_common, ckpt.source
        index = ckpt.index(allow_unsafe_pickle)
        ...read from ckpt.directory, passing ckpt.source to the readers...
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from .format.commitrecord import COMMIT_RECORD
from .format.dcp_metadata import CheckpointIndex, read_index
from .format.layout import METADATA_JSON, read_backend_metadata
from .format.lease import ReadLease, removed_error
from .format.reader import RangeSource
from .format.safefs import entry_exists
from .storage.nodeview import NodeLocalCheckpoint, node_local_view
from .storage.s3view import s3_checkpoint_view
from .storage.url import S3Location, parse_location


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A checkpoint open for reading: ``directory`` to read from (for an ``s3://`` checkpoint, its
    local view), whether it has ``common.pt`` (decided once, at open: a checkpoint that disappears
    later is never taken for a plain DCP one), and the ``source`` its data files' bytes come from
    when they are not on disk yet."""

    directory: Path
    has_common: bool
    source: RangeSource | None
    where: str  # the path or URL the caller named, for messages
    # Raises CheckpointRemovedError when the directory was replaced or removed since it was opened
    # (a local one: the lease's check; others tell on each read). Called before what was read is
    # handed to anything that keeps it (a Stateful's load_state_dict), so nothing takes a mix.
    check_unchanged: Callable[[], None] = lambda: None

    def index(self, allow_unsafe_pickle: bool = False) -> CheckpointIndex:
        read_backend_metadata(self.directory)
        return read_index(self.directory, allow_unsafe_pickle)


@contextmanager
def opened(checkpoint_dir: str | os.PathLike | S3Location | NodeLocalCheckpoint) -> Iterator[OpenedCheckpoint]:
    if isinstance(checkpoint_dir, NodeLocalCheckpoint):
        with node_local_view(checkpoint_dir) as nodes:
            yield OpenedCheckpoint(
                nodes.directory, entry_exists(nodes.directory, METADATA_JSON), nodes.source, str(checkpoint_dir)
            )
        return
    location = parse_location(checkpoint_dir)
    if isinstance(location, S3Location):
        with s3_checkpoint_view(location) as view:
            yield OpenedCheckpoint(
                view.directory, entry_exists(view.directory, METADATA_JSON), view.source, str(location)
            )
        return
    with _leased(location) as (has_common, check):
        yield OpenedCheckpoint(location, has_common, None, str(location), check)


@contextmanager
def _leased(checkpoint_dir: Path) -> Iterator[tuple[bool, Callable[[], None]]]:
    """Hold a read lease on ``checkpoint_dir`` (:mod:`ckptd.format.lease`: retention and gc leave
    it alone meanwhile) and yield whether it has ``common.pt`` (its ``metadata.json`` exists) and
    the check that raises CheckpointRemovedError once it was replaced or removed. A
    read that fails because the directory went away (no lease on this filesystem, or removed by
    hand) raises CheckpointRemovedError instead, and so does a read that succeeded while the
    directory was replaced: a re-save of the step after a rollback renames its commit into place
    whatever the lease, and the readers open files by path, so what was read may mix the two."""
    with ReadLease.acquire(checkpoint_dir) as lease:
        has_common = entry_exists(checkpoint_dir, METADATA_JSON)
        if not has_common and entry_exists(checkpoint_dir, COMMIT_RECORD):
            # ckptd committed it, so it had metadata.json and common.pt: read as a plain DCP
            # checkpoint it would load without its common state, silently.
            raise CorruptCheckpointError(
                f"{checkpoint_dir}: ckptd committed it ({COMMIT_RECORD}), but its {METADATA_JSON} is gone, "
                f"so its common state (common.pt) would be left out; restore the file from a copy, or load "
                "another step"
            )

        def check() -> None:
            if lease.gone():
                raise removed_error(lease.directory)

        try:
            yield has_common, check
        except (OSError, CorruptCheckpointError, CheckpointNotFoundError, UnsupportedFormatError) as exc:
            if lease.gone():
                raise removed_error(lease.directory) from exc
            raise
        if lease.gone():
            raise removed_error(lease.directory)
