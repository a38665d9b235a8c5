"""Test hooks only: file openers that slow down or fail the daemon's writes on purpose.

Fault tests need real resource failures (a full disk, a read-only or forbidden directory, a slow
disk) at a chosen moment, inside a real daemon, and they need the failure to go away again. Two
:class:`~ckptd.config.CkptdConfig` knobs enable them; both are off by default and production code
never sets them:

- ``debug_write_delay_s``: sleep that long before opening each file for writing;
- ``debug_fault_file``: a path that is read again at *every* open, so a test switches faults on
  and off while the daemon runs by writing or deleting that file. Each non-empty line is one rule:

  ``delay <seconds>``
      sleep before opening a file for writing (a slow disk);
  ``hang [glob]``
      an open for writing of a file whose name matches ``glob`` (default ``*``) blocks for as long
      as this rule stays in the fault file (checked every 50 ms, at most :data:`HANG_MAX_S`): a
      disk that stopped answering, until the test removes the rule;
  ``fail <ERRNO> [after_nbytes] [glob]``
      files whose name matches ``glob`` (default ``*``) fail with ``OSError(ERRNO)``: at open when
      ``after_nbytes`` is 0 or absent, else once more than ``after_nbytes`` bytes were written to
      the file (the bytes up to the limit are written, as a filling disk does). ``ERRNO`` is a
      name from :mod:`errno` (``ENOSPC``, ``EACCES``, ``EROFS``, ``EIO``, ``EDQUOT``...).

A missing or empty fault file means no fault. The raised errors are the ``OSError``s the kernel
gives, with the real ``strerror``: a failed open names its file, a failed write names none (as
``write(2)`` does), so everything downstream handles them exactly like real ones and must say
itself which file failed; each injection is logged as such at WARNING so a daemon log never
hides that a fault was staged.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CkptdError
from ..format.durable import Opener, WriteFile, default_opener

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailRule:
    errno_code: int
    after_nbytes: int
    glob: str


HANG_MAX_S = 600.0
_HANG_POLL_S = 0.05


@dataclass(frozen=True)
class FaultPlan:
    delay_s: float = 0.0
    failures: tuple[FailRule, ...] = ()
    hangs: tuple[str, ...] = ()  # globs of the files whose open hangs

    def failure_for(self, name: str) -> FailRule | None:
        return next((r for r in self.failures if fnmatch.fnmatch(name, r.glob)), None)

    def hangs_for(self, name: str) -> bool:
        return any(fnmatch.fnmatch(name, glob) for glob in self.hangs)


def parse_fault_spec(text: str, source: str = "fault file") -> FaultPlan:
    """Parse the rules of a fault file (see the module docstring); raise CkptdError on a bad line."""
    delay, failures, hangs = 0.0, [], []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        try:
            if words[0] == "delay" and len(words) == 2:
                delay += float(words[1])
                continue
            if words[0] == "hang" and len(words) <= 2:
                hangs.append(words[1] if len(words) > 1 else "*")
                continue
            if words[0] == "fail" and 2 <= len(words) <= 4:
                code = getattr(errno, words[1])
                after = int(words[2]) if len(words) > 2 else 0
                if not isinstance(code, int) or after < 0:
                    raise ValueError(line)
                failures.append(FailRule(code, after, words[3] if len(words) > 3 else "*"))
                continue
        except (AttributeError, ValueError):
            pass
        raise CkptdError(
            f"{source} line {n}: {line!r} is not 'delay <seconds>', 'hang [glob]' or "
            "'fail <ERRNO> [after_nbytes] [glob]'"
        )
    return FaultPlan(delay, tuple(failures), tuple(hangs))


def read_fault_plan(path: str) -> FaultPlan:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return FaultPlan()
    return parse_fault_spec(text, path)


class FailingFile:
    """A write-through wrapper that raises ``OSError(code)`` once ``limit`` bytes were written."""

    def __init__(self, f: WriteFile, path: str, code: int, limit: int) -> None:
        self._f = f
        self._path = path
        self._code = code
        self._left = limit

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes > self._left:
            if self._left > 0:
                self._f.write(view[: self._left])
            self._left = 0
            log.warning("injected fault: %s while writing %s", errno.errorcode[self._code], self._path)
            raise OSError(self._code, os.strerror(self._code))  # write(2) names no file
        self._left -= view.nbytes
        return self._f.write(view)

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:  # what a DirectFile has besides (skip_to, direct_alignment)
        return getattr(self._f, name)

    def __enter__(self) -> FailingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


def fault_opener(fault_file: str, base: Opener = default_opener) -> Opener:
    """An opener applying the rules of ``fault_file`` as they are at each open."""

    def opener(path: str, mode: str) -> WriteFile:
        if "w" not in mode and "a" not in mode:
            return base(path, mode)
        plan = read_fault_plan(fault_file)
        if plan.delay_s:
            time.sleep(plan.delay_s)
        name = os.path.basename(path)
        if plan.hangs_for(name):
            plan = _hang(fault_file, name, path)
        rule = plan.failure_for(name)
        if rule is None:
            return base(path, mode)
        if rule.after_nbytes == 0:
            log.warning("injected fault: %s opening %s", errno.errorcode[rule.errno_code], path)
            raise OSError(rule.errno_code, os.strerror(rule.errno_code), path)
        return FailingFile(base(path, mode), path, rule.errno_code, rule.after_nbytes)

    return opener


def _hang(fault_file: str, name: str, path: str) -> FaultPlan:
    """Block while a ``hang`` rule of ``fault_file`` matches ``name`` (at most HANG_MAX_S);
    returns the rules as they are when it ends."""
    log.warning("injected fault: the open of %s hangs until the rule is removed", path)
    deadline = time.monotonic() + HANG_MAX_S
    while True:
        time.sleep(_HANG_POLL_S)
        plan = read_fault_plan(fault_file)
        if not plan.hangs_for(name) or time.monotonic() > deadline:
            log.warning("injected fault: the hang of %s ends", path)
            return plan


def delayed_opener(delay_s: float, base: Opener = default_opener) -> Opener:
    """Sleep ``delay_s`` before opening each file for writing."""

    def opener(path: str, mode: str) -> WriteFile:
        if "w" in mode:
            time.sleep(delay_s)
        return base(path, mode)

    return opener


def debug_opener(delay_s: float, fault_file: str, base: Opener = default_opener) -> Opener:
    """The daemon's file opener: ``base`` unless a test hook is configured."""
    opener = base
    if fault_file:
        opener = fault_opener(fault_file, opener)
    if delay_s:
        opener = delayed_opener(delay_s, opener)
    return opener
