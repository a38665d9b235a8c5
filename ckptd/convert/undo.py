"""A failed conversion leaves its output directory as it found it."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..format.durable import ATOMIC_TMP_SUFFIX
from ..format.layout import COMMON_PT, DATA_SUFFIX, DCP_METADATA, METADATA_JSON

log = logging.getLogger("ckptd.convert")

#: The files write_checkpoint creates (data files, then common.pt, .metadata, metadata.json via tmp).
_WRITTEN = re.compile(
    rf"(__\d+_\d+{re.escape(DATA_SUFFIX)}|{re.escape(COMMON_PT)}|{re.escape(DCP_METADATA)}"
    rf"|{re.escape(METADATA_JSON)})({re.escape(ATOMIC_TMP_SUFFIX)})?"
)


@contextmanager
def undone_on_failure(root: Path) -> Iterator[None]:
    """Create ``root`` (and its missing parents); if the body fails, remove what it created there: the
    files a checkpoint write creates that were not there before, and the directories made here
    (when empty). A failed conversion then leaves ``dst`` as it was, not a data file without
    markers that looks like an interrupted save."""
    made = [p for p in (root, *root.parents) if not p.exists()]
    root.mkdir(parents=True, exist_ok=True)
    before = set(os.listdir(root))
    try:
        yield
    except BaseException:
        for name in sorted(set(os.listdir(root)) - before):
            if _WRITTEN.fullmatch(name):
                try:
                    (root / name).unlink()
                except OSError as exc:
                    log.warning("could not remove %s after the failed conversion: %s", root / name, exc)
        for directory in made:  # deepest first
            try:
                directory.rmdir()
            except OSError:
                break  # not empty: something else is in it
        raise
