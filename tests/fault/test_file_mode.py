"""``file_mode`` (CKPTD_FILE_MODE): every file a real daemon writes into the root (data, metadata,
trackers) gets it, and step directories get it plus x where r is set. The default, 0o600, keeps
checkpoints owner-only under the usual umask 0o022 (they were 0o644, then 0o640: readable by a
shared primary group such as ``users``); 0o640 is there for who asks for it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ckptd.config import CkptdConfig
from ckptd.errors import CkptdError
from ckptd.format.rootlayout import MEGATRON_TRACKER, node_lock_name
from tests.fault.single_job import single_job


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("file_mode, dir_mode", [(None, 0o700), (0o640, 0o750)])
def test_the_daemon_writes_checkpoints_with_file_mode(tmp_path, monkeypatch, file_mode, dir_mode):
    old_umask = os.umask(0o022)  # the usual default: it used to leave checkpoints world-readable
    try:
        config = {} if file_mode is None else {"file_mode": file_mode}
        with single_job(tmp_path, monkeypatch, **config) as job:
            job.committed(1)
            job.committed(2)
            modes = _modes(job.root)
    finally:
        os.umask(old_umask)
    want_file = 0o600 if file_mode is None else file_mode
    for name in (
        "latest",
        MEGATRON_TRACKER,
        "iter_0000002/__0_0.distcp",
        "iter_0000002/common.pt",
        "iter_0000002/.metadata",
        "iter_0000002/metadata.json",
    ):
        assert modes.pop(name) == want_file, (name, oct(want_file))
    for name in ("iter_0000001", "iter_0000002"):
        assert modes.pop(name) == dir_mode, name
    assert modes.pop(node_lock_name(0)) == 0o600  # the daemon's root lock: no checkpoint, owner-only always
    assert all(m == want_file for m in modes.values()), {k: oct(v) for k, v in modes.items()}


def test_file_mode_is_octal_in_the_environment_and_read_write_only():
    assert CkptdConfig.from_env({"CKPTD_FILE_MODE": "600"}).file_mode == 0o600
    assert CkptdConfig.from_env({"CKPTD_FILE_MODE": "0o644"}).file_mode == 0o644
    cfg = CkptdConfig(file_mode=0o660)
    assert cfg.to_env()["CKPTD_FILE_MODE"] == "0o660" and CkptdConfig.from_env(cfg.to_env()) == cfg
    for bad in (0o755, 0o440, 0o4600):
        with pytest.raises(CkptdError, match="file_mode"):
            CkptdConfig(file_mode=bad)
    with pytest.raises(CkptdError, match="not a valid octal"):
        CkptdConfig.from_env({"CKPTD_FILE_MODE": "rw-r-----"})
