"""``import ckptd`` is light (PEP 562): the command line and the daemon start without torch, and
the public names import what they need on first use, whatever the trainer set up before."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _python(code: str) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip()


@pytest.mark.timeout(90)
def test_import_ckptd_and_the_admin_client_load_no_torch():
    out = _python("import sys, ckptd, ckptd.client.admin, ckptd.cli; print('torch' in sys.modules)")
    assert out == "False"


@pytest.mark.timeout(90)
def test_public_names_import_after_deterministic_mode_is_on():
    """The demo (and many trainers) turn on deterministic algorithms before first touching
    ckptd.Checkpointer: the dtype table built on that first import used to allocate a tensor of
    every dtype, and deterministic mode's fill of a float4 tensor raised NotImplementedError."""
    code = (
        "import torch; torch.use_deterministic_algorithms(True)\n"
        "import ckptd\n"
        "print(ckptd.Checkpointer.__name__, ckptd.CkptdConfig.__name__, ckptd.load.__name__)"
    )
    assert _python(code) == "Checkpointer CkptdConfig load"
