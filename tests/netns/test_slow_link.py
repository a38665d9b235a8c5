"""Control messages over a slow, lossy link (netem), with 1 MiB of common state.

Node 1's link delays and drops packets both ways (``delay 50ms 20ms loss 2%``); the job saves
1 MiB of common state and 4,000 one-element shards per rank, so node 1's WRITTEN (its records) is
about 1 MiB too and crosses the slow link, while rank 0's common state travels to the coordinator
on node 0 itself (global rank 0 always sits on node 0). Every save commits on every rank within
the commit timeout and loads bit-exact; the link's retransmissions never lose or duplicate a
report.

Skipped, with tc's reason, where the kernel has no netem (``tc qdisc add ... netem``: "Specified
qdisc kind is unknown" on the CI machine).
"""

from __future__ import annotations

import pytest

from tools.harness.netns import NetnsUnavailable

from .job import NetnsJob

NETEM = "delay 50ms 20ms loss 2%"


@pytest.mark.timeout(300)
def test_slow_link_with_large_control_messages(make_job):
    job: NetnsJob = make_job(
        2,
        launch=False,
        CKPTD_COMMIT_TIMEOUT_S="60",
        CKPTD_COORDINATOR_TIMEOUT_S="30",
        CKN_COMMON_NBYTES=str(1 << 20),
        CKN_ITEMS_PER_RANK="4000",
    )
    try:
        job.cluster.nodes[1].add_netem(NETEM)
    except NetnsUnavailable as exc:
        pytest.skip(f"netem unavailable here: {exc}")
    job.launch()
    for step in (1, 2, 3):
        job.save(step)
        job.committed(step, timeout_s=90)
        job.check(step)
    coordinator = job.status(0)["coordinator"]
    assert coordinator["rejected"]["malformed"] == 0 and coordinator["rejected"]["unauthenticated"] == 0, coordinator
