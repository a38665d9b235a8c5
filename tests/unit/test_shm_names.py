"""Staging segment names: 128 random bits per ring, created O_EXCL|O_NOFOLLOW 0600, and parsed
exactly when a daemon cleans up after a crash: job ``llama``'s cleanup never touches job
``llama-n0``'s segments, nor a file of another user (chowned to 65534: these tests run as root)."""

from __future__ import annotations

import os
import re
import secrets
import stat

import pytest

from ckptd.errors import StagingError
from ckptd.staging.rankside import StagingRing
from ckptd.staging.segment import SHM_DIR, ShmSegment, new_generation, remove_orphans, segment_name, unlink_segments


@pytest.fixture
def job() -> str:
    job = f"llama{secrets.token_hex(3)}"
    yield job
    for name in os.listdir(SHM_DIR):
        if name.startswith(f"ckptd-{job}"):
            os.unlink(SHM_DIR / name)


def test_ring_segments_have_unguessable_private_names(job):
    ring = StagingRing.create(f"ckptd-{job}-n0-", 3, 4096, timeout_s=1)
    try:
        assert len(ring.names) == 1
        for i, name in enumerate(ring.names):
            assert re.fullmatch(rf"ckptd-{job}-n0-r3-[0-9a-f]{{32}}-s{i}", name), name
            st = os.lstat(SHM_DIR / name)
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    finally:
        ring.close(unlink=True)
    assert new_generation() != new_generation()


def test_a_link_at_a_segment_name_is_never_followed(job, tmp_path):
    name = segment_name(f"ckptd-{job}-n0-", 0, new_generation(), 0)
    (tmp_path / "target").write_bytes(b"")
    os.symlink(tmp_path / "target", SHM_DIR / name)
    with pytest.raises(StagingError, match="already exists"):
        ShmSegment.create(name, 4096)
    assert (tmp_path / "target").stat().st_size == 0


def test_orphan_cleanup_parses_names_and_owners_exactly(job):
    mine = f"ckptd-{job}-n0-"
    orphans = [segment_name(mine, r, new_generation(), 0) for r in (0, 1)]
    other_job = [segment_name(f"ckptd-{job}-n0-n0-", 0, new_generation(), 0)]  # job "<job>-n0", node 0
    other_node = [segment_name(f"ckptd-{job}-n1-", 0, new_generation(), 0)]
    not_a_segment = [f"{mine}r0-crashed-s0", f"{mine}notes"]
    foreign = segment_name(mine, 2, new_generation(), 0)  # an empty file of another user
    for name in orphans + other_job + other_node:
        ShmSegment.create(name, 4096).close()
    for name in not_a_segment + [foreign]:
        (SHM_DIR / name).write_bytes(b"")
    os.chown(SHM_DIR / foreign, 65534, 65534)
    assert sorted(remove_orphans(mine)) == sorted(orphans)
    left = set(os.listdir(SHM_DIR))
    assert set(other_job + other_node + not_a_segment + [foreign]) <= left
    assert not set(orphans) & left
    # The broad cleanup of tools and tests still removes only this user's files.
    assert foreign not in unlink_segments(f"ckptd-{job}")
    assert os.path.exists(SHM_DIR / foreign)
