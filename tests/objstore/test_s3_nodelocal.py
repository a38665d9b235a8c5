"""Resuming from node-local disks (config ``node_local``) against a real server (SeaweedFS): a node
reads the data files its disk holds (in ``iter_N/`` of the commit, else in the attempt directory a
daemon that died before its rename left), and the other ranks' files from the mirror's copy of the
same commit by ranged GETs; a file on neither waits for the copy, then fails with a clear error;
a damaged local file fails as any local load does, a local file of another size than the mirror's
is read from the mirror.

The node roots are built from one real commit: two Checkpointers of this process (ranks 0 and 1 on
one daemon) save a step into a local root, whose two data files ``__0_0.distcp`` and
``__1_0.distcp`` a 2-node job would have written on two disks; ``mirror_step`` (what the daemon's
mirror thread runs) copies the commit to a mirror; a node's root keeps the small files and its
own rank's data file."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.control.endpoints import JobEnv
from ckptd.errors import CorruptCheckpointError, NodeFilesMissingError
from ckptd.format.commitrecord import COMMIT_RECORD, CommitRecord
from ckptd.format.layout import COMMON_PT, DCP_METADATA, METADATA_JSON
from ckptd.format.rootlayout import step_dir_name
from ckptd.loading.loader import LoadRequest, run_load
from ckptd.opening import opened
from ckptd.roots.mirror import CommitRef, local_latest, mirror_step
from ckptd.roots.s3_root import S3Root
from ckptd.storage.nodeview import NodeLocalCheckpoint
from ckptd.storage.s3client import S3Client
from ckptd.storage.url import S3Location, parse_location
from tests.multiproc import clear_torchrun_env
from tests.objstore.test_s3_roots import _config
from tools.harness.daemons import private_runtime_dir, stop_root_daemons

STEP = 10
NAME = "iter_0000010"
ROW = 1 << 18  # 1 MiB of float32 per rank
SMALL = (METADATA_JSON, DCP_METADATA, COMMON_PT, COMMIT_RECORD)


@dataclass(frozen=True)
class Saved:
    root: Path  # a local root holding both ranks' data files of steps 10 and 20
    commits: dict[int, CommitRef]
    values: dict[int, torch.Tensor]  # the saved tensor of each step: row r is rank r's shard

    @property
    def commit(self) -> CommitRef:
        return self.commits[STEP]

    @property
    def w(self) -> torch.Tensor:
        return self.values[STEP]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    root = tmp_path_factory.mktemp("saved") / "local"
    values = {step: torch.randn(2, ROW) for step in (STEP, 2 * STEP)}
    commits: dict[int, CommitRef] = {}
    with pytest.MonkeyPatch.context() as mp, private_runtime_dir(tmp_path_factory.mktemp("daemon-logs")) as rt:
        clear_torchrun_env(mp)
        cfg = _config(rt, run_id="nodelocal-test")
        try:
            ranks = [
                ckptd.Checkpointer(root, config=cfg, env=JobEnv(rank=r, local_rank=r, world_size=2, local_world_size=2))
                for r in (0, 1)
            ]
            for step, w in values.items():
                # Saves use no collective: each rank's save() returns once staged, the daemon
                # commits the step once both ranks reported.
                handles = [ck.save(_shard(w, r, step), step=step) for r, ck in enumerate(ranks)]
                for h in handles:
                    h.wait(timeout_s=60)
                commit = local_latest(root)
                assert commit is not None and commit.step == step
                commits[step] = commit
            for ck in ranks:
                ck.close()
        finally:
            stop_root_daemons(root, rt, timeout_s=60)
    yield Saved(root, commits, values)


def _shard(w: torch.Tensor, rank: int, step: int) -> dict[str, Any]:
    return {"w": ShardedTensor.from_rank_offsets("w", w[rank : rank + 1].clone(), (0, rank, 2)), "iteration": step}


def _mirror(saved: Saved, url: str, step: int = STEP) -> S3Location:
    """Copy the commit of ``step`` into the mirror ``url`` as the coordinator's mirror thread does."""
    location = parse_location(url)
    assert isinstance(location, S3Location)
    mirror_step(saved.root, saved.commits[step], S3Root(location))
    return location


