"""The mirror copy of a commit held by node-local disks, as data and pure decisions.

With ``node_local`` every node's disk holds only its own ranks' data files of a commit, so no node
can copy a commit alone. The copy is coordinated through the mirror itself (the store I/O:
ckptd.roots.mirror_nodes), with two kinds of objects:

- the *request* (:class:`CopyRequest`, at :data:`REQUEST_KEY`, overwritten each round): node 0
  names the local commit C = (step, attempt, seq), the round's mirror attempt M, the number of
  nodes, and every data file of C with its items (offset, length, recorded checksum) and the
  checksum algorithm of C's ``.metadata``: all a node needs to upload and check its files without
  reading ``.metadata`` (which it may not hold);
- one *manifest* per node (:class:`NodeManifest`, ``iter_<step>/`` + :func:`manifest_name`): the
  objects that node uploaded (local file, object, rank, bytes, each item's CRC-32C), or the error
  that stopped it.

:func:`round_verdict` decides from the manifests in: a node's error fails the round at once, a
node missing at the deadline fails it naming the node, and the round is complete once every node
answered and together they uploaded every data file of the request, each exactly once in content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import CorruptCheckpointError
from ..format.checksum import ALGORITHMS, Checksum, checksum_for, crc32c
from ..format.layout import DATA_FILE_PATTERN
from ..format.records import BYTES, TENSOR, ItemRecord
from ..format.rootlayout import ATTEMPT_PATTERN, step_dir_name
from .mirror import CommitRef
from .s3_data import s3_data_file_name
from .s3_names import MANIFEST

REQUEST_KEY = "ckptd_copy_request.json"
FORMAT_VERSION = 1
# Far above a real request: about 60 bytes per stored item (a job of 10,000 ranks with 100 items
# each writes ~60 MB); a larger object is refused before its bytes are read.
RECORD_MAX_NBYTES = 1 << 30
# A mirror attempt names object keys: new_mirror_attempt's "<attempt>-m<8 hex>" (no dots, no slashes).
_MIRROR_ATTEMPT = re.compile(rf"^(?:{ATTEMPT_PATTERN}|x)-m[0-9a-f]{{8}}$")
_MAX_NODES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ItemSpec:
    """One item of a data file: where it is and what its bytes' recorded checksum is (``crc``
    None: not recorded); ``fqn``, ``kind``, ``offsets`` name it in messages."""

    file_offset: int
    length: int
    crc: int | None
    fqn: str
    kind: str
    offsets: tuple[int, ...] = ()

    def record(self, file_name: str, rank: int) -> ItemRecord:
        return ItemRecord(
            fqn=self.fqn,
            kind=self.kind,
            rank=rank,
            offsets=self.offsets,
            relative_path=file_name,
            file_offset=self.file_offset,
            length=self.length,
            crc=self.crc,
        )


@dataclass(frozen=True, kw_only=True)
class FileSpec:
    """One rank's data file of the commit: its local name and its items in file order."""

    name: str
    rank: int
    items: tuple[ItemSpec, ...]


