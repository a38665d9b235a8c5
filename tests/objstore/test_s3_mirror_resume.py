"""Two tiers against a real server (SeaweedFS), around a rollback and damage: ``wait_mirrored(N)``
waits for the copy of the local commit of step N (not the mirror's copy of the step from before a
rollback); a local checkpoint found damaged resumes from the mirror's intact copy of the same
commit before any older one, on every rank alike; a local root restored from before a rollback
resumes the mirror's later commit; a copy whose local directory a re-save replaced meanwhile
commits nothing.

The local roots come from one real history (:func:`history`): a Checkpointer saves steps 10, 20,
30 and 40, the job rolls back to 20 and saves 25 and 30 again. The mirror's copies are made by
hand with ``mirror_step`` (what the coordinator's mirror thread runs), so each test decides which
commits the mirror holds."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.client.tiers import Levels
from ckptd.errors import CkptdError, SaveTimeoutError
from ckptd.format.commitrecord import COMMIT_RECORD, CommitRecord, read_commit_record
from ckptd.format.dcp_metadata import read_index, records_from_index, with_file_ranks
from ckptd.format.layout import data_file_name
from ckptd.format.rootlayout import TRACKER_FILE, step_dir_name, tracker_bytes
from ckptd.roots import mirror as mirror_mod
from ckptd.roots import mirror_nodes
from ckptd.roots.copyround import REQUEST_KEY
from ckptd.roots.mirror import CommitRef, local_latest, mirror_step
from ckptd.roots.s3_root import S3Root
from ckptd.s3catalog import read_s3_commit_record, scan_s3_root
from ckptd.storage.url import S3Location, parse_location
from tests.checkpoints import flip_bit, make_root, reference_tensors, stamp_commits
from tests.multiproc import clear_torchrun_env
from tests.objstore.test_s3_roots import _config, _sd
from tools.harness.daemons import private_runtime_dir, stop_root_daemons

N = 1 << 12
RESAVED = 3000.0  # the value of step 30 saved again after the rollback


@dataclass(frozen=True)
class History:
    before: Path  # steps 10, 20, 30, 40 committed (seq 1-4)
    after: Path  # then a rollback to 20: 25 (seq 5) and 30 again (seq 6), replacing 30 locally


def _value(step: int, resaved: bool = False) -> torch.Tensor:
    return torch.full((N,), RESAVED if resaved else float(step))


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Iterator[History]:
    base = tmp_path_factory.mktemp("history")
    root = base / "root"
    with pytest.MonkeyPatch.context() as mp, private_runtime_dir(tmp_path_factory.mktemp("daemon-logs")) as rt:
        clear_torchrun_env(mp)
        cfg = _config(rt)
        try:
            with ckptd.Checkpointer(root, config=cfg) as ckpt:
                for step in (10, 20, 30, 40):
                    ckpt.save(_sd(_value(step), step), step=step).wait(timeout_s=60)
        finally:
            stop_root_daemons(root, rt, timeout_s=60)
        shutil.copytree(root, base / "before")
        try:
            with ckptd.Checkpointer(root, config=cfg) as ckpt:
                ckpt.load(_sd(torch.zeros(N), -1), step=20)  # the rollback
                ckpt.save(_sd(_value(25), 25), step=25).wait(timeout_s=60)
                ckpt.save(_sd(_value(30, resaved=True), 30), step=30).wait(timeout_s=60)
        finally:
            stop_root_daemons(root, rt, timeout_s=60)
    yield History(before=base / "before", after=root)


def _copy(source: Path, to: Path) -> Path:
    shutil.copytree(source, to)
    return to


def _commit(root: Path, step: int) -> CommitRef:
    record = read_commit_record(root / step_dir_name(step))
    assert record is not None
    return CommitRef(step=step, attempt=record.attempt, seq=record.seq)


def _store(url: str) -> S3Root:
    location = parse_location(url)
    assert isinstance(location, S3Location)
    return S3Root(location)


def _resumed(levels: Levels) -> tuple[int, torch.Tensor]:
    w = torch.zeros(N)
    out = levels.load_resumed(_sd(w, -1), {}, 0, {})
    return out["iteration"], w


@pytest.mark.timeout(180)
def test_wait_mirrored_waits_for_the_copy_of_the_local_commit_not_of_one_a_rollback_replaced(
    history, s3_bucket, tmp_path
):
    store = _store(f"s3://{s3_bucket}/m")
    before = _copy(history.before, tmp_path / "before")
    mirror_step(before, _commit(before, 30), store)  # the mirror copied step 30 before the rollback
    local = _copy(history.after, tmp_path / "local")  # ... and lagged past 25 and the new 30 since
    levels = Levels(local, store.location)
    with pytest.raises(SaveTimeoutError, match=r"copies commit .* \(seq 3\), not .* \(seq 6\).*saved again"):
        levels.wait_mirrored(30, timeout_s=1.0)
    mirror_step(local, _commit(local, 30), store)
    levels.wait_mirrored(30, timeout_s=30.0)
    # What wait_mirrored() promises: the step outlives the disk.
    shutil.rmtree(local)
    local.mkdir()
    step, w = _resumed(Levels(local, store.location))
    assert step == 30 and torch.equal(w, _value(30, resaved=True))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_local_latest_resumes_from_the_mirrors_intact_copy_of_the_same_commit(
    history, s3_bucket, tmp_path, caplog, damage
):
    store = _store(f"s3://{s3_bucket}/m")
    local = _copy(history.before, tmp_path / "local")
    mirror_step(local, _commit(local, 40), store)
    data = local / step_dir_name(40) / data_file_name(0)
    raw = data.read_bytes()
    if damage == "truncate":  # found by the structural check
        data.write_bytes(raw[: len(raw) // 2])
    else:  # found by the load's checksums
        flip_bit(data, len(raw) // 2)
    levels = Levels(local, store.location)
    damaged: dict[str, str] = {}
    caplog.set_level(logging.WARNING)
    w = torch.zeros(N)
    out = levels.load_resumed(_sd(w, -1), damaged, 0, {})
    assert out["iteration"] == 40 and torch.equal(w, _value(40))  # not the local step 30
    said = [r.getMessage() for r in caplog.records if "mirror's intact copy of the same commit" in r.getMessage()]
    assert said and str(local / step_dir_name(40)) in said[-1] and data_file_name(0) in said[-1], said
    assert levels.resume(damaged).step == 40  # latest() says so too
    # checkpoint_dir() names the copy the resume read (it named the damaged local directory)
    assert levels.resumed_location(damaged) == store.location.child(step_dir_name(40))

    # The mirror's copy damaged as well: the commit before it, from the local root.
    client = store.client
    key = next(i.key for i in client.list_objects(step_dir_name(40)) if i.key.endswith(".distcp"))
    got = client.get(key, 1 << 30)
    assert got is not None
    bad = bytearray(got[0])
    bad[len(bad) // 2] ^= 1
    client.put(key, bytes(bad))
    w = torch.zeros(N)
    out = Levels(local, store.location).load_resumed(_sd(w, -1), {}, 0, {})
    assert out["iteration"] == 30 and torch.equal(w, _value(30))


@pytest.mark.timeout(180)
def test_a_damaged_re_save_after_a_rollback_does_not_resume_the_mirrors_copy_of_the_abandoned_commit(
    s3_bucket, tmp_path, monkeypatch
):
    """The mirror copied step 30 (commit A); the job rolled back to 20 and saved 30 again (commit B),
    after 25, and B is now damaged. The local root resumes step 25: the mirror's step 30 is A, of the
    branch the rollback abandoned (it was resumed, with its values, as the newer step)."""
    store = _store(f"s3://{s3_bucket}/m")
    root = tmp_path / "local"
    clear_torchrun_env(monkeypatch)
    with private_runtime_dir(tmp_path / "logs") as rt:
        cfg = _config(rt)
        try:
            with ckptd.Checkpointer(root, config=cfg) as ckpt:
                for step in (10, 20, 30):
                    ckpt.save(_sd(_value(step), step), step=step).wait(timeout_s=60)
            mirror_step(root, _commit(root, 20), store)
            mirror_step(root, _commit(root, 30), store)  # the copy of A
            with ckptd.Checkpointer(root, config=cfg) as ckpt:
                ckpt.load(_sd(torch.zeros(N), -1), step=20)  # the rollback
                ckpt.save(_sd(_value(25), 25), step=25).wait(timeout_s=60)
                ckpt.save(_sd(_value(30, resaved=True), 30), step=30).wait(timeout_s=60)
        finally:
            stop_root_daemons(root, rt, timeout_s=60)
    data = root / step_dir_name(30) / data_file_name(0)
    flip_bit(data, data.stat().st_size // 2)
    step, w = _resumed(Levels(root, store.location))
    assert step == 25 and torch.equal(w, _value(25))
    # Only the abandoned copy is passed over, not the mirror: with the local 25 and 20 damaged too,
    # the mirror's copy of 20 is resumed (the mirror level was dropped: the local 10 was).
    for step in (25, 20):
        data = root / step_dir_name(step) / data_file_name(0)
        flip_bit(data, data.stat().st_size // 2)
    step, w = _resumed(Levels(root, store.location))
    assert step == 20 and torch.equal(w, _value(20))


@pytest.mark.timeout(180)
def test_a_mirror_copy_above_the_rollback_point_is_not_resumed_when_the_new_branch_is_damaged(
    history, s3_bucket, tmp_path
):
    """The mirror copied step 40 before the rollback to 20 (25 and 30 saved since). With the new
    branch's 30 and 25 damaged, the local 20 is resumed: the mirror's 40 is of the abandoned branch
    (it was resumed: the local root holds that commit and the mirror's seq was the higher)."""
    store = _store(f"s3://{s3_bucket}/m")
    mirror_step(_copy(history.before, tmp_path / "before"), _commit(history.before, 40), store)
    local = _copy(history.after, tmp_path / "local")
    for step in (30, 25):
        data = local / step_dir_name(step) / data_file_name(0)
        flip_bit(data, data.stat().st_size // 2)
    step, w = _resumed(Levels(local, store.location))
    assert step == 20 and torch.equal(w, _value(20))


def _resume_rank(rank: int, world_size: int, root: str, mirror: str, env: dict[str, str]) -> tuple[int, list]:
    """One rank of a 2-rank job on a shared root with a mirror: ``Checkpointer.load()``'s resume
    (the ranks agree over gloo); the step and this rank's rows of ``layer.weight``."""
    os.environ.update(env)
    location = parse_location(mirror)
    assert isinstance(location, S3Location)
    x = torch.zeros(4, 6)
    sd: dict[str, Any] = {"layer.weight": ShardedTensor.from_rank_offsets("layer.weight", x, (0, rank, 2))}
    out = Levels(Path(root), location).load_resumed({**sd, "iteration": 0}, {}, rank, {})
    return out["iteration"], x.tolist()


@pytest.mark.timeout(120)
def test_every_rank_resumes_from_the_mirrors_copy_when_one_ranks_local_file_is_damaged(s3_env, s3_bucket, tmp_path):
    """Rank 1's data file of the latest commit is damaged, rank 0's is intact: rank 0's load
    succeeds, rank 1's fails, and both then load the mirror's copy of that commit (before, both
    fell back to the local step 20)."""
    from tools.harness.ranks import run_ranks

    root = make_root(tmp_path / "local", [10, 20, 30], latest=30)
    stamp_commits(root, [10, 20, 30])
    url = f"s3://{s3_bucket}/m"
    mirror_step(root, _commit(root, 30), _store(url))
    directory = root / step_dir_name(30)
    item = next(
        r for r in with_file_ranks(records_from_index(read_index(directory))) if r.rank == 1 and r.fqn == "layer.weight"
    )
    flip_bit(directory / data_file_name(1), item.file_offset + item.length // 2)
    results = run_ranks(_resume_rank, 2, str(root), url, s3_env.env(), timeout_s=90)
    w = reference_tensors()["layer.weight"]
    assert results == [(30, w[0:4].tolist()), (30, w[4:8].tolist())]


def _stale_rank_1(rank: int, world_size: int, root: str, mirror: str, env: dict[str, str]) -> tuple[int, list]:
    """:func:`_resume_rank`, with rank 1 reading the local root's `latest` as it was a commit ago
    (a filesystem's cache, or the previous launch's commit finishing meanwhile)."""
    if rank == 1:
        import ckptd.client.tiers as tiers
        from ckptd.recovery import LatestChoice
        from ckptd.s3catalog import scan_any

        real = tiers.resolve_resumable

        def stale(where: Any, **kwargs: Any) -> Any:
            if isinstance(where, Path):
                entry = next(e for e in scan_any(where, usage=False).entries if e.step == 20)
                return LatestChoice(entry)
            return real(where, **kwargs)

        tiers.resolve_resumable = stale
    return _resume_rank(rank, world_size, root, mirror, env)


@pytest.mark.timeout(120)
def test_ranks_that_found_different_local_commits_resume_the_oldest_not_an_older_mirror_copy(
    s3_env, s3_bucket, tmp_path
):
    """Rank 0 finds step 30, rank 1 (a stale view) step 20; the mirror's latest copy is of step 10,
    hours behind. Every rank read the mirror's step 10 whenever the ranks disagreed, silently; they
    resume step 20 now, which both hold."""
    from tools.harness.ranks import run_ranks

    root = make_root(tmp_path / "local", [10, 20, 30], latest=30)
    stamp_commits(root, [10, 20, 30])
    url = f"s3://{s3_bucket}/m"
    mirror_step(root, _commit(root, 10), _store(url))
    results = run_ranks(_stale_rank_1, 2, str(root), url, s3_env.env(), timeout_s=90)
    assert [step for step, _ in results] == [20, 20]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("copied", [40, 20], ids=["its-latest", "the-marked-step"])
def test_a_local_root_restored_from_before_a_rollback_resumes_the_mirrors_later_commit(
    history, s3_bucket, tmp_path, copied
):
    """The local root is a backup from before the rollback (latest step 40, seq 4); the mirror's
    latest copy is the re-saved step 30 (seq 6), a later commit of the same root. The mirror also
    holds a copy of a commit the backup holds (its latest, or the step its ``ckptd_mirrored``
    names), which shows that both seqs are of one commit order: the later commit wins, not the
    higher step."""
    store = _store(f"s3://{s3_bucket}/m")
    stale = _copy(history.before, tmp_path / "stale")
    mirror_step(stale, _commit(stale, copied), store)  # made before the rollback (writes the marker)
    after = _copy(history.after, tmp_path / "after")
    mirror_step(after, _commit(after, 30), store)
    levels = Levels(stale, store.location)
    if copied == 40:
        # The daemon's mirror pass, which its start runs before load(): the mirror holds a copy of the
        # local latest, but its own latest was committed after it. Naming that copy latest (as after
        # a failed tracker update) moved the mirror back, and the resume took the abandoned branch.
        from ckptd.daemon.mirror import MirrorUploader

        uploader = MirrorUploader(stale, store)
        uploader._pass()
        assert "the local root is behind the mirror" in uploader.status()["error"]
    resume = levels.resume({})
    assert resume.root == store.location and resume.step == 30
    step, w = _resumed(levels)
    assert step == 30 and torch.equal(w, _value(30, resaved=True))


@pytest.mark.timeout(180)
def test_a_replaced_disks_first_commit_wins_while_the_mirrors_tracker_still_names_the_old_disks_copy(
    history, s3_bucket, tmp_path
):
    """A replaced node's new disk committed step 40 as its commit 1 (the old disk's step 30 was
    commit 3, the mirror's latest copy). The mirror has committed its copy of step 40 and not yet
    moved its tracker. That copy is of a commit of this disk, but committed after the mirror's
    latest: it proves nothing of the latest's history, so the higher step wins, not the higher
    seq (which resumed step 30, the old disk's, and lost step 40)."""
    store = _store(f"s3://{s3_bucket}/m")
    before = _copy(history.before, tmp_path / "before")
    mirror_step(before, _commit(before, 30), store)
    new = tmp_path / "new"
    new.mkdir()
    shutil.copytree(before / step_dir_name(40), new / step_dir_name(40))
    record = CommitRecord(seq=1, step=40, attempt="fedcba987654-1", committed_unix_s=time.time())
    (new / step_dir_name(40) / COMMIT_RECORD).write_bytes(record.to_bytes())
    (new / TRACKER_FILE).write_bytes(tracker_bytes(step_dir_name(40)))
    mirror_step(new, _commit(new, 40), store)
    store.client.put(TRACKER_FILE, tracker_bytes(step_dir_name(30)))  # the tracker not moved yet
    levels = Levels(new, store.location)
    resume = levels.resume({})
    assert resume.root == new and resume.step == 40
    step, w = _resumed(levels)
    assert step == 40 and torch.equal(w, _value(40))


def _attempt_dir(directory: Path, value: float, tag: str, seq: int, attempt: str, *, checksums: bool) -> None:
    """A committed ``iter_0000030`` as the coordinator leaves it (a commit record of ``seq``)."""
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.full((N,), value)), "tag": tag}
    ckptd.save(sd, directory, checksums=checksums)
    record = CommitRecord(seq=seq, step=30, attempt=attempt, committed_unix_s=time.time())
    (directory / COMMIT_RECORD).write_bytes(record.to_bytes())


def _replace(root: Path, new: Path) -> None:
    """What publish_step does for a re-save of a step after a rollback (whatever a lease)."""
    name = step_dir_name(30)
    os.rename(root / name, root / f"{name}.deleting")
    os.rename(new, root / name)
    shutil.rmtree(root / f"{name}.deleting")


def _nothing_committed(store: S3Root) -> None:
    assert not scan_s3_root(store.location, usage=False).committed
    assert not list(store.client.list_objects(step_dir_name(30))) and not store.client.uploads("")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checksums", [False, True], ids=["no-checksums", "checksums"])
def test_a_copy_whose_directory_a_re_save_replaced_meanwhile_commits_nothing(
    s3_bucket, tmp_path, monkeypatch, checksums
):
    """A re-save of step 30 after a rollback renames its commit over the one being copied, after
    the copy read the small files and before the data files. Before, the copy read the data by
    path: without checksums it committed the old ``common.pt`` with the new tensor, with them it
    failed as bit rot. It fails cleanly now, and the next copy takes the new commit."""
    root = tmp_path / "local"
    root.mkdir()
    _attempt_dir(root / step_dir_name(30), 30.0, "old", 3, "aaaaaaaaaaaa-1", checksums=checksums)
    (root / TRACKER_FILE).write_bytes(tracker_bytes(step_dir_name(30)))
    new = tmp_path / "new"
    _attempt_dir(new, RESAVED, "new", 5, "bbbbbbbbbbbb-1", checksums=checksums)
    old = local_latest(root)
    assert old is not None
    store = _store(f"s3://{s3_bucket}/m")
    real = _replace_first(monkeypatch, mirror_mod, "_upload_data", root, new)
    with pytest.raises(CkptdError, match="was replaced while the mirror copied it") as raised:
        mirror_step(root, old, store)
    assert str(root / step_dir_name(30)) in str(raised.value) and "copies the local root's newest" in str(raised.value)
    _nothing_committed(store)
    monkeypatch.setattr(mirror_mod, "_upload_data", real)
    latest = local_latest(root)
    assert latest is not None and latest.seq == 5
    mirror_step(root, latest, store)
    w = torch.zeros(N)
    out = ckptd.load({"w": ShardedTensor.from_rank_offsets("w", w), "tag": ""}, store.location.child(step_dir_name(30)))
    assert out["tag"] == "new" and torch.equal(w, torch.full((N,), RESAVED))


def _replace_first(monkeypatch: Any, module: Any, name: str, root: Path, new: Path) -> Any:
    """Make ``module.name`` re-save ``root``'s step 30 (``new`` renamed over it) before it runs:
    the race a copy meets. Returns the real function."""
    real = getattr(module, name)

    def racing(*args: Any, **kwargs: Any) -> Any:
        _replace(root, new)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, racing)
    return real


