"""Waiting in tests and harnesses: poll a condition until it holds or a deadline passes, never sleep a guess.

``wait_until(cond, timeout_s, what)`` returns ``cond()``'s first true value and fails the test (naming
``what``) when ``timeout_s`` passed first; ``wait_for_exit(pid, timeout_s)`` waits until a process
is gone (or a zombie: exited, not yet reaped by its parent).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import psutil

POLL_INTERVAL_S = 0.02
T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout_s: float, what: str) -> T:
    """The first true value of ``cond()``."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(POLL_INTERVAL_S)
    return value


def exited(pid: int) -> bool:
    """``pid`` is gone, or a zombie (exited, its parent has not reaped it yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for_exit(pid: int, timeout_s: float, what: str | None = None) -> None:
    wait_until(lambda: exited(pid), timeout_s, what or f"process {pid} to exit")
