"""Who is who on the wire: CurveZMQ keys from the job token, attempt ids, the coordinator's address."""

from __future__ import annotations

import socket

import psutil
import pytest
import zmq

from ckptd.config import CkptdConfig
from ckptd.control.attempt import MAX_STEP, check_attempt, check_save_step, incarnation_for
from ckptd.control.endpoints import Endpoints, JobEnv
from ckptd.control.keys import derive_keys
from ckptd.control.netaddr import coordinator_bind_host
from ckptd.errors import CkptdError, ProtocolError


def test_keys_are_derived_from_the_token_alone():
    a, b = derive_keys(b"t" * 64), derive_keys(b"t" * 64)
    assert a == b  # every node derives the same keys: nothing new to distribute
    assert len({a.server_public, a.server_secret, a.client_public, a.client_secret}) == 4
    assert all(len(k) == 40 for k in (a.server_public, a.server_secret, a.client_public, a.client_secret))
    assert zmq.curve_public(a.server_secret) == a.server_public
    assert zmq.curve_public(a.client_secret) == a.client_public
    other = derive_keys(b"u" * 64)
    assert not {other.server_public, other.client_public} & {a.server_public, a.client_public}
    assert b"secret" not in repr(a).encode() and a.server_secret.decode() not in repr(a)


def test_ranks_of_one_launch_agree_on_the_incarnation_without_talking():
    torchrun = {"TORCHELASTIC_RUN_ID": "3f1c", "TORCHELASTIC_RESTART_COUNT": "0", "MASTER_PORT": "29500"}
    rank0 = incarnation_for("", 8, {**torchrun, "RANK": "0"})
    rank7 = incarnation_for("", 8, {**torchrun, "RANK": "7", "LOCAL_RANK": "3"})
    assert rank0 == rank7 and not rank0.weak and "TORCHELASTIC_RUN_ID=3f1c" in rank0.source
    # An elastic restart, another launch, or an explicit run id: another incarnation.
    restarted = incarnation_for("", 8, {**torchrun, "TORCHELASTIC_RESTART_COUNT": "1"})
    relaunched = incarnation_for("", 8, {**torchrun, "TORCHELASTIC_RUN_ID": "9a0e"})
    explicit = incarnation_for("job-42.1", 8, torchrun)
    assert len({rank0.tag, restarted.tag, relaunched.tag, explicit.tag}) == 4
    assert "CKPTD_RUN_ID=job-42.1" in explicit.source
    slurm = incarnation_for("", 8, {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "MASTER_PORT": "1"})
    assert slurm == incarnation_for("", 8, {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "MASTER_PORT": "2"})
    # No launch id: several ranks fall back to the rendezvous address (weak); one process is unique.
    weak = incarnation_for("", 2, {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "n0", "MASTER_PORT": "1"})
    assert weak.weak and weak == incarnation_for("", 2, {"MASTER_ADDR": "n0", "MASTER_PORT": "1"})
    assert incarnation_for("", 1, {}) != incarnation_for("", 1, {})
    attempt = rank0.attempt(2)
    check_attempt(attempt)
    assert attempt == f"{rank0.tag}-2" and len(rank0.tag) == 12


def test_steps_are_bounded_at_save():
    check_save_step(0)
    check_save_step(MAX_STEP)
    for bad in (-1, MAX_STEP + 1, 2**64 - 1, 1.0, True, "3"):
        with pytest.raises(CkptdError, match="step must be an int in 0..999999999"):
            check_save_step(bad)
    for bad in ("", "0123456789AB-1", "0123456789ab-", "0123456789ab-1/..", "x" * 100):
        with pytest.raises(ProtocolError, match="attempt id"):
            check_attempt(bad)


