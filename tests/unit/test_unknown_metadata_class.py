"""A ``.metadata`` that names a class ckptd does not know (a newer torch's or Megatron-Core's) is not
damage: it was refused as unsafe and then taken for damaged, so ``ckptd verify`` said DAMAGED, a
resume fell back past the checkpoint to an older one, and a coordinator start moved the trackers
back to that one. Now verify says UNSUPPORTED, the resume's check raises UnknownClassError naming
the file and the class (nothing resumed past it), and the trackers stay. A name that cannot be
another writer's class stays damage: one byte off a known one, no Python name, or the standard
library's."""

from __future__ import annotations

import pytest
import torch

import ckptd
from ckptd.errors import CorruptCheckpointError, UnknownClassError, UnsafePickleError, UnsupportedFormatError
from ckptd.format.dcp_metadata import read_index
from ckptd.format.rootlayout import MEGATRON_TRACKER, TRACKER_FILE
from ckptd.recovery import resolve_latest, structural_problem
from ckptd.roots.posix import finish_interrupted_commit
from ckptd.verify import UNKNOWN_CLASS, verify_checkpoint
from tests.checkpoints import (
    FUTURE_CLASS,
    FUTURE_MODULE,
    future_writer_importable,
    make_checkpoint,
    make_root,
    reference_tensors,
    rewrite_as_future_class,
)

NAMED = rf"iter_0000010/\.metadata names the class {FUTURE_MODULE}\.{FUTURE_CLASS}, which this ckptd does not know"


def _root(tmp_path):
    """Steps 5 and 10, no ``latest`` (Megatron-LM's tracker names 10), step 10 by a newer writer."""
    root = make_root(tmp_path / "r", [5, 10], latest=None)
    (root / MEGATRON_TRACKER).write_text("10")
    rewrite_as_future_class(root / "iter_0000010")
    return root


def test_an_unknown_class_is_unsupported_not_damaged(tmp_path):
    root = _root(tmp_path)
    ckpt = root / "iter_0000010"
    with pytest.raises(UnknownClassError, match=NAMED + r".*upgrade ckptd.*allow_unsafe_pickle=True") as caught:
        read_index(ckpt)
    assert isinstance(caught.value, UnsafePickleError) and isinstance(caught.value, UnsupportedFormatError)
    report = verify_checkpoint(ckpt, deep=True)
    assert (report.status, report.errors) == ("UNSUPPORTED", []), report.findings
    [finding] = report.unknown_classes
    assert finding.check == UNKNOWN_CLASS and f"{FUTURE_MODULE}.{FUTURE_CLASS}" in finding.message
    # Trusted, with the writer's library installed, it loads; without it, it is still no damage.
    with future_writer_importable():
        assert verify_checkpoint(ckpt, deep=True, allow_unsafe_pickle=True).status == "OK"
        out = ckptd.load({"embedding": torch.zeros(4, 4, dtype=torch.bfloat16)}, ckpt, allow_unsafe_pickle=True)
        assert torch.equal(out["embedding"], reference_tensors()["embedding"])
    with pytest.raises(UnknownClassError, match=r"cannot be imported here.*install the library"):
        read_index(ckpt, allow_unsafe_pickle=True)
    assert verify_checkpoint(ckpt, allow_unsafe_pickle=True).status == "UNSUPPORTED"


def test_the_resume_raises_rather_than_fall_back_past_it_and_the_trackers_stay(tmp_path):
    root = _root(tmp_path)
    with pytest.raises(UnknownClassError, match=NAMED + r".*never falls back.*move .*iter_0000010 out of the root"):
        resolve_latest(root)
    with pytest.raises(UnknownClassError):
        structural_problem(root / "iter_0000010")
    assert structural_problem(root / "iter_0000010", damage_only=True) is None  # a save of step 10 is refused
    with future_writer_importable():
        choice = resolve_latest(root, allow_unsafe_pickle=True)
        assert choice is not None and choice.step == 10
    # A coordinator start: 10 may be the last commit; not known to be damaged, it is not passed over.
    assert finish_interrupted_commit(root, fsync=False, megatron_tracker=True) is None
    assert not (root / TRACKER_FILE).exists() and (root / MEGATRON_TRACKER).read_text() == "10"


@pytest.mark.parametrize(
    "old, new, why",
    [
        (b"TensorStorageMetadata", b"TensorStorageMetadatb", "one byte off torch.distributed.checkpoint.metadata"),
        (b"TensorStorageMetadata", b"TensorStorage-etadata", "not a Python name"),
        (b"torch.distributed.checkpoint.filesystem", b"importlib.util.checkpoint.filesystem", "standard-library"),
        # A flipped memo reference: a field name in the module's place.
        (b"torch.distributed.checkpoint.filesystem", b"relative_path", "_StorageInfo under a module it is not of"),
    ],
)
def test_a_damaged_class_name_stays_damage(tmp_path, old, new, why):
    ckpt = tmp_path / "c"
    make_checkpoint(ckpt)
    raw = (ckpt / ".metadata").read_bytes()
    assert raw.count(old) == 1
    # The same length keeps the pickle's string and frame lengths: only the name changes.
    (ckpt / ".metadata").write_bytes(raw.replace(old, new.ljust(len(old), b"_")[: len(old)]))
    with pytest.raises(UnsafePickleError, match=why) as caught:
        read_index(ckpt)
    assert not isinstance(caught.value, UnknownClassError)
    assert verify_checkpoint(ckpt).status == "DAMAGED"
    assert "refusing to unpickle it" in (structural_problem(ckpt) or "")


def test_a_damaged_name_that_cannot_be_imported_is_damage_with_unsafe_pickles_too(tmp_path):
    ckpt = tmp_path / "c"
    make_checkpoint(ckpt)
    raw = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(raw.replace(b"TensorStorageMetadata", b"TensorStorageMetadatb"))
    with pytest.raises(CorruptCheckpointError, match="cannot be decoded"):
        read_index(ckpt, allow_unsafe_pickle=True)
