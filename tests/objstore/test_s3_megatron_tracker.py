"""Megatron-LM's tracker (``latest_checkpointed_iteration.txt``) on an ``s3://`` root against a real
server (SeaweedFS): retention and ``ckptd gc`` keep the checkpoint it names, as on a directory root,
when it lags ``latest`` (its update failed at a commit, or a crash came before it)."""

from __future__ import annotations

import pytest

from ckptd import commands
from ckptd.format.rootlayout import MEGATRON_TRACKER, TRACKER_MAX_NBYTES
from ckptd.roots.s3_root import S3Root
from ckptd.s3catalog import scan_s3_root
from ckptd.storage.s3client import S3Client
from ckptd.storage.url import S3Location, parse_location
from tests.objstore.commits import commit_one_rank


def _steps(client: S3Client) -> list[str]:
    return sorted({i.key.split("/", 1)[0] for i in client.list_objects("") if i.key.startswith("iter_")})


@pytest.mark.timeout(120)
def test_retention_and_gc_keep_the_step_megatron_lms_tracker_names(s3_bucket, single_process, capsys):
    """A commit whose Megatron-LM tracker update failed (``megatron_tracker=False`` leaves it as the
    failed PUT does, naming the step before) removed, by its own retention, the step that tracker
    still names: Megatron-LM's resume then found no checkpoint. The scan never read that tracker."""
    loc = parse_location(f"s3://{s3_bucket}/run")
    assert isinstance(loc, S3Location)
    client = S3Client(loc)
    for step in (1, 2):
        commit_one_rank(S3Root(loc), step, f"0123456789ab-{step}")
    assert client.get(MEGATRON_TRACKER, TRACKER_MAX_NBYTES)[0] == b"2\n"
    lagging = S3Root(loc, megatron_tracker=False)
    commit_one_rank(lagging, 3, "0123456789ab-3")
    assert scan_s3_root(loc, client, usage=False).megatron_latest_name == "iter_0000002"

    capsys.readouterr()
    assert commands.main(["gc", loc.url(), "--keep", "1", "--grace-s", "0"]) == 0
    out = capsys.readouterr().out
    assert "removed iter_0000001" in out and "kept iter_0000002: named by Megatron-LM's tracker" in out, out
    assert _steps(client) == ["iter_0000002", "iter_0000003"]

    commit_one_rank(S3Root(loc, keep_last=1, megatron_tracker=False), 4, "0123456789ab-4")  # its retention
    assert _steps(client) == ["iter_0000002", "iter_0000004"]

    # Read as on a directory root (one parser): what is not a step number protects nothing, and
    # an oversized object is not read whole; neither fails the scan.
    for raw in (b"iter_0000002\n", b"2" * (TRACKER_MAX_NBYTES + 1)):
        client.put(MEGATRON_TRACKER, raw)
        assert scan_s3_root(loc, client, usage=False).megatron_latest_name is None
    client.put(MEGATRON_TRACKER, b"release\n")
    assert scan_s3_root(loc, client, usage=False).megatron_latest_name == "release"
