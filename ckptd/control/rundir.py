"""The runtime directory a user's ckptd processes meet in when ``CKPTD_RUNTIME_DIR`` is not set.

A restarted trainer finds the daemon that still persists its last saves by looking where every
process of its user looks: this module's answer must be the same for all of them, and no other
user may choose it. In order:

1. ``$XDG_RUNTIME_DIR/ckptd`` when ``XDG_RUNTIME_DIR`` names a directory (the login session's own,
   ``/run/user/<uid>``: nobody else can create anything in it);
2. a directory of this user named ``/tmp/ckptd-<uid>-<random>``, if one exists (the first by
   name): a fallback made earlier, because
3. ``/tmp/ckptd-<uid>``, created (mode 0700) if absent, belongs to someone else or is not a
   directory. Its name is predictable, so any local user can create it first, which used to stop
   every job of this user; the fallback's name is not, and a directory that another user created
   is never taken for one (the owner is checked; in the sticky ``/tmp`` nobody else can remove or
   rename ours).

Fallbacks are made under an ``flock`` of ``/tmp`` itself (waited for at most
:data:`LOCK_WAIT_S`), so that ranks starting together agree on one. Should another user hold that
lock, the wait ends and the processes making a fallback in that very moment may each keep their
own; every later process takes the first by name.

The same rules (:func:`private_dir_in`) place the user's directory of the machine locks of
``s3://`` roots, ``/dev/shm/.ckptd-<uid>`` (ckptd.daemon.rootlock).
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from ..format.safefs import lock_by

log = logging.getLogger(__name__)

TMP = Path("/tmp")
LOCK_WAIT_S = 5.0
_LOCK_POLL_S = 0.01


def runtime_dir_for(environ: Mapping[str, str], tmp: Path = TMP, uid: int | None = None) -> Path:
    """This user's runtime directory (see the module docstring); creates it under ``tmp`` when
    needed. ``tmp`` and ``uid`` are for tests (another user's ``/tmp`` view)."""
    uid = os.getuid() if uid is None else uid
    xdg = environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "ckptd"
    return private_dir_in(tmp, f"ckptd-{uid}", uid)


def private_dir_in(parent: Path, name: str, uid: int) -> Path:
    """``parent/name``, a directory of ``uid`` in the world-writable sticky ``parent``, created
    (mode 0700) if absent; where someone else took that name, this user's fallback
    ``parent/name-<random>`` (points 2 and 3 of the module docstring)."""
    found = find_private_dir(parent, name, uid)
    if found is not None:
        return found
    canonical = parent / name
    try:
        os.mkdir(canonical, 0o700)
        return canonical
    except FileExistsError:
        if _is_own_dir(canonical, uid):  # another process of this user made it just now
            return canonical
    return _make_fallback(parent, name, uid)


def find_private_dir(parent: Path, name: str, uid: int) -> Path | None:
    """What :func:`private_dir_in` answers, without making anything: None while it would."""
    canonical = parent / name
    if _is_own_dir(canonical, uid):
        return canonical
    found = _fallbacks(parent, name, uid)
    return found[0] if found else None


def _is_own_dir(path: Path, uid: int) -> bool:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


def _fallbacks(tmp: Path, name: str, uid: int) -> list[Path]:
    """This user's fallback directories for ``name`` under ``tmp``, in name order."""
    prefix = f"{name}-"
    try:
        names = sorted(n for n in os.listdir(tmp) if n.startswith(prefix))
    except OSError:
        return []
    return [tmp / n for n in names if _is_own_dir(tmp / n, uid)]


def _make_fallback(tmp: Path, name: str, uid: int) -> Path:
    squatted = tmp / name
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        locked = _lock(fd, tmp)
        found = _fallbacks(tmp, name, uid)  # made by another process of this user while we waited
        if not found:
            made = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))
            log.warning(
                "%s is not a directory of uid %d (someone else created it first); using %s, which "
                "every later ckptd process of this user finds again",
                squatted,
                uid,
                made,
            )
            # Without the lock (another user holds it) processes racing here may each have made
            # one: the first by name is everyone's from now on; an empty loser is removed.
            found = [made] if locked else _fallbacks(tmp, name, uid)
            if found[0] != made:
                _remove_empty(made)
        return found[0]
    finally:
        os.close(fd)  # releases the flock


def _lock(fd: int, tmp: Path) -> bool:
    try:
        if lock_by(fd, time.monotonic() + LOCK_WAIT_S, _LOCK_POLL_S):
            return True
        why = f"another process held it for {LOCK_WAIT_S:g} s"
    except OSError as exc:
        why = str(exc)
    log.warning("could not lock %s to make a runtime directory (%s); going on without", tmp, why)
    return False


def _remove_empty(path: Path) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