@pytest.mark.timeout(120)
def test_a_node_local_round_whose_directory_a_re_save_replaced_meanwhile_commits_nothing(
    s3_bucket, tmp_path, monkeypatch
):
    """Node 0's ``iter_<step>`` is replaced while the round waits for the nodes' manifests: its
    copy of the old commit is complete, but the local root moved on; the round fails and
    withdraws its objects instead of committing a commit the root no longer holds."""
    root = tmp_path / "node0"
    make_root(root, [30], latest=30)
    stamp_commits(root, [30])
    new = tmp_path / "new"
    shutil.copytree(root / step_dir_name(30), new)
    record = CommitRecord(seq=5, step=30, attempt="bbbbbbbbbbbb-1", committed_unix_s=time.time())
    (new / COMMIT_RECORD).write_bytes(record.to_bytes())
    old = _commit(root, 30)
    store = _store(f"s3://{s3_bucket}/nodes")
    _replace_first(monkeypatch, mirror_nodes, "_wait_for_nodes", root, new)
    with pytest.raises(CkptdError, match="was replaced while the mirror copied it"):
        mirror_nodes.coordinate_copy(root, old, store, nnodes=1, timeout_s=30)
    _nothing_committed(store)
    assert store.client.head(REQUEST_KEY) is None
    assert read_s3_commit_record(store.client, step_dir_name(30)) is None


