"""Property-based fuzzing of real checkpoints written by ckptd: bit flips, truncation, type swaps in
``metadata.json``, pickle mutations of ``.metadata`` and ``common.pt``, and directories, FIFOs and
links in place of files. Whatever the damage, load, load_common_state_dict, verify (deep),
inspect and resolve_latest raise only CkptdError subclasses, every case ends (the test has a
timeout; a FIFO must not block), and the CLI (in process here; as real processes in the last
test) exits 0 or 1 with a one-line message, never a traceback (``verify`` also 3: a flip can make
a name in ``.metadata`` one no class of ckptd's has, which is a class ckptd does not know, not
damage; of the 12,544 single-bit flips of a 1.5 KB ``.metadata`` one does).

The default run takes ~150 examples; ``-m slow`` runs 3,000.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import pickle
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ckptd
from ckptd.cli import build_parser
from ckptd.describe import describe_checkpoint
from ckptd.errors import CkptdError
from ckptd.format.dcp_metadata import CHECKSUMS_ATTR
from ckptd.format.rootlayout import step_dir_name
from ckptd.recovery import resolve_latest
from ckptd.verify import verify_checkpoint
from tests.checkpoints import make_checkpoint, reference_tensors
from tests.cli import offline_cli
from tests.integration.test_cli import _env

FILES = ["metadata.json", ".metadata", "common.pt", "__0_0.distcp", "__1_0.distcp"]

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.sampled_from(["", ".", "..", "../outside", "a/b", "x\x00y", "__9_0.distcp", "torch_dist"])
    | st.text(max_size=6)
)
JSON = st.recursive(
    _scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=8,
)
# Values the restricted .metadata unpickler may decode: builtins, torch.Size and dtypes.
PICKLABLE = st.recursive(
    _scalars
    | st.sampled_from([torch.float32, torch.int64, torch.bool])
    | st.binary(max_size=8)
    | st.lists(st.integers(-5, 2**65), max_size=3).map(torch.Size),
    lambda kids: (
        st.lists(kids, max_size=3)
        | st.lists(kids, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=4) | st.integers(), kids, max_size=3)
    ),
    max_leaves=8,
)
METADATA_TARGETS = [
    "tensor size",
    "tensor dtype",
    "tensor properties",
    "tensor chunks",
    "chunk offsets",
    "chunk sizes",
    "storage path",
    "storage offset",
    "storage length",
    "storage entry",
    "storage key",
    "state_dict_metadata",
    "storage_data",
    "planner_data",
    "checksums",
    "checksum items",
    "checksum files",
    "whole object",
]

MUTATIONS = st.one_of(
    st.tuples(
        st.just("flip"), st.sampled_from(FILES), st.lists(st.floats(0, 1), min_size=1, max_size=4), st.integers(0, 7)
    ),
    st.tuples(st.just("truncate"), st.sampled_from(FILES), st.floats(0, 1)),
    st.tuples(
        st.just("json value"),
        st.sampled_from(
            ["sharded_backend", "sharded_backend_version", "common_backend", "common_backend_version", "x"]
        ),
        JSON,
    ),
    st.tuples(st.just("json document"), JSON),
    st.tuples(
        st.just("deep nesting"),
        st.sampled_from(["metadata.json", ".metadata", "common.pt"]),
        st.sampled_from([100, 5000, 200_000]),
    ),
    st.tuples(st.just("metadata field"), st.sampled_from(METADATA_TARGETS), PICKLABLE),
    st.tuples(st.just("common object"), PICKLABLE),
    st.tuples(
        st.just("replace"),
        st.sampled_from(FILES),
        st.sampled_from(["directory", "fifo", "dangling link", "link out", "empty", "missing"]),
    ),
)


def _deep(kind: str, depth: int) -> bytes:
    if kind == "metadata.json":
        return b"[" * depth + b"]" * depth
    # A list nested ``depth`` times: MARK x depth, [], then LIST x depth (each wraps the top).
    return pickle.PROTO + b"\x02" + pickle.MARK * depth + pickle.EMPTY_LIST + pickle.LIST * depth + pickle.STOP


def _mutate_metadata(md: Any, target: str, value: Any) -> Any:
    md = copy.deepcopy(md)
    tensor = next(v for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))
    key, info = next(iter(md.storage_data.items()))
    if target == "tensor size":
        tensor.size = value
    elif target == "tensor dtype":
        tensor.properties.dtype = value
    elif target == "tensor properties":
        tensor.properties = value
    elif target == "tensor chunks":
        tensor.chunks = value
    elif target == "chunk offsets":
        tensor.chunks[0].offsets = value
    elif target == "chunk sizes":
        tensor.chunks[0].sizes = value
    elif target == "storage path":
        info.relative_path = value
    elif target == "storage offset":
        info.offset = value
    elif target == "storage length":
        info.length = value
    elif target == "storage entry":
        md.storage_data[key] = value
    elif target == "storage key":
        md.storage_data[value if _hashable(value) else repr(value)] = md.storage_data.pop(key)
    elif target in ("state_dict_metadata", "storage_data", "planner_data"):
        setattr(md, target, value)
    elif target == "checksums":
        setattr(md, CHECKSUMS_ATTR, value)
    elif target in ("checksum items", "checksum files"):
        getattr(md, CHECKSUMS_ATTR)[target.split()[1]] = value
    else:
        return value
    return md


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def apply(ckpt: Path, mutation: tuple, outside: Path, original: Path) -> None:
    """Damage ``ckpt`` by ``mutation``; ``original`` is an intact copy (field mutations start from
    its ``.metadata``: unpickling a damaged one without restrictions would be unsafe here too)."""
    kind, *args = mutation
    if kind in ("flip", "truncate"):
        path = ckpt / args[0]
        data = bytearray(path.read_bytes())
        if kind == "truncate":
            del data[int(len(data) * args[1]) :]
        elif data:  # nothing to flip in an empty file
            for where in args[1]:
                data[min(int(len(data) * where), len(data) - 1)] ^= 1 << args[2]
        path.write_bytes(bytes(data))
    elif kind == "json value":
        meta = json.loads((ckpt / "metadata.json").read_text())
        meta[args[0]] = args[1]
        (ckpt / "metadata.json").write_text(json.dumps(meta))
    elif kind == "json document":
        (ckpt / "metadata.json").write_text(json.dumps(args[0]))
    elif kind == "deep nesting":
        (ckpt / args[0]).write_bytes(_deep(args[0], args[1]))
    elif kind == "metadata field":
        md = pickle.loads((original / ".metadata").read_bytes())  # ckptd's own intact file
        (ckpt / ".metadata").write_bytes(pickle.dumps(_mutate_metadata(md, args[0], args[1])))
    elif kind == "common object":
        torch.save(args[0], ckpt / "common.pt")
    else:
        name, how = args
        path = ckpt / name
        path.unlink()
        if how == "directory":
            path.mkdir()
        elif how == "fifo":
            os.mkfifo(path)
        elif how == "dangling link":
            path.symlink_to(outside / "nothing-here")
        elif how == "link out":
            path.symlink_to(outside / "file")
        elif how == "empty":
            path.write_bytes(b"")


def _template() -> dict[str, Any]:
    sd: dict[str, Any] = {
        k: ckptd.ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in reference_tensors().items()
    }
    sd["rng"] = ckptd.ShardedObject("rng", None, (2,), (0,))
    return sd


def _cli(*argv: str) -> int:
    args = build_parser().parse_args([str(a) for a in argv])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = args.func(args)  # anything but a CkptdError (or OSError) escapes and fails the test
    assert rc in ((0, 1, 3) if argv[0] == "verify" else (0, 1)), (argv, rc)
    return rc


def check_only_ckptd_errors(root: Path) -> None:
    """Every reader on ``root/iter_0000001`` ends with a result or a CkptdError."""
    ckpt = root / "iter_0000001"
    for read in (
        lambda: ckptd.load(_template(), ckpt),
        lambda: ckptd.load_common_state_dict(ckpt),
        lambda: describe_checkpoint(ckpt),
        lambda: resolve_latest(root),
    ):
        try:
            read()
        except CkptdError:
            pass
    verify_checkpoint(ckpt, deep=True)  # damage is a finding; only a non-directory raises
    _cli("verify", ckpt, "--deep")
    _cli("inspect", ckpt)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("fuzz")
    make_checkpoint(base / "root" / "iter_0000001")
    (base / "root" / "latest").write_text("iter_0000001\n")
    (base / "outside").mkdir()
    (base / "outside" / "file").write_bytes(b"not part of any checkpoint")
    return base


# The file each kind of mutation rewrites (flip, truncate, replace and deep nesting name theirs).
_TARGETS = {
    "json value": "metadata.json",
    "json document": "metadata.json",
    "metadata field": ".metadata",
    "common object": "common.pt",
}
_NEEDS_THE_FILE = ("flip", "truncate", "replace", "json value")  # they read it first


def _applicable(ckpt: Path, mutation: tuple) -> bool:
    """Whether ``mutation`` can be applied by this test: its file is a regular file, or absent for
    a mutation that only writes. An earlier mutation may have left a FIFO there (the test's own
    open would block on it: the readers under test must not), a link out of the checkpoint (the
    test would damage what it points to) or a directory."""
    try:
        st_ = os.lstat(ckpt / _TARGETS.get(mutation[0], mutation[1]))
    except FileNotFoundError:
        return mutation[0] not in _NEEDS_THE_FILE
    return stat.S_ISREG(st_.st_mode)


def _fuzz(pristine: Path, mutations: list[tuple]) -> None:
    with tempfile.TemporaryDirectory(dir=pristine) as work:
        root = Path(work) / "root"
        shutil.copytree(pristine / "root", root)
        for m in mutations:
            if _applicable(root / "iter_0000001", m):
                try:
                    apply(root / "iter_0000001", m, pristine / "outside", pristine / "root" / "iter_0000001")
                except (OSError, ValueError, TypeError, AttributeError, KeyError, StopIteration, RuntimeError):
                    pass  # an earlier mutation left nothing this one can act on (e.g. JSON to edit)
        check_only_ckptd_errors(root)


_SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
}


@pytest.mark.timeout(300)
@settings(max_examples=150, **_SETTINGS)
@given(mutations=st.lists(MUTATIONS, min_size=1, max_size=3))
# A file an earlier mutation replaced by a FIFO or a link out is not rewritten by a later one (the
# test's own open of the FIFO blocked forever).
@example(mutations=[("replace", "common.pt", "fifo"), ("deep nesting", "common.pt", 100)])
@example(mutations=[("replace", "metadata.json", "link out"), ("json document", [1])])
# A flipped bit in common.pt's central directory (a record's header offset -1), read without a
# recorded checksum: the archive check's seek raised ValueError.
@example(mutations=[("flip", "common.pt", [0.9609375], 0), ("truncate", ".metadata", 0.0)])
# A flag zipfile refuses with NotImplementedError (bit 5) or RuntimeError (bit 0: encrypted) in
# common.pt's local header, checked against its archive's CRC-32s (no checksum table to go by).
@example(
    mutations=[
        ("flip", "metadata.json", [0.0], 0),
        ("flip", ".metadata", [0.0], 0),
        ("flip", "common.pt", [0.7702843493395239], 5),
    ]
)
@example(
    mutations=[
        ("flip", "metadata.json", [0.0], 0),
        ("flip", ".metadata", [0.0], 0),
        ("flip", "common.pt", [0.7702843493395239], 0),
    ]
)
def test_damaged_checkpoints_raise_only_ckptd_errors(pristine, mutations):
    _fuzz(pristine, mutations)
    assert (pristine / "outside" / "file").read_bytes() == b"not part of any checkpoint"


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=3000, **_SETTINGS)
@given(mutations=st.lists(MUTATIONS, min_size=1, max_size=4))
def test_damaged_checkpoints_raise_only_ckptd_errors_long(pristine, mutations):
    _fuzz(pristine, mutations)


@pytest.mark.timeout(180)
def test_the_cli_exits_1_without_a_traceback_on_damage(tmp_path):
    """Real processes on a root of checkpoints damaged in the ways that escaped as tracebacks."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "file").write_bytes(b"x")
    damage = [
        ("deep nesting", "metadata.json", 200_000),
        ("json value", "sharded_backend", [1]),
        ("replace", ".metadata", "directory"),
        ("metadata field", "chunk offsets", "ab"),
        ("metadata field", "storage path", "../outside"),
        ("replace", "common.pt", "fifo"),
    ]
    root = tmp_path / "root"
    for step, mutation in enumerate(damage, start=1):
        make_checkpoint(root / step_dir_name(step))
        apply(root / step_dir_name(step), mutation, outside, root / step_dir_name(step))
    (root / "latest").write_text(f"{step_dir_name(len(damage))}\n")
    for argv in (["verify", root, "--all", "--deep"], ["inspect", root / "iter_0000003"]):
        p = offline_cli(*argv, env=_env(), timeout_s=150)
        assert p.returncode == 1 and "Traceback" not in p.stderr, (argv, p.returncode, p.stdout[-2000:], p.stderr)
