"""The rank files of a Megatron-LM legacy (``--ckpt-format torch``) checkpoint: where they are, which
(TP, PP, EP) rank each is, and reading one (see :mod:`ckptd.convert.legacy`)."""

from __future__ import annotations

import argparse
import io
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, ShardingError, UnsafePickleError
from ..format.rootlayout import MEGATRON_TRACKER, STEP_PREFIX, TRACKER_MAX_NBYTES, step_dir_name
from ..format.safefs import read_regular

FILE_NAME = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2,})(?:_(\d{3,}))?(?:_(\d{3,}))?$")


@dataclass(frozen=True)
class RankFile:
    path: Path
    tp: int
    pp: int
    ep: int


@dataclass
class LegacyTree:
    """The rank files of one legacy iteration directory."""

    directory: Path
    files: list[RankFile]
    tp_size: int
    pp_size: int
    ep_size: int

    def file(self, tp: int, pp: int, ep: int) -> RankFile:
        return self._by_rank[(tp, pp, ep)]

    def __post_init__(self) -> None:
        self._by_rank = {(f.tp, f.pp, f.ep): f for f in self.files}


def resolve_iteration_dir(src: str | os.PathLike) -> Path:
    """``src`` itself if it holds ``mp_rank_*`` directories, else the tracker's iteration."""
    root = Path(src)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root} is not a directory")
    if any(_RANK_DIR.match(p.name) for p in root.iterdir() if p.is_dir()):
        return root
    tracker = root / MEGATRON_TRACKER
    if tracker.is_file():
        try:
            text = read_regular(root, MEGATRON_TRACKER, "Megatron-LM tracker", TRACKER_MAX_NBYTES).decode().strip()
        except (OSError, CorruptCheckpointError, UnicodeDecodeError) as exc:
            raise CheckpointNotFoundError(
                f"{tracker} cannot be read ({exc}); pass the iteration directory itself"
            ) from None
        if text != "release" and not (text.isascii() and text.isdigit()):
            raise CheckpointNotFoundError(
                f"{tracker} holds {text[:80]!r}, neither an iteration number nor "
                "'release'; pass the iteration directory itself"
            )
        sub = root / ("release" if text == "release" else step_dir_name(int(text)))
        if sub.is_dir():
            return sub
        raise CheckpointNotFoundError(f"{tracker} names {text!r} but {sub} does not exist")
    raise CheckpointNotFoundError(
        f"{root} holds no mp_rank_* directories and no {MEGATRON_TRACKER}; pass a legacy Megatron "
        f"checkpoint root or one of its {STEP_PREFIX}* directories"
    )


def discover(
    src: str | os.PathLike, expert_parallel: bool | None = None, allow_unsafe_pickle: bool = False
) -> LegacyTree:
    """Find and check the rank files. Two-number names (``mp_rank_00_001``) are TP+PP or TP+EP:
    ``expert_parallel`` says which (None: the checkpoint's ``args`` say, read with
    ``allow_unsafe_pickle``; where they cannot tell, this raises rather than guess)."""
    directory = resolve_iteration_dir(src)
    parsed: list[tuple[Path, tuple[int, ...]]] = []
    for p in sorted(directory.iterdir()):
        m = _RANK_DIR.match(p.name)
        if m and p.is_dir():
            if not (p / FILE_NAME).is_file():
                raise CheckpointNotFoundError(f"{p} has no {FILE_NAME}; the checkpoint is incomplete")
            parsed.append((p / FILE_NAME, tuple(int(g) for g in m.groups() if g is not None)))
    if not parsed:
        raise CheckpointNotFoundError(f"{directory} holds no mp_rank_* directories")
    widths = {len(n) for _, n in parsed}
    if len(widths) > 1:
        raise CheckpointNotFoundError(f"{directory} mixes mp_rank_* naming schemes: {sorted(widths)}")
    width = widths.pop()
    if width == 2 and expert_parallel is None:
        expert_parallel = _second_number_is_ep(parsed[0][0], 1 + max(n[1] for _, n in parsed), allow_unsafe_pickle)
    files = []
    for path, nums in parsed:
        tp = nums[0]
        pp = nums[1] if width >= 2 and not (width == 2 and expert_parallel) else 0
        ep = nums[2] if width == 3 else (nums[1] if width == 2 and expert_parallel else 0)
        files.append(RankFile(path, tp, pp, ep))
    sizes = [max(getattr(f, a) for f in files) + 1 for a in ("tp", "pp", "ep")]
    have = {(f.tp, f.pp, f.ep) for f in files}
    missing = [
        (t, p, e) for t in range(sizes[0]) for p in range(sizes[1]) for e in range(sizes[2]) if (t, p, e) not in have
    ]
    if missing:
        raise CheckpointNotFoundError(
            f"{directory} is incomplete: no rank file for (tp, pp, ep) {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}"
        )
    return LegacyTree(directory, files, *sizes)


