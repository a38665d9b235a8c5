"""The object-storage side of a synchronous :func:`ckptd.save` into ``s3://bucket/prefix``.

The same order as a save into a directory (ckptd.api): every rank uploads its data object, then
rank 0 writes ``common.pt``, ``.metadata`` and, last, ``metadata.json``, which marks the checkpoint
complete (a reader finds no checkpoint before it exists). Data objects are named
``__<rank>_0.<token>.distcp`` with a token rank 0 draws for this save, so no key of an earlier or
concurrent save is ever written; the metadata objects are created once (``If-None-Match: *``), so
an existing checkpoint is never overwritten. A failed save removes its objects again, and of the
metadata objects only those it created (a save that lost the race never removes the winner's).
"""

from __future__ import annotations

import logging
import pickle
import secrets

from .errors import CheckpointExistsError, SaveFailedError, StorageError
from .format.checksum import crc32c
from .format.dcp_pickle import metadata_pickle
from .format.items import PlannedItem
from .format.layout import COMMON_PT, DCP_METADATA, METADATA_JSON, backend_metadata_bytes
from .format.records import ItemRecord
from .format.validate import validate_records
from .roots.s3_data import S3DataTarget
from .storage.s3client import S3Client
from .storage.url import S3Location

log = logging.getLogger(__name__)


class S3SaveTarget:
    def __init__(self, location: S3Location) -> None:
        self.location = location
        self.client = S3Client(location)
        self.created: list[str] = []  # the metadata objects this save created (rank 0)

    @staticmethod
    def new_token() -> str:
        """Drawn by rank 0 and shared in the planning round."""
        return secrets.token_hex(6)

    def check(self) -> None:
        """Raise CheckpointExistsError when the prefix holds a checkpoint already."""
        for marker in (METADATA_JSON, DCP_METADATA):
            if self.client.head(marker) is not None:
                raise CheckpointExistsError(
                    f"{self.location} already holds a checkpoint ({marker} exists); ckptd never "
                    "overwrites one. Save to a new prefix, or delete the old one first."
                )

    def data_name(self, rank: int, token: str) -> str:
        return f"__{rank}_0.{token}.distcp"

    def write(self, rank: int, token: str, items: list[PlannedItem], checksums: bool) -> list[ItemRecord]:
        target = S3DataTarget(self.client, "", self.data_name(rank, token))
        target.key = target.name  # the client's prefix is the checkpoint itself
        try:
            stored = target.write(items, checksums=checksums, ready=lambda _i: None, written=lambda _i: None)
        except StorageError as exc:
            target.discard()
            raise SaveFailedError(
                f"rank {rank} could not upload {self.location.url(target.name)}: {exc}. Nothing was committed "
                "and this save's objects were removed; fix the storage and save again"
            ) from exc
        return stored

    def finalize(self, records: list[ItemRecord], common: bytes) -> None:
        """Rank 0: validate, then the metadata objects, ``metadata.json`` last."""
        validate_records(records)
        meta = metadata_pickle(records, str(self.location), crc32c(common), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            # common.pt first, without a read-back: two saves' can be equal byte for byte. Only the
            # save that created it gets to write .metadata, which names its token (so a read-back
            # tells), and only the one that created .metadata writes metadata.json.
            self.client.put(COMMON_PT, common, create_only=True)
            self.created.append(COMMON_PT)
            for name, data in ((DCP_METADATA, meta), (METADATA_JSON, backend_metadata_bytes())):
                self.client.create(name, data, if_unknown="if it was, this save's removal leaves it")
                self.created.append(name)
        except FileExistsError as exc:
            try:
                orphan = not self.created and self.client.head(DCP_METADATA) is None
            except StorageError as error:
                raise SaveFailedError(
                    f"{self.location} holds a {COMMON_PT} already, and the store did not say whether a checkpoint "
                    f"is there ({error}); nothing was committed; check the store and save again"
                ) from error
            if orphan:
                # common.pt without .metadata: a save writing the prefix, or a failed one's
                raise CheckpointExistsError(
                    f"{self.location} holds a {COMMON_PT} but no checkpoint: another save is writing this prefix, "
                    f"or one that failed left it (its create's answer lost). If no save runs, delete "
                    f"{self.location.url(COMMON_PT)} and save again"
                ) from None
            raise CheckpointExistsError(f"{self.location} was written by another save meanwhile ({exc})") from None
        except StorageError as exc:
            raise SaveFailedError(
                f"rank 0 could not write the metadata of {self.location}: {exc}. Nothing was committed and this "
                "save's data objects and the metadata it wrote were removed; fix the storage and save again"
            ) from exc

    def remove_partial(self, rank: int, world_size: int, token: str) -> None:
        """Undo a failed save: each rank its data object; rank 0 every rank's and the metadata
        objects it created itself (a concurrent save's are that save's). Nothing once this save is
        complete (its ``metadata.json`` there, over its own ``.metadata``: the write's answer was
        lost), or when the store cannot tell."""
        names = [self.data_name(rank, token)]
        if rank == 0:
            names = [self.data_name(r, token) for r in range(world_size)] + self.created
        try:
            if METADATA_JSON in self.created:
                return
            if (rank != 0 or DCP_METADATA in self.created) and self.client.head(METADATA_JSON) is not None:
                return  # (ranks but 0 cannot tell whose it is: the data objects stay, as junk at worst)
            self.client.delete(names)
        except StorageError as exc:
            log.warning("could not remove the objects of a failed save of %s: %s", self.location, exc)
