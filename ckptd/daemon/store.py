"""The root store a daemon writes and commits through (ckptd.roots), made in one place: the only
place the test hooks of ckptd.daemon.faults enter (production configurations never set them)."""

from __future__ import annotations

from ..config import CkptdConfig
from ..format.direct import open_data_file
from ..format.durable import default_opener
from ..roots.base import RootStore
from ..roots.posix_root import PosixRoot
from ..storage.url import Location
from .faults import debug_opener, fault_opener


def daemon_store(root: Location, config: CkptdConfig) -> RootStore:
    """``root``'s store with the daemon's settings (fsync, retention, Megatron-LM tracker)."""
    return PosixRoot(
        root,  # type: ignore[arg-type]
        fsync=config.fsync,
        keep_last=config.keep_last,
        megatron_tracker=config.megatron_tracker,
        data_opener=debug_opener(config.debug_write_delay_s, config.debug_fault_file, open_data_file),
        opener=fault_opener(config.debug_fault_file) if config.debug_fault_file else default_opener,
    )
