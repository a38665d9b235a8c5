"""The mirror copy of a commit on node-local disks, as pure decisions (ckptd.roots.copyround): the
request and manifests every node reads, when a round is complete, which node failed it, and when
node k's daemon stays up for a copy."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ckptd.errors import CorruptCheckpointError
from ckptd.format.checksum import crc32c
from ckptd.format.records import BYTES, TENSOR, ItemRecord
from ckptd.roots.copyround import (
    CopyRequest,
    NodeManifest,
    ObjectCopy,
    RoundComplete,
    RoundFailed,
    Waiting,
    build_request,
    checksum_key,
    copier_due,
    manifest_name,
    manifest_node,
    renamed_records,
    round_verdict,
    should_answer,
)
from ckptd.roots.mirror import CommitRef

C = CommitRef(step=7, attempt="0123456789ab-1", seq=3)
M = "0123456789ab-1-m0badcafe"


def records(nranks: int = 3) -> list[ItemRecord]:
    out = []
    for rank in range(nranks):
        name = f"__{rank}_0.distcp"
        out.append(
            ItemRecord(
                fqn="w",
                kind=TENSOR,
                rank=rank,
                dtype="float32",
                global_shape=(4 * nranks,),
                offsets=(4 * rank,),
                sizes=(4,),
                relative_path=name,
                file_offset=64,
                length=16,
                crc=100 + rank,
            )
        )
        out.append(
            ItemRecord(fqn=f"obj{rank}", kind=BYTES, rank=rank, relative_path=name, file_offset=0, length=10, crc=None)
        )
    return out


def request(nnodes: int = 3) -> CopyRequest:
    return build_request(C, M, nnodes, records(), crc32c)


def manifest(node: int, *ranks: int, crcs: tuple[int, ...] | None = None, nbytes: int = 100) -> NodeManifest:
    objects = tuple(
        ObjectCopy(
            file=f"__{r}_0.distcp",
            object=f"__{r}_0.{M}.distcp",
            rank=r,
            nbytes=nbytes,
            crcs=crcs if crcs is not None else (555, 100 + r),  # items in file order: obj (no crc), then w
        )
        for r in ranks
    )
    return NodeManifest(node=node, step=C.step, mirror_attempt=M, objects=objects)


def verdict(manifests: dict[int, NodeManifest], expired: bool = False, req: CopyRequest | None = None):
    return round_verdict(req or request(), manifests, expired=expired, timeout_s=600)


def test_the_request_names_every_file_with_its_items_in_file_order_and_travels_whole():
    req = request()
    assert req.commit == C and req.checksum == checksum_key(crc32c) == (2, "crc32c")
    assert [f.name for f in req.files] == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert [i.file_offset for i in req.files[1].items] == [0, 64]
    assert req.files[1].items[1].record("__1_0.distcp", 1).where() == "'w' chunk at offsets (4,) (rank 1)"
    assert CopyRequest.parse(req.to_bytes(), "x") == req
    assert req.manifest_key(2) == f"iter_0000007/{manifest_name(M, 2)}"
    assert manifest_node(manifest_name(M, 2), M) == 2
    assert manifest_node(manifest_name("0123456789ab-1-m00000000", 2), M) is None  # another round's
    assert manifest_node("__1_0.x.distcp", M) is None


@pytest.mark.parametrize(
    "change",
    [
        lambda o: o.update(attempt="../../etc"),  # names a local directory
        lambda o: o.update(mirror_attempt="a/b"),  # names object keys
        lambda o: o["files"][0].update(name="../__0_0.distcp"),
        lambda o: o["files"][0].update(rank=1),  # not the rank its name gives
        lambda o: o["files"].append(dict(o["files"][0])),  # a file twice
        lambda o: o["files"][0]["items"][0].__setitem__(0, -1),  # a negative offset
        lambda o: o["files"][0]["items"][0].__setitem__(4, "pickle"),
        lambda o: o.update(nnodes=0),
        lambda o: o.update(step="7"),
        lambda o: o.update(version=99),
        lambda o: o.pop("files"),
    ],
)
def test_a_damaged_request_is_refused_naming_where_it_was_read(change):
    obj = json.loads(request().to_bytes())
    change(obj)
    with pytest.raises(CorruptCheckpointError, match="the mirror copy request s3://b/r/x is damaged"):
        CopyRequest.parse(json.dumps(obj).encode(), "s3://b/r/x")
    with pytest.raises(CorruptCheckpointError):
        CopyRequest.parse(b"\xff not json", "x")


def test_a_manifest_travels_whole_and_a_damaged_one_is_its_nodes_error():
    m = manifest(1, 1)
    assert NodeManifest.parse(m.to_bytes(), request(), 1, "k") == m
    other = NodeManifest.parse(m.to_bytes(), request(), 2, "k")  # under node 2's key
    assert other.node == 2 and "damaged (it names another node" in (other.error or "")
    assert "damaged" in (NodeManifest.parse(b"[]", request(), 1, "k").error or "")


def test_a_round_waits_for_every_node_then_commits_what_they_uploaded_together():
    assert verdict({0: manifest(0, 0)}) == Waiting(missing=(1, 2))
    done = verdict({0: manifest(0, 0), 1: manifest(1, 1), 2: manifest(2, 2)})
    assert isinstance(done, RoundComplete) and sorted(done.copies) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    renamed, data_files = renamed_records(records(), done.copies)
    assert data_files == {f"__{r}_0.{M}.distcp": (r, 100) for r in range(3)}
    assert {(r.relative_path, r.fqn, r.crc) for r in renamed if r.rank == 1} == {
        (f"__1_0.{M}.distcp", "obj1", 555),  # each item's CRC-32C as its node computed it
        (f"__1_0.{M}.distcp", "w", 101),
    }
    # A node may hold several ranks' files, another none of them (but it must answer).
    assert isinstance(verdict({0: manifest(0, 0, 2), 1: manifest(1, 1), 2: manifest(2)}), RoundComplete)


def test_a_nodes_error_fails_the_round_at_once_naming_it():
    failed = verdict({0: manifest(0, 0), 2: replace(manifest(2), error="the disk is gone")})
    assert failed == RoundFailed(node=2, reason="node 2: the disk is gone")


def test_a_missing_node_fails_the_round_at_its_deadline_naming_it():
    failed = verdict({0: manifest(0, 0), 2: manifest(2, 2)}, expired=True)
    assert isinstance(failed, RoundFailed) and failed.node == 1
    assert failed.reason.startswith("node 1 did not answer the copy request of step 7 attempt 0123456789ab-1")
    assert "within 600 s" in failed.reason
    assert verdict({0: manifest(0, 0)}, expired=True).reason.startswith("node 1, 2 did not answer")  # type: ignore[union-attr]


def test_a_file_no_node_holds_fails_the_round_without_blaming_a_node():
    failed = verdict({0: manifest(0, 0), 1: manifest(1, 1), 2: manifest(2)})
    assert isinstance(failed, RoundFailed) and failed.node is None
    assert "no node holds __2_0.distcp (rank 2) of step 7" in failed.reason


def test_a_manifest_that_contradicts_the_request_fails_its_node():
    wrong_crc = verdict({0: manifest(0, 0), 1: manifest(1, 1, crcs=(555, 999))})
    assert isinstance(wrong_crc, RoundFailed) and wrong_crc.node == 1 and "recorded checksum" in wrong_crc.reason
    short = verdict({0: manifest(0, 0), 1: manifest(1, 1, nbytes=50)})
    assert isinstance(short, RoundFailed) and short.node == 1 and "reach byte 80" in short.reason
    stranger = replace(manifest(1), objects=(replace(manifest(1, 1).objects[0], file="__9_0.distcp"),))
    assert verdict({0: manifest(0, 0), 1: stranger}).node == 1  # type: ignore[union-attr]
    few = verdict({0: manifest(0, 0), 1: manifest(1, 1, crcs=(1,))})
    assert isinstance(few, RoundFailed) and "gives 1 item checksums" in few.reason
    # Two nodes holding one file (a shared disk called node-local) must agree on its bytes.
    twice = verdict({0: manifest(0, 0, 1), 1: manifest(1, 1, nbytes=200), 2: manifest(2, 2)})
    assert isinstance(twice, RoundFailed) and twice.node == 1 and "differs from another node's copy" in twice.reason
    agree = verdict({0: manifest(0, 0, 1), 1: manifest(1, 1), 2: manifest(2, 2)})
    assert isinstance(agree, RoundComplete)


def test_without_recorded_crc32cs_the_nodes_checksums_are_taken_as_computed():
    req = build_request(C, M, 2, [replace(r, crc=None) for r in records(2)], None)
    assert req.checksum is None
    assert isinstance(verdict({0: manifest(0, 0), 1: manifest(1, 1, crcs=(1, 2))}, req=req), RoundComplete)


def test_node_k_answers_each_round_of_its_job_once():
    req = request(nnodes=2)
    assert should_answer(req, 1, None)
    assert not should_answer(req, 1, M)  # answered
    assert should_answer(req, 1, "0123456789ab-1-m00000000")  # a new round (a retry)
    assert not should_answer(req, 2, None)  # a launch with fewer nodes: not its round
    assert not should_answer(req, 0, None)  # node 0 asks, it never answers


def test_node_k_stays_busy_after_a_local_commit_until_a_round_copied_it_or_the_deadline():
    older = replace(C, step=5, seq=2)
    assert not copier_due(None, C, None, 10.0, 600)  # no local commit since the start
    assert copier_due(10.0, C, None, 11.0, 600)
    assert copier_due(10.0, C, older, 11.0, 600)
    assert not copier_due(10.0, C, C, 11.0, 600)  # its round was answered
    assert not copier_due(10.0, C, older, 610.0, 600)  # node 0 never asked (overtaken, or waiting to retry)
