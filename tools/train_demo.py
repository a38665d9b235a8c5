"""A small tensor- and data-parallel training job that checkpoints asynchronously through ckptd.

Run with torchrun (CPU + gloo by default, CUDA + NCCL when available)::

    torchrun --standalone --nproc-per-node 2 tools/train_demo.py --ckpt-dir /tmp/demo --steps 30
    # hard-kill the job at step 23 (after the save of step 20 returned):
    torchrun ... tools/train_demo.py --ckpt-dir /tmp/demo --steps 30 --kill-at 23
    # recover from the last committed checkpoint and continue:
    torchrun ... tools/train_demo.py --ckpt-dir /tmp/demo --steps 30 --resume

The model is a stack of Megatron-style MLP blocks: fc1 is column-parallel and fc2 row-parallel
over the TP group; embedding, norms and head are replicated. The sharded state dict covers the
model and the Adam state (same sharding as the parameters) and the step counter (common state).
Batches are a pure function of the step, so a resumed run sees exactly the data the
uninterrupted run saw and its losses match bit for bit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ckptd

log = logging.getLogger("train_demo")


@dataclass(frozen=True)
class Layout:
    rank: int
    world: int
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    tp_group: object
    dp_group: object


def make_layout(tp: int) -> Layout:
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % tp:
        raise SystemExit(f"world size {world} is not divisible by --tp {tp}")
    dp = world // tp
    tp_group = dp_group = None
    # Every rank must create every group, in the same order.
    for d in range(dp):
        g = dist.new_group([d * tp + t for t in range(tp)])
        if rank // tp == d:
            tp_group = g
    for t in range(tp):
        g = dist.new_group([d * tp + t for d in range(dp)])
        if rank % tp == t:
            dp_group = g
    return Layout(rank, world, tp, dp, rank % tp, rank // tp, tp_group, dp_group)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; gradients of the replicated input are summed over the TP group."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Sum partial outputs of a row-parallel layer over the TP group."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g, None


class DemoModel(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, ffn: int, layers: int, lay: Layout) -> None:
        super().__init__()
        if ffn % lay.tp:
            raise SystemExit(f"--ffn {ffn} must be divisible by --tp {lay.tp}")
        gen = torch.Generator().manual_seed(1234)  # same full weights on every layout

        def init(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * (1.0 / shape[-1] ** 0.5)

        self.lay = lay
        self.embed = torch.nn.Parameter(init(vocab, hidden))
        self.norms = torch.nn.ParameterList()
        self.fc1 = torch.nn.ParameterList()
        self.fc2 = torch.nn.ParameterList()
        shard = ffn // lay.tp
        sl = slice(lay.tp_rank * shard, (lay.tp_rank + 1) * shard)
        for _ in range(layers):
            self.norms.append(torch.nn.Parameter(torch.ones(hidden)))
            self.fc1.append(torch.nn.Parameter(init(ffn, hidden)[sl].clone()))
            self.fc2.append(torch.nn.Parameter(init(hidden, ffn)[:, sl].clone()))
        self.head = torch.nn.Parameter(init(vocab, hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed[tokens]
        for norm, w1, w2 in zip(self.norms, self.fc1, self.fc2):
            h = F.layer_norm(x, x.shape[-1:], weight=norm)
            h = _CopyToTP.apply(h, self.lay.tp_group)
            y = F.gelu(h @ w1.t()) @ w2.t()
            x = x + _ReduceFromTP.apply(y, self.lay.tp_group)
        return x @ self.head.t()

    def sharding(self) -> dict[str, tuple]:
        """Per parameter name: the ckptd sharding spec ``(rank_offsets..., replica_id)``."""
        lay = self.lay
        out: dict[str, tuple] = {}
        for name, _ in self.named_parameters():
            if name.startswith("fc1."):
                out[name] = ((0, lay.tp_rank, lay.tp),), lay.dp_rank
            elif name.startswith("fc2."):
                out[name] = ((1, lay.tp_rank, lay.tp),), lay.dp_rank
            else:
                out[name] = (), (lay.tp_rank, lay.dp_rank)
        return out


def batch(step: int, lay: Layout, vocab: int, batch_size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The DP rank's slice of step ``step``'s global batch: a noisy affine sequence task."""
    gen = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, vocab, (batch_size * lay.dp, 1), generator=gen)
    stride = torch.randint(1, 5, (batch_size * lay.dp, 1), generator=gen)
    seqs = (start + stride * torch.arange(seq + 1)) % vocab
    seqs = seqs[lay.dp_rank * batch_size : (lay.dp_rank + 1) * batch_size]
    return seqs[:, :-1], seqs[:, 1:]


