"""A tiny progress bar for command-line tools: drawn on a terminal, silent otherwise.

Library code never draws anything; it accepts a plain ``advance(n)`` callback. A command builds a
:class:`Progress` and hands its :meth:`Progress.advance` down::

    with Progress(total_bytes, "verify iter_0000100") as bar:
        verify_checkpoint(path, progress=bar.advance)

The bar goes to stderr (stdout stays clean for ``--json`` and pipes) and only when that stream is
a TTY, so logs, CI output and captured test output never see carriage returns.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_BAR_WIDTH = 24
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(nbytes: float) -> str:
    """Human-readable binary size: ``1.5 GiB``."""
    value = float(nbytes)
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for unit in _UNITS[1:]:
        value /= 1024
        if abs(value) < 1024:
            break
    return f"{value:.1f} {unit}"


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """A byte-counting progress bar, redrawn at most every ``min_interval_s``.

    ``enabled`` defaults to ``stream.isatty()``; when disabled every method is a cheap no-op.
    Use as a context manager (or call :meth:`close`) so the last line is finished with a newline.
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        min_interval_s: float = 0.1,
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.total = max(0, int(total))
        self.label = label
        self.done = 0
        self.min_interval_s = min_interval_s
        self._start = time.monotonic()
        self._last_draw = float("-inf")
        self._drawn = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_total(self, total: int) -> None:
        """Set the total once it is known (e.g. after reading an index)."""
        self.total = max(0, int(total))

    def advance(self, n: int) -> None:
        """Count ``n`` more units done; redraws when enough time has passed."""
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_draw >= self.min_interval_s or self.done >= self.total:
            self._draw(now)

    def render(self, now: float | None = None) -> str:
        """The current line (without the leading carriage return)."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(round(frac * _BAR_WIDTH))
        rate = self.done / elapsed
        line = (f"{self.label} [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {100 * frac:5.1f}% "
                f"{format_bytes(self.done)}/{format_bytes(self.total)} {format_bytes(rate)}/s")
        if 0 < frac < 1 and rate > 0:
            line += f" ETA {format_duration((self.total - self.done) / rate)}"
        return line

    def _draw(self, now: float) -> None:
        self._last_draw = now
        self._drawn = True
        # Pad to erase the tail of a longer previous line.
        self.stream.write("\r" + self.render(now).ljust(79))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._drawn:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
