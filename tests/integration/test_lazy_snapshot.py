"""Lazy snapshots (snapshot="lazy"): save() returns before the copy; the copy runs behind
training; before_update() (or attach(optimizer)) fences it. Never torn: a tensor changed before
its copy was complete fails the save instead. Real daemon, real files, one process."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ckptd
from ckptd import SaveFailedError, ShardedTensor
from tests.interop.reference import same_bits
from tools.harness.ranks import run_ranks


def _config(runtime_dir: Path, **kw) -> ckptd.CkptdConfig:
    return ckptd.CkptdConfig.from_env(
        {}, runtime_dir=str(runtime_dir), idle_exit_s=2.0, heartbeat_s=0.2, snapshot="lazy", **kw
    )


def _state(tensors: dict[str, torch.Tensor], step: int) -> dict:
    return {**{k: ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}, "step": step}


def _load(ckpt: ckptd.Checkpointer, like: dict[str, torch.Tensor], step: int) -> dict:
    return ckpt.load(_state({k: torch.zeros_like(v) for k, v in like.items()}, -1), step=step)


@pytest.mark.timeout(180)
def test_lazy_saves_with_an_attached_optimizer_commit_exact_values(tmp_path, single_process, runtime_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    expected = {}
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir)) as ckpt:
        ckpt.attach(opt)
        handles = []
        for step in range(1, 7):
            loss = model(torch.randn(8, 256)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()  # the pre-hook fences the previous lazy save before the update
            params = {f"p{i}": p.data for i, p in enumerate(model.parameters())}
            handles.append(ckpt.save(_state(params, step), step=step))
            expected[step] = {k: v.clone() for k, v in params.items()}
            model(torch.randn(8, 256)).sum()  # forward while the copy runs: reads only
        for h in handles:
            h.wait(timeout_s=60)
        for step in (1, 4, 6):
            out = _load(ckpt, expected[step], step)
            assert all(same_bits(out[k], expected[step][k]) for k in expected[step]), step


def _fsdp2_like_training(rank: int, world: int, root: str, runtime: str) -> list[int]:
    """DTensor parameters and an attached foreach Adam (FSDP2's kind of state, as get_state_dict
    gives it): every lazy save commits the values save() was called with, loaded back bit-exact;
    the steps committed."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Linear(64, 64)
    for name, p in list(model.named_parameters()):
        model.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)  # its steps bump no counter
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, idle_exit_s=2.0, heartbeat_s=0.2, snapshot="lazy")
    expected, handles = {}, []
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        ckpt.attach(opt)  # the storages it owns: its DTensors' local tensors
        for step in range(1, 5):
            for p in model.parameters():
                p.grad = distribute_tensor(torch.randn(p.shape), mesh, [Shard(0)])
            opt.step()  # the pre-hook fences the previous save before the update
            model_sd, optim_sd = get_state_dict(model, opt)
            handles.append(ckpt.save({"model": model_sd, "optim": optim_sd}, step=step))
            expected[step] = {k: v.full_tensor().clone() for k, v in model_sd.items()}
        committed = [h.wait(timeout_s=60) and h.step for h in handles]
        for step in (1, 4):
            like = {k: torch.zeros_like(v) for k, v in expected[step].items()}
            out = ckpt.load({"model": like}, step=step)
            assert all(same_bits(out["model"][k], expected[step][k]) for k in like), step
    return committed


@pytest.mark.timeout(180)
def test_lazy_saves_of_dtensors_with_an_attached_foreach_optimizer_commit_exact_values(tmp_path, runtime_dir):
    """Before, the attached optimizer's DTensors made every lazy save raise (a DTensor's storage
    has no address), and with none attached a write through a DTensor before the fence tore the
    save: both fixed (ckptd.staging.owned, PlannedItem.watch)."""
    out = run_ranks(_fsdp2_like_training, 2, str(tmp_path / "run"), str(runtime_dir), timeout_s=150)
    assert out == [[1, 2, 3, 4], [1, 2, 3, 4]]


