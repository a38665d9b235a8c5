"""The ranks of a resume load one checkpoint, chosen once (on rank 0), and a load that fails on
one rank before a collective fails on every rank instead of crossing the collectives.

Real gloo process groups, real checkpoints on disk; the moment of the race is forced from inside
the real resolution (the tracker moves right after rank 0 read it, as a coordinator daemon that
finishes an interrupted commit moves it while the ranks of another node resume).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import ckptd
from tools.harness.ranks import run_ranks

FLAG_TIMEOUT_S = 20.0


def _resume_while_the_tracker_moves(rank: int, world_size: int, root: str) -> list[float]:
    from ckptd.client import resume

    real = resume.resolve_resumable
    moved = Path(root) / "moved"

    def resolve(where, **kwargs):
        if rank != 0:  # a rank that looks on its own looks after the tracker moved
            deadline = time.monotonic() + FLAG_TIMEOUT_S
            while not moved.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        choice = real(where, **kwargs)
        if rank == 0:
            (Path(root) / "latest").write_text("iter_0000020")
            moved.touch()
        return choice

    resume.resolve_resumable = resolve
    out = resume.load_latest(Path(root), {"w": torch.zeros(4)}, {}, rank, {})
    return out["w"].tolist()


@pytest.mark.timeout(120)
def test_every_rank_resumes_from_rank_0s_choice_while_the_tracker_moves(tmp_path):
    root = tmp_path / "root"
    ckptd.save({"w": torch.full((4,), 10.0)}, root / "iter_0000010")
    ckptd.save({"w": torch.full((4,), 20.0)}, root / "iter_0000020")  # renamed in, tracker not moved yet
    (root / "latest").write_text("iter_0000010")
    assert run_ranks(_resume_while_the_tracker_moves, 2, str(root), timeout_s=90) == [[10.0] * 4] * 2


def _resume_while_a_commit_lands(rank: int, world_size: int, root: str, lazily: bool) -> float | None:
    """The README's ``Checkpointer.resume()`` while the previous launch's daemon commits step 20
    right after rank 0 looked: what this rank loaded (None: nothing)."""
    from ckptd.client import resume

    real = resume.resolve_resumable
    moved = Path(root) / "moved"

    def resolve(where, **kwargs):
        # Only rank 0 looks when the ranks agree; a rank that looked on its own would look after
        # the commit (and load step 20, or make its state dict and wait in a load rank 0 skipped).
        if rank != 0:
            deadline = time.monotonic() + FLAG_TIMEOUT_S
            while not moved.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        choice = real(where, **kwargs)
        if rank == 0 and not moved.exists():  # the commit: renamed in, then the tracker moved
            (Path(root).parent / "iter_0000020").rename(Path(root) / "iter_0000020")
            (Path(root) / "latest").write_text("iter_0000020")
            moved.touch()
        return choice

    resume.resolve_resumable = resolve
    made = []

    def request() -> dict:
        made.append(True)
        return {"w": torch.zeros(4)}

    with ckptd.Checkpointer(root) as ckpt:
        loaded = ckpt.resume(request if lazily else request())
    if lazily and made != ([] if loaded is None else [True]):
        raise AssertionError(f"the state dict was made {len(made)} times, loaded {loaded}")
    return None if loaded is None else float(loaded["w"][0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("before", [10, None])
@pytest.mark.parametrize("lazily", [False, True], ids=["dict", "made-when-needed"])
def test_every_rank_resumes_rank_0s_choice_while_a_commit_lands(tmp_path, runtime_dir, before, lazily):
    """Rank 1 would read step 20, committed by the previous launch's daemon just after rank 0 read
    step 10, or read a first checkpoint where rank 0 read none: every rank loads rank 0's choice,
    or starts fresh (not one rank fresh while the others wait in the load)."""
    root = tmp_path / "root"
    root.mkdir()
    ckptd.save({"w": torch.full((4,), 20.0)}, tmp_path / "iter_0000020")  # written, not renamed in yet
    if before is not None:
        ckptd.save({"w": torch.full((4,), 10.0)}, root / "iter_0000010")
        (root / "latest").write_text("iter_0000010")
    env = {"CKPTD_RUNTIME_DIR": str(runtime_dir)}
    answers = run_ranks(_resume_while_a_commit_lands, 2, str(root), lazily, timeout_s=90, env=env)
    assert answers == [10.0 if before else None] * 2


def _load_failing_on_rank_1(rank: int, world_size: int, root: str, resume: bool) -> str:
    from ckptd.client.resume import load_latest

    request: dict = {"w": torch.zeros(4)}
    if rank == 1:  # two entries that flatten to one key: this rank's request cannot be loaded
        request.update({"a.b": 1, "a": {"b": 2}})
    try:
        if resume:
            load_latest(Path(root), request, {}, rank, {"strict": "raise_all"})
        else:
            ckptd.load(request, Path(root) / "iter_0000010", strict="raise_all")
    except ckptd.CkptdError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("resume", [False, True], ids=["load", "resume"])
def test_a_strict_all_load_failing_on_one_rank_fails_on_every_rank(tmp_path, resume):
    """``strict="*_all"`` gathers every rank's requested keys: a rank whose request failed before
    that gather fails it on every rank (the others name it), where it used to pair with another
    collective (the resume's outcome gather) and fail with an unrelated error or hang."""
    root = tmp_path / "root"
    ckptd.save({"w": torch.full((4,), 10.0)}, root / "iter_0000010")
    (root / "latest").write_text("iter_0000010")
    rank0, rank1 = run_ranks(_load_failing_on_rank_1, 2, str(root), resume, timeout_s=90)
    assert "'a.b'" in rank1, rank1
    assert "failed on another rank: rank 1" in rank0 and "'a.b'" in rank0, rank0
    assert rank0.split(":")[0] == rank1.split(":")[0]  # the same error class on every rank


def _resume_whose_factory_fails_on_rank_1(rank: int, world_size: int, root: str) -> str:
    from ckptd.client.resume import load_latest

    def make() -> dict:
        if rank == 1:
            raise ckptd.CkptdError("rank 1 could not make its state dict (simulated)")
        return {"w": torch.zeros(4)}

    try:
        load_latest(Path(root), make, {}, rank, {"strict": "raise_all"})
    except ckptd.CkptdError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


@pytest.mark.timeout(120)
def test_a_state_dict_factory_failing_on_one_rank_fails_the_resume_on_every_rank(tmp_path):
    """A resume's state dict made by a function, once the checkpoint is chosen: a rank whose
    function raised skipped the load's collectives (strict="*_all" gathers the keys) and went
    into the outcome's, which paired with the others' key gather: they failed with an unrelated
    error or hung. The function's failure is agreed on first."""
    root = tmp_path / "root"
    ckptd.save({"w": torch.full((4,), 10.0)}, root / "iter_0000010")
    (root / "latest").write_text("iter_0000010")
    rank0, rank1 = run_ranks(_resume_whose_factory_fails_on_rank_1, 2, str(root), timeout_s=90)
    assert "simulated" in rank1, rank1
    assert "failed on another rank: rank 1" in rank0 and "simulated" in rank0, rank0


def _load_step_on_a_lagging_node(rank: int, world_size: int, root: str) -> tuple[str, int]:
    from ckptd.client import tiers
    from ckptd.roots.mirror import CommitRef
    from ckptd.storage.url import parse_location

    # Node 1's disk and the mirror's copy still record the commit of step 20 that a rollback
    # abandoned (node 1's daemon had not renamed the re-save's commit in yet); node 0's, the new one.
    seen = {0: CommitRef(step=20, attempt="resaved-1", seq=7), 1: CommitRef(step=20, attempt="abandoned-1", seq=3)}
    tiers._step_commit = lambda *_: seen[rank]
    mirror = parse_location("s3://bucket/mirror")
    levels = tiers.Levels(Path(root) / f"node{rank}", mirror, node_local=True, node=rank, world_size=world_size)
    target = levels.step_target(20)
    return target.attempt, target.seq


@pytest.mark.timeout(120)
def test_every_node_loads_node_0s_commit_of_a_step_on_node_local_disks(tmp_path):
    assert run_ranks(_load_step_on_a_lagging_node, 2, str(tmp_path), timeout_s=90) == [("resaved-1", 7)] * 2


def _resume_failing_to_open_on_rank_1(rank: int, world_size: int, root: str) -> str:
    from ckptd import opening
    from ckptd.client.resume import load_latest
    from ckptd.format.lease import removed_error

    if rank == 1:  # as a load that starts while retention removes the checkpoint, on every try

        def removed(directory):
            raise removed_error(Path(directory))

        opening.ReadLease.acquire = staticmethod(removed)
    try:
        load_latest(Path(root), {"w": torch.zeros(4)}, {}, rank, {"strict": "raise_all"})
    except ckptd.CkptdError as exc:
        return type(exc).__name__
    return "loaded"


@pytest.mark.timeout(120)
def test_a_strict_all_resume_failing_to_open_on_one_rank_fails_on_every_rank(tmp_path):
    """A rank whose load failed before it gathered the requested keys (opening the checkpoint) went
    to the resume's outcome gather, which paired with the other ranks' key gather: they waited in
    a collective nobody else entered until that rank's process exited."""
    root = tmp_path / "root"
    ckptd.save({"w": torch.full((4,), 10.0)}, root / "iter_0000010")
    (root / "latest").write_text("iter_0000010")
    outcomes = run_ranks(_resume_failing_to_open_on_rank_1, 2, str(root), timeout_s=90)
    assert outcomes == ["CheckpointRemovedError"] * 2
