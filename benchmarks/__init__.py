"""Benchmarks that measure ckptd against torch DCP in the same run (``ckptd bench ...``).

- :mod:`.suite` (``ckptd bench all``): saves (first and steady stall, durable time, persist
  throughput) of ckptd and DCP, lazy snapshots, a quarter staging budget, memory over many saves,
  training-loop overhead, many small tensors, stall vs ranks, load, memory and CPU, reference
  limits, and the targets (:mod:`.harness`, :mod:`.suite_rank`, :mod:`.suite_train`,
  :mod:`.suite_report`, :mod:`.memory`);
- :mod:`.load`: same-layout and resharding load throughput;
- :mod:`.checksums`: what per-item CRC-32C costs on the persist path;
- :mod:`.coordinator`: how the coordinator scales with the ranks of a job (commit latency, CPU,
  memory, ``.metadata`` size, messages), against a real coordinator.

Each module has ``main(argv) -> int`` and prints ratios measured in one run, never absolute
thresholds: the machine may be shared and noisy.
"""
