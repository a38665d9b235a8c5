"""The network to the object store cut in the middle of a save (namespace nodes, a real S3 server
on the host's address on the nodes' bridge, real daemons): the save aborts on every rank within
the commit timeout (the upload hung on the dead connection fails at its request timeout),
with the store's own error naming the object, nothing of it becomes visible, the step
committed before stays latest, and once the link is back the next save commits and loads
bit-exact."""

from __future__ import annotations

import pytest

from ckptd.s3catalog import scan_s3_root

COMMON_NBYTES = 48 << 20  # the commit uploads it as common.pt: the cut lands inside the save


@pytest.mark.timeout(240)
def test_the_store_cut_off_mid_save_aborts_it_and_the_next_save_commits(make_job, monkeypatch):
    job = make_job(
        1,
        per_node=2,
        s3=True,
        CKN_COMMON_NBYTES=str(COMMON_NBYTES),
        CKPTD_S3_RETRIES="3",
        CKPTD_S3_RETRY_TIMEOUT_S="5",
        CKPTD_S3_REQUEST_TIMEOUT_S="6",  # the upload hung on the cut link fails after it
        CKPTD_COMMIT_TIMEOUT_S="15",
    )
    for name, value in job.store.env().items():  # this process reads the store too
        monkeypatch.setenv(name, value)
    job.save(1)
    job.committed(1)

    job.save(2)  # save() returned: the daemon uploads the step now
    job.cluster.nodes[0].link_down()
    try:
        out = job.outcomes(2, timeout_s=60)
    finally:
        job.cluster.nodes[0].link_up()
    for r, o in enumerate(out):
        assert o["outcome"] == "aborted", f"rank {r}: step 2 {o['outcome']}: {o['reason']}"
        # the store's own error, within the commit timeout (an upload's, or the commit's when the
        # cut came after the uploads): where, and what to check
        assert f"s3://{job.root.bucket}/job" in o["reason"], o["reason"]
        assert "check the endpoint (AWS_ENDPOINT_URL), the network" in o["reason"], o["reason"]
    cat = scan_s3_root(job.root, usage=False)
    assert [e.step for e in cat.committed] == [1] and cat.latest_name == "iter_0000001"
    assert [o["latest"] for o in job.call("latest")] == [1, 1]

    job.quiet(60)
    job.save(3)
    job.committed(3)
    job.check(3)
    assert [o["latest"] for o in job.call("latest")] == [3, 3]
