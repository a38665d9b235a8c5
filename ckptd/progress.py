"""Progress bars for command-line tools (tqdm): drawn on a terminal, silent otherwise.

Library code never draws anything; it accepts a plain ``advance(n)`` callback
(:func:`ckptd.load_plain_tensors`) or an object with ``set_total`` and ``advance``
(:func:`ckptd.verify.verify_checkpoint`). A command builds a :class:`Progress` and hands it down::

    with Progress(0, "verify iter_0000100") as bar:
        verify_checkpoint(path, progress=bar)

``ckptd verify`` and ``ckptd convert`` are the commands that draw one.

The bar goes to stderr (stdout stays clean for ``--json`` and pipes) and only when that stream is
a TTY, so logs, CI output and captured test output never see carriage returns.
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(nbytes: float) -> str:
    """Human-readable binary size: ``1.5 GiB``."""
    value = float(nbytes)
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for unit in _UNITS[1:-1]:
        value /= 1024
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} {_UNITS[-1]}"


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """A byte-counting progress bar (tqdm), drawn only when ``stream`` is a terminal.

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
        self.label = label
        self.done = 0
        self._bar = tqdm(
            total=max(0, int(total)),
            desc=label,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=self.stream,
            disable=not enabled,
            mininterval=min_interval_s,
            leave=True,
            dynamic_ncols=False,
            ncols=100,
            nrows=40,
        )  # a pty may report 0x0

    @property
    def total(self) -> int:
        return int(self._bar.total or 0)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_total(self, total: int) -> None:
        """Set the total once it is known (e.g. after reading an index)."""
        self._bar.total = max(0, int(total))
        self._bar.refresh()

    def set_label(self, label: str) -> None:
        """Change the text before the bar (e.g. the file being worked on)."""
        self.label = label
        self._bar.set_description_str(label, refresh=False)

    def advance(self, n: int) -> None:
        """Count ``n`` more units done; the bar redraws when enough time has passed."""
        self.done += n
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()
