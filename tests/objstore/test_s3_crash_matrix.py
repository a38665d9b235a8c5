"""The crash matrix on object storage (issue 24.3): a job saving to an s3:// root of a real
SeaweedFS server, one process SIGKILLed at a random moment (a rank, a node daemon, the
coordinator), restarted; every step reported COMMITTED still loads bit-exact, nothing partial is
visible, the restart resumes bit-exact (tools/harness/crash_trial.py). `python
tools/crash_matrix.py --s3` runs the 30-trial version."""

from __future__ import annotations

import pytest

import tools.harness.crash_trial as ct


@pytest.fixture
def ctx():
    context = ct.process_context()
    yield context
    ct.stop_process_context()


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "victim",
    [pytest.param("rank", marks=pytest.mark.slow), pytest.param("node", marks=pytest.mark.slow), "coordinator"],
)
def test_a_short_crash_matrix_on_s3(ctx, s3_bucket, tmp_path, victim):
    result = ct.run_trial(
        2000 + len(victim), ct.LoopbackHosts(ctx), ranks=2, nodes=2, victim=victim, workdir=tmp_path,
        root=f"s3://{s3_bucket}/crash-{victim}",
    )  # fmt: skip
    assert result.ok, ct.failures([result])
