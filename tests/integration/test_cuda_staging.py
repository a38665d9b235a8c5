"""The CUDA staging path: a ring pinned in the background, device-to-host copies on a side stream,
lazy snapshots fenced by the stream order, real models and optimizers on a GPU.

Runs only where CUDA is available (skipped on CI's CPU machines; on a GPU machine
``tools/gpu_check.sh`` runs it with the train benchmark). Timings are never asserted (the
project's rule): the first-save test checks the mechanism (no registration inside save(), every
copy a DMA into a pinned chunk), and ``ckptd bench train`` reports the stalls against targets.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.client import rankring as rankring_mod
from ckptd.staging.pinning import CudaRegistrar
from tools.harness.ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.timeout(180)
def test_cuda_shards_stage_pinned_and_commit_bit_exact(tmp_path, single_process, runtime_dir):
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=2.0, heartbeat_s=0.2)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {f"w{i}": torch.randn(1 << 20, device="cuda", generator=gen) for i in range(8)}
    tensors["half"] = torch.randn(333, 77, device="cuda", generator=gen).to(torch.bfloat16)
    refs = {}
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        for step in (1, 2, 3):
            for t in tensors.values():
                t.add_(1)  # queued on the current stream: the save must copy after it
            refs[step] = {k: v.cpu() for k, v in tensors.items()}
            h = ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, step=step)
            for t in tensors.values():
                t.fill_(float("nan"))  # training overwrites on the GPU right after save() returned
            assert ckpt._ring.current is not None and ckpt._ring.current.pinner is not None  # pinned in the background
            h.wait(timeout_s=60)
            for k, v in refs[step].items():
                tensors[k].copy_(v)
        ring = ckpt._ring.current
        assert ring.pinner.wait(ring.capacity - 1, timeout_s=60) and ring.pinned
        assert ring.dma_pieces > 0 and ring.pageable_pieces == 0  # every copy by DMA
        for step in (1, 3):
            want = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in tensors.items()}
            out = ckpt.load(want, step=step)
            for k, ref in refs[step].items():
                assert out[k].is_cuda and torch.equal(out[k].cpu(), ref), (step, k)


@pytest.mark.timeout(180)
def test_cuda_lazy_snapshots_are_fenced_by_the_stream_order(tmp_path, single_process, runtime_dir):
    """snapshot="lazy": save() only enqueues the device-to-host copies; before_update() orders the
    next kernels after them (no host wait), so overwriting right after the fence is safe; a write
    before the fence fails the save."""
    cfg = ckptd.CkptdConfig.from_env(
        {}, runtime_dir=str(runtime_dir), idle_exit_s=2.0, heartbeat_s=0.2, snapshot="lazy"
    )
    gen = torch.Generator(device="cuda").manual_seed(1)
    tensors = {f"w{i}": torch.randn(4 << 20, device="cuda", generator=gen) for i in range(4)}
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        ref = {k: v.cpu() for k, v in tensors.items()}
        h = ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, step=1)
        ckpt.before_update()
        for t in tensors.values():
            t.fill_(float("nan"))  # ordered after the copies on the GPU
        h.wait(timeout_s=60)
        out = ckpt.load(
            {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in tensors.items()}, step=1
        )
        assert all(torch.equal(out[k].cpu(), ref[k]) for k in ref)
        h = ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, step=2)
        tensors["w0"].add_(1)  # before the fence: this save must fail, never commit torn values
        ckpt.before_update()
        with pytest.raises(ckptd.SaveFailedError, match="abandoned its snapshot of this save"):
            h.wait(timeout_s=60)


def _config(runtime_dir: str | Path, **kw) -> ckptd.CkptdConfig:
    return ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=2.0, heartbeat_s=0.2, **kw)


def _sharded(tensors: dict[str, torch.Tensor]) -> dict:
    return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}


class RecordingRegistrar(CudaRegistrar):
    """The real registrar (cudaHostRegister), recording on which thread each call ran."""

    def __init__(self, device: int) -> None:
        super().__init__(device)
        self.threads: list[int] = []

    def register(self, address: int, nbytes: int) -> None:
        self.threads.append(threading.get_ident())
        super().register(address, nbytes)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("snapshot", ["auto", "lazy"])
@pytest.mark.parametrize("prepared,on_device", [(True, True), (False, True), (False, False)])
def test_the_first_save_registers_nothing_and_copies_only_by_dma(
    tmp_path, single_process, monkeypatch, snapshot, prepared, on_device, runtime_dir
):
    """Issue 23.1 on a GPU: every cudaHostRegister runs on the pinner thread, none inside save();
    the first save's copies are all DMA into pinned chunks (a chunk not pinned yet is waited for,
    never copied into as pageable memory); the values are exact although training overwrites them
    right after save(). prepare() pins before the first save; without it the first save is a
    device snapshot (ckptd.staging.devsnap: a device copy in save(), the DMA into the ring from a
    thread as the ring is pinned), or with device_snapshot_fraction=0 waits for its own chunks
    (ckptd bench train reports the stalls). Many tensors of mixed sizes, as a model's state dict."""
    reg = RecordingRegistrar(torch.cuda.current_device())
    monkeypatch.setattr(rankring_mod, "cuda_registrar", lambda device=None: reg)
    gen = torch.Generator(device="cuda").manual_seed(3)
    sizes = [1 << 24, 3 << 20, 1000, 1, 4096, 1 << 22] * 20  # 120 tensors, 1.6 GiB of float32
    tensors = {f"t{i}": torch.randn(n, device="cuda", generator=gen) for i, n in enumerate(sizes)}
    cfg = _config(runtime_dir, snapshot=snapshot, device_snapshot_fraction=0.25 if on_device else 0.0)
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        if prepared:
            ckpt.prepare(_sharded(tensors))
            assert ckpt._ring.current.pinner.wait(ckpt._ring.current.capacity - 1, timeout_s=120)
        ref = {k: v.cpu() for k, v in tensors.items()}
        h = ckpt.save(_sharded(tensors), step=1)
        assert threading.get_ident() not in reg.threads  # nothing registered on this thread
        assert len(ckpt._ring.device_snapshots) == (1 if on_device and not prepared else 0)
        ckpt.before_update()
        for t in tensors.values():
            t.fill_(float("nan"))  # training overwrites right after (default) / after the fence (lazy)
        h.wait(timeout_s=120)
        ring = ckpt._ring.current
        assert ring.pageable_pieces == 0 and ring.dma_pieces > 0
        assert ring.dma_pieces < len(sizes)  # small tensors were gathered into shared copies
        out = ckpt.load(_sharded({k: torch.zeros_like(v) for k, v in tensors.items()}), step=1)
        assert all(torch.equal(out[k].cpu(), ref[k]) for k in ref)
        print(f"first save ({snapshot}, prepared={prepared}): stall {h.stall_s:.3f} s")
    assert threading.get_ident() not in reg.threads