def _local_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def test_the_coordinator_binds_the_interface_that_reaches_master_addr(tmp_path):
    cfg = CkptdConfig.from_env({}, runtime_dir=str(tmp_path))
    two_nodes = {"rank": 0, "local_rank": 0, "world_size": 4, "local_world_size": 2, "node": 0, "master_port": 29500}
    assert coordinator_bind_host("anything", 1) == "127.0.0.1"  # single node: loopback only
    single = Endpoints.for_job(tmp_path, JobEnv(master_addr="10.1.2.3"), cfg)
    assert single.coordinator_bind.startswith("tcp://127.0.0.1:")
    loop = Endpoints.for_job(tmp_path, JobEnv(master_addr="127.0.0.1", **two_nodes), cfg)
    assert loop.coordinator_bind == "tcp://127.0.0.1:29501"
    local = _local_ipv4()
    if local is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    ep = Endpoints.for_job(tmp_path, JobEnv(master_addr=local, **two_nodes), cfg)
    assert (ep.coordinator_bind, ep.coordinator_connect) == (f"tcp://{local}:29501", f"tcp://{local}:29501")
    # A MASTER_ADDR elsewhere (node 0 reaches it through its default route): that route's source.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("203.0.113.7", 9))
        except OSError:
            return  # no default route here
        expected = probe.getsockname()[0]
    assert coordinator_bind_host("203.0.113.7", 2) == expected != "0.0.0.0"
    with pytest.raises(CkptdError, match="cannot resolve the coordinator host"):
        coordinator_bind_host("no-such-host.invalid", 2)


def test_only_node_0_looks_for_a_route_to_the_coordinator(tmp_path):
    """Node 0 binds the coordinator's port on the address of its route to MASTER_ADDR; the other
    nodes only connect, so a host they cannot resolve or reach yet does not stop their start."""
    cfg = CkptdConfig.from_env({}, runtime_dir=str(tmp_path))
    two_nodes = {"world_size": 4, "local_world_size": 2, "master_port": 29500, "master_addr": "no-such-host.invalid"}
    node1 = Endpoints.for_job(tmp_path, JobEnv(rank=2, local_rank=0, node=1, **two_nodes), cfg)
    assert node1.coordinator_connect == "tcp://no-such-host.invalid:29501"
    with pytest.raises(CkptdError, match="cannot resolve the coordinator host"):
        Endpoints.for_job(tmp_path, JobEnv(rank=0, local_rank=0, node=0, **two_nodes), cfg)


def test_a_rank_tells_its_node_daemon_where_its_launch_has_the_coordinator(tmp_path):
    """HELLO's coordinator address (a node daemon of an earlier launch follows it: ckptd.daemon.node):
    node 0's daemon binds it, another node's connects to it, and one node names none (any port)."""
    cfg = CkptdConfig.from_env({}, runtime_dir=str(tmp_path))
    two_nodes = {"world_size": 4, "local_world_size": 2, "master_port": 29500, "master_addr": "127.0.0.1"}
    node0 = Endpoints.for_job(tmp_path, JobEnv(rank=0, local_rank=0, node=0, **two_nodes), cfg)
    node1 = Endpoints.for_job(tmp_path, JobEnv(rank=2, local_rank=0, node=1, **two_nodes), cfg)
    assert node0.launch_coordinator == node0.coordinator_bind == "tcp://127.0.0.1:29501"
    assert node1.launch_coordinator == node1.coordinator_connect == "tcp://127.0.0.1:29501"
    assert Endpoints.for_job(tmp_path, JobEnv(master_addr="127.0.0.1"), cfg).launch_coordinator == ""
    pinned = Endpoints.for_job(tmp_path, JobEnv(), cfg.replace(coordinator_port=29999))
    assert pinned.launch_coordinator == "tcp://127.0.0.1:29999"


def test_ranks_agree_on_a_random_incarnation_through_the_launch_store():
    """Issue 26.4: whatever the launcher sets, two launches get different incarnations and the
    ranks of one launch the same, agreed through the launch's store (a real TCPStore)."""
    from datetime import timedelta

    import torch.distributed as dist

    from ckptd.client.incarnation import LaunchRound, agreed_incarnation

    def launch() -> list[str]:
        server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
        clients = [dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=10)) for _ in range(3)]
        world = LaunchRound(world_size=3)
        first = [agreed_incarnation(c, "job1", r, world).tag for r, c in enumerate(clients)]
        # A second Checkpointer of the job in the same launch: a new agreement, not the first's.
        second = [agreed_incarnation(c, "job1", r, world).tag for r, c in enumerate(clients)]
        assert len(set(first)) == 1 and len(set(second)) == 1 and first != second
        return first

    assert launch()[0] != launch()[0]


