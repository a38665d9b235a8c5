"""A small, bounded client of S3-compatible object storage, for one bucket.

Two libraries, each where it is best (measured here against SeaweedFS, see the README's Object
stores section): `obstore <https://developmentseed.org/obstore>`_ (Rust's ``object_store``) moves
the bytes: uploads and ranged reads at the highest throughput and the least client CPU of the
clients tried, with retries and jittered backoff of 5xx, SlowDown and connection errors built in,
and conditional PUTs (``If-None-Match: *``, ``If-Match``). botocore resolves the standard AWS
configuration (``AWS_ENDPOINT_URL[_S3]``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_PROFILE`` and the shared config and credentials
files, refreshing temporary credentials) and runs the two calls obstore lacks: listing and
aborting unfinished multipart uploads.

Every failure is a :class:`~ckptd.errors.StorageError` (or ``CorruptCheckpointError`` for a
hostile size) naming the object and what to do; credentials are never logged or put in messages.
Reads are bounded: an object is read whole only up to a stated limit, checked before anything is
allocated.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from ..errors import CorruptCheckpointError, StorageError
from .url import S3Location

log = logging.getLogger(__name__)

# A refusal of the credentials in an error's text: the store's error codes, or HTTP status 403 said
# as a status (not the digits of a duration such as "in 1.394114031s", of a port, or of a key in the
# request's URL: rank 403's data object, part number 403).
_DENIED = re.compile(
    r"AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch"
    r"|status(?: code)?:? 403\b|\b403 Forbidden|HTTP/\S+ 403\b|\(403\)"
)

# The store's error code in the XML body of its answer: obstore puts the body on the lines after
# the first of its error's text (then a debug dump of the request), so codes are searched for in
# the whole text, up to _ERROR_SCAN_CHARS of it.
_CODE = re.compile(r"<Code>([A-Za-z0-9.]{1,64})</Code>")
_ERROR_SCAN_CHARS = 8000

# obstore's own retries (exponential backoff with jitter) of 5xx, 429/SlowDown and connection
# errors; a request still failing after them fails the operation. CKPTD_S3_RETRIES,
# CKPTD_S3_RETRY_TIMEOUT_S and CKPTD_S3_REQUEST_TIMEOUT_S (one request, a part of 32 MiB or more included: a
# connection the network dropped silently fails after it) override the defaults (a save's deadline
# is commit_timeout_s anyway).
RETRIES = 6
RETRY_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True, kw_only=True)
class ObjectInfo:
    key: str  # relative to the client's prefix
    size: int
    etag: str | None
    last_modified_unix_s: float = 0.0

    @classmethod
    def of(cls, meta: Any) -> ObjectInfo:
        modified = meta.get("last_modified")
        return cls(
            key=meta["path"],
            size=int(meta["size"]),
            etag=meta.get("e_tag"),
            last_modified_unix_s=modified.timestamp() if modified is not None else 0.0,
        )


@dataclass(frozen=True, kw_only=True)
class Upload:
    """An unfinished multipart upload."""

    key: str  # relative to the client's prefix
    upload_id: str = field(repr=False)
    initiated_unix_s: float


@dataclass(frozen=True, kw_only=True)
class S3Settings:
    """Where and as whom to connect, from the standard AWS configuration (see the module docstring)."""

    endpoint_url: str | None
    region: str
    profile: str | None
    retries: int = RETRIES
    retry_timeout_s: float = RETRY_TIMEOUT_S
    request_timeout_s: float = REQUEST_TIMEOUT_S

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> S3Settings:
        env = os.environ if environ is None else environ
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
        profile = env.get("AWS_PROFILE") or None
        session = _botocore_session(profile)
        if endpoint is None:
            endpoint = session.get_scoped_config().get("endpoint_url") or None
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or session.get_config_variable("region")
        try:
            retries = int(env.get("CKPTD_S3_RETRIES", RETRIES))
            retry_timeout_s = float(env.get("CKPTD_S3_RETRY_TIMEOUT_S", RETRY_TIMEOUT_S))
            request_timeout_s = float(env.get("CKPTD_S3_REQUEST_TIMEOUT_S", REQUEST_TIMEOUT_S))
            if not (retries >= 0 and retry_timeout_s > 0 and request_timeout_s >= 1):
                raise ValueError("need retries >= 0, a retry timeout > 0 and a request timeout >= 1 s")
        except ValueError as exc:
            raise StorageError(
                f"CKPTD_S3_RETRIES / CKPTD_S3_RETRY_TIMEOUT_S / CKPTD_S3_REQUEST_TIMEOUT_S: {exc}"
            ) from None
        return cls(
            endpoint_url=endpoint,
            region=region or "us-east-1",
            profile=profile,
            retries=retries,
            retry_timeout_s=retry_timeout_s,
            request_timeout_s=request_timeout_s,
        )


def _botocore_session(profile: str | None) -> Any:
    """botocore's session of ``profile``, checked: a profile that does not exist is otherwise
    found out by whichever later call reads it, as botocore's own error."""
    import botocore.session

    try:
        session = botocore.session.Session(profile=profile)
        session.get_scoped_config()
        return session
    except Exception as exc:  # noqa: BLE001 - botocore raises its own ProfileNotFound etc.
        raise StorageError(
            f"AWS profile {profile!r} cannot be used ({type(exc).__name__}: {exc}); check AWS_PROFILE "
            "and the profiles of ~/.aws/config and ~/.aws/credentials"
        ) from None


