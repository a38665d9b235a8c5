"""Megatron-Core's saves in the suite's rank processes, on CPU.

:func:`megatron_save_on_cpu`, called in a rank before its first ``dist_checkpointing.save``:

- Megatron-Core's torch_dist save calls ``torch.cuda.synchronize`` and ``current_device``
  unconditionally; on CPU they become no-ops;
- its writer collects its results through a multiprocessing Manager that it starts with the spawn
  method (``filesystem_async._get_write_results_queue``): a fresh interpreter importing torch, 4
  CPU-seconds for each rank that saves, about ten of them per suite run. The rank hands it a
  Manager started by fork instead, as Megatron-Core starts its writer processes from the same rank
  (a Megatron-Core without that module global keeps its own).
"""

from __future__ import annotations

import multiprocessing as mp

import torch


def megatron_save_on_cpu() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]
    if getattr(filesystem_async, "_results_queue", "absent") is None:  # not made yet in this process
        filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()