def _node_root(saved: Saved, root: Path, ranks: list[int], *, renamed: bool = True, step: int = STEP) -> Path:
    """A node's disk after the commit of ``step``: ``iter_N/`` with the small files and ``ranks``'
    data files, ``latest`` naming it (``renamed``), or only the data files in the attempt's
    directory (its daemon died before its rename)."""
    name = step_dir_name(step)
    directory = root / (name if renamed else f"{name}.{saved.commits[step].attempt}.tmp")
    directory.mkdir(parents=True)
    for file in [*(SMALL if renamed else ()), *(f"__{r}_0.distcp" for r in ranks)]:
        shutil.copyfile(saved.root / name / file, directory / file)
    if renamed:
        (root / "latest").write_text(f"{name}\n")
    return directory


def _commit(saved: Saved, root: Path, mirror: S3Location, node: int = 1, wait_s: float = 60.0) -> NodeLocalCheckpoint:
    c = saved.commits[STEP]
    return NodeLocalCheckpoint(
        root=root, step=c.step, attempt=c.attempt, seq=c.seq, mirror=mirror, wait_s=wait_s, node=node
    )


def _request(rows: int = 2, rank: int = 0) -> tuple[dict[str, Any], torch.Tensor]:
    """The whole tensor (``rows=2``), or rank ``rank``'s row."""
    x = torch.zeros(rows, ROW)
    sh = ShardedTensor.from_rank_offsets("w", x) if rows == 2 else ShardedTensor.from_rank_offsets("w", x, (0, rank, 2))
    return {"w": sh}, x


def _load_counted(target: NodeLocalCheckpoint, sd: dict[str, Any]) -> tuple[dict[str, Path], int]:
    """Load ``sd`` from ``target`` as ckptd.load does; which data files were read from this node's
    disk, and how many bytes were fetched from the mirror."""
    with opened(target) as ckpt:
        run_load(ckpt.index(), LoadRequest(sd, ckpt.directory, has_common=ckpt.has_common, source=ckpt.source))
        source: Any = ckpt.source
        return dict(source.local_files), source.fetched_nbytes


def _data_objects(mirror: S3Location) -> dict[int, tuple[str, int]]:
    """The mirror's data objects of the step, by rank: (key, size)."""
    client = S3Client(mirror)
    out = {}
    for info in client.list_objects(NAME):
        name = info.key.rsplit("/", 1)[-1]
        if name.endswith(".distcp"):
            out[int(name[2 : name.index("_", 2)])] = (info.key, info.size)
    return out


@pytest.mark.timeout(120)
def test_a_node_reads_its_ranks_files_from_its_disk_and_the_others_from_the_mirror(saved, s3_bucket, tmp_path):
    mirror = _mirror(saved, f"s3://{s3_bucket}/m")
    node1 = tmp_path / "node1"
    local = _node_root(saved, node1, [1]) / "__1_0.distcp"
    target = _commit(saved, node1, mirror)
    objects = _data_objects(mirror)

    sd, x = _request()
    read_locally, fetched = _load_counted(target, sd)
    assert torch.equal(x, saved.w)  # bit-exact
    assert read_locally == {"__1_0.distcp": local}
    assert fetched == objects[0][1]  # rank 0's object, and nothing of rank 1's

    sd, x = _request(rows=1, rank=1)  # what rank 1 itself loads when the layout is the same
    assert _load_counted(target, sd) == ({"__1_0.distcp": local}, 0)  # no GET of data at all
    assert torch.equal(x, saved.w[1:])

    # Without the mirror's object of rank 1 the load is the same: its bytes come from the disk.
    S3Client(mirror).delete([objects[1][0]])
    sd, x = _request()
    out = ckptd.load({**sd, "iteration": 0}, target)  # the public API opens the same view
    assert torch.equal(x, saved.w) and out["iteration"] == STEP


