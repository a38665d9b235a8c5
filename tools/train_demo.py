"""A small FSDP2 language-model training job that checkpoints asynchronously through ckptd.

Run with torchrun (CPU + gloo by default, CUDA + NCCL when available)::

    torchrun --standalone --nproc-per-node 2 tools/train_demo.py --ckpt-dir /tmp/demo --steps 30
    # hard-kill the job at step 23 (after the save of step 20 returned):
    torchrun ... tools/train_demo.py --ckpt-dir /tmp/demo --steps 30 --kill-at 23
    # recover from the last committed checkpoint and continue (any number of ranks):
    torchrun ... tools/train_demo.py --ckpt-dir /tmp/demo --steps 30 --resume

The model is a pre-norm Transformer language model (``torch.nn.TransformerEncoderLayer`` blocks
with a causal mask), every block and the root wrapped by FSDP2's ``fully_shard``, trained with
AdamW. Its state is what PyTorch's own tooling produces: ``get_state_dict(model, optimizer)``
gives DTensor shards of the parameters and of AdamW's moments, the step counters and the
parameter groups; ckptd saves that dict as torch DCP would (``ckpt.save(state, step=...)`` in
place of ``dcp.async_save(state, checkpoint_id=...)``) and ``ckpt.resume(state)`` fills it in place
before ``set_state_dict``. ``--loader dcp`` loads with ``torch.distributed.checkpoint.load``
instead, to show that torch reads ckptd's checkpoints.

Batches are a pure function of the step (the global batch is split over the ranks), so a run
resumed at the same world size sees exactly the data the uninterrupted run saw and its losses
match bit for bit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F  # noqa: N812 - torch's idiom
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckptd

log = logging.getLogger("train_demo")


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, ffn: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def build(args: argparse.Namespace, device: torch.device, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)  # the same full weights at every world size
    model = TinyLM(args.vocab, args.hidden, args.heads, args.ffn, args.layers).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


def batch(
    step: int, rank: int, world: int, vocab: int, global_batch: int, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch: a noisy affine sequence task."""
    gen = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, vocab, (global_batch, 1), generator=gen)
    stride = torch.randint(1, 5, (global_batch, 1), generator=gen)
    seqs = (start + stride * torch.arange(seq + 1)) % vocab
    per_rank = global_batch // world
    seqs = seqs[rank * per_rank : (rank + 1) * per_rank]
    return seqs[:, :-1], seqs[:, 1:]


def training_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    """What torch's tooling gives for FSDP2: DTensor shards of parameters and AdamW state."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt-dir", required=True, help="checkpoint root (one directory per step inside)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over the ranks)")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--kill-at", type=int, default=None, help="SIGKILL this job at that step")
    ap.add_argument(
        "--hold-writes-at",
        type=int,
        default=None,
        metavar="STEP",
        help="before the save of STEP, make the daemon's disk stop answering: a 'hang' rule in the fault "
        "file CKPTD_DEBUG_FAULT_FILE names (a test hook), so that save is still in flight at --kill-at "
        "until the rule is removed (tools/run_demo.py)",
    )
    ap.add_argument("--resume", action="store_true", help="continue from the last committed checkpoint")
    ap.add_argument(
        "--loader",
        choices=("ckptd", "dcp"),
        default="ckptd",
        help="load with ckpt.load (default) or torch.distributed.checkpoint.load",
    )
    ap.add_argument(
        "--loss-log",
        default=None,
        help="append the run's story here as JSON lines: start, each step's loss and save stall, kill, done (rank 0)",
    )
    ap.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA (NCCL) when available, else CPU (gloo)",
    )
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
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the world size {world}")
    model, opt = build(args, device, world)

    def record(**fields: object) -> None:
        """One JSON line of the run's story for tools/run_demo.py (rank 0)."""
        if rank == 0 and args.loss_log:
            with open(args.loss_log, "a") as f:
                f.write(json.dumps(fields) + "\n")

    with ckptd.Checkpointer(args.ckpt_dir) as ckpt:
        start = 0
        if args.resume:
            state = training_state(model, opt, 0)
            if args.loader == "dcp":
                # rank 0's directory on every rank: ranks that each read the tracker while a commit
                # lands would read different checkpoints (ckpt.resume() agrees by itself)
                where = [str(ckpt.checkpoint_dir()) if ckpt.latest() is not None else ""]  # every rank
                dist.broadcast_object_list(where, src=0)  # (both are collectives with node_local)
                found = bool(where[0])
                if found:
                    dcp.load(state, checkpoint_id=where[0])
            else:
                found = ckpt.resume(state) is not None  # fills the DTensors and values in place, as dcp.load does
            if not found:
                raise SystemExit(f"--resume: no committed checkpoint under {args.ckpt_dir}")
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            start = int(state["step"])
            if rank == 0:
                log.info("resumed from committed step %d with %s at world size %d", start, args.loader, world)
        params = sum(p.numel() for p in model.parameters())  # DTensors: their global sizes
        record(
            event="start", params=params, world=world, device=device.type, resumed_from=start if args.resume else None
        )
        handles = []
        for step in range(start + 1, args.steps + 1):
            tokens, targets = (t.to(device) for t in batch(step, rank, world, args.vocab, args.batch, args.seq))
            loss = F.cross_entropy(model(tokens).reshape(-1, args.vocab), targets.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            avg = float(avg / world)
            stall_s = None
            if step % args.save_every == 0:
                if step == args.hold_writes_at:
                    if rank == 0:
                        with open(os.environ["CKPTD_DEBUG_FAULT_FILE"], "w") as f:
                            f.write("hang\n")
                    dist.barrier()  # no rank hands this save off before the disk stops answering
                t0 = time.perf_counter()
                handles.append(ckpt.save(training_state(model, opt, step), step=step))
                stall_s = time.perf_counter() - t0
                if rank == 0:
                    log.info("step %d loss %.4f; save stalled training %.1f ms", step, avg, 1e3 * stall_s)
            record(step=step, loss=avg.hex(), world=world, save_stall_s=stall_s)
            if args.kill_at is not None and step == args.kill_at:
                log.warning("rank %d: --kill-at %d: SIGKILL now", rank, step)
                dist.barrier()  # every rank's save() returned: what is not decided yet is the daemon's
                record(event="killed", step=step, in_flight=[h.step for h in handles if not h.done()])
                os.kill(os.getpid(), signal.SIGKILL)
        for h in handles:
            h.wait()
        if rank == 0:
            log.info("done at step %d; newest committed checkpoint: step %s", args.steps, ckpt.latest())
        record(event="done", step=args.steps, latest=ckpt.latest())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
