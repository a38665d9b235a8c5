"""The CLI progress bar: silent unless its stream is a terminal."""

import io

from ckptd.progress import Progress, format_bytes, format_duration


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_silent_when_not_a_tty():
    out = io.StringIO()
    with Progress(100, "verify", stream=out) as bar:
        bar.advance(50)
        bar.advance(50)
    assert not bar.enabled and out.getvalue() == ""


def test_draws_on_a_tty_and_ends_the_line():
    out = _Tty()
    with Progress(0, "verify c", stream=out, min_interval_s=0) as bar:
        bar.set_total(4 << 20)
        bar.advance(1 << 20)
        assert " 25%" in out.getvalue() and "1.00M/4.00M" in out.getvalue()
        bar.advance(3 << 20)
    text = out.getvalue()
    assert text.startswith("\rverify c:") and "100%" in text and text.endswith("\n")
    assert bar.done == 4 << 20


def test_formatting():
    assert format_bytes(0) == "0 B" and format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(3 << 30) == "3.0 GiB"
    assert format_bytes(1 << 60) == "1024.0 PiB"
    assert format_duration(5) == "5s" and format_duration(125) == "2m05s" and format_duration(7260) == "2h01m"
