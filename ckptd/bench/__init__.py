"""Benchmarks that measure ckptd against torch DCP in the same run (``ckptd bench ...``).

- :mod:`.suite` (``ckptd bench all``): everything below on one state, plus training-loop overhead,
  many small tensors, stall vs ranks, memory and reference limits, with the issue's targets
  (:mod:`.suite_rank`, :mod:`.suite_train`, :mod:`.suite_report`, :mod:`.memory`);
- :mod:`.save`: training stall and time to commit of asynchronous saves, and pool memory;
- :mod:`.load`: same-layout and resharding load throughput;
- :mod:`.checksums`: what per-item CRC32 costs on the persist path;
- :mod:`.coordinator`: how the coordinator scales with the ranks of a job (commit latency, CPU,
  memory, ``.metadata`` size, messages), against a real coordinator.

Each module has ``main(argv) -> int`` and prints ratios measured in one run, never absolute
thresholds: the machine may be shared and noisy.
"""
