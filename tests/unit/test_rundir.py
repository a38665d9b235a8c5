"""The default runtime directory (ckptd.control.rundir) against another user who creates
``/tmp/ckptd-<uid>`` first: here a private directory stands for ``/tmp`` and uid 65534 for the
other user (chown: the tests run as root). tests/fault/test_runtime_dir.py runs the same with a real
``/tmp`` of a mount namespace, real daemons and a restarted trainer."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ckptd.control.rundir import runtime_dir_for

OTHER_UID = 65534


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    base = tmp_path / "tmp"
    base.mkdir()
    base.chmod(0o1777)
    return base


def _resolve(tmp: Path) -> Path:
    return runtime_dir_for({}, tmp)


def test_the_usual_directory_while_nobody_else_took_it(tmp):
    uid = os.getuid()
    assert _resolve(tmp) == tmp / f"ckptd-{uid}" and (tmp / f"ckptd-{uid}").is_dir()
    assert _resolve(tmp) == tmp / f"ckptd-{uid}"
    xdg = tmp / "xdg"
    xdg.mkdir()
    assert runtime_dir_for({"XDG_RUNTIME_DIR": str(xdg)}, tmp) == xdg / "ckptd"


@pytest.mark.parametrize("squat", ["directory", "file", "link"])
def test_a_squatted_directory_gives_an_unpredictable_one_found_again(tmp, squat):
    uid = os.getuid()
    squatted = tmp / f"ckptd-{uid}"
    if squat == "directory":
        squatted.mkdir(mode=0o777)
    elif squat == "file":
        squatted.write_text("")
    else:
        squatted.symlink_to(tmp)
    os.chown(squatted, OTHER_UID, OTHER_UID, follow_symlinks=False)
    decoy = tmp / f"ckptd-{uid}-0decoy"  # first by name, but not this user's
    decoy.mkdir(mode=0o700)
    os.chown(decoy, OTHER_UID, OTHER_UID)
    found: list[Path] = []
    threads = [threading.Thread(target=lambda: found.append(_resolve(tmp))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(found) == 8 and len(set(found)) == 1, found
    mine = found[0]
    assert mine.name.startswith(f"ckptd-{uid}-") and mine != decoy
    st = os.lstat(mine)
    assert st.st_uid == uid and st.st_mode & 0o777 == 0o700
    assert sorted(p.name for p in tmp.iterdir()) == sorted([squatted.name, decoy.name, mine.name])
    # Found again later, also once the squatter left (a daemon may still live in it).
    assert _resolve(tmp) == mine
    if squat == "directory":
        squatted.rmdir()
    else:
        squatted.unlink()
    assert _resolve(tmp) == mine