class S3Client:
    """Objects under ``location`` (keys are relative to its prefix). Thread-safe; reuse it."""

    def __init__(self, location: S3Location, settings: S3Settings | None = None) -> None:
        try:
            from obstore.store import S3Store
        except ImportError:
            raise StorageError(
                f"{location}: checkpoints on object storage need obstore and boto3: pip install 'ckptd[s3]'"
            ) from None

        self.location = location
        self.settings = settings if settings is not None else S3Settings.from_environment()
        self._session = _botocore_session(self.settings.profile)
        credentials = self._session.get_credentials()
        if credentials is None:
            raise StorageError(
                f"{location}: no AWS credentials found (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, the shared credentials file or an instance role); set them for every "
                "process of the job"
            )
        self._credentials = credentials
        endpoint = self.settings.endpoint_url
        self._store = S3Store(
            location.bucket,
            prefix=location.prefix or None,
            region=self.settings.region,
            endpoint=endpoint,
            credential_provider=cast(Any, self._provide_credentials),  # returns its S3Credential dict
            virtual_hosted_style_request=False,
            conditional_put="etag",
            client_options={
                "allow_http": bool(endpoint and endpoint.startswith("http://")),
                "timeout": f"{int(self.settings.request_timeout_s)}s",
                "connect_timeout": "10s",
            },
            retry_config={
                "max_retries": self.settings.retries,
                "retry_timeout": datetime.timedelta(seconds=self.settings.retry_timeout_s),
                "backoff": {
                    "init_backoff": datetime.timedelta(milliseconds=100),
                    "max_backoff": datetime.timedelta(seconds=15),
                    "base": 2,
                },
            },
        )
        self._boto: Any = None

    def __repr__(self) -> str:
        return f"S3Client({self.location})"

    def _provide_credentials(self) -> dict[str, Any]:
        """obstore's credential provider: botocore's current (refreshed) credentials, asked for
        again every five minutes."""
        c = self._credentials.get_frozen_credentials()
        return {
            "access_key_id": c.access_key,
            "secret_access_key": c.secret_key,
            "token": c.token,
            "expires_at": datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5),
        }

    def url(self, key: str) -> str:
        return self.location.url(key)

    def check_access(self) -> None:
        """One cheap request, so that a wrong endpoint, bucket or credentials fail at once with a
        clear StorageError instead of at the first save: the listing of a "directory" nothing is
        in. (Not a HEAD: AWS S3 and MinIO answer a HEAD in a missing bucket with a bodiless 404, which
        reads as a missing object; a listing's answer says NoSuchBucket.)"""
        self.list_dir(".ckptd-access-check")

    # --- reading --------------------------------------------------------------------------------
    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and ETag, or None when it does not exist."""
        import obstore

        try:
            meta = obstore.head(self._store, key)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - obstore's errors, mapped below
            raise self._error(exc, key, "read") from None
        return ObjectInfo.of(meta)

    def get(self, key: str, max_nbytes: int, what: str = "object") -> tuple[bytes, str | None] | None:
        """The whole object and its ETag, or None when it does not exist. An object larger than
        ``max_nbytes`` is refused (CorruptCheckpointError) before its bytes are read."""
        import obstore

        try:
            result = obstore.get(self._store, key)
        except FileNotFoundError as exc:
            if _no_bucket(exc):
                raise self._error(exc, key, "read") from None
            return None
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, key, "read") from None
        size = int(result.meta["size"])
        if size > max_nbytes:
            raise CorruptCheckpointError(
                f"{what} {self.url(key)} has {size} bytes, more than the {max_nbytes} such a file may have; "
                "it is damaged or not a checkpoint file"
            )
        try:
            data = bytes(result.bytes())
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, key, "read") from None
        if len(data) != size:
            raise StorageError(f"{self.url(key)}: read {len(data)} bytes of {size}; the object changed while read")
        return data, result.meta.get("e_tag")

    def get_range(self, key: str, start: int, length: int) -> tuple[memoryview, str | None]:
        """Bytes ``[start, start + length)`` of ``key`` (``length`` > 0) and the ETag of the object
        they were read from (normalized: :func:`plain_etag`; None when the store gives none)."""
        import obstore

        try:
            result = obstore.get(self._store, key, options={"range": (start, start + length)})
            view = memoryview(result.bytes())
        except FileNotFoundError as exc:
            if _no_bucket(exc):
                raise self._error(exc, key, "read") from None
            raise CorruptCheckpointError(
                f"data object {self.url(key)} is missing; the checkpoint is incomplete"
            ) from None
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, key, "read") from None
        if len(view) != length:
            raise CorruptCheckpointError(
                f"data object {self.url(key)} is truncated: bytes [{start}, {start + length}) are not all there"
            )
        etag = result.meta.get("e_tag")
        return view, None if etag is None else plain_etag(etag)

    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under the "directory" ``prefix`` (paged; keys relative to the client's prefix)."""
        import obstore

        try:
            for batch in obstore.list(self._store, prefix or None, chunk_size=1000):
                for meta in batch:
                    yield ObjectInfo.of(meta)
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, prefix or "", "list") from None

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[ObjectInfo]]:
        """What lies right under the "directory" ``prefix``: its "subdirectories" (common prefixes,
        relative to the client's prefix, without the trailing slash) and its objects."""
        import obstore

        try:
            result = obstore.list_with_delimiter(self._store, prefix or None)
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, prefix or "", "list") from None
        return [p.rstrip("/") for p in result["common_prefixes"]], [ObjectInfo.of(m) for m in result["objects"]]

    # --- writing --------------------------------------------------------------------------------
    def create(self, key: str, data: bytes, *, if_unknown: str) -> None:
        """Create ``key`` holding ``data`` (``If-None-Match: *``); FileExistsError when another
        writer's object is there.

        A create the store applied can fail at the client: its response lost, obstore's retry of
        it gets 412 (FileExistsError), or the last try times out (StorageError). Failing the save
        then would leave the writer's object behind, believed not written (a commit record: the
        step committed though its ranks were told it aborted; ``ckptd.save``'s metadata: a
        complete checkpoint reported failed), so the object is read back and counts as created
        when it holds exactly ``data`` (a commit record names its attempt, seq and time, a
        ``.metadata`` its save's token: no other writer's is equal). ``if_unknown`` says what
        follows when it cannot be read back."""
        try:
            self.put(key, data, create_only=True)
            return
        except (FileExistsError, StorageError) as exc:
            failure: Exception = exc
        try:
            got = self.get(key, len(data), "object")
        except CorruptCheckpointError:  # larger than ``data``: another writer's
            got = None
        except StorageError as exc:
            raise StorageError(
                f"the create-only write of {self.url(key)} failed ({failure}) and reading it back "
                f"failed too ({exc}), so whether the store wrote it is unknown ({if_unknown}); check the "
                "store (AWS_ENDPOINT_URL, the network)"
            ) from failure
        if got is not None and got[0] == data:
            log.info("%s was created, though its write reported: %s", self.url(key), failure)
            return
        raise failure

    def put(
        self, key: str, data: bytes | memoryview, *, create_only: bool = False, if_match: str | None = None
    ) -> str | None:
        """Write a small object whole; returns its ETag. ``create_only``: ``If-None-Match: *``
        (FileExistsError when it exists); ``if_match``: only over that ETag (PreconditionFailed:
        FileExistsError too)."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        mode: Any = None
        if create_only:
            mode = "create"
        elif if_match is not None:
            mode = {"e_tag": if_match}
        try:
            result = obstore.put(self._store, key, data, mode=mode, use_multipart=False)
        except (AlreadyExistsError, PreconditionError) as exc:
            raise FileExistsError(f"{self.url(key)}: the precondition failed ({type(exc).__name__})") from None
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, key, "write") from None
        return result.get("e_tag")

    def writer(self, key: str, part_nbytes: int, max_concurrency: int) -> Any:
        """A file-like writer that uploads ``key`` as a multipart upload, ``part_nbytes`` per part,
        ``max_concurrency`` parts in flight; ``close()`` completes it, an error aborts it."""
        import obstore

        return obstore.open_writer(self._store, key, buffer_size=part_nbytes, max_concurrency=max_concurrency)

    def delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` (batched; missing ones are no error)."""
        import obstore

        for i in range(0, len(keys), 1000):
            try:
                obstore.delete(self._store, list(keys[i : i + 1000]))
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001
                raise self._error(exc, keys[i], "delete") from None

    # --- unfinished multipart uploads (botocore) ---------------------------------------------------
    def _boto_client(self) -> Any:
        if self._boto is None:
            from botocore.config import Config

            self._boto = self._session.create_client(
                "s3",
                region_name=self.settings.region,
                endpoint_url=self.settings.endpoint_url,
                config=Config(
                    retries={"max_attempts": self.settings.retries, "mode": "adaptive"},
                    s3={"addressing_style": "path"},
                ),
            )
        return self._boto

    def uploads(self, prefix: str = "") -> list[Upload]:
        """Unfinished multipart uploads of keys under the "directory" ``prefix``."""
        client = self._boto_client()
        out: list[Upload] = []
        # A "directory": S3 prefixes match any key that starts with them, and run1 would list run10's.
        under = self.location.key(prefix) + "/" if self.location.key(prefix) else ""
        kwargs: dict[str, Any] = {"Bucket": self.location.bucket, "Prefix": under}
        try:
            while True:
                page = client.list_multipart_uploads(**kwargs)
                for u in page.get("Uploads", []):
                    if not u["Key"].startswith(under):
                        continue  # a store that ignores the prefix
                    out.append(
                        Upload(
                            key=_relative(u["Key"], self.location.prefix),
                            upload_id=u["UploadId"],
                            initiated_unix_s=u["Initiated"].timestamp(),
                        )
                    )
                if not page.get("IsTruncated"):
                    return out
                markers = {"KeyMarker": page.get("NextKeyMarker"), "UploadIdMarker": page.get("NextUploadIdMarker")}
                if all(kwargs.get(k) == v for k, v in markers.items()):
                    # A store that ignores the markers sends the same page again, for ever.
                    raise StorageError(
                        f"the store listed the same page of unfinished uploads again (markers {markers}); "
                        "it does not page this listing: abort the uploads under it by hand"
                    )
                kwargs.update(markers)
        except Exception as exc:  # noqa: BLE001 - botocore's ClientError and connection errors
            raise self._error(exc, prefix, "list the multipart uploads of") from None

    def abort_upload(self, upload: Upload) -> None:
        try:
            self._boto_client().abort_multipart_upload(
                Bucket=self.location.bucket, Key=self.location.key(upload.key), UploadId=upload.upload_id
            )
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, upload.key, "abort the multipart upload of") from None

    # --- errors -----------------------------------------------------------------------------------
    def _error(self, exc: BaseException, key: str, verb: str) -> StorageError:
        """A StorageError naming the object and what to do (the exception's text never holds
        credentials: obstore and botocore do not put them in messages)."""
        full = str(exc)[:_ERROR_SCAN_CHARS]
        text = full.splitlines()[0][:400] if full.strip() else type(exc).__name__
        code = _CODE.search(full)
        if code is not None and code.group(1) not in text:
            text = f"{text} ({code.group(1)})"
        name = type(exc).__name__
        if name in ("PermissionDeniedError", "UnauthenticatedError") or _DENIED.search(full):
            hint = (
                "check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and the "
                "bucket's permissions"
            )
        elif "NoSuchBucket" in full:
            hint = f"create the bucket {self.location.bucket!r} first"
        else:
            hint = (
                "check the endpoint (AWS_ENDPOINT_URL), the network and the store's health; the operation was retried"
            )
        return StorageError(f"could not {verb} {self.url(key)}: {name}: {text}; {hint}")


def _no_bucket(exc: BaseException) -> bool:
    """Whether obstore's "not found" is the bucket's (a GET's answer says so; a HEAD's has no body)."""
    return "NoSuchBucket" in str(exc)[:_ERROR_SCAN_CHARS]


def plain_etag(etag: str) -> str:
    """``etag`` without the quotes and weak-validator mark stores put around it, so that two
    responses' ETags of one object compare equal."""
    etag = etag.strip()
    return (etag[2:] if etag.startswith("W/") else etag).strip('"')


def _relative(key: str, prefix: str) -> str:
    return key[len(prefix) + 1 :] if prefix and key.startswith(prefix + "/") else key
