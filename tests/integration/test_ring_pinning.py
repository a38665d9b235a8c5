"""The Checkpointer pins its staging ring in the background, never inside ``save()``
(ckptd.staging.pinning), with a real daemon, real ``/dev/shm`` and real threads.

The registrar is :class:`tests.unit.test_pinning.CountingRegistrar`: the real ``cudaHostRegister``
cannot run without a GPU, and the registrar is the one seam every CUDA pinning call goes through,
so it is the one stand-in here (tests/integration/test_cuda_staging.py uses the real one on a GPU).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.client import rankring as rankring_mod
from tests.unit.test_pinning import CountingRegistrar


def _state(n: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((n,), float(i)) for i in range(4)}


def _sharded(state: dict[str, torch.Tensor]) -> dict:
    return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}


def _config(runtime_dir: Path, **kw) -> ckptd.CkptdConfig:
    return ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=2.0, heartbeat_s=0.2, **kw)


def _sent_messages(ckpt: ckptd.Checkpointer, monkeypatch) -> list:
    """The requests ``ckpt`` sends its daemon from now on, in order (each still sent)."""
    sent: list = []
    request = ckpt._link.request
    monkeypatch.setattr(ckpt._link, "request", lambda msg, *a, **kw: sent.append(msg) or request(msg, *a, **kw))
    return sent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("snapshot", ["auto", "copy", "lazy"])
def test_save_never_registers_ring_memory_inside_the_stall(
    tmp_path, single_process, monkeypatch, snapshot, runtime_dir
):
    """Every cudaHostRegister runs on the pinner thread, none on the thread calling save(), and
    none while save() runs once the ring is pinned (``prepare()``); close() releases them all. The
    code before this (StagingPool._pin) registered the whole ring inside the first save(), on the
    training thread."""
    reg = CountingRegistrar()
    monkeypatch.setattr(rankring_mod, "cuda_registrar", lambda device=None: reg)
    state = _state(300_000)  # 4.6 MiB: the default 1.25x ring is 5.7 MiB, 23 chunks of 256 KiB
    monkeypatch.setattr("ckptd.staging.rankside.CHUNK_NBYTES", 256 << 10)
    me = threading.get_ident()
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir, snapshot=snapshot)) as ckpt:
        ckpt.prepare(_sharded(state))
        ring = ckpt._ring.current
        assert ring is not None and ring.pinner is not None
        assert ring.pinner.wait(ring.capacity - 1, timeout_s=30)
        before = len(reg.calls)
        for step in (1, 2):
            h = ckpt.save(_sharded(state), step=step)
            assert len(reg.calls) == before  # nothing registered (or released) inside save()
            ckpt.before_update()
            h.wait(timeout_s=60)
        assert reg.registered_nbytes() == ring.capacity and reg.registered_nbytes(thread=me) == 0
    assert reg.live == {}  # close() unregistered every chunk


@pytest.mark.timeout(120)
def test_the_first_save_starts_pinning_in_the_background_without_waiting_for_it(
    tmp_path, single_process, monkeypatch, runtime_dir
):
    """Without prepare(), the ring is created by the first save and pinned behind it: that save
    (CPU tensors here, which need no pinned chunk) returns while the pinner still works."""
    gate = threading.Event()
    reg = CountingRegistrar(gate=gate)
    monkeypatch.setattr(rankring_mod, "cuda_registrar", lambda device=None: reg)
    state = _state(100_000)
    try:
        with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir, snapshot="copy")) as ckpt:
            h = ckpt.save(_sharded(state), step=1)
            assert reg.registered() == [] and not ckpt._ring.current.pinned  # the pinner waits at the gate
            gate.set()
            h.wait(timeout_s=60)
            assert ckpt._ring.current.pinner.wait(ckpt._ring.current.capacity - 1, timeout_s=30)
            assert reg.registered_nbytes(thread=threading.get_ident()) == 0
    finally:
        gate.set()
    assert reg.live == {}


@pytest.mark.timeout(120)
def test_a_byte_budget_creates_and_pins_the_ring_before_the_first_save(
    tmp_path, single_process, monkeypatch, runtime_dir
):
    reg = CountingRegistrar()
    monkeypatch.setattr(rankring_mod, "cuda_registrar", lambda device=None: reg)
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir, staging_budget="4MiB")) as ckpt:
        ring = ckpt._ring.current
        assert ring is not None and ring.capacity == 4 << 20 and ring.pinner is not None
        assert ring.pinner.wait(ring.capacity - 1, timeout_s=30)
        h = ckpt.save(_sharded(_state(1000)), step=1)
        h.wait(timeout_s=60)
        assert ckpt._ring.current is ring and reg.registered_nbytes() == 4 << 20
    assert reg.live == {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wait", [True, False])
def test_prepare_returns_once_the_ring_is_pinned_unless_told_not_to_wait(
    tmp_path, single_process, monkeypatch, runtime_dir, wait
):
    """prepare() returns with the ring pinned, so the first save is a steady one (on an H200, a
    first save made while chunks were still registered stalled 0.097 s against 0.007 s after);
    ``wait=False`` returns while the pinner works."""
    gate = threading.Event()
    reg = CountingRegistrar(gate=gate)
    monkeypatch.setattr(rankring_mod, "cuda_registrar", lambda device=None: reg)
    monkeypatch.setattr("ckptd.staging.rankside.CHUNK_NBYTES", 256 << 10)
    state = _sharded(_state(100_000))
    try:
        with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir)) as ckpt:
            done = threading.Event()
            raised: list[BaseException] = []

            def prepare() -> None:
                try:
                    ckpt.prepare(state, wait=wait)
                except Exception as exc:  # noqa: BLE001 - re-raised on the test's thread below
                    raised.append(exc)
                done.set()

            worker = threading.Thread(target=prepare)
            worker.start()
            if wait:
                assert not done.wait(0.5)  # held by the first chunk's registration
                gate.set()
            assert done.wait(30)
            worker.join(30)
            if raised:
                raise raised[0]
            ring = ckpt._ring.current
            assert ring is not None and ring.pinned == wait
            gate.set()
            ckpt.save(state, step=1).wait(timeout_s=60)
    finally:
        gate.set()
    assert reg.live == {}


@pytest.mark.timeout(120)
def test_prepare_returns_at_once_when_the_pinning_fails(tmp_path, single_process, monkeypatch, runtime_dir):
    """A registration refused halfway (the driver out of pinnable memory): prepare() returns, the
    chunks pinned so far stay in use, and saves copy the rest without them."""
    reg = CountingRegistrar(fail_at=2)
    monkeypatch.setattr(rankring_mod, "cuda_registrar", lambda device=None: reg)
    monkeypatch.setattr("ckptd.staging.rankside.CHUNK_NBYTES", 256 << 10)
    state = _state(100_000)
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir)) as ckpt:
        ckpt.prepare(_sharded(state))
        ring = ckpt._ring.current
        assert ring is not None and ring.pinner is not None and not ring.pinned
        assert "CUDA error 2" in ring.pinner.error and len(reg.registered()) == 2
        ckpt.save(_sharded(state), step=1).wait(timeout_s=60)
        out = ckpt.load(_sharded({k: torch.zeros_like(v) for k, v in state.items()}), step=1)
        assert all(torch.equal(out[k], v) for k, v in state.items())
    assert reg.live == {}


@pytest.mark.timeout(60)
def test_no_pinning_without_cuda_in_use(tmp_path, single_process, runtime_dir):
    """A process that never used CUDA pins nothing (and creates no CUDA context to do it)."""
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir)) as ckpt:
        ckpt.prepare(_sharded(_state(1000)))
        assert ckpt._ring.current is not None and ckpt._ring.current.pinner is None


@pytest.mark.timeout(120)
def test_prepare_plans_the_first_save(tmp_path, single_process, monkeypatch, runtime_dir):
    """prepare() remembers its plan and registers its item list with the daemon: a first save of
    the same structure is not taken apart again (ckptd.format.repeat), sends only the layout's id
    (ckptd.client.layout) and commits the values it was given."""
    from ckptd.client import saveplanner

    splits = []
    full = saveplanner.split_state_dict
    monkeypatch.setattr(saveplanner, "split_state_dict", lambda sd: splits.append(1) or full(sd))
    state = {"model": {"w": torch.randn(1000), "b": torch.randn(10)}, "step": 3}
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir)) as ckpt:
        sent = _sent_messages(ckpt, monkeypatch)
        ckpt.prepare(state)
        assert [type(m).__name__ for m in sent] == ["RegisterRing", "RegisterLayout"]
        registered = sent[1].layout
        assert len(sent[1].items) == 3  # w, b, step
        state["model"]["w"].add_(1.0)
        state["step"] = 4
        ckpt.save(state, step=1).wait(timeout_s=60)
        assert len(splits) == 1  # prepare()'s
        assert type(sent[2]).__name__ == "Save" and sent[2].items == [] and sent[2].layout == registered
        want = {"model": {"w": torch.zeros(1000), "b": torch.zeros(10)}, "step": 0}
        ckpt.load(want, step=1)
    assert torch.equal(want["model"]["w"], state["model"]["w"]) and want["step"] == 4


@pytest.mark.timeout(120)
def test_prepare_registers_no_layout_for_items_larger_than_the_ring(tmp_path, single_process, monkeypatch, runtime_dir):
    """An item larger than the ring is split by each save, so prepare() registers no item list:
    the first save sends its pieces in full and commits."""
    state = {"w": torch.randn(300_000), "b": torch.randn(10)}  # w: 1.2 MB, the ring a quarter of the state
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir, staging_budget="0.25x")) as ckpt:
        sent = _sent_messages(ckpt, monkeypatch)
        ckpt.prepare(state)
        assert [type(m).__name__ for m in sent] == ["RegisterRing"]
        ckpt.save(state, step=1).wait(timeout_s=60)
        assert type(sent[1]).__name__ == "Save" and len(sent[1].items) > 2  # w's pieces, b
        want = {"w": torch.zeros(300_000), "b": torch.zeros(10)}
        ckpt.load(want, step=1)
    assert all(torch.equal(want[k], state[k]) for k in state)
