"""Hostile checkpoints on real files: a link out of the checkpoint, a FIFO or a device in place of
one of its files is never followed, opened for a blocking read or read without bound. Loading,
``load_common_state_dict``, ``inspect``, ``verify`` (``--deep`` too), ``convert consolidate
--with-common`` and resuming from a root (``resolve_latest``, behind ``Checkpointer.latest()``)
raise a CkptdError naming the file (``verify`` reports it) at once, and nothing outside the
checkpoint is ever returned or copied.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.convert.consolidate import consolidate
from ckptd.describe import describe_checkpoint
from ckptd.errors import CkptdError
from ckptd.recovery import resolve_latest
from ckptd.verify import verify_checkpoint
from tests.checkpoints import make_checkpoint, reference_tensors
from tests.cli import offline_cli
from tests.integration.test_cli import _env, cli

SECRET = "outside the checkpoint"


def _template() -> dict[str, Any]:
    return {k: ckptd.ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in reference_tensors().items()}


def _link_to_copy(ckpt: Path, name: str, outside: Path) -> None:
    """``name`` becomes a link to a file outside with valid content: only following it could tell."""
    outside.mkdir(exist_ok=True)
    target = outside / name.lstrip(".")
    os.replace(ckpt / name, target)
    (ckpt / name).symlink_to(target)


def _outside_common(ckpt: Path, outside: Path) -> None:
    outside.mkdir(exist_ok=True)
    torch.save({"iteration": 99, "note": SECRET}, outside / "other.pt")
    (ckpt / "common.pt").unlink()
    (ckpt / "common.pt").symlink_to(outside / "other.pt")


def _fifo(ckpt: Path, name: str) -> None:
    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)


def _socket(ckpt: Path, name: str) -> None:
    """A socket, which cannot even be opened (ENXIO): what it is, not an I/O error, is the damage."""
    (ckpt / name).unlink()
    os.mknod(ckpt / name, 0o600 | stat.S_IFSOCK)


def _dev_zero(ckpt: Path, name: str) -> None:
    (ckpt / name).unlink()
    (ckpt / name).symlink_to("/dev/zero")


# name -> (the file made hostile, how)
CASES: dict[str, tuple[str, Callable[[Path, Path], None]]] = {
    "data file links out": ("__0_0.distcp", lambda c, o: _link_to_copy(c, "__0_0.distcp", o)),
    "common.pt links out": ("common.pt", _outside_common),
    "metadata.json links out": ("metadata.json", lambda c, o: _link_to_copy(c, "metadata.json", o)),
    "data file is a FIFO": ("__1_0.distcp", lambda c, o: _fifo(c, "__1_0.distcp")),
    ".metadata is a FIFO": (".metadata", lambda c, o: _fifo(c, ".metadata")),
    "common.pt is a FIFO": ("common.pt", lambda c, o: _fifo(c, "common.pt")),
    "metadata.json is a FIFO": ("metadata.json", lambda c, o: _fifo(c, "metadata.json")),
    "data file is a socket": ("__0_0.distcp", lambda c, o: _socket(c, "__0_0.distcp")),
    "common.pt is a socket": ("common.pt", lambda c, o: _socket(c, "common.pt")),
    ".metadata -> /dev/zero": (".metadata", lambda c, o: _dev_zero(c, ".metadata")),
}
# The operations that read each file (the others succeed without touching it).
READERS = {
    "metadata.json": {"load", "load_common", "inspect", "verify", "consolidate", "resume"},
    ".metadata": {"load", "inspect", "verify", "consolidate", "resume"},
    "common.pt": {"load", "load_common", "inspect", "verify", "consolidate", "resume"},
    "__0_0.distcp": {"load", "verify", "consolidate", "resume"},
    "__1_0.distcp": {"load", "verify", "consolidate", "resume"},
}


@pytest.fixture(params=sorted(CASES))
def hostile(request, tmp_path) -> tuple[Path, str]:
    """A root whose only checkpoint, ``iter_0000007``, has one hostile file; ``(checkpoint, file)``."""
    root = tmp_path / "root"
    ckpt = root / "iter_0000007"
    make_checkpoint(ckpt)
    (root / "latest").write_text("iter_0000007\n")
    name, make = CASES[request.param]
    make(ckpt, tmp_path / "outside")
    return ckpt, name


def _raises_naming(fn: Callable[[], Any], name: str) -> str:
    with pytest.raises(CkptdError) as err:
        fn()
    assert name in str(err.value), str(err.value)
    return str(err.value)


@pytest.mark.timeout(60)
def test_every_reader_refuses_the_hostile_file_at_once(hostile, tmp_path):
    ckpt, name = hostile
    readers = READERS[name]
    if "load" in readers:
        _raises_naming(lambda: ckptd.load(_template(), ckpt), name)
    if "load_common" in readers:
        _raises_naming(lambda: ckptd.load_common_state_dict(ckpt), name)
    if "consolidate" in readers:
        out = tmp_path / "model.pt"
        _raises_naming(lambda: consolidate(ckpt, out, include_common=True, fsync=False), name)
        assert not out.exists()
    if "resume" in readers:
        _raises_naming(lambda: resolve_latest(ckpt.parent), name)
    if "verify" in readers:
        report = verify_checkpoint(ckpt, deep=True)
        assert not report.ok and any(name in f.message for f in report.errors), report.findings
    if "inspect" in readers:
        try:
            summary = describe_checkpoint(ckpt)
        except CkptdError as exc:
            assert name in str(exc)
        else:  # a damaged common.pt is a note, so that the index still shows
            assert name == "common.pt" and name in (summary.common_note or ""), summary


@pytest.mark.timeout(60)
def test_load_never_returns_bytes_from_outside(tmp_path):
    """The same checkpoint loads; with its data file and common.pt replaced by links to valid
    copies, it does not (today's code loaded them, and SECRET with them)."""
    ckpt = tmp_path / "c"
    make_checkpoint(ckpt)
    assert ckptd.load_common_state_dict(ckpt)["note"] == "test"
    _link_to_copy(ckpt, "__0_0.distcp", tmp_path / "outside")
    _outside_common(ckpt, tmp_path / "outside")
    for fn in (lambda: ckptd.load(_template(), ckpt), lambda: ckptd.load_common_state_dict(ckpt)):
        with pytest.raises(CkptdError, match="symbolic link"):
            fn()


@pytest.mark.timeout(120)
def test_cli_reports_links_and_fifos_with_exit_1(tmp_path, capsys):
    linked, fifo = tmp_path / "linked", tmp_path / "fifo"
    make_checkpoint(linked)
    make_checkpoint(fifo)
    _link_to_copy(linked, "__0_0.distcp", tmp_path / "outside")
    _outside_common(linked, tmp_path / "outside")
    _fifo(fifo, ".metadata")
    rc, out, _ = cli(capsys, "verify", linked, "--deep")
    assert rc == 1 and "__0_0.distcp is a symbolic link" in out and "common.pt is a symbolic link" in out, out
    rc, _, err = cli(capsys, "convert", "consolidate", linked, tmp_path / "m.pt", "--with-common", "--no-fsync")
    assert rc == 1 and "symbolic link" in err and not (tmp_path / "m.pt").exists(), err
    # Real processes: a FIFO must not hang them, and no traceback comes out.
    for argv in (["inspect", fifo], ["verify", fifo, "--deep"]):
        p = offline_cli(*argv, env=_env(), timeout_s=100)
        assert p.returncode == 1 and "is a FIFO" in p.stdout + p.stderr, (argv, p.stdout, p.stderr)
        assert "Traceback" not in p.stderr, p.stderr