class SlowRegistrar(CudaRegistrar):
    """The real registrar, slowed down: the ring is still being pinned for several saves."""

    def register(self, address: int, nbytes: int) -> None:
        time.sleep(0.3)
        super().register(address, nbytes)


@pytest.mark.timeout(300)
def test_saves_while_the_ring_is_pinned_are_device_snapshots_of_their_own_moment(
    tmp_path, single_process, monkeypatch, runtime_dir
):
    """Three saves in a row while the ring is still being pinned, the tensors overwritten by
    kernels right after each save(): each is a device snapshot (ckptd.staging.devsnap), written
    into the ring by its thread once the chunks are pinned, and each committed checkpoint holds
    exactly the values of its save(), never a later step's (the stream order protects them, not
    a host synchronisation)."""
    monkeypatch.setattr(rankring_mod, "cuda_registrar", lambda device=None: SlowRegistrar(torch.cuda.current_device()))
    gen = torch.Generator(device="cuda").manual_seed(5)
    tensors = {f"t{i}": torch.randn(n, device="cuda", generator=gen) for i, n in enumerate([1 << 22, 999, 1 << 20] * 8)}
    expected = {}
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir, staging_budget="3.5x")) as ckpt:
        handles = []
        for step in (1, 2, 3):
            expected[step] = {k: v.cpu() for k, v in tensors.items()}
            handles.append(ckpt.save(_sharded(tensors), step=step))
            for t in tensors.values():
                t.mul_(1.5).add_(1.0)  # queued right behind save(), no host wait in between
        assert len(ckpt._ring.device_snapshots) >= 2  # the pinning (0.3 s a chunk) outlasted them
        for h in handles:
            h.wait(timeout_s=120)
        assert ckpt._ring.current.pageable_pieces == 0
        # a finished snapshot keeps neither its device copies nor the save's own tensors
        assert all(p.join(10) and not p.items and not p.claim.items for p in ckpt._ring.device_snapshots)
        for step in (1, 2, 3):
            out = ckpt.load(_sharded({k: torch.zeros_like(v) for k, v in tensors.items()}), step=step)
            assert all(torch.equal(out[k].cpu(), expected[step][k]) for k in tensors), step


