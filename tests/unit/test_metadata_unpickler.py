"""The restricted ``.metadata`` unpickler refuses BUILD on anything it did not create itself: a
pickle must not set attributes on an allow-listed class (``PurePosixPath.__truediv__ = set``
rebinds ``/`` for the whole process) or on a shared enum member, while real checkpoints (ckptd's,
torch DCP's) still load."""

from __future__ import annotations

import pathlib
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItemType

import ckptd
from ckptd.errors import CorruptCheckpointError, UnsafePickleError
from ckptd.format.dcp_metadata import read_index
from tests.checkpoints import make_checkpoint


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _str(s: str) -> bytes:
    data = s.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def _build(target: bytes, attrs: dict[str, bytes], slots: bool) -> bytes:
    """``target`` BUILT with ``attrs`` as its state (``slots``: as proto-2 slot state, which is
    applied with setattr)."""
    state = pickle.EMPTY_DICT + b"".join(_str(k) + v + pickle.SETITEM for k, v in attrs.items())
    if slots:
        state = pickle.NONE + state + pickle.TUPLE2
    return pickle.PROTO + b"\x04" + target + state + pickle.BUILD + pickle.STOP


def _enum_member_built(make: bytes) -> bytes:
    """WriteItemType.TENSOR, got by ``make`` (REDUCE or NEWOBJ of the class with its value), BUILT."""
    target = (
        _global("torch.distributed.checkpoint.planner", "WriteItemType")
        + pickle.BININT1
        + bytes([WriteItemType.TENSOR.value])
        + pickle.TUPLE1
        + make
    )
    return _build(target, {"_value_": pickle.BININT1 + b"\x07"}, slots=False)


HOSTILE = {
    "class PurePosixPath, slot state": (
        pathlib.PurePosixPath,
        "__truediv__",
        _build(_global("pathlib", "PurePosixPath"), {"__truediv__": _global("builtins", "set")}, slots=True),
    ),
    "class Metadata, slot state": (
        Metadata,
        "__eq__",
        _build(
            _global("torch.distributed.checkpoint.metadata", "Metadata"),
            {"__eq__": _global("builtins", "set")},
            slots=True,
        ),
    ),
    # Megatron-Core's subclass is read as DCP's Metadata: that class is as safe from a BUILD.
    "class MCoreMetadata (read as Metadata), slot state": (
        Metadata,
        "__eq__",
        _build(
            _global("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),
            {"__eq__": _global("builtins", "set")},
            slots=True,
        ),
    ),
    "shared enum member": (WriteItemType.TENSOR, "_value_", _enum_member_built(pickle.REDUCE)),
    # NEWOBJ of an enum class: its __new__ returns the shared member, which was taken for an
    # object the pickle had made, so the BUILD after it was allowed.
    "shared enum member, through NEWOBJ": (WriteItemType.TENSOR, "_value_", _enum_member_built(pickle.NEWOBJ)),
}


@pytest.fixture
def restore_on_failure() -> Iterator[None]:
    """Undo what a hostile pickle managed to set, so a failing run does not break later tests."""
    before = {id(obj): (obj, dict(vars(obj))) for obj, _, _ in HOSTILE.values()}
    yield
    for obj, saved in before.values():
        for name in set(vars(obj)) - set(saved):
            delattr(obj, name)
        for name, value in saved.items():
            if vars(obj).get(name) is not value:
                setattr(obj, name, value)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_build_on_an_object_the_pickle_did_not_create_is_refused(case, tmp_path, restore_on_failure):
    obj, attr, payload = HOSTILE[case]
    before = vars(obj).get(attr)
    ckpt = tmp_path / "c"
    make_checkpoint(ckpt)
    (ckpt / ".metadata").write_bytes(payload)
    with pytest.raises(UnsafePickleError, match="tries to set attributes of"):
        read_index(ckpt)
    assert vars(obj).get(attr) is before, f"{case}: {attr} was rebound"
    assert str(pathlib.PurePosixPath("a") / "b") == "a/b"
    assert WriteItemType.TENSOR.value == 1 and WriteItemType(1) is WriteItemType.TENSOR


def test_real_checkpoints_still_unpickle(tmp_path):
    ref = make_checkpoint(tmp_path / "c")
    index = read_index(tmp_path / "c")
    assert isinstance(index.raw, Metadata) and set(index.tensors) == set(ref)
    assert ckptd.load_plain_tensors(tmp_path / "c")["layer.weight"].equal(ref["layer.weight"])
    # Pickles of the same objects other writers make (protocol 2..5) keep loading.
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(index.raw, protocol=protocol))
        assert set(read_index(Path(tmp_path / "c")).tensors) == set(ref)


def test_a_metadata_whose_fields_lost_their_names_is_damaged_not_a_crash(tmp_path):
    """One flipped byte in a field's name BUILDs a Metadata without ``state_dict_metadata`` (found by
    test_fuzz_checkpoints): a CorruptCheckpointError naming the file, not an AttributeError."""
    make_checkpoint(tmp_path)
    raw = (tmp_path / ".metadata").read_bytes()
    assert raw.count(b"state_dict_metadata") == 1
    (tmp_path / ".metadata").write_bytes(raw.replace(b"state_dict_metadata", b"state_dict_metadatb"))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata does not hold a DCP Metadata object"):
        read_index(tmp_path)


def test_a_chunk_list_repeated_by_reference_is_refused_before_it_is_indexed(tmp_path):
    """A chunk repeated by the pickle's memo costs 2 bytes of the file and became a 600-byte
    record: 4 MB of .metadata took 1.2 GB and 14 s before it was refused."""
    import torch

    ckpt = tmp_path / "c"
    ckptd.save({"x": torch.ones(4)}, ckpt)
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    entry = md.state_dict_metadata["x"]
    entry.chunks = [entry.chunks[0]] * 200_000
    (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    with pytest.raises(CorruptCheckpointError, match=r"lists 200000 chunks in \d+ bytes, which cannot hold so many"):
        read_index(ckpt)