def sharded_state(model: DemoModel, opt: torch.optim.Adam, step: int) -> dict:
    """The job's sharded state dict: parameters, Adam moments (sharded alike), step (common)."""
    sd: dict = {"model": {}, "optimizer": {}, "step": step}
    specs = model.sharding()
    for name, p in model.named_parameters():
        offsets, replica = specs[name]
        sd["model"][name] = ckptd.ShardedTensor.from_rank_offsets(
            f"model.{name}", p.data, *offsets, replica_id=replica
        )
        st = opt.state[p]
        sd["optimizer"][name] = {
            m: ckptd.ShardedTensor.from_rank_offsets(
                f"optimizer.{name}.{m}", st[m], *offsets, replica_id=replica
            )
            for m in ("exp_avg", "exp_avg_sq")
        }
    return sd


def init_optimizer_state(model: DemoModel, opt: torch.optim.Adam) -> None:
    """Materialize Adam's state so a checkpoint can be loaded into it in place."""
    for p in model.parameters():
        opt.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt-dir", required=True, help="checkpoint root (one directory per step inside)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (world = tp * dp)")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--kill-at", type=int, default=None, help="SIGKILL this job at that step")
    ap.add_argument("--resume", action="store_true", help="continue from the last committed checkpoint")
    ap.add_argument("--loss-log", default=None, help="append 'step loss' JSON lines here (rank 0)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: CUDA (NCCL) when available, else CPU (gloo)")
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    lay = make_layout(args.tp)
    # Built on the CPU (the same weights on every layout and device), then moved.
    model = DemoModel(args.vocab, args.hidden, args.ffn, args.layers, lay).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    init_optimizer_state(model, opt)

    with ckptd.Checkpointer(args.ckpt_dir) as ckpt:
        start = 0
        if args.resume:
            latest = ckpt.latest()
            if latest is None:
                raise SystemExit(f"--resume: no committed checkpoint under {args.ckpt_dir}")
            loaded = ckpt.load(sharded_state(model, opt, 0))
            start = int(loaded["step"])
            for p in model.parameters():
                opt.state[p]["step"].fill_(start)
            if lay.rank == 0:
                log.info("resumed from committed step %d", start)
        handles = []
        for step in range(start + 1, args.steps + 1):
            tokens, targets = (t.to(device) for t in batch(step, lay, args.vocab, args.batch, args.seq))
            loss = F.cross_entropy(model(tokens).reshape(-1, args.vocab), targets.reshape(-1))
            opt.zero_grad(set_to_none=False)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, group=lay.dp_group)
                p.grad.div_(lay.dp)
            opt.step()
            avg = loss.detach().clone()
            dist.all_reduce(avg, group=lay.dp_group)
            avg = float(avg / lay.dp)
            if lay.rank == 0 and args.loss_log:
                with open(args.loss_log, "a") as f:
                    f.write(json.dumps({"step": step, "loss": avg.hex()}) + "\n")
            if step % args.save_every == 0:
                t0 = time.perf_counter()
                handles.append(ckpt.save(sharded_state(model, opt, step), step=step))
                if lay.rank == 0:
                    log.info("step %d loss %.4f; save stalled training %.1f ms", step, avg,
                             1e3 * (time.perf_counter() - t0))
            if args.kill_at is not None and step == args.kill_at:
                log.warning("rank %d: --kill-at %d: SIGKILL now", lay.rank, step)
                os.kill(os.getpid(), signal.SIGKILL)
        for h in handles:
            h.wait()
        if lay.rank == 0:
            log.info("done at step %d; newest committed checkpoint: step %s", args.steps, ckpt.latest())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
