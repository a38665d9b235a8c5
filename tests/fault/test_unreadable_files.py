"""A file the storage fails to return while a checkpoint is checked is not damage: a resume raises
StorageError naming the file and errno instead of falling back past the checkpoint, a save of its
step fails instead of replacing it, and ``ckptd verify`` says UNREADABLE (exit 1), not DAMAGED.

The failure is real: the file's mode denies reading it (EACCES). On NFS or Lustre the same comes
as ESTALE or EIO, and a process out of descriptors gets EMFILE: none says anything of the bytes.
Taken for damage, the resume went back to the step before, its next commit left the intact newest
step on an abandoned branch, and retention removed it.
"""

from __future__ import annotations

import contextlib
import io
import os
import traceback
from multiprocessing import Queue
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoints import make_root, stamp_commits
from tests.filemodes import obey_file_modes
from tools.harness.ranks import spawn_queue, spawned


def _checks(tmp: str, name: str, queue: Queue) -> None:
    """Resume, a save's check, ``verify`` and ``ckptd verify`` of a root whose latest (20) has
    ``name`` unreadable; what each did, on ``queue``."""
    try:
        why = obey_file_modes()
        if why is not None:
            queue.put(("skip", why))
            return
        from ckptd.catalog import scan_root
        from ckptd.commands import main
        from ckptd.errors import StorageError
        from ckptd.recovery import resolve_latest
        from ckptd.roots.posix import damaged_commit
        from ckptd.verify import verify_checkpoint

        root = make_root(Path(tmp) / "r", [10, 20], latest=20)
        stamp_commits(root, [10, 20])
        latest = root / "iter_0000020"
        os.chmod(latest / name, 0)
        try:
            os.close(os.open(latest / name, os.O_RDONLY))
            queue.put(("skip", "file modes are not enforced for this process"))
            return
        except PermissionError:
            pass
        out: dict[str, Any] = {}
        try:
            out["resume"] = f"resumed {resolve_latest(root).entry.name}"  # type: ignore[union-attr]
        except StorageError as exc:
            out["resume"] = f"StorageError: {exc}"
        try:
            replaced, damage = damaged_commit(scan_root(root, usage=False), latest.name, latest)
            out["save"] = "refused" if replaced is None else f"replaced it: {damage}"
        except StorageError as exc:
            out["save"] = f"StorageError: {exc}"
        report = verify_checkpoint(latest)
        out["verify"] = (report.status, report.ok, [f.message for f in report.findings if f.severity == "unreadable"])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = main(["verify", str(root)])
        out["cli"] = (code, printed.getvalue())
        queue.put(("ok", out))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put(("error", traceback.format_exc()))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["__0_0.distcp", "common.pt", ".metadata", "metadata.json"])
def test_a_file_the_storage_fails_to_return_is_not_damage(tmp_path, name):
    queue = spawn_queue()
    with spawned([(_checks, (str(tmp_path), name, queue))], join_timeout_s=60):
        kind, out = queue.get(timeout=100)
    if kind == "skip":
        pytest.skip(out)
    assert kind == "ok", out
    path = str(tmp_path / "r" / "iter_0000020" / name)
    for said in (out["resume"], out["save"]):
        # Not a fallback to iter_0000010, nor a save replacing iter_0000020: the error, naming
        # the file and errno, and what to do.
        assert said.startswith("StorageError: ") and path in said and "(EACCES)" in said, said
        assert "not taken for damage" in said and "make the checkpoint readable" in said, said
    status, ok, unreadable = out["verify"]
    assert (status, ok) == ("UNREADABLE", False) and len(unreadable) == 1 and path in unreadable[0], out["verify"]
    code, printed = out["cli"]
    assert code == 1 and ": UNREADABLE" in printed and "UNREADABLE [" in printed and path in printed, printed