@pytest.mark.timeout(180)
def test_a_device_snapshot_whose_save_went_unanswered_is_still_sealed(
    tmp_path, single_process, monkeypatch, runtime_dir
):
    """The SAVE of a device snapshot got no answer (the daemon took it): the snapshot is written
    and sealed anyway, so the daemon never waits snapshot_timeout_s for it and the next save
    commits at once (ckptd.staging.devsnap.DeviceSnapshotProducer.detach)."""
    from ckptd.errors import DaemonError

    monkeypatch.setattr(rankring_mod, "cuda_registrar", lambda device=None: SlowRegistrar(torch.cuda.current_device()))
    tensors = {f"t{i}": torch.full((1 << 20,), float(i), device="cuda") for i in range(4)}
    cfg = _config(runtime_dir, staging_budget="3.5x", snapshot_timeout_s=300.0)
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        announce = ckpt._link.announce

        def answer_lost(msg):
            announce(msg)
            raise DaemonError("no answer within request_timeout_s (simulated)")

        ckpt._link.announce = answer_lost
        with pytest.raises(DaemonError, match="simulated"):
            ckpt.save(_sharded(tensors), step=1)
        ckpt._link.announce = announce
        assert len(ckpt._ring.device_snapshots) == 1 and ckpt._ring.device_snapshots[0].join(60)
        ckpt.save(_sharded(tensors), step=2).wait(timeout_s=60)
        assert ckpt.latest() == 2


@pytest.mark.timeout(180)
def test_without_pinning_cuda_tensors_are_copied_through_pageable_memory_explicitly(
    tmp_path, single_process, runtime_dir
):
    """pin_memory=False: no DMA into the (unregistered) ring; an explicit device-to-host copy."""
    tensors = {f"w{i}": torch.full((1 << 20,), float(i), device="cuda") for i in range(4)}
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir, pin_memory=False)) as ckpt:
        ckpt.save(_sharded(tensors), step=1).wait(timeout_s=60)
        ring = ckpt._ring.current
        assert ring.pinner is None and ring.dma_pieces == 0 and ring.pageable_pieces > 0
        out = ckpt.load(_sharded({k: torch.zeros_like(v) for k, v in tensors.items()}), step=1)
        assert all(torch.equal(out[k], v) for k, v in tensors.items())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("snapshot", ["auto", "lazy"])
def test_a_cuda_tensor_larger_than_the_ring_streams_through_it_by_dma(tmp_path, single_process, runtime_dir, snapshot):
    """A 4 MiB ring and a 16 MiB CUDA tensor (plus a strided one): the tensor is saved in pieces of
    the device tensor, each copied by DMA into a pinned chunk, never one pageable copy of the
    whole tensor inside save(); the training's writes after save() are not in the checkpoint."""
    big = torch.arange(1 << 22, dtype=torch.float32, device="cuda")
    strided = torch.arange(1 << 22, dtype=torch.float32, device="cuda").reshape(1024, 4096).t()
    cfg = _config(runtime_dir, staging_budget="4MiB", snapshot=snapshot)
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        ring = ckpt._ring.current
        assert ring is not None and ring.pinner is not None
        assert ring.pinner.wait(ring.capacity - 1, timeout_s=60)
        refs = {"big": big.cpu(), "strided": strided.cpu()}
        h = ckpt.save(_sharded({"big": big, "strided": strided}), step=1)
        ckpt.before_update()
        big.fill_(float("nan"))
        strided.fill_(float("nan"))
        h.wait(timeout_s=120)
        assert ring.pageable_pieces == 0 and ring.dma_pieces >= 8
        out = ckpt.load(_sharded({k: torch.zeros_like(v, device="cuda") for k, v in refs.items()}), step=1)
        assert all(torch.equal(out[k].cpu(), v) for k, v in refs.items())