@dataclass(frozen=True, kw_only=True)
class CopyRequest:
    step: int
    attempt: str
    seq: int
    mirror_attempt: str
    nnodes: int
    checksum: tuple[int, str] | None  # the checksum table's (version, algorithm) of C's .metadata
    files: tuple[FileSpec, ...]

    @property
    def commit(self) -> CommitRef:
        return CommitRef(step=self.step, attempt=self.attempt, seq=self.seq)

    def checksum_fn(self) -> Checksum | None:
        return None if self.checksum is None else checksum_for(*self.checksum)

    def manifest_key(self, node: int) -> str:
        return f"{step_dir_name(self.step)}/{manifest_name(self.mirror_attempt, node)}"

    def object_key(self, rank: int) -> str:
        return f"{step_dir_name(self.step)}/{s3_data_file_name(self.mirror_attempt, rank)}"

    def describe(self) -> str:
        return f"step {self.step} attempt {self.attempt} (mirror attempt {self.mirror_attempt})"

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "version": FORMAT_VERSION,
                "step": self.step,
                "attempt": self.attempt,
                "seq": self.seq,
                "mirror_attempt": self.mirror_attempt,
                "nnodes": self.nnodes,
                "checksum": None if self.checksum is None else list(self.checksum),
                "files": [
                    {
                        "name": f.name,
                        "rank": f.rank,
                        "items": [[i.file_offset, i.length, i.crc, i.fqn, i.kind, list(i.offsets)] for i in f.items],
                    }
                    for f in self.files
                ],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def parse(cls, raw: bytes, where: str) -> CopyRequest:
        """The request in ``raw`` (read from ``where``); CorruptCheckpointError naming ``where``
        for anything malformed: its names become directory and object names, so every one is
        checked."""
        try:
            obj = json.loads(raw)
            if obj.get("version") != FORMAT_VERSION:
                raise ValueError(f"version {obj.get('version')!r}, not {FORMAT_VERSION}")
            checksum = obj["checksum"]
            if checksum is not None:
                version, algorithm = checksum
                checksum = (_int(version, 0), str(algorithm))
            req = cls(
                step=_int(obj["step"], 0),
                attempt=_match(obj["attempt"], re.compile(ATTEMPT_PATTERN), "attempt"),
                seq=_int(obj["seq"], 1),
                mirror_attempt=_match(obj["mirror_attempt"], _MIRROR_ATTEMPT, "mirror attempt"),
                nnodes=_int(obj["nnodes"], 1, _MAX_NODES),
                checksum=checksum,
                files=tuple(_file_spec(f) for f in obj["files"]),
            )
            if len({f.name for f in req.files}) != len(req.files) or len({f.rank for f in req.files}) != len(req.files):
                raise ValueError("a data file or rank is listed twice")
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise CorruptCheckpointError(
                f"the mirror copy request {where} is damaged ({exc}); ignoring it (node 0's next copy "
                "round overwrites it)"
            ) from None
        return req


@dataclass(frozen=True, kw_only=True)
class ObjectCopy:
    """One data file a node uploaded: ``file`` (its local name) as ``object`` (in the step)."""

    file: str
    object: str
    rank: int
    nbytes: int
    crcs: tuple[int, ...]  # CRC-32C of each item, in the request's order


