"""DCP writes with as many threads per rank as ckptd's daemon has writer threads per rank on the
node (DCP's default is one), and the reports say how many each side used."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.harness import dcp_thread_count, dcp_writer
from benchmarks.suite_report import write_threads_line


def test_dcp_gets_the_daemons_writer_threads_shared_by_the_nodes_ranks() -> None:
    assert dcp_thread_count(2, 1) == 2
    assert dcp_thread_count(2, 2) == 1
    assert dcp_thread_count(2, 4) == 1  # at least one
    assert dcp_thread_count(8, 2) == 4


def test_the_writer_writes_with_that_many_threads(tmp_path: Path) -> None:
    # DCP's FileSystemWriter gives each of its threads a file of its own.
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(4)}
    dcp.save(state, storage_writer=dcp_writer(tmp_path / "two", 2), no_dist=True)
    assert len(list((tmp_path / "two").glob("*.distcp"))) == 2
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, checkpoint_id=str(tmp_path / "two"), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_the_report_says_both_thread_counts() -> None:
    line = write_threads_line({"dcp_thread_count": 1, "writer_threads": 2}, 2)
    assert "thread_count=1) per rank" in line and "writer_threads=2 per node (2 ranks" in line