def _second_number_is_ep(path: Path, count: int, allow_unsafe_pickle: bool) -> bool:
    """Whether ``mp_rank_TT_NNN`` numbers expert ranks (Megatron-LM appends ``_PPP`` when
    pipeline-parallel, then ``_EEE`` when expert-parallel), from ``path``'s ``args``. Guessing wrong
    is silent (each expert rank taken for a pipeline stage, or the reverse), so anything short of
    sizes that say it raises. An UnsafePickleError (numpy RNG states) says to allow unsafe pickles:
    the rank files cannot be converted without that anyway."""
    args = read_rank_file(path, allow_unsafe_pickle).get("args")
    get = args.get if isinstance(args, dict) else lambda name: getattr(args, name, None)
    pp, ep = get("pipeline_model_parallel_size"), get("expert_model_parallel_size")
    if isinstance(pp, int) and pp > 1 and (ep is None or (isinstance(ep, int) and ep <= 1)) and pp == count:
        return False
    if pp == 1 and isinstance(ep, int) and ep > 1 and ep == count:
        return True
    raise ShardingError(
        f"cannot tell whether the second number of {path.parent.parent}'s mp_rank_TT_NNN directories "
        f"({count} values) is a pipeline stage or an expert-parallel rank: the args in {path} "
        + (
            "are missing"
            if args is None
            else f"say pipeline_model_parallel_size={pp!r}, expert_model_parallel_size={ep!r}"
        )
        + ". Say which: expert_parallel=True (--expert-parallel) for TP x EP, False "
        "(--no-expert-parallel) for TP x PP"
    )


def read_rank_file(path: Path, allow_unsafe_pickle: bool, mmap: bool = True) -> dict:
    """A rank file's dict (memory-mapped), weights-only unless ``allow_unsafe_pickle``."""
    try:
        if allow_unsafe_pickle:
            obj = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        else:
            # Namespace (args) and BytesIO (TransformerEngine `_extra_state`) only hold data.
            with torch.serialization.safe_globals([argparse.Namespace, io.BytesIO]):
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln or "global" in ln]
        raise UnsafePickleError(
            f"{path} holds objects outside torch's weights-only allow-list "
            f"({lines[0] if lines else str(exc).splitlines()[0]}); "
            "legacy Megatron files usually do (numpy RNG states). If you trust the checkpoint, "
            "convert with allow_unsafe_pickle=True (--allow-unsafe-pickle)."
        ) from exc
    except Exception as exc:
        raise CheckpointNotFoundError(f"{path} cannot be read as a torch.save file ({exc!r})") from exc
    if not isinstance(obj, dict):
        raise CheckpointNotFoundError(f"{path} holds a {type(obj).__name__}, not a Megatron state dict")
    return obj


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def model_chunks(sd: dict) -> list[dict[str, Any]]:
    """The flattened model state dict(s): ``model`` or ``model0``, ``model1``.. (virtual pipeline)."""
    if "model" in sd:
        names = ["model"]
    else:
        names = sorted((k for k in sd if re.fullmatch(r"model\d+", str(k))), key=lambda k: int(k[5:]))
    if not names:
        raise CheckpointNotFoundError("the rank file has no 'model' entry")
    out = []
    for n in names:
        flat: dict[str, Any] = {}
        _flatten("", sd[n], flat)
        out.append(flat)
    return out


def check_same_entries(per_rank: list[list[dict[str, Any]]], files: list[RankFile]) -> None:
    """Raise ShardingError unless every TP rank's model chunks (``per_rank``, read from ``files``)
    hold the entries TP rank 0's do: a conversion writes TP rank 0's keys, and a tensor only
    another rank holds would be left out of the checkpoint, silently."""
    first = per_rank[0]
    for r, chunks in enumerate(per_rank[1:], start=1):
        extra = sorted({k for v, c in enumerate(chunks) for k in c if v >= len(first) or k not in first[v]})
        if len(chunks) != len(first) or extra:
            raise ShardingError(
                f"{files[r].path} holds {len(chunks)} model chunk(s) and entries TP rank 0's file {files[0].path} "
                f"({len(first)} chunk(s)) lacks: {extra[:5]}; the TP ranks of one pipeline stage must hold the "
                "same entries. Is the checkpoint complete and from one run?"
            )
