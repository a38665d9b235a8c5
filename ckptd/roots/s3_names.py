"""Which objects of an ``s3://`` root's step a Checkpointer wrote, told by their names alone.

A Checkpointer's save names every data object after its attempt
(``__<rank>_0.<attempt>.distcp``: a save's ``<12 hex>-<n>``, a mirror copy's ``<attempt>-m<8 hex>``,
ckptd.roots.s3_data); its commit writes ``common.pt``, ``.metadata``, ``metadata.json`` and
``ckptd_commit.json``, and a mirror's copy round its manifests ``ckptd_copy.<attempt>.node<N>.json``.
Other tools name theirs otherwise: torch DCP ``__0_0.distcp``, ``ckptd.save``
``__0_0.<12 hex>.distcp`` (a token, not an attempt). A step without a commit object that holds
checkpoint metadata is a crashed ckptd attempt's leftovers only when its names prove it: a data
object of an attempt and nothing ckptd does not write. Anything else (an object another tool
named, or metadata without any attempt's data object) is another tool's checkpoint, or too
doubtful to tell: a coordinator's start never removes it. A commit of the step, whose own data
objects are there, refuses metadata next to an object another tool named (and an abort keeps
that metadata); metadata with nothing else of another tool is replaced as an earlier attempt's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..format.commitrecord import COMMIT_RECORD
from ..format.layout import COMMON_PT, DCP_METADATA, METADATA_JSON
from ..format.rootlayout import ATTEMPT_PATTERN, parse_step_dir

METADATA_OBJECTS = (COMMON_PT, DCP_METADATA, METADATA_JSON)
_DATA_OBJECT = re.compile(rf"^__\d+_0\.({ATTEMPT_PATTERN}(?:-m[0-9a-f]{{8}})?|x-m[0-9a-f]{{8}})\.distcp$")
# A mirror copy round's manifest (ckptd.roots.copyround.manifest_name).
MANIFEST = re.compile(r"^ckptd_copy\.([0-9A-Za-z-]+)\.node(\d+)\.json$")


def leaf(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def attempt_of(key: str) -> str | None:
    """The attempt a Checkpointer's data object's key names (``.../__<rank>_0.<attempt>.distcp``),
    else None (another tool's object: ``ckptd.save``'s token is no attempt)."""
    m = _DATA_OBJECT.match(leaf(key))
    return None if m is None else m.group(1)


def step_attempt_of(key: str) -> tuple[int, str] | None:
    """The step and attempt a Checkpointer's data object's key (relative to the root:
    ``iter_<step>/__<rank>_0.<attempt>.distcp``) names, else None."""
    parsed = parse_step_dir(key.split("/", 1)[0])
    attempt = attempt_of(key)
    return None if parsed is None or parsed.suffix or attempt is None else (parsed.step, attempt)


def ckptd_named(key: str) -> bool:
    """Whether a Checkpointer (or its mirror) names a step's objects so."""
    name = leaf(key)
    return (
        attempt_of(key) is not None or name in METADATA_OBJECTS or name == COMMIT_RECORD or bool(MANIFEST.match(name))
    )


def foreign_checkpoint(keys: Iterable[str]) -> list[str]:
    """The objects of an uncommitted step that make it a checkpoint ckptd cannot prove it wrote,
    [] when it holds no checkpoint metadata or is provably a Checkpointer's attempt (see the module
    docstring): the objects no Checkpointer names so, else its metadata objects."""
    names = sorted(leaf(k) for k in keys)
    metadata = [n for n in names if n in (DCP_METADATA, METADATA_JSON)]
    if not metadata:
        return []
    foreign = [n for n in names if not ckptd_named(n)]
    if foreign or any(attempt_of(n) is not None for n in names):
        return foreign
    return metadata


def removable(keys: Iterable[str]) -> list[str]:
    """The objects of an uncommitted step that an attempt's removal (a start's, an abort's) may
    delete: what a Checkpointer's save names so, its metadata objects only next to a data object
    of an attempt and nothing another tool named (``ckptd.save`` writes ``common.pt`` before
    ``.metadata``: one caught in between holds no checkpoint metadata yet, and its ``common.pt``
    is its own)."""
    keys = list(keys)
    theirs = any(not ckptd_named(k) for k in keys)
    ours = any(attempt_of(k) is not None for k in keys)
    return [k for k in keys if ckptd_named(k) and (leaf(k) not in METADATA_OBJECTS or (ours and not theirs))]


def retired(key: str, keep_attempt: str | None, only_attempt: str | None) -> bool:
    """Whether retiring a step removes object ``key`` (see ckptd.roots.s3_root.S3Root._retire):
    the metadata objects always (an attempt writes them only at its commit), data objects by
    their attempt."""
    attempt = attempt_of(key)
    if attempt is None:
        return True
    return attempt != keep_attempt and (only_attempt is None or attempt == only_attempt)


def why_kept(step_url: str, keys: Iterable[str]) -> str | None:
    """Why a coordinator's start keeps objects of the uncommitted step at ``step_url`` holding
    ``keys`` (no Checkpointer's save names them so), or None when it keeps none."""
    names = [leaf(k) for k in keys]
    theirs = foreign_checkpoint(names)
    kept = "ckptd never removes it"
    if theirs and not all(ckptd_named(n) for n in theirs):
        what = f"checkpoint metadata next to objects no Checkpointer's save wrote ({', '.join(theirs[:3])})"
        kept = "ckptd never removes nor replaces it (a save of its step fails)"
    elif theirs:
        what = f"{' and '.join(theirs)} but no data object of a Checkpointer's save"
    elif others := sorted(n for n in names if not ckptd_named(n)):
        return (
            f"{step_url}: objects no Checkpointer's save wrote ({', '.join(others[:3])}) are left to their "
            "writer (`ckptd gc` removes an uncommitted step's objects past --grace-s)"
        )
    else:
        return None
    return (
        f"{step_url} holds {what}, without a commit object ({COMMIT_RECORD}): another tool's checkpoint "
        f"(ckptd.save, torch DCP), or one ckptd cannot tell for its own. Kept: {kept}; remove it by hand if "
        "it is not wanted"
    )