@pytest.mark.timeout(300)
def test_lazy_fence_under_fused_adamw_kernels(tmp_path, single_process, runtime_dir):
    """A model trained on the GPU with fused AdamW (its kernels bump no version counter): with the
    optimizer attached, every save is a lazy snapshot whose copies the optimizer's kernels are
    ordered after, so each committed checkpoint holds exactly the state of its save()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(64, 512, device="cuda")
    expected, handles = {}, []
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir)) as ckpt:
        ckpt.attach(opt)
        for step in range(1, 9):
            model(x).square().mean().backward()
            opt.step()  # the pre-hook fences the previous save: these kernels run after its copies
            opt.zero_grad()
            state = {f"p{i}": p.detach() for i, p in enumerate(model.parameters())}
            for i, p in enumerate(model.parameters()):
                for name, v in opt.state[p].items():
                    if isinstance(v, torch.Tensor) and v.is_cuda:
                        state[f"s{i}.{name}"] = v
            expected[step] = {k: v.to("cpu", copy=True) for k, v in state.items()}
            assert ckpt._ring.saves_lazily()
            handles.append(ckpt.save(_sharded(state), step=step))
        for h in handles:
            h.wait(timeout_s=120)
        for step in (1, 5, 8):
            want = _sharded({k: torch.zeros(v.shape, dtype=v.dtype, device="cuda") for k, v in expected[step].items()})
            out = ckpt.load(want, step=step)
            assert all(torch.equal(out[k].cpu(), v) for k, v in expected[step].items()), step


def _two_ranks_one_gpu(rank: int, world: int, root: str, runtime: str) -> bool:
    torch.cuda.set_device(0)
    full = torch.arange(world * (1 << 20), dtype=torch.float32, device="cuda").reshape(world, -1) + 0.5
    local = full[rank].clone()
    moment = torch.full((1 << 18,), float(rank), device="cuda", dtype=torch.bfloat16)
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world)),
        f"m{rank}": ShardedTensor.from_rank_offsets(f"m{rank}", moment),
    }
    with ckptd.Checkpointer(root, config=_config(runtime)) as ckpt:
        ckpt.prepare(sd)
        h = ckpt.save(sd, step=1)
        local.fill_(float("nan"))
        h.wait(timeout_s=120)
        assert ckpt._ring.current.pageable_pieces == 0
        want = {
            "w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(local), (0, rank, world)),
            f"m{rank}": ShardedTensor.from_rank_offsets(f"m{rank}", torch.zeros_like(moment)),
        }
        out = ckpt.load(want, step=1)
    return bool(torch.equal(out["w"], full[rank]) and torch.equal(out[f"m{rank}"], moment))


@pytest.mark.timeout(300)
def test_two_ranks_sharing_one_gpu(tmp_path, runtime_dir):
    assert run_ranks(_two_ranks_one_gpu, 2, str(tmp_path / "run"), str(runtime_dir), timeout_s=240) == [True, True]


def _dtensor_on_cuda_mesh(rank: int, world: int, root: str, runtime: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (world,))
    gen = torch.Generator(device="cuda").manual_seed(rank)
    local = torch.randn(256, 64, device="cuda", generator=gen)
    sd = {"model": {"w": DTensor.from_local(local, mesh, [Shard(0)])}, "step": 5}
    with ckptd.Checkpointer(root, config=_config(runtime)) as ckpt:
        ckpt.save(sd, step=5).wait(timeout_s=120)
        want = {"model": {"w": DTensor.from_local(torch.zeros_like(local), mesh, [Shard(0)])}, "step": 0}
        ckpt.load(want, step=5)
    got = want["model"]["w"]
    return bool(got.to_local().is_cuda and torch.equal(got.to_local(), local))


@pytest.mark.timeout(300)
def test_dtensor_state_dict_on_a_cuda_mesh(tmp_path, runtime_dir):
    assert run_ranks(_dtensor_on_cuda_mesh, 1, str(tmp_path / "run"), str(runtime_dir), timeout_s=240) == [True]


def _submesh_round_trip(rank: int, root: str, runtime: str, device: str) -> list[str]:
    """DDP + TP: DTensors on the "tp" submesh of a (dp=2, tp=1) mesh, so both ranks hold each
    chunk whole; saved by ckptd.save (which compares the copies' CRC-32Cs, copying each replicated
    chunk to the host) and by a Checkpointer, loaded back onto the device."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if device == "cuda":
        torch.cuda.set_device(0)
    tp = init_device_mesh(device, (2, 1), mesh_dim_names=("dp", "tp"))["tp"]
    gen = torch.Generator(device=device).manual_seed(3)  # the same values on both data-parallel ranks
    ref = {"w": torch.randn(96, 32, device=device, generator=gen), "b": torch.randn(17, device=device, generator=gen)}

    def state(zero: bool) -> dict:
        w, b = (torch.zeros_like(ref[k]) if zero else ref[k].clone() for k in ("w", "b"))
        model = {"w": DTensor.from_local(w, tp, [Shard(0)]), "b": DTensor.from_local(b, tp, [Replicate()])}
        return {"model": model, "step": 0 if zero else 9}

    bad = []
    ckptd.save(state(False), f"{root}/sync")
    with ckptd.Checkpointer(f"{root}/async", config=_config(runtime)) as ckpt:
        ckpt.save(state(False), step=9).wait(timeout_s=120)
    for path in (f"{root}/sync", f"{root}/async/iter_0000009"):
        want = state(True)
        ckptd.load(want, path)
        for k, v in ref.items():
            got = want["model"][k].to_local()
            if got.device.type != device or not torch.equal(got, v):
                bad.append(f"rank {rank}: {k} from {path}")
        if want["step"] != 9:
            bad.append(f"rank {rank}: step from {path}")
        meta = FileSystemReader(path).read_metadata().state_dict_metadata
        bad += [
            f"{path}: {len(meta[k].chunks)} chunks of {k}" for k in ("model.w", "model.b") if len(meta[k].chunks) != 1
        ]
    return bad