@pytest.mark.timeout(180)
def test_the_default_snapshot_is_lazy_while_an_optimizer_is_attached(tmp_path, single_process, runtime_dir):
    """snapshot="auto" (the default): attach(optimizer) makes the saves lazy snapshots (fenced by
    the optimizer's step); after the attachment is removed they are fork snapshots again. Seen by
    what each does with a write before the next optimizer step: a lazy save fails (its fence sees
    the change), a fork snapshot keeps the values of save() time. Before this, attach() only
    registered the fence and the default stayed a fork snapshot."""
    w = torch.nn.Parameter(torch.zeros(1 << 16))
    opt = torch.optim.SGD([w], lr=0.5)
    cfg = _config(runtime_dir).replace(snapshot="auto")
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        attachment = ckpt.attach(opt)
        w.grad = torch.ones_like(w)
        h1 = ckpt.save(_state({"w": w.detach()}, 1), step=1)
        opt.step()  # fenced first: commits the values of save() time
        h1.wait(timeout_s=60)
        assert same_bits(_load(ckpt, {"w": w.detach()}, 1)["w"], torch.zeros(1 << 16))
        h2 = ckpt.save(_state({"w": w.detach()}, 2), step=2)
        with torch.no_grad():
            w.add_(1.0)  # an update the fence did not precede: the lazy save must fail
        with pytest.raises(SaveFailedError, match="abandoned its snapshot"):
            h2.wait(timeout_s=60)
        attachment.remove()
        saved = w.detach().clone()
        h3 = ckpt.save(_state({"w": w.detach()}, 3), step=3)
        with torch.no_grad():
            w.add_(1.0)  # a fork snapshot has its copy-on-write view of save() time
        h3.wait(timeout_s=60)
        assert same_bits(_load(ckpt, {"w": saved}, 3)["w"], saved)


@pytest.mark.timeout(150)
def test_the_fence_returns_at_once_when_the_node_daemon_dies_while_the_copier_waits_for_room(
    tmp_path, single_process, runtime_dir, caplog
):
    """The node daemon is SIGKILLed while the lazy copier waits for ring space (a save 4x the ring,
    the daemon's writes delayed): the optimizer step's fence returned only after snapshot_timeout_s
    (the copier learned of the death only from the training thread, after that fence), and the
    save was said abandoned because "the node daemon is not persisting". Now the copier watches
    the daemon's process: the fence returns within a few seconds, the save fails as not confirmed,
    and the next save starts a new daemon."""
    timeout_s = 60.0  # far above what the fence may take: a bound on a hang, not a speed
    model = torch.nn.Linear(1024, 2048)  # 8 MiB of parameters: a 2 MiB ring
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = _config(runtime_dir, staging_budget="0.25x", debug_write_delay_s=2.0, snapshot_timeout_s=timeout_s)
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        ckpt.attach(opt)
        h1 = ckpt.save({"model": model.state_dict()}, step=1)  # the copier fills the ring, then waits
        pid = ckpt.status()["pid"]
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)  # before its first write (2 s late): no room is ever freed
        model(torch.randn(4, 1024)).sum().backward()
        t0 = time.monotonic()
        opt.step()  # the attach() pre-hook fences the lazy save
        assert time.monotonic() - t0 < timeout_s / 4
        with pytest.raises(SaveFailedError, match="step 1 was not confirmed"):
            h1.wait(timeout_s=30)
        assert time.monotonic() - t0 < timeout_s / 4
        assert f"its node daemon (pid {pid}) died before it was copied" in caplog.text
        assert "not persisting" not in caplog.text
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt.save({"model": model.state_dict()}, step=2).wait(timeout_s=60)  # a new daemon
        assert ckpt.status()["pid"] != pid
        out = ckpt.load({"model": {k: torch.zeros_like(v) for k, v in expected.items()}}, step=2)
        assert all(same_bits(out["model"][k], v) for k, v in expected.items())


