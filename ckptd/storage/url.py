"""What a checkpoint root or checkpoint path names: a local directory, or ``s3://bucket/prefix``.

Every place that accepts a root or a checkpoint path parses it here first, so a URL ckptd does not
support is refused with a clear error instead of becoming a local directory named ``s3:``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import UnsupportedLocationError

# S3 bucket names: 3-63 characters of lowercase letters, digits, dots and hyphens.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# A first path component that is a URL scheme and its colon: what ``Path("s3://b/p")`` leaves of
# the URL ("s3:/b/p": pathlib folds the double slash), so never taken for a local directory.
_LOST_SLASHES = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:")


@dataclass(frozen=True, kw_only=True)
class S3Location:
    """``s3://<bucket>/<prefix>``; ``prefix`` has no leading or trailing slash ("" for the bucket)."""

    bucket: str
    prefix: str

    def key(self, *parts: str) -> str:
        """The object key of ``parts`` under the prefix."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def url(self, *parts: str) -> str:
        return f"s3://{self.bucket}/{self.key(*parts)}"

    def child(self, *parts: str) -> S3Location:
        return S3Location(bucket=self.bucket, prefix=self.key(*parts))

    @property
    def name(self) -> str:
        """The last component of the prefix (a checkpoint's directory name, like ``Path.name``)."""
        return self.prefix.rsplit("/", 1)[-1]

    @property
    def parent(self) -> S3Location:
        return S3Location(bucket=self.bucket, prefix=self.prefix.rsplit("/", 1)[0] if "/" in self.prefix else "")

    def __str__(self) -> str:
        return self.url()


Location = Path | S3Location


def parse_location(where: str | os.PathLike | S3Location) -> Location:
    """A local path, or an :class:`S3Location` for ``s3://bucket/prefix``; any other URL
    (``gs://``, ``http://``, ...) raises UnsupportedLocationError naming what is supported.

    A relative path whose first component is a URL scheme and its colon (``s3:/ckpt/run1``: a
    ``Path("s3://ckpt/run1")``, which lost a slash) is refused too: it would otherwise become a
    local directory named ``s3:``. A local directory whose name ends in a colon is still reached
    by an absolute path."""
    if isinstance(where, S3Location):
        return where
    if isinstance(where, Path):
        _refuse_lost_slashes(where, where.parts)
        return where
    text = os.fspath(where)
    m = _SCHEME.match(text)
    if m is None:
        path = Path(text)
        _refuse_lost_slashes(where, path.parts)
        return path
    scheme = m.group(1).lower()
    if scheme == "file":
        return Path(urlsplit(text).path)
    if scheme != "s3":
        raise UnsupportedLocationError(
            f"{text!r}: ckptd stores checkpoints in a local or shared POSIX directory, or in "
            f"S3-compatible object storage (s3://bucket/prefix); {scheme}:// is not supported"
        )
    rest = text[len(m.group(0)) :]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise UnsupportedLocationError(f"{text!r}: {bucket!r} is not an S3 bucket name")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise UnsupportedLocationError(f"{text!r}: the prefix may not hold empty, '.' or '..' components")
    return S3Location(bucket=bucket, prefix=prefix)


def _refuse_lost_slashes(where: str | os.PathLike, parts: tuple[str, ...]) -> None:
    if parts and _LOST_SLASHES.fullmatch(parts[0]):
        raise UnsupportedLocationError(
            f"{os.fspath(where)!r} begins with {parts[0]!r}: a {parts[0][:-1]}:// URL that lost a slash "
            "(pathlib.Path folds 's3://bucket/prefix' into 's3:/bucket/prefix'), so it is not made a local "
            f"directory named {parts[0]!r}; pass a URL as a str ('s3://bucket/prefix'), and a local directory "
            "whose name ends in ':' as an absolute path"
        )


def join(location: Location, *parts: str) -> Location:
    """``location / parts``: a path below a directory, or a prefix below an ``s3://`` prefix."""
    return location.child(*parts) if isinstance(location, S3Location) else location.joinpath(*parts)


def is_s3(where: str | os.PathLike | S3Location) -> bool:
    return isinstance(parse_location(where), S3Location)