def _submesh_on_cuda(rank: int, world: int, root: str, runtime: str) -> list[str]:
    return _submesh_round_trip(rank, root, runtime, "cuda")


@pytest.mark.timeout(300)
def test_dtensors_on_a_cuda_submesh_are_kept_once_and_load_bit_exact(tmp_path, runtime_dir):
    # Two ranks on the one GPU, over gloo (NCCL refuses two ranks on one device).
    assert run_ranks(_submesh_on_cuda, 2, str(tmp_path / "run"), str(runtime_dir), timeout_s=240) == [[], []]


def _megatron_gpt_on_cuda(rank: int, world: int, root: str, runtime: str) -> list[str]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.real.megatron_gpt import adamw, build_gpt, sharded_state

    torch.cuda.set_device(0)
    model = build_gpt(tp=1)
    model_parallel_cuda_manual_seed(0)
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, 128, (2, 33), device="cuda", generator=gen)
    positions = torch.arange(32, device="cuda").unsqueeze(0).expand(2, -1)
    mask = torch.ones(1, 1, 32, 32, dtype=torch.bool, device="cuda").triu(1)  # True: masked out
    for _ in range(3):  # real forward and backward on the GPU, fused AdamW steps
        model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean().backward()
        opt.step()
        opt.zero_grad()
    params = [p.detach().cpu() for p in model.parameters()]
    moments = [{k: v.cpu() for k, v in opt.state[p].items() if k != "step"} for p in model.parameters()]
    with ckptd.Checkpointer(root, config=_config(runtime)) as ckpt:
        ckpt.save(sharded_state(model, opt, iteration=3), step=3).wait(timeout_s=120)
        fresh = build_gpt(tp=1).cuda()
        fresh_opt = adamw(fresh)
        ckpt.load(sharded_state(fresh, fresh_opt, iteration=3), step=3)
    bad = [f"param {i}" for i, (p, q) in enumerate(zip(params, fresh.parameters())) if not torch.equal(p, q.cpu())]
    for i, (m, p) in enumerate(zip(moments, fresh.parameters())):
        bad += [f"state {i}.{k}" for k, v in m.items() if not torch.equal(v, fresh_opt.state[p][k].cpu())]
    return bad


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_megatron_gpt_trained_on_cuda_saves_and_loads_bit_exact(tmp_path, runtime_dir):
    assert run_ranks(
        _megatron_gpt_on_cuda, 1, str(tmp_path / "run"), str(runtime_dir), timeout_s=240, daemon=False
    ) == [[]]
