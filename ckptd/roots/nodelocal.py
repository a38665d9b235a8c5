"""Node-local roots (``CkptdConfig.node_local``): each node of a multi-node job commits its own
ranks' files on its own disk, mounted at the same path on every node but not shared.

No node sees another's disk, so the commit is coordinated. Order of one commit of attempt A of
step N:

1. [node daemons] each writes its ranks' data files into its own ``iter_N.A.tmp/`` and reports
   them (WRITTEN: fsynced, with their sizes and checksums), as on any root;
2. [coordinator, node 0] commits on node 0's disk as :func:`ckptd.roots.posix.commit_step` does,
   checking node 0's data files only (the other nodes fsynced theirs before reporting them); its
   commit record lists every rank's data file with its size. The rename of node 0's directory is
   the commit point of the local level. The commit's files travel to the other nodes
   (:func:`travelling_files`);
3. [node daemons] the COMMITTED verdict carries those files; :func:`finish_on_node` writes them
   next to the node's own data files, renames its directory, points its trackers at it and applies
   its retention, and only then are the node's ranks told. Every node's ``iter_N/`` then holds
   the same ``.metadata``, ``common.pt``, ``metadata.json`` and commit record, and the data files
   of its own ranks.

A node daemon that dies between 1 and 3 leaves its complete files in ``iter_N.A.tmp/`` (the
attempt is in the name, so they are the committed ones): the mirror copies them from there and a
resume reads them there. An attempt the coordinator aborts is removed by every node from its own
disk (an attempt a node aborted on its own, having lost the coordinator, is kept: the coordinator
may still commit it; ``ckptd gc`` removes what is left).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import CkptdError, ProtocolError
from ..format.commitrecord import COMMIT_RECORD, parse_commit_record, read_commit_record
from ..format.durable import Opener, atomic_write_bytes
from ..format.layout import COMMON_PT, DCP_METADATA, METADATA_JSON
from ..format.rootlayout import step_dir_name, tmp_dir_name
from ..format.safefs import Dir
from .base import CommitOutcome
from .posix import apply_retention, publish_step, remove_partial_files

log = logging.getLogger(__name__)

NODE_FILES = (COMMON_PT, DCP_METADATA, METADATA_JSON, COMMIT_RECORD)


def travelling_files(files: dict[str, bytes], max_nbytes: int, where: Path) -> dict[str, bytes]:
    """The committed ``files`` (of ``where``) that every other node writes next to its data files;
    empty when together they exceed ``max_nbytes`` (they travel in one message: the nodes then keep
    their files in the attempt's directory, see the module docstring)."""
    total = sum(len(data) for data in files.values())
    if total <= max_nbytes:
        return files
    log.warning(
        "%s: the commit's metadata (%d bytes) is larger than half the message limit; the other nodes "
        "keep their files of it in the attempt's directory (raise CKPTD_MAX_MESSAGE_NBYTES)",
        where,
        total,
    )
    return {}


def finish_on_node(
    root: Path,
    step: int,
    attempt: str,
    files: dict[str, bytes],
    *,
    fsync: bool,
    keep_last: int,
    megatron_tracker: bool,
    opener: Opener,
) -> CommitOutcome:
    """Step 3 of the module docstring on this node's disk; nothing to do when ``iter_<step>`` holds
    the commit already (node 0's, or a repeated verdict). Raises CkptdError naming the directory
    when this node has no files of the attempt, ProtocolError when ``files`` are not the commit's."""
    name = step_dir_name(step)
    tmp = tmp_dir_name(step, attempt)
    if sorted(files) != sorted(NODE_FILES):
        raise ProtocolError(f"the commit of step {step} attempt {attempt} carried files {sorted(files)}")
    record = parse_commit_record(files[COMMIT_RECORD], f"the commit record of step {step} sent by the coordinator")
    if record is None or (record.step, record.attempt) != (step, attempt):
        raise ProtocolError(f"the commit record sent for step {step} attempt {attempt} is not that commit's")
    held = read_commit_record(root / name)
    if held is not None and (held.step, held.attempt, held.seq) == (step, attempt, record.seq):
        return CommitOutcome(name=name)
    with Dir.open(root) as rootd:
        if rootd.lstat(tmp) is None:
            raise CkptdError(
                f"{root / tmp} is missing: this node holds no files of step {step} attempt {attempt} "
                "(removed by gc or by hand?); a resume reads them from the mirror"
            )
        with rootd.subdir(tmp) as tmpd:
            remove_partial_files(tmpd)
            for file_name in NODE_FILES:
                atomic_write_bytes(tmpd.entry(file_name), files[file_name], opener, fsync)
        # The coordinator decided: an iter_<step> here is one it replaced (a branch a rollback
        # abandoned), as it did on its own disk.
        replaced = rootd.lstat(name) is not None
        untracked = publish_step(
            rootd, step, tmp, replaced=replaced, fsync=fsync, opener=opener, megatron_tracker=megatron_tracker
        )
    if keep_last > 0 and untracked is None:  # (retention is by the tracker's branch: see commit_step)
        apply_retention(root, keep_last)
    log.info("step %d committed on this node's disk as %s (attempt %s)", step, root / name, attempt)
    return CommitOutcome(name=name, warnings=() if untracked is None else (untracked,))