@pytest.mark.timeout(120)
def test_a_node_whose_daemon_missed_the_rename_reads_the_attempt_directory(saved, s3_bucket, tmp_path):
    mirror = _mirror(saved, f"s3://{s3_bucket}/m")
    node1 = tmp_path / "node1"
    attempt_dir = _node_root(saved, node1, [1], renamed=False)
    (attempt_dir / "__1_0.distcp.0123.part").write_bytes(b"an unfinished write is never read")
    # An iter_N/ of another commit of the step (a re-save that this node did not see replaced)
    # holds other bytes of rank 1: never read for this commit.
    other = _node_root(saved, node1, [1])
    other_record = CommitRecord(seq=saved.commit.seq + 5, step=STEP, attempt="ffffffffffff-1", committed_unix_s=0.0)
    (other / COMMIT_RECORD).write_bytes(other_record.to_bytes())
    (other / "__1_0.distcp").write_bytes(b"\0" * (other / "__1_0.distcp").stat().st_size)

    sd, x = _request()
    read_locally, fetched = _load_counted(_commit(saved, node1, mirror), sd)
    assert torch.equal(x, saved.w)
    # The small files came from the mirror (its .metadata names its own objects), rank 1's data
    # from the attempt's directory.
    assert list(read_locally.values()) == [attempt_dir / "__1_0.distcp"]
    assert fetched == _data_objects(mirror)[0][1]


@pytest.mark.timeout(120)
def test_a_file_on_neither_the_disk_nor_the_mirror_waits_for_the_copy_then_fails_clearly(saved, s3_bucket, tmp_path):
    mirror = parse_location(f"s3://{s3_bucket}/m")  # no copy of the step (yet)
    assert isinstance(mirror, S3Location)
    node1 = tmp_path / "node1"
    _node_root(saved, node1, [1])
    target = _commit(saved, node1, mirror, wait_s=1.0)

    sd, x = _request(rows=1, rank=1)  # only this node's file is needed: no wait, no copy needed
    assert _load_counted(target, sd)[1] == 0 and torch.equal(x, saved.w[1:])

    sd, _ = _request()  # rank 0's file is on node 0's disk only
    t0 = time.monotonic()
    with pytest.raises(NodeFilesMissingError) as err:
        ckptd.load(sd, target)
    assert time.monotonic() - t0 >= 1.0  # it waited the configured bound for the copy first
    msg = str(err.value)
    assert "node 1 needs rank 0's data file of step 10" in msg, msg
    assert f"the mirror {mirror} has no copy of step 10" in msg and "mirror_timeout_s" in msg, msg
    assert str(node1 / NAME) in msg, msg

    # A node that missed the rename has no metadata either: the same wait, then the error says so.
    node2 = tmp_path / "node2"
    _node_root(saved, node2, [1], renamed=False)
    with pytest.raises(NodeFilesMissingError, match=r"node 2's disk does not hold commit .* \(.*: absent\)"):
        ckptd.load(_request(rows=1, rank=1)[0], _commit(saved, node2, mirror, node=2, wait_s=0.5))