@pytest.mark.timeout(120)
def test_a_load_into_the_tensors_of_a_lazy_save_in_flight_fences_it_first(tmp_path, single_process, runtime_dir):
    """Rolling back right after a save (``save(2)``, then ``load(step=1)`` into the same tensors,
    before the next optimizer step): the load writes into tensors the copier may still read. The
    load decides the save first, so it commits the values of save() time. Before, the load's
    writes (straight into the tensors' memory: no version counter sees them) went into what the
    copier copied next, and the save committed torn. Here the copier is held back by a ring of a
    quarter of the save, which the daemon drains only a second after the save."""
    n = 4 << 20
    w = torch.full((n,), 1.0)
    cfg = _config(runtime_dir, staging_budget="0.25x", debug_write_delay_s=1.0)
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        ckpt.save(_state({"w": w}, 1), step=1).wait(timeout_s=60)
        w.fill_(2.0)
        h2 = ckpt.save(_state({"w": w}, 2), step=2)
        ckpt.load(_state({"w": w}, -1), step=1)  # in place: w holds step 1's values again
        assert same_bits(w, torch.full((n,), 1.0))
        h2.wait(timeout_s=60)
        assert same_bits(_load(ckpt, {"w": w}, 2)["w"], torch.full((n,), 2.0))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fenced", [False, True])
def test_a_tensor_changed_before_the_fence_fails_the_save_never_tears_it(tmp_path, single_process, fenced, runtime_dir):
    """Each save changes one of its tensors (an optimizer step on it) at one point: right after
    save() returned (the copy is running) or once the copy is complete; before the fence
    (before_update()) or after it. Changed before the fence: the save fails, whatever the copy had
    done; after: it commits exactly the saved values. Never a mix."""
    names = [f"t{i}" for i in range(4)]
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir)) as ckpt:
        step = 0
        for victim in names:
            for when in ("during the copy", "after the copy"):
                step += 1
                tensors = {k: torch.full((1 << 20,), float(step * 10 + i)) for i, k in enumerate(names)}
                saved = {k: v.clone() for k, v in tensors.items()}
                handle = ckpt.save(_state(tensors, step), step=step)
                if when == "after the copy":
                    assert ckpt._ring.lazy._pending[-1].copied.wait(30)  # the copier is done, not fenced yet
                if fenced:
                    ckpt.before_update()
                tensors[victim].add_(1000.0)
                if not fenced:
                    ckpt.before_update()
                if fenced:
                    handle.wait(timeout_s=60)
                    out = _load(ckpt, saved, step)
                    assert all(same_bits(out[k], saved[k]) for k in names), (step, victim, when)
                else:
                    with pytest.raises(SaveFailedError, match="abandoned its snapshot"):
                        handle.wait(timeout_s=60)
                    assert ckpt.latest() != step


@pytest.mark.timeout(120)
def test_lazy_save_of_non_contiguous_tensors_and_objects(tmp_path, single_process, runtime_dir):
    w = torch.randn(64, 32)
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir)) as ckpt:
        sd = {
            "wt": ShardedTensor.from_rank_offsets("wt", w.t()),
            "obj": ckptd.ShardedObject("obj", {"a": 1}, (1,), (0,)),
            "step": 1,
        }
        h = ckpt.save(sd, step=1)
        ckpt.before_update()
        w.mul_(2)  # after the fence: the save keeps the values it was given
        h.wait(timeout_s=60)
        out = ckpt.load(
            {
                "wt": ShardedTensor.from_rank_offsets("wt", torch.empty(32, 64)),
                "obj": ckptd.ShardedObject("obj", None, (1,), (0,)),
            }
        )
        assert same_bits(out["wt"], (w / 2).t().contiguous()) and out["obj"] == {"a": 1} and out["step"] == 1


# What a fence sees (issue 26, item 8): each write the README's lazy-snapshot section lists, made
# to a saved tensor after its copy and before the fence, keyed by the words the README uses.
# Seen: the save fails; not seen: it commits what was copied, the write notwithstanding.
def _plain(write: Callable[[torch.Tensor], Any]) -> Callable[[int], tuple[torch.Tensor, Callable[[], Any]]]:
    def make(rank: int) -> tuple[torch.Tensor, Callable[[], Any]]:
        t = torch.full((1024,), float(rank + 1))
        return t, lambda: write(t)

    return make


def _under(mode: Any) -> Callable[[torch.Tensor], None]:
    def write(t: torch.Tensor) -> None:
        with mode():
            t.add_(1)

    return write