def test_a_store_that_fails_one_rank_is_an_error_never_an_incarnation_of_its_own():
    """Before, that rank fell back to an incarnation of its own: its attempt ids matched no other
    rank's, and every save of the launch aborted after commit_timeout_s."""
    from datetime import timedelta

    import torch.distributed as dist

    from ckptd.client.incarnation import LaunchRound, agreed_incarnation

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=10))
    world = LaunchRound(world_size=2)
    client.set("ckptd/job1/world2/incarnation/1", "not twelve hex digits")
    with pytest.raises(CkptdError, match="not 12 hex digits.*Set CKPTD_RUN_ID"):
        agreed_incarnation(client, "job1", 0, world)
    del server  # the store goes: the next agreement fails
    with pytest.raises(CkptdError, match="rank 0 could not agree.*Set CKPTD_RUN_ID"):
        agreed_incarnation(client, "job1", 0, world)


def _torchrun_rank(rank: int, world_size: int, per_node: int) -> JobEnv:
    return JobEnv(
        rank=rank, local_rank=rank % per_node, world_size=world_size, local_world_size=per_node, node=rank // per_node
    )


def test_the_round_is_told_by_the_world_size_and_a_lone_torchruns_restart_count():
    """torchrun's agent store outlives its rounds of workers: ranks agree per round. A one-node
    torchrun raises its restart count every round; several nodes' agents count each their own (a
    membership change raises none, a failure only the failed node's), so there the count would
    split the ranks of one round, and only the world size tells rounds apart (README, Launch)."""
    from ckptd.client.incarnation import LaunchRound

    one_node = [LaunchRound.of(_torchrun_rank(r, 2, 2), {"TORCHELASTIC_RESTART_COUNT": "1"}) for r in range(2)]
    assert one_node[0] == one_node[1] == LaunchRound(world_size=2, restart_count="1")
    assert one_node[0].key != LaunchRound.of(_torchrun_rank(0, 2, 2), {"TORCHELASTIC_RESTART_COUNT": "0"}).key
    assert str(one_node[0]) == "world size 2, torchrun restart 1"
    # Two nodes whose agents counted differently: one round all the same.
    nodes = [LaunchRound.of(_torchrun_rank(r, 4, 2), {"TORCHELASTIC_RESTART_COUNT": str(r // 2)}) for r in range(4)]
    assert len(set(nodes)) == 1 and nodes[0] == LaunchRound(world_size=4) and str(nodes[0]) == "world size 4"
    assert LaunchRound.of(_torchrun_rank(0, 6, 2), {}).key != nodes[0].key  # a node joined
    assert LaunchRound.of(_torchrun_rank(0, 2, 2), {}).key == "world2"  # no torchrun: the world size


def test_a_rank_behind_the_others_in_counting_agrees_with_its_own_round():
    """Keyed by the job alone, a rank that died in round 0 before its first save (or a rank new to
    the job) counted one Checkpointer behind the others in round 1 and read round 0's tag: its
    attempts were the dead round's (a real TCPStore, the ranks' calls in the order that did it)."""
    from datetime import timedelta

    import torch.distributed as dist

    from ckptd.client.incarnation import LaunchRound, agreed_incarnation

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    store = dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=10))
    round0, round1 = (LaunchRound(world_size=2, restart_count=str(n)) for n in (0, 1))
    dead = agreed_incarnation(store, "job1", 0, round0).tag  # rank 1 died before its first save
    late = agreed_incarnation(store, "job1", 1, round1).tag  # round 1: rank 1 first, rank 0 after
    assert agreed_incarnation(store, "job1", 0, round1).tag == late != dead
    # A node joins (no agent counts a restart): the new rank and the old ones agree afresh.
    grown = LaunchRound(world_size=3)
    tags = {agreed_incarnation(store, "job1", r, grown).tag for r in (2, 0, 1)}
    assert len(tags) == 1 and not tags & {dead, late}
