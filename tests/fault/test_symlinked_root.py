"""Links planted in a checkpoint root never make a commit write, resume or collect outside it:
``latest.tmp`` and the Megatron tracker's ``.tmp`` as links to a file elsewhere, ``iter_N.tmp`` as
a link to a directory elsewhere, links at the metadata files' ``.tmp`` names inside a step
directory, a committed ``iter_N`` that is a link to a checkpoint elsewhere, and a link at the name
gc renames a checkpoint to. A real daemon commits (tests.fault.single_job).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd.catalog import scan_root
from ckptd.format.durable import atomic_tmp_name
from ckptd.format.layout import COMMON_PT, DCP_METADATA, METADATA_JSON, data_file_name
from ckptd.format.rootlayout import MEGATRON_TRACKER, TRACKER_FILE, tmp_dir_name
from ckptd.recovery import resolve_latest
from ckptd.retention import apply_gc, plan_gc
from tests.checkpoints import make_checkpoint, make_root
from tests.fault.single_job import single_job, tmp_leftovers

PRECIOUS = "precious bytes of someone else\n"


def _victim(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PRECIOUS)
    return path


@pytest.mark.timeout(120)
def test_tracker_tmp_links_are_replaced_never_written_through(tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    with single_job(tmp_path, monkeypatch) as job:
        (job.root / atomic_tmp_name(TRACKER_FILE)).symlink_to(_victim(outside / "a"))
        (job.root / atomic_tmp_name(MEGATRON_TRACKER)).symlink_to(_victim(outside / "b"))
        job.committed(1)
        job.committed(2)
        assert (outside / "a").read_text() == PRECIOUS and (outside / "b").read_text() == PRECIOUS
        for name, text in (("latest", "iter_0000002\n"), (MEGATRON_TRACKER, "2\n")):
            assert not (job.root / name).is_symlink() and (job.root / name).read_text() == text


@pytest.mark.timeout(120)
def test_a_linked_step_directory_fails_its_save_and_nothing_lands_outside(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with single_job(tmp_path, monkeypatch) as job:
        linked = job.root / tmp_dir_name(2, job.ckpt._tries.incarnation.attempt(1))  # the first try's directory
        linked.symlink_to(elsewhere)
        reason = job.failed(2)
        assert f"{linked} is a symbolic link" in reason, reason
        assert list(elsewhere.iterdir()) == []
        assert not os.path.lexists(job.root / "iter_0000002")
        # The aborted save's link was removed (never followed), and the job goes on.
        assert not os.path.lexists(linked)
        job.committed(3)
        assert list(elsewhere.iterdir()) == []


@pytest.mark.timeout(120)
def test_links_at_file_names_inside_a_step_directory_are_never_written_through(tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    with single_job(tmp_path, monkeypatch) as job:
        step = job.root / tmp_dir_name(3, job.ckpt._tries.incarnation.attempt(1))
        step.mkdir()
        names = [*map(atomic_tmp_name, (COMMON_PT, DCP_METADATA, METADATA_JSON)), data_file_name(0)]
        for i, name in enumerate(names):
            (step / name).symlink_to(_victim(outside / str(i)))
        job.committed(3)  # loads bit-exact and verifies --deep: the links were replaced
        assert [(outside / str(i)).read_text() for i in range(len(names))] == [PRECIOUS] * len(names)
        assert not any(p.is_symlink() for p in (job.root / "iter_0000003").iterdir())
        assert tmp_leftovers(job.root) == []


@pytest.mark.timeout(60)
def test_a_linked_checkpoint_is_neither_resumed_nor_collected(tmp_path):
    root = make_root(tmp_path / "root", [1, 2], latest=None)
    foreign = tmp_path / "elsewhere" / "ckpt"
    make_checkpoint(foreign, step=99)
    (root / "iter_0000099").symlink_to(foreign)
    (root / "latest").write_text("iter_0000099\n")
    choice = resolve_latest(root)
    assert choice is not None and choice.entry.name == "iter_0000002", choice
    assert "symbolic link" in (choice.fallback_reason or "")
    assert "iter_0000099" not in [e.name for e in scan_root(root).entries]
    # gc renames a checkpoint to <name>.deleting first: a link planted there is removed, not
    # followed, and what it pointed to stays.
    victim_dir = tmp_path / "elsewhere" / "dir"
    victim_dir.mkdir()
    _victim(victim_dir / "file")
    (root / "iter_0000001.deleting").symlink_to(victim_dir)
    (root / "latest").write_text("iter_0000002\n")
    results = apply_gc(plan_gc(scan_root(root), keep=1))
    assert [(r.entry.name, err) for r, err in results] == [("iter_0000001", None)]
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "iter_0000099", "latest"]
    assert (victim_dir / "file").read_text() == PRECIOUS and (foreign / "metadata.json").exists()
