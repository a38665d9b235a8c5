"""The pieces the fault tests rely on, in one process: the fault-file test hook, and the data-file
write that can never rewrite a file of a checkpoint committed meanwhile."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from ckptd import ShardedTensor
from ckptd.daemon.faults import fault_opener, parse_fault_spec
from ckptd.daemon.workers import write_rank_file
from ckptd.errors import CkptdError, StorageError
from ckptd.format.items import plan_tensor_items
from ckptd.roots.posix_data import PosixDataTarget
from tests.rings import produced_save


def test_fault_rules_parse_and_apply(tmp_path):
    plan = parse_fault_spec("# a comment\ndelay 0.5\nfail ENOSPC 10 __*\nfail EROFS\n")
    assert plan.delay_s == 0.5
    assert plan.failure_for("__0_0.distcp").errno_code == errno.ENOSPC
    assert plan.failure_for("common.pt").errno_code == errno.EROFS
    hangs = parse_fault_spec("hang __*\nhang\n")
    assert hangs.hangs == ("__*", "*") and hangs.hangs_for("common.pt") and not parse_fault_spec("").hangs_for("x")
    for bad in ("fail ENOPE", "fail ENOSPC -1", "delay soon", "explode", "hang a b"):
        with pytest.raises(CkptdError, match="is not 'delay <seconds>'"):
            parse_fault_spec(bad)

    rules = tmp_path / "faults"
    opener = fault_opener(str(rules))
    with opener(str(tmp_path / "a"), "wb") as f:  # no fault file: no fault
        f.write(b"x" * 100)
    rules.write_text("fail ENOSPC 10 b*\n")
    with opener(str(tmp_path / "a"), "wb") as f:
        f.write(b"x" * 100)
    with pytest.raises(OSError) as err, opener(str(tmp_path / "b"), "wb") as f:
        f.write(b"12345678")
        f.write(b"9abc")  # crosses 10 bytes: the first two land, as on a filling disk
    assert err.value.errno == errno.ENOSPC and err.value.filename is None  # as write(2): no file named
    assert (tmp_path / "b").read_bytes() == b"123456789a"
    with opener(str(tmp_path / "b"), "rb") as f:
        assert f.read() == b"123456789a"  # reads are never faulted


def _items(value: float) -> list:
    return plan_tensor_items(ShardedTensor.from_rank_offsets("w", torch.full((16, 16), value)), 0)


def test_a_late_write_never_touches_a_committed_checkpoint(tmp_path):
    tmp, final = tmp_path / "iter_0000007.tmp", tmp_path / "iter_0000007"
    with produced_save(7, _items(1.0)) as save:  # the attempt that commits
        write_rank_file(PosixDataTarget(tmp, 0, open, True), save.ring, save.request, True, save.wait, 30)
    committed = (tmp / "__0_0.distcp").read_bytes()

    def commit_meanwhile(path: str, mode: str):
        f = open(path, mode)  # noqa: SIM115 - returned to the writer
        os.rename(tmp, final)  # another attempt of the step commits while this one writes
        return f

    with produced_save(7, _items(2.0)) as late:
        with pytest.raises(StorageError, match="No such file or directory"):
            write_rank_file(
                PosixDataTarget(tmp, 0, commit_meanwhile, True), late.ring, late.request, True, late.wait, 30
            )
        assert late.ring.consumed() == late.request.ring_end  # its ring space was given back
    assert (final / "__0_0.distcp").read_bytes() == committed
    assert sorted(os.listdir(final)) == ["__0_0.distcp"]  # its .part file was removed too