@dataclass(frozen=True, kw_only=True)
class NodeManifest:
    """What one node did for a request: the objects it uploaded, or the error that stopped it."""

    node: int
    step: int
    mirror_attempt: str
    objects: tuple[ObjectCopy, ...] = ()
    error: str | None = None

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "version": FORMAT_VERSION,
                "node": self.node,
                "step": self.step,
                "mirror_attempt": self.mirror_attempt,
                "objects": [[o.file, o.object, o.rank, o.nbytes, list(o.crcs)] for o in self.objects],
                "error": self.error,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def parse(cls, raw: bytes, request: CopyRequest, node: int, where: str) -> NodeManifest:
        """Node ``node``'s manifest for ``request``; a malformed one, or one of another round,
        becomes that node's error (the round fails naming it)."""
        try:
            obj = json.loads(raw)
            if obj.get("version") != FORMAT_VERSION:
                raise ValueError(f"version {obj.get('version')!r}, not {FORMAT_VERSION}")
            if (obj["node"], obj["step"], obj["mirror_attempt"]) != (node, request.step, request.mirror_attempt):
                raise ValueError("it names another node, step or round")
            error = obj["error"]
            if error is not None and not isinstance(error, str):
                raise ValueError("its error is not text")
            objects = tuple(
                ObjectCopy(
                    file=str(o[0]),
                    object=str(o[1]),
                    rank=_int(o[2], 0),
                    nbytes=_int(o[3], 0),
                    crcs=tuple(_int(c, 0, 0xFFFFFFFF) for c in o[4]),
                )
                for o in obj["objects"]
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
            return cls(
                node=node,
                step=request.step,
                mirror_attempt=request.mirror_attempt,
                error=f"its manifest {where} is damaged ({exc})",
            )
        return cls(node=node, step=request.step, mirror_attempt=request.mirror_attempt, objects=objects, error=error)


@dataclass(frozen=True, kw_only=True)
class Waiting:
    missing: tuple[int, ...]  # nodes whose manifest is not in yet


@dataclass(frozen=True, kw_only=True)
class RoundFailed:
    node: int | None  # the node that failed (None: no single node, e.g. a file nobody holds)
    reason: str


@dataclass(frozen=True, kw_only=True)
class RoundComplete:
    copies: dict[str, ObjectCopy]  # local data file name -> its uploaded object


def manifest_name(mirror_attempt: str, node: int) -> str:
    return f"ckptd_copy.{mirror_attempt}.node{node}.json"


def manifest_node(name: str, mirror_attempt: str) -> int | None:
    """The node whose manifest for round ``mirror_attempt`` the object ``name`` is, else None."""
    m = MANIFEST.match(name)
    return int(m.group(2)) if m is not None and m.group(1) == mirror_attempt else None


def checksum_key(fn: Checksum | None) -> tuple[int, str] | None:
    """The ``(version, algorithm)`` a checksum table of ``fn`` is recorded under."""
    return next((key for key, f in ALGORITHMS.items() if f is fn), None)


def build_request(
    commit: CommitRef, mirror_attempt: str, nnodes: int, records: Sequence[ItemRecord], checksum: Checksum | None
) -> CopyRequest:
    """The request of one round: ``records`` (with their ranks: ckptd.roots.mirror) grouped by
    data file, each file's items in file order."""
    by_file: dict[str, list[ItemRecord]] = {}
    for r in records:
        by_file.setdefault(r.relative_path, []).append(r)
    files = tuple(
        FileSpec(
            name=name,
            rank=items[0].rank,
            items=tuple(
                ItemSpec(
                    file_offset=r.file_offset, length=r.length, crc=r.crc, fqn=r.fqn, kind=r.kind, offsets=r.offsets
                )
                for r in sorted(items, key=lambda r: r.file_offset)
            ),
        )
        for name, items in sorted(by_file.items())
    )
    return CopyRequest(
        step=commit.step,
        attempt=commit.attempt,
        seq=commit.seq,
        mirror_attempt=mirror_attempt,
        nnodes=nnodes,
        checksum=checksum_key(checksum),
        files=files,
    )


def should_answer(request: CopyRequest, node: int, answered: str | None) -> bool:
    """Whether node ``node`` (>= 1) answers ``request``: a round it did not answer yet, of a job
    with that node (a request of a launch with fewer nodes is not its to answer)."""
    return 0 < node < request.nnodes and request.mirror_attempt != answered


def round_verdict(
    request: CopyRequest, manifests: Mapping[int, NodeManifest], *, expired: bool, timeout_s: float
) -> Waiting | RoundFailed | RoundComplete:
    """The state of a round from the manifests in (node 0's own included); ``expired``: its
    deadline (``timeout_s`` after the request) has passed."""
    specs = {f.name: f for f in request.files}
    for node in sorted(manifests):
        problem = _manifest_problem(request, specs, manifests[node])
        if problem is not None:
            return RoundFailed(node=node, reason=f"node {node}: {problem}")
    missing = tuple(k for k in range(request.nnodes) if k not in manifests)
    if missing:
        if not expired:
            return Waiting(missing=missing)
        names = ", ".join(map(str, missing))
        return RoundFailed(
            node=missing[0],
            reason=(
                f"node {names} did not answer the copy request of {request.describe()} within {timeout_s:g} s "
                "(its daemon is not running with node_local=True and this mirror, is stopped, or is slower "
                "than the deadline); the copy is retried"
            ),
        )
    copies: dict[str, ObjectCopy] = {}
    for node in sorted(manifests):
        for obj in manifests[node].objects:
            first = copies.setdefault(obj.file, obj)
            if (first.nbytes, first.crcs) != (obj.nbytes, obj.crcs):
                return RoundFailed(
                    node=node,
                    reason=(
                        f"node {node}: its copy of {obj.file} differs from another node's copy of the file "
                        f"(bytes {obj.nbytes} vs {first.nbytes}, or item checksums); two disks hold different "
                        f"versions of {request.describe()}"
                    ),
                )
    lost = [f for f in request.files if f.name not in copies]
    if lost:
        names = ", ".join(f"{f.name} (rank {f.rank})" for f in lost[:8])
        more = f" and {len(lost) - 8} more" if len(lost) > 8 else ""
        return RoundFailed(
            node=None,
            reason=(
                f"no node holds {names}{more} of {request.describe()}: the node of those ranks lost the files "
                "(a replaced disk, a removed directory); this commit cannot be mirrored, the next one will be"
            ),
        )
    return RoundComplete(copies=copies)


def _manifest_problem(request: CopyRequest, specs: Mapping[str, FileSpec], manifest: NodeManifest) -> str | None:
    """Why a node's manifest fails the round: its error, or an object that contradicts the request."""
    if manifest.error is not None:
        return manifest.error
    alg = request.checksum_fn()
    for obj in manifest.objects:
        spec = specs.get(obj.file)
        if spec is None or obj.rank != spec.rank or obj.object != s3_data_file_name(request.mirror_attempt, obj.rank):
            return f"its manifest names {obj.file!r} as {obj.object!r}, which is no data file of the request"
        if len(obj.crcs) != len(spec.items):
            return f"its manifest gives {len(obj.crcs)} item checksums for {obj.file}, which has {len(spec.items)}"
        end = max((i.file_offset + i.length for i in spec.items), default=0)
        if obj.nbytes < end:
            return f"it uploaded {obj.nbytes} bytes of {obj.file}, whose items reach byte {end}"
        if alg is crc32c:  # the recorded checksums are CRC-32Cs: they must be the uploaded ones
            for item, crc in zip(spec.items, obj.crcs, strict=True):
                if item.crc is not None and item.crc != crc:
                    return f"its copy of {item.record(obj.file, obj.rank).where()} does not match its recorded checksum"
    return None


def renamed_records(
    records: Sequence[ItemRecord], copies: Mapping[str, ObjectCopy]
) -> tuple[list[ItemRecord], dict[str, tuple[int, int]]]:
    """The commit's records pointing at the uploaded objects, each with the CRC-32C its node
    computed (the mirror's ``.metadata`` records it), and ``{object: (rank, nbytes)}``."""
    by_file: dict[str, list[ItemRecord]] = {}
    for r in records:
        by_file.setdefault(r.relative_path, []).append(r)
    renamed: list[ItemRecord] = []
    data_files: dict[str, tuple[int, int]] = {}
    for name, items in sorted(by_file.items()):
        obj = copies[name]
        ordered = sorted(items, key=lambda r: r.file_offset)
        data_files[obj.object] = (obj.rank, obj.nbytes)
        renamed += [replace(r, relative_path=obj.object, crc=crc) for r, crc in zip(ordered, obj.crcs, strict=True)]
    return renamed, data_files


def copier_due(
    kicked_at_s: float | None, local: CommitRef | None, answered: CommitRef | None, now_s: float, timeout_s: float
) -> bool:
    """Whether node k's daemon should stay up for a copy: a local commit was made there (at
    ``kicked_at_s``, monotonic) that no round it answered copied yet, for at most ``timeout_s``
    (node 0 may never ask: a newer commit overtook it, or its copy waits for a retry)."""
    if kicked_at_s is None or now_s - kicked_at_s >= timeout_s:
        return False
    return local is None or local != answered


def _file_spec(obj: Any) -> FileSpec:
    name = obj["name"]
    m = DATA_FILE_PATTERN.match(name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(f"data file name {str(name)[:80]!r} is not __<rank>_<n>.distcp")
    rank = _int(obj["rank"], 0)
    if rank != int(m.group(1)):
        raise ValueError(f"{name} is listed as rank {rank}'s")
    items = tuple(
        ItemSpec(
            file_offset=_int(i[0], 0),
            length=_int(i[1], 0),
            crc=None if i[2] is None else _int(i[2], 0, 0xFFFFFFFF),
            fqn=str(i[3]),
            kind=_kind(i[4]),
            offsets=tuple(_int(o, 0) for o in i[5]),
        )
        for i in obj["items"]
    )
    return FileSpec(name=name, rank=rank, items=items)


def _int(value: Any, low: int, high: int = 1 << 62) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{str(value)[:40]!r} is not an integer in [{low}, {high}]")
    return value


def _match(value: Any, pattern: re.Pattern[str], what: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"{what} {str(value)[:40]!r} is malformed")
    return value


def _kind(value: Any) -> str:
    if value not in (TENSOR, BYTES):
        raise ValueError(f"item kind {str(value)[:40]!r} is neither {TENSOR!r} nor {BYTES!r}")
    return str(value)
