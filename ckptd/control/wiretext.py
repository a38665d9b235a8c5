"""Text put on the wire, bounded so that the message carrying it always fits.

A reason or warning a daemon sends (a refusal, an abort's reason, a commit's warnings) can be built
from a peer's strings (a key, a root, a file name). Bounded in bytes, not characters: a character
takes up to 4 bytes of UTF-8, and the message limit (CKPTD_MAX_MESSAGE_NBYTES, at least 64 KiB)
counts bytes. A commit's warnings share one budget: a node-local commit's files take up to half the
limit in the same message (ckptd.roots.nodelocal).
"""

from __future__ import annotations

MAX_TEXT_NBYTES = 16384
MAX_WARNINGS = 64
MAX_WARNINGS_NBYTES = 16384
# The room kept for the note that says how much was cut ("... (N more bytes)").
_CUT_NOTE_NBYTES = 48


def bounded_text(text: str, limit_nbytes: int = MAX_TEXT_NBYTES) -> str:
    """``text`` in at most ``limit_nbytes`` bytes of UTF-8, cut with the number of bytes left out
    said; a character UTF-8 cannot encode (a file name's undecodable byte) is escaped, as an
    unencodable string would fail the whole message."""
    raw = text.encode("utf-8", "backslashreplace")
    if len(raw) <= limit_nbytes:
        return raw.decode("utf-8")
    cut = max(0, limit_nbytes - _CUT_NOTE_NBYTES)
    return f"{raw[:cut].decode('utf-8', 'ignore')}... ({len(raw) - cut} more bytes)"


def bounded_warnings(warnings: list[str]) -> list[str]:
    """At most :data:`MAX_WARNINGS` warnings of :data:`MAX_WARNINGS_NBYTES` bytes together, each
    :func:`bounded_text`, the rest counted."""
    kept: list[str] = []
    left_nbytes = MAX_WARNINGS_NBYTES
    for warning in warnings[:MAX_WARNINGS]:
        if left_nbytes < 2 * _CUT_NOTE_NBYTES:
            break
        kept.append(bounded_text(warning, left_nbytes - _CUT_NOTE_NBYTES))  # (room for the count below)
        left_nbytes -= len(kept[-1].encode("utf-8")) + 8  # (+ msgpack's string header)
    if len(warnings) > len(kept):
        kept.append(f"... and {len(warnings) - len(kept)} more warnings (the coordinator's log has them all)")
    return kept
