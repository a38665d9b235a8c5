"""A test process that is a single process to ckptd, not a rank of a launched job.

A test that is a single process clears torchrun's variables (:data:`TORCHRUN_VARS`): the
``single_process`` fixture (tests/conftest.py), :func:`clear_torchrun_env`, or
:func:`without_torchrun` for the environment of a subprocess. Multi-rank tests run their ranks with
:func:`tools.harness.ranks.run_ranks`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# What makes a process a rank of a launched job (ckptd.control.endpoints.JobEnv.detect reads them).
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def without_torchrun(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without torchrun's variables: a subprocess started with it is a single process."""
    return {k: v for k, v in environ.items() if k not in TORCHRUN_VARS}


def clear_torchrun_env(monkeypatch: Any) -> None:
    """Make this test process a single process for ckptd until ``monkeypatch`` undoes it."""
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