@pytest.mark.timeout(120)
def test_a_committed_copy_whose_tracker_update_failed_is_named_latest_not_uploaded_again(s3_bucket, tmp_path):
    """The mirror committed its copy of the local latest, but moving its ``latest`` failed (or could
    not be read just now): every pass uploaded every file again, and the commit then refused the
    step as committed already, until the next local commit."""
    from ckptd.daemon.mirror import MirrorUploader
    from ckptd.format.rootlayout import TRACKER_FILE, tracker_bytes

    root = make_root(tmp_path / "local", [10, 20], latest=20)
    stamp_commits(root, [10, 20])
    store = _store(f"s3://{s3_bucket}/named")
    for step in (10, 20):
        mirror_step(root, _commit(root, step), store)
    store.client.put(TRACKER_FILE, tracker_bytes(step_dir_name(10)))  # the tracker update of 20 "failed"
    objects = sorted(i.key for i in store.client.list_objects(""))
    uploader = MirrorUploader(root, store)
    uploader._pass()
    assert store.client.get(TRACKER_FILE, 100)[0] == tracker_bytes(step_dir_name(20))
    assert sorted(i.key for i in store.client.list_objects("")) == objects  # nothing uploaded again
    assert uploader.status()["mirrored_step"] == 20 and uploader.status()["error"] is None