def _param(rank: int) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.full((1024,), float(rank + 1)))
    p.grad = torch.ones(1024)
    return p


def _optimizer(**kw: Any) -> Callable[[int], tuple[torch.Tensor, Callable[[], Any]]]:
    def make(rank: int) -> tuple[torch.Tensor, Callable[[], Any]]:
        p = _param(rank)
        return p, torch.optim.Adam([p], lr=0.1, **kw).step

    return make


def _through_param(payload: Callable[[torch.nn.Linear], torch.Tensor]) -> Callable[[int], tuple[torch.Tensor, Any]]:
    def make(rank: int) -> tuple[torch.Tensor, Callable[[], Any]]:
        m = torch.nn.Linear(32, 32)

        def write() -> None:
            with torch.no_grad():
                m.weight.add_(1)

        return payload(m), write

    return make


def _load_state_dict(rank: int) -> tuple[torch.Tensor, Callable[[], Any]]:
    m = torch.nn.Linear(32, 32)
    return m.weight, lambda: m.load_state_dict({"weight": torch.ones(32, 32), "bias": torch.ones(32)})


def _init(rank: int) -> tuple[torch.Tensor, Callable[[], Any]]:
    p = _param(rank)
    return p, lambda: torch.nn.init.normal_(p)


def _from_numpy(rank: int) -> tuple[torch.Tensor, Callable[[], Any]]:
    arr = np.zeros(1024, dtype=np.float32)
    return torch.from_numpy(arr), lambda: arr.__setitem__(0, 5.0)


def _rebind(rank: int) -> tuple[torch.Tensor, Callable[[], Any]]:
    p = _param(rank)

    def write() -> None:
        p.data = torch.zeros(1024)

    return p, write


def _vector_to_parameters(rank: int) -> tuple[torch.Tensor, Callable[[], Any]]:
    p = _param(rank)
    return p, lambda: torch.nn.utils.vector_to_parameters(torch.zeros(1024), [p])


