"""Paths a user gets wrong, with a real Checkpointer and the real command line: each is refused with
a message that names the path, says what is wrong with it and what to do, never with a raw
``OSError`` or a traceback.
"""

from __future__ import annotations

import pytest

import ckptd
from ckptd.errors import StorageError
from tests.cli import ckptd_cli


@pytest.mark.timeout(120)
def test_a_checkpoint_root_that_is_a_file_is_refused_saying_so(single, tmp_path):
    _, runtime, env = single
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime)
    with pytest.raises(StorageError, match=f"the checkpoint root {afile} is a file, not a directory: give"):
        ckptd.Checkpointer(afile, config=cfg)
    with pytest.raises(StorageError, match=f"{afile} is a file, not a directory, so the checkpoint root"):
        ckptd.Checkpointer(afile / "ckpts", config=cfg)
    for detach in ([], ["--detach"]):
        run = ckptd_cli(env, "daemon", "--root", str(afile), *detach)
        assert run.returncode == 1, (run.returncode, run.stderr)
        assert f"the checkpoint root {afile} is a file, not a directory" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr and "FileExistsError" not in run.stderr, run.stderr
