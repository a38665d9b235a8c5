"""``ckptd bench {all,train,load,checksums,coordinator} ...``: the benchmarks of a source checkout.

The benchmarks are not library code: they live in the checkout's top-level ``benchmarks``
package, next to ``tools/``, and are not installed with the package. ``ckptd bench`` runs them
from the checkout ckptd was installed from (``pip install -e .``), or from the current directory
when that is a checkout.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from ._common import UsageError, add_parser, guarded

DESCRIPTION = """\
Measure ckptd against torch DCP on this machine, in one run, and print ratios (and how the
coordinator scales):

  ckptd bench all        the whole suite on one state: first and steady stall, time to durable and
                         persist GiB/s of ckptd, DCP save and async_save (THREAD, PROCESS; stager
                         reused and as called); lazy snapshots; a quarter staging budget; memory
                         over many saves; training-loop overhead; many small tensors; stall vs
                         ranks; load; memory and CPU; reference limits; the targets (--check)
  ckptd bench train      a GPT-like training loop (CPU or CUDA) checkpointed by ckptd and by DCP's
                         best working configuration: loop overhead, first and steady stall, fence
                         wait, device-to-host floor, a save taken while training goes on loaded
                         back bit-exact, two save intervals (with and without backpressure)
  ckptd bench load       same-layout and resharded load throughput vs DCP load
  ckptd bench checksums  what per-item CRC-32C costs on the persist path
  ckptd bench coordinator  how the coordinator scales: commit latency, CPU, memory, .metadata size
                         and messages per commit for 64 to 4,096 played ranks (real sockets,
                         CurveZMQ, records and files) against a real coordinator
  ckptd bench objstore   ckptd on S3-compatible object storage (a SeaweedFS server it starts) vs
                         torch DCP's fsspec writer and reader, and the S3 clients' raw upload speed

Arguments after the benchmark's name go to it (ckptd bench all --help lists them).

exit status: 0 ok; 1 a target was missed (with --check); 2 usage error."""

BENCHMARKS = ("all", "train", "load", "checksums", "coordinator", "objstore")
MODULES = {"all": "suite"}  # benchmark name -> module of the benchmarks package, where they differ


def register(subparsers: Any) -> None:
    p = add_parser(subparsers, "bench", "benchmark ckptd against torch DCP (ratios, same run)", DESCRIPTION)
    p.add_argument("benchmark", choices=BENCHMARKS)
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    p.set_defaults(func=run)


def checkout_root() -> Path | None:
    """The source checkout holding the benchmarks: the one ckptd was installed from (editable), or
    the current directory; None when neither is one."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / "benchmarks" / "__init__.py").is_file() and (root / "ckptd" / "__init__.py").is_file():
            return root
    return None


@guarded("bench")
def run(args: argparse.Namespace) -> int:
    root = checkout_root()
    if root is None:
        raise UsageError(
            "the benchmarks are not part of the installed package: run `ckptd bench` from a source "
            "checkout of ckptd (git clone ...; pip install -e .), or from its directory"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # also the spawned ranks' path (multiprocessing passes it on)
    module = importlib.import_module(f"benchmarks.{MODULES.get(args.benchmark, args.benchmark)}")
    return int(module.main(args.args) or 0)