@pytest.mark.timeout(120)
def test_waiting_for_a_step_a_newer_one_overtook_in_the_mirror_says_so_at_once(s3_bucket, tmp_path):
    """Step 20 committed locally, then step 30 before the mirror got to 20: the mirror copies only
    the newest local commit, so it never copies 20. wait_mirrored(20) waited out its whole timeout
    (600 s by default), saying the mirror had no commit of it yet."""
    root = make_root(tmp_path / "local", [10, 20, 30], latest=30)
    stamp_commits(root, [10, 20, 30])
    store = _store(f"s3://{s3_bucket}/overtaken")
    mirror_step(root, _commit(root, 30), store)
    levels = Levels(root, store.location)
    t0 = time.monotonic()
    with pytest.raises(ckptd.CheckpointNotFoundError, match="step 20 will never be copied .* wait for step 30"):
        levels.wait_mirrored(20, timeout_s=60)
    assert time.monotonic() - t0 < 30
    levels.wait_mirrored(30, timeout_s=10)
    # A replaced disk numbers its commits from 1 again: its step 40 (seq 1) is not "overtaken" by the
    # old disk's step 30 (seq 3) the mirror copied; the mirror copies it next.
    new_disk = make_root(tmp_path / "new-disk", [40], latest=40)
    stamp_commits(new_disk, [40])
    with pytest.raises(SaveTimeoutError, match="the mirror has no commit of step 40 yet"):
        Levels(new_disk, store.location).wait_mirrored(40, timeout_s=1)


@pytest.mark.timeout(120)
def test_a_copy_the_store_fails_to_keep_is_retried_only_local_damage_is_not(s3_bucket, tmp_path, monkeypatch):
    """The store losing an uploaded object (found when the copy commits) is the store's doing: the
    copy is retried. Only damage in the local files stops retries until a newer commit (a
    CorruptCheckpointError from either side counted as such, and a job's last step was then never
    mirrored)."""
    import math

    from ckptd.daemon.mirror import MirrorUploader
    from ckptd.errors import CorruptCheckpointError

    root = make_root(tmp_path / "local", [10], latest=10)
    stamp_commits(root, [10])
    store = _store(f"s3://{s3_bucket}/lost-object")

    def lost(*_args: Any, **_kwargs: Any) -> Any:
        raise CorruptCheckpointError("data object __0_0.x.distcp of the copy is missing")

    monkeypatch.setattr(S3Root, "commit", lost)
    uploader = MirrorUploader(root, store)
    uploader._pass()
    assert "committing the copy of step 10 failed" in uploader.status()["error"]
    assert uploader._failed is not None and uploader._failed.retry_at_s < math.inf
