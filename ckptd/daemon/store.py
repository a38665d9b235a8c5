"""The root store a daemon writes and commits through (ckptd.roots), made in one place: the only
place the test hooks of ckptd.daemon.faults enter (production configurations never set them)."""

from __future__ import annotations

from ..config import CkptdConfig
from ..errors import CkptdError
from ..format.direct import open_data_file
from ..format.durable import default_opener
from ..roots.base import RootStore
from ..roots.posix_root import PosixRoot
from ..roots.s3_root import S3Root
from ..storage.url import Location, S3Location, parse_location
from .faults import debug_opener, fault_opener
from .mirror import MirrorUploader


def daemon_store(root: Location, config: CkptdConfig) -> RootStore:
    """``root``'s store with the daemon's settings (fsync, retention, Megatron-LM tracker). An
    ``s3://`` root's faults are real ones (the tests stop, fill and cut off a real server)."""
    if isinstance(root, S3Location):
        return S3Root(root, keep_last=config.keep_last, megatron_tracker=config.megatron_tracker)
    return PosixRoot(
        root,
        fsync=config.fsync,
        keep_last=config.keep_last,
        megatron_tracker=config.megatron_tracker,
        data_opener=debug_opener(config.debug_write_delay_s, config.debug_fault_file, open_data_file),
        opener=fault_opener(config.debug_fault_file) if config.debug_fault_file else default_opener,
        node_local=config.node_local,
        message_nbytes=config.max_message_nbytes,
    )


def daemon_mirror(root: Location, config: CkptdConfig, *, node: int = 0, nnodes: int = 1) -> MirrorUploader | None:
    """The mirror thread (not started) of node ``node`` of ``nnodes`` when ``config.mirror``
    names one: node 0's always, every node's with ``config.node_local`` (each node uploads the
    files its own disk holds: ckptd.roots.mirror_nodes), None for the others."""
    if not config.mirror or (node != 0 and not config.node_local):
        return None
    mirror = parse_location(config.mirror)
    if not isinstance(mirror, S3Location) or isinstance(root, S3Location):
        raise CkptdError(
            f"config mirror={config.mirror!r} for root {root}: a mirror is an s3://bucket/prefix of a local root"
        )
    store = S3Root(mirror, keep_last=config.mirror_keep_last, megatron_tracker=config.megatron_tracker)
    return MirrorUploader(
        root,
        store,
        node=node,
        nnodes=nnodes,
        node_local=config.node_local,
        round_timeout_s=config.mirror_timeout_s,
    )