@pytest.mark.timeout(120)
def test_a_copy_that_arrives_during_the_wait_is_read(saved, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/m"
    mirror = parse_location(url)
    assert isinstance(mirror, S3Location)
    node1 = tmp_path / "node1"
    _node_root(saved, node1, [1])
    copier = threading.Timer(1.0, _mirror, (saved, url))  # the daemons copy the commit meanwhile
    copier.start()
    try:
        sd, x = _request()
        read_locally, fetched = _load_counted(_commit(saved, node1, mirror, wait_s=60.0), sd)
    finally:
        copier.join(60)
    assert torch.equal(x, saved.w) and list(read_locally) == ["__1_0.distcp"] and fetched > 0


@pytest.mark.timeout(120)
def test_a_damaged_local_file_fails_and_one_of_another_size_is_read_from_the_mirror(saved, s3_bucket, tmp_path):
    mirror = _mirror(saved, f"s3://{s3_bucket}/m")
    node1 = tmp_path / "node1"
    data = _node_root(saved, node1, [1]) / "__1_0.distcp"
    target = _commit(saved, node1, mirror)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # a bit flip: same size, so the local file is read, and checked
    data.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match="CRC-32C") as err:
        ckptd.load(_request()[0], target)
    assert str(data) in str(err.value)  # the node's file, not the view's temporary name

    data.write_bytes(raw[: len(raw) // 2])  # a size the mirror's copy contradicts: not trusted
    sd, x = _request()
    read_locally, fetched = _load_counted(target, sd)
    assert torch.equal(x, saved.w) and read_locally == {}
    assert fetched == sum(size for _, size in _data_objects(mirror).values())

    # Without a copy to compare with, the truncated file is what this node holds: a damaged checkpoint.
    no_copy = parse_location(f"s3://{s3_bucket}/empty")
    assert isinstance(no_copy, S3Location)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        ckptd.load(_request(rows=1, rank=1)[0], _commit(saved, node1, no_copy, wait_s=0.5))


@pytest.mark.timeout(180)
def test_a_node_local_checkpointer_resumes_from_its_disk_and_the_mirror(saved, s3_bucket, runtime_dir, tmp_path):
    """Node 0 of a 2-node job, resumed in one process: its disk holds rank 0's files of steps 10
    and 20, the mirror's copies the rest. latest(), load() and load(step=) agree; checkpoint_dir()
    is the node's part; a damaged local file sends the resume to the mirror's copy of step 20 (it
    went back to step 10: the damage was recorded by the step's name, which ruled out the mirror's
    intact copy too, and with nothing older the job could not restart)."""
    url = f"s3://{s3_bucket}/m"
    for step in (STEP, 2 * STEP):
        _mirror(saved, url, step)
    node0 = tmp_path / "node0"
    _node_root(saved, node0, [0], step=STEP)
    data = _node_root(saved, node0, [0], step=2 * STEP) / "__0_0.distcp"
    cfg = _config(runtime_dir, mirror=url, node_local=True)
    try:
        with ckptd.Checkpointer(node0, config=cfg) as ckpt:
            assert ckpt.latest() == 2 * STEP
            assert ckpt.checkpoint_dir() == data.parent
            sd, x = _request()
            out = ckpt.load({**sd, "iteration": 0})
            assert torch.equal(x, saved.values[2 * STEP]) and out["iteration"] == 2 * STEP
            sd, y = _request()
            ckpt.load(sd, step=STEP)
            assert torch.equal(y, saved.values[STEP])

            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            data.write_bytes(raw)
            sd, z = _request()
            out = ckpt.load({**sd, "iteration": 0})  # step 20 is damaged on this disk: the mirror's
            assert torch.equal(z, saved.values[2 * STEP]) and out["iteration"] == 2 * STEP
            assert ckpt.checkpoint_dir() == parse_location(url).child(step_dir_name(2 * STEP))  # what it read
    finally:
        stop_root_daemons(node0, runtime_dir, timeout_s=60)


def _resume_on_node(rank: int, world_size: int, roots: list[str], mirror: str, env: dict[str, str]) -> tuple[int, list]:
    """One rank of a 2-node job on node ``rank``'s disk: ``Checkpointer.load()``'s resume on node-local
    disks (the ranks agree on rank 0's decision over gloo); its row of the tensor and the step."""
    import os

    from ckptd.client.resume import load_agreed
    from ckptd.client.tiers import Levels

    os.environ.update(env)
    location = parse_location(mirror)
    assert isinstance(location, S3Location)
    levels = Levels(Path(roots[rank]), location, node_local=True, wait_s=5.0, node=rank)
    damaged: dict[str, str] = {}
    sd, x = _request(rows=1, rank=rank)
    out = load_agreed(lambda: levels.candidate(damaged), {**sd, "iteration": 0}, damaged, rank, {})
    return out["iteration"], x.tolist()


@pytest.mark.timeout(120)
def test_a_node_that_lags_behind_does_not_roll_the_job_back(saved, s3_env, s3_bucket, tmp_path):
    """Node 1's daemon renamed step 20 into place but died before it moved its ``latest``, which
    still names step 10, the mirror's latest copy. Before, each disk's missing data files failed
    the resume, and ranks that found different local checkpoints all read the mirror (step 10
    here). Node 0's disk decides now: both ranks resume from step 20, each from its own disk."""
    from tools.harness.ranks import run_ranks

    url = f"s3://{s3_bucket}/m"
    _mirror(saved, url, STEP)
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    for rank, root in enumerate((node0, node1)):
        _node_root(saved, root, [rank], step=STEP)
        _node_root(saved, root, [rank], step=2 * STEP)
    (node1 / "latest").write_text(f"{NAME}\n")
    results = run_ranks(_resume_on_node, 2, [str(node0), str(node1)], url, s3_env.env())
    w = saved.values[2 * STEP]
    assert results == [(2 * STEP, w[0:1].tolist()), (2 * STEP, w[1:2].tolist())]


@pytest.mark.timeout(120)
def test_a_step_lost_with_a_replaced_node_falls_back_to_the_mirrors_copy_without_waiting(
    saved, s3_env, s3_bucket, tmp_path
):
    """Node 1 was replaced after step 20 committed and before the daemons copied it: its new disk
    holds nothing, the mirror's latest copy is step 10. Step 20 can never be completed (node 1's
    file of it is gone), so both ranks resume from step 10 at once, rank 1 reading its file from
    the mirror, instead of waiting for a copy that cannot come (and failing with
    NodeFilesMissingError after it, as before)."""
    from tools.harness.ranks import run_ranks

    url = f"s3://{s3_bucket}/lost"
    _mirror(saved, url, STEP)
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    _node_root(saved, node0, [0], step=STEP)
    _node_root(saved, node0, [0], step=2 * STEP)
    node1.mkdir()
    results = run_ranks(_resume_on_node, 2, [str(node0), str(node1)], url, s3_env.env())
    w = saved.values[STEP]
    assert results == [(STEP, w[0:1].tolist()), (STEP, w[1:2].tolist())]


def _resume_error_on_node(rank: int, world_size: int, roots: list[str], mirror: str, env: dict[str, str]) -> str:
    """:func:`_resume_on_node`, for a resume that must fail: the error, as every rank sees it."""
    try:
        _resume_on_node(rank, world_size, roots, mirror, env)
    except ckptd.CkptdError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "resumed"


@pytest.mark.timeout(120)
def test_commits_on_other_disks_after_node_0s_disk_was_lost_uncopied_are_an_error_not_a_fresh_start(
    saved, s3_env, s3_bucket, tmp_path
):
    """Node 0 was replaced before any copy: its disk and the mirror hold nothing, node 1's disk
    holds step 10. Without node 0's file the commit cannot be loaded; every rank says so, instead
    of the job starting over as if it had never saved."""
    from tools.harness.ranks import run_ranks

    url = f"s3://{s3_bucket}/lost0"
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    _node_root(saved, node1, [1], step=STEP)
    errors = run_ranks(_resume_error_on_node, 2, [str(node0), str(node1)], url, s3_env.env())
    for error in errors:
        assert error.startswith("CorruptCheckpointError: the commits the disks of nodes [1] hold (up to step 10)"), (
            error
        )
        assert "cannot be loaded" in error and "move" in error, error


def test_load_of_a_step_takes_node_0s_commit_over_a_copy_of_a_replaced_disks(saved, s3_bucket, tmp_path):
    """Node 0's disk was replaced: its commits are numbered from 1 again, and the mirror's copy of
    step 20 from the old disk (a higher commit number) was taken over the new disk's own commit
    of 20 by ``load(step=20)``: the job loaded a commit of another history."""
    from ckptd.client.tiers import _step_commit

    step, old = 2 * STEP, saved.commits[2 * STEP]
    mirror = _mirror(saved, f"s3://{s3_bucket}/mirror", step=step)
    node0 = tmp_path / "node0"
    directory = _node_root(saved, node0, [0, 1], step=step)
    renumbered = CommitRecord(seq=1, step=step, attempt="fedcba987654-1", committed_unix_s=time.time())
    (directory / COMMIT_RECORD).write_bytes(renumbered.to_bytes())
    assert old.seq > 1
    assert _step_commit(node0, mirror, step) == CommitRef(step=step, attempt="fedcba987654-1", seq=1)
    # Without the step on node 0's disk, the mirror's copy is the one.
    shutil.rmtree(directory)
    assert _step_commit(node0, mirror, step) == old


@pytest.mark.timeout(180)
def test_a_mid_run_resume_on_node_local_disks_resumes_the_save_in_flight(s3_bucket, runtime_dir, tmp_path):
    """On node-local disks a resume after a loss spike did not wait for the Checkpointer's own save
    in flight: it loaded the step before, and the job's save of the landed step was refused
    (node-local disks never replace a step)."""
    url = f"s3://{s3_bucket}/m"
    root = tmp_path / "node0"
    cfg = _config(runtime_dir, mirror=url, node_local=True, debug_write_delay_s=1.5)
    w10, w20 = torch.full((2, ROW), 10.0), torch.full((2, ROW), 20.0)
    try:
        with ckptd.Checkpointer(root, config=cfg) as ckpt:
            ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w10), "iteration": 10}, step=10).wait(timeout_s=60)
            h = ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w20), "iteration": 20}, step=20)
            sd, x = _request()
            out = ckpt.resume({**sd, "iteration": 0})
            assert h.done() and out["iteration"] == 20 and torch.equal(x, w20)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)
