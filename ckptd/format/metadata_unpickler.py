"""Reading the DCP ``.metadata`` pickle: an allow-list unpickler, so that a hostile ``.metadata``
cannot run code unless the caller explicitly allows unsafe pickles.

The allow-list holds the classes torch DCP's ``Metadata`` is made of, and the subclasses of them
Megatron-Core pickles, which are read as the DCP classes they extend (:data:`STAND_INS`). A class
it refuses is damage (UnsafePickleError) when its name is no Python name, is of the standard
library (``posix.system``) or is what bit rot makes of a name it admits (:func:`_damage`); any
other is a class ckptd does not know, most likely a newer torch's or Megatron-Core's
(UnknownClassError): not damage.
"""

from __future__ import annotations

import enum
import io
import os
import pickle
import sys
from collections.abc import Callable
from typing import Any, BinaryIO, ClassVar

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from ..errors import UnknownClassError, UnsafePickleError
from .layout import DCP_METADATA

_ALLOWED_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    # Megatron-Core records every rank's save plan in `all_local_plans`.
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    # torch DCP's FileSystemWriter records its checkpoint_id (a path) in StorageMeta.
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}

# Megatron-Core up to 0.15 subclasses two DCP classes to add a field `mcore_data`: each rank's plan
# in `all_local_plans` is an MCoreSavePlan, and 0.15 pickles the whole object as an MCoreMetadata
# (tests/interop/test_megatron_core_files.py reads files 0.13 and 0.15 wrote).
# Each is read as the DCP class it extends, its fields (`mcore_data` among them) becoming plain
# attributes of that object: ckptd reads Metadata's `mcore_data` (ckptd.loading.view.grid_shapes)
# and nothing of the plans. No Megatron code is imported or run (Megatron-Core 0.16 itself keeps
# empty classes of these names, only so that such files unpickle). Refused, a resume took those
# checkpoints for damaged and fell back past them.
_MEGATRON_TORCH = "megatron.core.dist_checkpointing.strategies.torch"
STAND_INS: dict[tuple[str, str], type] = {
    (_MEGATRON_TORCH, "MCoreMetadata"): Metadata,
    (_MEGATRON_TORCH, "MCoreSavePlan"): SavePlan,
}


class MetadataUnpickler(pickle._Unpickler):
    """Allow-listed globals only, and BUILD only on objects this unpickling created with NEWOBJ.

    pickle's Python unpickler, not the C one, because BUILD must be checked: with the C one a
    pickle could push an allow-listed class (or a shared enum member) and BUILD it, setting
    attributes process-wide (``PurePosixPath.__truediv__ = ...``). Here such a BUILD is refused
    with UnsafePickleError before anything is set. The price, measured on the 2-core CI machine:
    2,000 chunks (0.4 MB) 0.24 s against 0.02 s with the C unpickler, 10,000 chunks (2 MB) 1.3 s
    against 0.22 s; ``allow_unsafe_pickle`` uses the C unpickler (:func:`unpickle_metadata`).
    """

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # pickle's Python unpickler keeps its stack here while it loads

    def __init__(self, file: BinaryIO, where: str | os.PathLike = DCP_METADATA) -> None:
        super().__init__(file)
        self._where = where
        # Objects NEWOBJ created here, kept alive so that no other object can reuse their id.
        self._fresh: dict[int, object] = {}

    def find_class(self, module: str, name: str) -> object:
        stand_in = STAND_INS.get((module, name))
        if stand_in is not None:
            return stand_in
        if (module, name) in _ALLOWED_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_ENUMS):
            return getattr(torch, name)
        damage = _damage(module, name)
        if damage is not None:
            raise UnsafePickleError(
                f"{self._where} references {module:.200}.{name:.200}, which is not part of the DCP metadata "
                f"format ({damage}); refusing to unpickle it: the file is damaged or hostile. Load an "
                "earlier checkpoint."
            )
        raise UnknownClassError(
            f"{self._where} names the class {module:.200}.{name:.200}, which this ckptd does not know (it is not "
            "part of the DCP metadata format ckptd reads: most likely a newer torch's or Megatron-Core's). "
            "The checkpoint is not known to be damaged, and it is not loaded: upgrade ckptd to a version "
            "that reads it, or, if you trust this checkpoint, pass allow_unsafe_pickle=True "
            "(--allow-unsafe-pickle), which unpickles whatever it names."
        )

    def _load_newobj(self) -> None:
        pickle._Unpickler.load_newobj(self)  # type: ignore[attr-defined]
        self._mark_fresh(self.stack[-1])

    def _load_newobj_ex(self) -> None:
        pickle._Unpickler.load_newobj_ex(self)  # type: ignore[attr-defined]
        self._mark_fresh(self.stack[-1])

    def _mark_fresh(self, obj: object) -> None:
        # An enum's __new__ returns its shared member, which a BUILD would change for the whole
        # process (a later dcp.save then wrote .metadata no process could load).
        if not isinstance(obj, enum.Enum):
            self._fresh[id(obj)] = obj

    def _load_build(self) -> None:
        target = self.stack[-2] if len(self.stack) >= 2 else None  # stack: ..., target, state
        if target is not None and (id(target) not in self._fresh or isinstance(target, type)):
            what = (
                f"class {target.__module__}.{target.__qualname__}"
                if isinstance(target, type)
                else f"a {type(target).__name__} it did not create"
            )
            raise UnsafePickleError(
                f"{self._where} tries to set attributes of {what}; DCP metadata never does "
                "this, and it would change that object for the whole process. Refusing to "
                "unpickle it: the file is damaged or hostile."
            )
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BUILD[0]] = _load_build