def _dtensor(rank: int) -> torch.nn.Parameter:
    """A parameter sharded over every rank (FSDP2's kind), with a gradient."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    p = torch.nn.Parameter(distribute_tensor(torch.arange(2048, dtype=torch.float32), mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.ones(2048), mesh, [Shard(0)])
    return p


def _through_dtensor(rank: int) -> tuple[torch.Tensor, Callable[[], Any]]:
    p = _dtensor(rank)

    def write() -> None:
        with torch.no_grad():
            p.add_(1)

    return p.detach(), write


def _dtensor_optimizer(**kw: Any) -> Callable[[int], tuple[torch.Tensor, Callable[[], Any]]]:
    def make(rank: int) -> tuple[torch.Tensor, Callable[[], Any]]:
        p = _dtensor(rank)
        return p.detach(), torch.optim.Adam([p], lr=0.1, **kw).step

    return make


def _alias(t: torch.Tensor) -> None:
    torch.empty(0).set_(t.untyped_storage()).add_(1)


def _raw(t: torch.Tensor) -> None:
    ctypes.memset(t.data_ptr(), 0x3F, 4)


SEEN = [
    ("`add_`", _plain(lambda t: t.add_(1))),
    ("`copy_`", _plain(lambda t: t.copy_(torch.ones_like(t)))),
    ("`x[i] = v`", _plain(lambda t: t.__setitem__(0, 5.0))),
    ("`out=`", _plain(lambda t: torch.mul(torch.ones_like(t), 2, out=t))),
    ("`set_()`", _plain(lambda t: t.set_(torch.ones_like(t)))),
    ("slices", _plain(lambda t: t[:4].add_(1))),
    ("`view()`", _plain(lambda t: t.view(4, -1).add_(1))),
    ("`detach()`", _plain(lambda t: t.detach().add_(1))),
    ("`module.state_dict()`'s tensors", _through_param(lambda m: m.state_dict()["weight"])),
    ("`torch.no_grad()`", _plain(_under(torch.no_grad))),
    ("`torch.inference_mode()`", _plain(_under(torch.inference_mode))),
    ("torch.optim's single-tensor and foreach steps", _optimizer(foreach=False)),
    ("torch.optim's single-tensor and foreach steps", _optimizer(foreach=True)),
    ("`load_state_dict()`", _load_state_dict),
    ("`torch.nn.init`", _init),
    ("in-place operations through the DTensor", _through_dtensor),
    ("single-tensor optimizer steps: its own counter is watched", _dtensor_optimizer(foreach=False)),
]
NOT_SEEN = [
    ("`tensor.data`", _plain(lambda t: t.data.add_(1))),
    ("`param.data`", _through_param(lambda m: m.weight.data)),
    ("`fused=True`", _optimizer(fused=True)),
    ("`dist.broadcast`", _plain(lambda t: dist.broadcast(t, 0))),
    ("`dist.all_reduce`", _plain(lambda t: dist.all_reduce(t))),
    ("`t.numpy()`", _plain(lambda t: t.numpy().__setitem__(0, 5.0))),
    ("`torch.from_numpy`", _from_numpy),
    ("DLPack", _plain(lambda t: torch.from_dlpack(t.__dlpack__()).add_(1))),
    ("`data_ptr()`", _plain(_raw)),
    ("`untyped_storage()`", _plain(_alias)),
    ("`param.data = x`", _rebind),
    ("`vector_to_parameters`", _vector_to_parameters),
    ("foreach steps on DTensor parameters", _dtensor_optimizer(foreach=True)),
]


def _fence_sees(rank: int, world: int, root: str, runtime: str) -> dict[str, list[str]]:
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, idle_exit_s=2.0, heartbeat_s=0.2, snapshot="lazy")
    out: dict[str, list[str]] = {}
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        for step, (words, make) in enumerate(SEEN + NOT_SEEN, start=1):
            payload, write = make(rank)
            if type(payload) is torch.Tensor:
                handle = ckpt.save({f"x{rank}": ShardedTensor.from_rank_offsets(f"x{rank}", payload), "i": step}, step)
            else:  # a DTensor, saved as such
                handle = ckpt.save({f"d{step}": payload, "i": step}, step)
            assert ckpt._ring.lazy._pending[-1].copied.wait(30)  # copied; the write comes before the fence
            write()
            ckpt.before_update()
            try:
                handle.wait(timeout_s=60)
                outcome = "committed"
            except SaveFailedError as exc:
                assert "abandoned its snapshot" in str(exc), exc
                outcome = "failed"
            out.setdefault(words, []).append(outcome)
    return out


def _readme_lists() -> tuple[str, str]:
    text = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    seen = text[text.index("- *seen* (the save fails)") :]
    not_seen = seen[seen.index("- *not seen*") :]
    return seen[: seen.index("- *not seen*")], not_seen[: not_seen.index("So save the tensors")]


@pytest.mark.timeout(240)
def test_the_fence_sees_the_writes_the_readme_says_it_sees(tmp_path, runtime_dir):
    """A lazy save fails when a write the README lists as seen changes a saved tensor before the
    fence, and commits despite one it lists as not seen (torn values are possible then); two
    ranks, so that collectives really write."""
    seen, not_seen = _readme_lists()
    assert all(words in seen and words not in not_seen for words, _ in SEEN), seen
    assert all(words in not_seen for words, _ in NOT_SEEN), not_seen
    out = run_ranks(_fence_sees, 2, str(tmp_path / "run"), str(runtime_dir), timeout_s=200)
    want = {w: {"failed"} for w, _ in SEEN} | {w: {"committed"} for w, _ in NOT_SEEN}
    for rank_out in out:
        assert {w: set(o) for w, o in rank_out.items()} == want


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["slice_split", "inference", "resized"])
def test_writes_the_fence_missed_tore_saves_that_committed(tmp_path, single_process, runtime_dir, case):
    """Three ways a lazy save committed values changed after ``save()``:

    - slice_split: a slice of a larger buffer, larger than the ring, was split into storage
      slices with version counters of their own, so ``add_()`` on it was not seen;
    - inference: an inference tensor has no version counter at all (it is now copied in save());
    - resized: a saved tensor grown by ``resize_()`` was copied at its new size, past its range,
      over an earlier save the daemon had not persisted yet."""
    n = 1 << 22  # 16 MiB of float32
    root = tmp_path / "run"
    if case == "slice_split":
        buf = torch.zeros(n + 16)
        t = buf[16:]
        t.fill_(1.0)
        with ckptd.Checkpointer(root, config=_config(runtime_dir, staging_budget="1MiB")) as ckpt:
            h = ckpt.save(_state({"t": t}, 1), step=1)
            t.add_(1000.0)
            with pytest.raises(SaveFailedError, match="abandoned its snapshot"):
                h.wait(timeout_s=60)
    elif case == "inference":
        with torch.inference_mode():
            t = torch.ones(n)
        saved = t.clone()
        with ckptd.Checkpointer(root, config=_config(runtime_dir)) as ckpt:
            h = ckpt.save(_state({"t": t}, 1), step=1)
            with torch.inference_mode():
                t.add_(1000.0)
            h.wait(timeout_s=60)
            assert torch.equal(_load(ckpt, {"t": saved}, 1)["t"], saved)
    else:
        faults = tmp_path / "faults"
        faults.write_text("hang *\n")  # the disk holds the first save in the ring meanwhile
        cfg = _config(runtime_dir, staging_budget="40MiB", debug_fault_file=str(faults))
        x, t = torch.full((n // 2,), 3.0), torch.full((n // 2,), 5.0)
        small = {f"a{i:04d}": torch.full((16,), float(i)) for i in range(2000)}  # the copier is behind
        with ckptd.Checkpointer(root, config=cfg) as ckpt:
            first = ckpt.save(_state({"x": x}, 1), step=1)
            second = ckpt.save(_state({**small, "z": t}, 2), step=2)  # fences the first
            t.resize_(5 * n // 2)
            t.fill_(7.0)
            ckpt.before_update()
            faults.write_text("")
            with pytest.raises(SaveFailedError):
                second.wait(timeout_s=60)
            first.wait(timeout_s=60)
            assert torch.equal(_load(ckpt, {"x": x}, 1)["x"], x)  # before: all 7.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("memory", ["share_memory", "from_file"])
def test_a_fork_snapshot_never_copies_shared_memory_the_trainer_writes(tmp_path, single_process, runtime_dir, memory):
    """A fork shares MAP_SHARED pages instead of copying them on write: the child copied the
    trainer's writes made after save() (a save of 16 MiB committed with 15 MiB of later values)."""
    n = 1 << 22
    if memory == "share_memory":
        t = torch.ones(n).share_memory_()
    else:
        path = tmp_path / "mapped.bin"
        path.write_bytes(bytes(4 * n))
        t = torch.from_file(str(path), shared=True, size=n, dtype=torch.float32)
        t.fill_(1.0)
    saved = t.clone()
    cfg = _config(runtime_dir, staging_budget="1MiB").replace(snapshot="auto")
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        h = ckpt.save(_state({"t": t}, 1), step=1)
        t.add_(1000.0)
        h.wait(timeout_s=60)
        assert torch.equal(_load(ckpt, {"t": saved}, 1)["t"], saved)


@pytest.mark.timeout(180)
def test_buffers_the_forward_pass_updates_are_copied_in_save_with_an_attached_optimizer(
    tmp_path, single_process, runtime_dir
):
    """BatchNorm's running statistics change in the forward pass, before the optimizer step the
    fence waits for: every lazy save of such a model failed. With an optimizer attached, small
    tensors it does not own are copied in save(); what it owns stays lazy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = {}
    cfg = _config(runtime_dir).replace(snapshot="auto")
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        ckpt.attach(opt)
        handles = []
        for step in range(1, 5):
            loss = model(torch.randn(32, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sd = model.state_dict()
            handles.append(ckpt.save({"model": sd, "step": step}, step=step))
            expected[step] = {k: v.clone() for k, v in sd.items()}
        for h in handles:
            h.wait(timeout_s=60)  # before: SaveFailedError, "num_batches_tracked ... was modified"
        for step in (1, 4):
            got = ckpt.load(
                {"model": {k: torch.zeros_like(v) for k, v in expected[step].items()}, "step": 0}, step=step
            )
            assert all(torch.equal(got["model"][k], v) for k, v in expected[step].items()), step
