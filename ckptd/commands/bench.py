"""``ckptd bench {all,save,load,checksums,coordinator} ...``: the benchmarks of :mod:`ckptd.bench`."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from ._common import add_parser

DESCRIPTION = """\
Measure ckptd against torch DCP on this machine, in one run, and print ratios (and how the
coordinator scales):

  ckptd bench all        the whole suite on one state: first and steady stall, time to durable and
                         persist GiB/s of ckptd, DCP save and async_save (THREAD, PROCESS; stager
                         reused and as called); lazy snapshots; a quarter staging budget; memory
                         over many saves; training-loop overhead; many small tensors; stall vs
                         ranks; load; memory and CPU; reference limits; the targets (--check)
  ckptd bench load       same-layout and resharded load throughput vs DCP load
  ckptd bench checksums  what per-item CRC-32C costs on the persist path
  ckptd bench coordinator  how the coordinator scales: commit latency, CPU, memory, .metadata size
                         and messages per commit for 64 to 4,096 played ranks (real sockets,
                         CurveZMQ, records and files) against a real coordinator

Arguments after the benchmark's name go to it (ckptd bench all --help lists them).

exit status: 0 ok; 1 a target was missed (with --check); 2 usage error."""

BENCHMARKS = ("all", "load", "checksums", "coordinator")
MODULES = {"all": "suite"}  # benchmark name -> module of ckptd.bench, where they differ


def register(subparsers: Any) -> None:
    p = add_parser(subparsers, "bench", "benchmark ckptd against torch DCP (ratios, same run)", DESCRIPTION)
    p.add_argument("benchmark", choices=BENCHMARKS)
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"ckptd.bench.{MODULES.get(args.benchmark, args.benchmark)}")
    return int(module.main(args.args) or 0)