class _UnsafeUnpickler(pickle.Unpickler):
    """``allow_unsafe_pickle``: any global, but Megatron-Core's subclasses read as DCP's all the
    same (a process without Megatron-Core 0.15 or older cannot import them; 0.16's are empty)."""

    def __init__(self, file: BinaryIO, where: str | os.PathLike) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        stand_in = STAND_INS.get((module, name))
        if stand_in is not None:
            return stand_in
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError) as exc:
            if _damage(module, name) is not None:
                raise  # a damaged name: the caller reports the file damaged
            raise UnknownClassError(
                f"{self._where} names the class {module:.200}.{name:.200}, which cannot be imported here ({exc}). "
                "The checkpoint is not known to be damaged: install the library that defines the class "
                "(the torch or Megatron-Core version that wrote the checkpoint), or upgrade ckptd."
            ) from exc


def unpickle_metadata(raw: bytes, allow_unsafe_pickle: bool, where: str | os.PathLike = DCP_METADATA) -> object:
    """The object a ``.metadata`` pickle (the file ``where``) holds: UnsafePickleError for a class
    the allow-list refuses as damaged or hostile, UnknownClassError for one ckptd does not know
    (with ``allow_unsafe_pickle``: one that cannot be imported)."""
    if allow_unsafe_pickle:
        return _UnsafeUnpickler(io.BytesIO(raw), where).load()
    return MetadataUnpickler(io.BytesIO(raw), where).load()


_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)


def _damage(module: str, name: str) -> str | None:
    """Why the global ``module.name`` the allow-list refused cannot be another writer's class (the
    file is damaged or hostile), or None: a class ckptd does not know. An unknown class is no
    damage (taken for damage, a resume fell back past an intact checkpoint, and a save of its step
    replaced it), but bit rot in a name ckptd knows stays damage: a flipped bit changes one byte of
    the name and keeps its length, or, in a memo reference, puts another of the file's strings in
    the module's or the name's place (a class name, a field name, another module)."""
    if not all(part.isidentifier() for part in module.split(".")) or not name.isidentifier():
        return "not a Python name"
    if module != module.lower():
        return "no module's name"
    if module.split(".")[0] in sys.stdlib_module_names:
        return "a standard-library object, which no DCP metadata holds"
    known = {(m, n) for m, n in _ALLOWED_CLASSES | set(STAND_INS)}
    known |= {("torch", n) for n, v in vars(torch).items() if isinstance(v, _TORCH_ENUMS)}
    modules, names = {m for m, _ in known}, {n for _, n in known}
    if module in names:
        return f"the name {module} in a module's place"
    # A known name in another known module, or in a one-word one (a field's name); not in any other
    # module: a class can move to another package's.
    if name in names and (module in modules or "." not in module):
        return f"the name {name} under a module it is not of"
    qualified = f"{module}.{name}"
    for k in sorted(f"{m}.{n}" for m, n in known):
        if len(k) == len(qualified) and sum(a != b for a, b in zip(k, qualified)) == 1:
            return f"one byte off {k}"
    return None
