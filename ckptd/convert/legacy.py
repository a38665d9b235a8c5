"""Convert a Megatron-LM legacy (``--ckpt-format torch``) checkpoint into torch_dist.

A legacy checkpoint is one ``torch.save`` file per model-parallel rank::

    <root>/latest_checkpointed_iteration.txt          "100" or "release"
    <root>/iter_0000100/mp_rank_<TP:02d>[_<PP:03d>][_<EP:03d>]/model_optim_rng.pt

each holding ``{"args", "checkpoint_version", "iteration", "model" | "model0".., "optimizer",
"opt_param_scheduler", "rng_state"}`` with the rank's *local* tensors. Nothing in them says how a
tensor was split over tensor-parallel ranks, so :class:`SplitRule` s (regex -> axis) say it;
tensors no rule names must be identical on every TP rank (replicated). Pipeline stages number
their layers locally: the converter counts each stage's layers (and each expert rank's local
experts) and renumbers keys globally, as torch_dist checkpoints name them.

The output holds the model tensors (each TP shard written as a chunk at its global offset, so
nothing is concatenated in memory) and a common state with ``iteration``,
``checkpoint_version``, ``args`` (as a plain dict) and a plain-data ``opt_param_scheduler``.
Optimizer and RNG states are dropped: they are tied to the old layout's flat buffers (Megatron's
own converters drop them too). Files are memory-mapped, so memory use stays small.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import pickle
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ShardingError,
    UnsafePickleError,
)
from ..format.finalize import write_checkpoint
from ..format.items import PlannedItem, serialize_object
from ..format.layout import DCP_METADATA, METADATA_JSON
from ..format.records import TENSOR, ItemRecord, dtype_name, object_record
from ..format.rootlayout import MEGATRON_TRACKER, STEP_PREFIX, step_dir_name
from ..mapping import ShardedObject
from . import mcore

log = logging.getLogger("ckptd.convert")

Progress = Callable[[int, int, str], None]  # (done bytes, total bytes, label)
FILE_NAME = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2,})(?:_(\d{3,}))?(?:_(\d{3,}))?$")
_LAYER = re.compile(r"(?<=layers\.)(\d+)(?=\.)")
_EXPERT = re.compile(r"(?<=local_experts\.)(\d+)(?=\.)")
_STACK = re.compile(r"^(.*?layers)\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class SplitRule:
    """Tensors whose key matches ``pattern`` (``re.search``) are split on ``axis`` over TP ranks.

    ``axis=None``: replicated (checked identical). ``glu=True``: each rank's shard is
    ``[gate_r; up_r]`` along ``axis`` (SwiGLU ``linear_fc1``); the global tensor is
    ``[gate; up]``.
    """

    pattern: str
    axis: int | None
    glu: bool = False

    @classmethod
    def parse(cls, text: str) -> SplitRule:
        """``REGEX=AXIS``, ``REGEX=replicated`` or ``REGEX=glu:AXIS`` (command-line form)."""
        pattern, sep, spec = text.rpartition("=")
        if not sep or not pattern:
            raise ShardingError(f"split rule {text!r} is not REGEX=AXIS|replicated|glu:AXIS")
        try:
            if spec == "replicated":
                return cls(pattern, None)
            if spec.startswith("glu:"):
                return cls(pattern, int(spec[4:]), glu=True)
            return cls(pattern, int(spec))
        except ValueError:
            raise ShardingError(f"split rule {text!r}: axis {spec!r} is not an integer") from None


#: Megatron-Core GPT names first, then legacy (``language_model.*``) names.
DEFAULT_RULES: tuple[SplitRule, ...] = (
    SplitRule(r"(^|\.)word_embeddings\.weight$", 0),
    SplitRule(r"(^|\.)output_layer\.weight$", 0),
    SplitRule(r"\.linear_qkv\.(weight|bias)$", 0),
    SplitRule(r"\.linear_q\.(weight|bias)$", 0),
    SplitRule(r"\.linear_kv\.(weight|bias)$", 0),
    SplitRule(r"\.linear_fc1\.(weight|bias)$", 0),
    SplitRule(r"\.linear_proj\.weight$", 1),
    SplitRule(r"\.linear_fc2\.weight$", 1),
    SplitRule(r"\.query_key_value\.(weight|bias)$", 0),
    SplitRule(r"\.dense_h_to_4h\.(weight|bias)$", 0),
    SplitRule(r"\.self_attention\.dense\.weight$", 1),
    SplitRule(r"\.dense_4h_to_h\.weight$", 1),
)


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


@dataclass
class ConversionReport:
    tensors: int = 0
    chunks: int = 0
    nbytes: int = 0
    objects: int = 0  # ShardedObjects (`_extra_state`) written, with mcore_spec
    skipped: list[str] = field(default_factory=list)
    iteration: Any = None


def resolve_iteration_dir(src: str | os.PathLike) -> Path:
    """``src`` itself if it holds ``mp_rank_*`` directories, else the tracker's iteration."""
    root = Path(src)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root} is not a directory")
    if any(_RANK_DIR.match(p.name) for p in root.iterdir() if p.is_dir()):
        return root
    tracker = root / MEGATRON_TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text != "release" and not text.isdigit():
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


def discover(src: str | os.PathLike, expert_parallel: bool | None = None) -> LegacyTree:
    """Find and check the rank files. Two-number names (``mp_rank_00_001``) are TP+PP unless
    ``expert_parallel`` says TP+EP (None: ask the checkpoint's ``args``)."""
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
        args = _read(parsed[0][0], allow_unsafe_pickle=False, mmap=True, tolerate_unsafe=True).get("args")
        pp = getattr(args, "pipeline_model_parallel_size", None) if args is not None else None
        ep = getattr(args, "expert_model_parallel_size", None) if args is not None else None
        expert_parallel = bool(pp == 1 and ep and ep > 1)
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


def _read(path: Path, allow_unsafe_pickle: bool, mmap: bool = True, tolerate_unsafe: bool = False) -> dict:
    try:
        if allow_unsafe_pickle:
            obj = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        else:
            # Namespace (args) and BytesIO (TransformerEngine `_extra_state`) only hold data.
            with torch.serialization.safe_globals([argparse.Namespace, io.BytesIO]):
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if tolerate_unsafe:
            return {}
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


def _count(pattern: re.Pattern[str], keys: Sequence[str]) -> int:
    found = {int(m.group(1)) for k in keys if (m := pattern.search(k))}
    return max(found) + 1 if found else 0


def _renumber(key: str, layer_offset: int, expert_offset: int) -> str:
    key = _LAYER.sub(lambda m: str(int(m.group(1)) + layer_offset), key, count=1)
    return _EXPERT.sub(lambda m: str(int(m.group(1)) + expert_offset), key, count=1)


def _plain(value: Any) -> Any:
    """Keep JSON-like data only (common.pt must load with weights_only)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


class _Converter:
    def __init__(
        self,
        tree: LegacyTree,
        rules: Sequence[SplitRule],
        allow_unsafe_pickle: bool,
        stack_layers: bool,
        mcore_map: tuple[tuple[str, str], ...] | None,
    ) -> None:
        self.tree = tree
        self.stack_layers = stack_layers
        self.mcore_map = mcore_map  # None: keep the legacy names, drop `_extra_state`
        self.num_layers = 0
        self.rules = [(re.compile(r.pattern), r) for r in rules]
        self.unsafe = allow_unsafe_pickle
        self.report = ConversionReport()
        self.total = sum(f.path.stat().st_size for f in tree.files)
        self.seen: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.skipped: set[str] = set()
        self.objects: set[str] = set()

    def _rule(self, key: str) -> SplitRule | None:
        for regex, rule in self.rules:
            if regex.search(key):
                return rule
        return None

    def layer_offsets(self) -> dict[tuple[int, int], int]:
        """Global first layer of (model chunk, pipeline stage), counting stage by stage."""
        counts: dict[tuple[int, int], int] = {}
        for pp in range(self.tree.pp_size):
            sd = _read(self.tree.file(0, pp, 0).path, self.unsafe)
            for v, chunk in enumerate(model_chunks(sd)):
                counts[(v, pp)] = _count(_LAYER, list(chunk))
        offsets, acc = {}, 0
        for v in range(max(v for v, _ in counts) + 1):
            for pp in range(self.tree.pp_size):
                offsets[(v, pp)] = acc
                acc += counts.get((v, pp), 0)
        self.num_layers = acc
        return offsets

    def chunks_for(self, key: str, shards: list[torch.Tensor]) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """``(payload, global offsets)`` per chunk, and validate the TP split."""
        t0 = shards[0]
        for r, t in enumerate(shards[1:], 1):
            if t.dtype != t0.dtype or t.shape != t0.shape:
                raise ShardingError(
                    f"'{key}': TP rank {r} holds {t.dtype} {tuple(t.shape)} but rank 0 holds "
                    f"{t0.dtype} {tuple(t0.shape)}; legacy TP shards must have equal shapes"
                )
        rule = self._rule(key)
        n = len(shards)
        if n == 1 or rule is None or rule.axis is None:
            if n > 1 and not all(torch.equal(t0, t) for t in shards[1:]):
                raise ShardingError(
                    f"'{key}' differs across tensor-parallel ranks, but "
                    + ("its split rule says replicated" if rule else "no split rule matches it")
                    + "; add a rule (SplitRule / --split 'REGEX=AXIS') saying along which axis it "
                    "is split"
                )
            return [(t0, (0,) * t0.dim())]
        axis = rule.axis
        if not 0 <= axis < t0.dim():
            raise ShardingError(f"'{key}' has shape {tuple(t0.shape)}; split rule axis {axis} does not exist")
        local = t0.shape[axis]
        out = []
        if rule.glu:
            if local % 2:
                raise ShardingError(f"'{key}': a GLU shard needs an even extent on axis {axis}, got {local}")
            half = local // 2
            for r, t in enumerate(shards):
                for part, base in ((0, 0), (1, n * half)):
                    piece = t.narrow(axis, part * half, half)
                    offs = [0] * t0.dim()
                    offs[axis] = base + r * half
                    out.append((piece, tuple(offs)))
            return out
        for r, t in enumerate(shards):
            offs = [0] * t0.dim()
            offs[axis] = r * local
            out.append((t, tuple(offs)))
        return out

    def group(
        self, index: int, pp: int, ep: int, layer_offsets: dict[tuple[int, int], int]
    ) -> tuple[list[PlannedItem], dict, int, str]:
        """The items of output rank ``index`` (pipeline stage ``pp``, expert rank ``ep``: every TP
        rank's file of it merged), TP rank 0's state dict, the input's bytes and a label."""
        files = [self.tree.file(tp, pp, ep) for tp in range(self.tree.tp_size)]
        sds = [_read(f.path, self.unsafe) for f in files]
        group_bytes = sum(f.path.stat().st_size for f in files)
        per_rank = [model_chunks(sd) for sd in sds]
        items: list[PlannedItem] = []
        label = files[0].path.parent.name
        for v, chunk0 in enumerate(per_rank[0]):
            experts = _count(_EXPERT, list(chunk0))
            for key, value in chunk0.items():
                if not isinstance(value, torch.Tensor):
                    if self.mcore_map is not None and mcore.is_extra_state(key) and not ep:
                        gkey = _renumber(key, layer_offsets.get((v, pp), 0), 0)
                        items += self.extra_state(index, gkey, value, key)
                    else:
                        self.skipped.add(key)  # e.g. TransformerEngine `_extra_state`: not a weight
                    continue
                is_expert = _EXPERT.search(key) is not None
                if ep and not is_expert:
                    continue  # replicated over expert-parallel ranks: written by EP rank 0
                gkey = _renumber(key, layer_offsets.get((v, pp), 0), ep * experts if is_expert else 0)
                shards = []
                for r, chunks in enumerate(per_rank):
                    t = chunks[v].get(key)
                    if not isinstance(t, torch.Tensor):
                        raise ShardingError(f"'{key}' is in TP rank 0's file but not in {files[r].path}")
                    shards.append(t)
                pieces = self.chunks_for(gkey, shards)
                gshape = list(shards[0].shape)
                rule = self._rule(gkey)
                if len(shards) > 1 and rule is not None and rule.axis is not None:
                    gshape[rule.axis] *= len(shards)
                if self.mcore_map is not None:
                    gkey = mcore.mcore_key(self.mcore_map, gkey)
                if gkey in self.seen:
                    if self.seen[gkey] != (shards[0].dtype, tuple(gshape)):
                        raise ShardingError(f"'{gkey}' appears in several pipeline stages with different shapes")
                    log.info("'%s' is held by several pipeline stages; keeping the first", gkey)
                    continue
                self.seen[gkey] = (shards[0].dtype, tuple(gshape))
                self.report.tensors += 1
                stacked = _STACK.match(gkey) if self.stack_layers else None
                if stacked:
                    # Megatron-Core's default torch_dist naming: one tensor per layer type with
                    # the layer number as a prepended axis.
                    gkey = f"{stacked.group(1)}.{stacked.group(3)}"
                    layer = int(stacked.group(2))
                    gshape = [self.num_layers] + gshape
                    pieces = [(p.unsqueeze(0), (layer,) + o) for p, o in pieces]
                for payload, offs in pieces:
                    rec = ItemRecord(
                        fqn=gkey,
                        kind=TENSOR,
                        rank=index,
                        dtype=dtype_name(payload.dtype, gkey),
                        global_shape=tuple(gshape),
                        offsets=offs,
                        sizes=tuple(payload.shape),
                    )
                    items.append(PlannedItem(rec, payload))
                    self.report.chunks += 1
                    self.report.nbytes += payload.numel() * payload.element_size()
        return items, sds[0], group_bytes, label

    def extra_state(self, index: int, gkey: str, value: object, key: str) -> list[PlannedItem]:
        """A module's ``_extra_state`` (TP rank 0's) as the ShardedObject Megatron-Core's
        ``sharded_state_dict`` asks for (``make_sharded_object_for_checkpoint``): one element of a
        ``(num_layers,)`` array with stacked layers, else a ``(1,)`` array of its own."""
        if mcore.DROPPED_EXTRA_STATE.search(gkey):
            self.skipped.add(key)
            return []
        gkey = mcore.mcore_key(self.mcore_map or (), gkey)
        stacked = _STACK.match(gkey) if self.stack_layers else None
        if stacked:
            obj = ShardedObject(
                key=f"{stacked.group(1)}.{stacked.group(3)}",
                data=value,
                global_shape=(self.num_layers,),
                global_offset=(int(stacked.group(2)),),
            )
        else:
            obj = ShardedObject(key=gkey, data=value, global_shape=(1,), global_offset=(0,))
        if obj.unique_key in self.objects:
            return []  # held by several pipeline stages (as tensors are, see group())
        self.objects.add(obj.unique_key)
        payload = serialize_object(value, f"ShardedObject '{obj.unique_key}'")
        self.report.objects += 1
        return [PlannedItem(object_record(obj, index), payload)]


def _mcore_map(tree: LegacyTree, spec: str, allow_unsafe_pickle: bool) -> tuple[tuple[str, str], ...]:
    """The key map of ``spec`` (``"auto"``: the spec that wrote the first pipeline stage holding
    layers), once every stage's keys (TP rank 0, expert rank 0) are known to be convertible."""
    stages = []
    for pp in range(tree.pp_size):
        path = tree.file(0, pp, 0).path
        keys = [k for chunk in model_chunks(_read(path, allow_unsafe_pickle)) for k in chunk]
        mcore.check_convertible(keys, str(path))
        stages.append((keys, str(path)))
    if spec == "auto":
        with_layers = [(keys, where) for keys, where in stages if any(_LAYER.search(k) for k in keys)]
        spec = mcore.detect_spec(*with_layers[0]) if with_layers else mcore.detect_spec([], str(tree.directory))
    log.info("naming as a Megatron-Core GPTModel with the %s layer spec", spec)
    return mcore.key_map(spec, [k for keys, _ in stages for k in keys])


def convert_legacy(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    rules: Sequence[SplitRule] = (),
    use_default_rules: bool = True,
    allow_unsafe_pickle: bool = False,
    expert_parallel: bool | None = None,
    glu: bool | None = None,
    stack_layers: bool = False,
    mcore_spec: str | None = None,
    progress: Progress | None = None,
    fsync: bool = True,
) -> ConversionReport:
    """Convert the legacy checkpoint ``src`` (root or iteration dir) into torch_dist at ``dst``.

    ``rules`` come before :data:`DEFAULT_RULES` (first match wins). ``glu`` (default: the
    checkpoint's ``args.swiglu`` / ``args.gated_linear_unit``) stores ``linear_fc1`` TP shards
    ``[gate_r; up_r]`` as ``[gate; up]``, as Megatron-Core's torch_dist does. ``stack_layers``
    names layers as Megatron-Core's default does (``decoder.layers.<name>`` with the layer number
    as a leading axis) instead of ``decoder.layers.<i>.<name>``.

    ``mcore_spec`` (``"local"``, ``"te"`` or ``"auto"``: from the keys) names the layer spec of the
    Megatron-Core GPTModel that wrote the checkpoint; the output then holds what that model's
    ``sharded_state_dict()`` asks for (with ``stack_layers``; without, what it asks for with
    ``metadata={"non_homogeneous_layers": True}``): the spec's key renames and every
    ``_extra_state`` as a ShardedObject (see :mod:`ckptd.convert.mcore`). MoE experts and
    pre-Megatron-Core (``language_model.*``) names are refused. ``progress(done, total, label)``
    is called after each pipeline/expert group. ``dst`` must not hold a checkpoint.
    """
    tree = discover(src, expert_parallel)
    if glu is None:
        args = _read(tree.files[0].path, allow_unsafe_pickle).get("args")
        glu = bool(getattr(args, "swiglu", False) or getattr(args, "gated_linear_unit", False))
    if glu:
        rules = list(rules) + [SplitRule(r"\.linear_fc1\.(weight|bias)$", 0, glu=True)]
    root = Path(dst)
    for marker in (METADATA_JSON, DCP_METADATA):
        if (root / marker).exists():
            raise CheckpointExistsError(f"{root} already holds a checkpoint ({marker} exists)")
    mcore_map = None  # decided (or refused) before anything is written
    if mcore_spec is not None:
        mcore_map = _mcore_map(tree, mcore.check_spec(mcore_spec), allow_unsafe_pickle)
    root.mkdir(parents=True, exist_ok=True)
    conv = _Converter(
        tree,
        list(rules) + (list(DEFAULT_RULES) if use_default_rules else []),
        allow_unsafe_pickle,
        stack_layers,
        mcore_map,
    )
    if progress:
        progress(0, conv.total, "start")
    offsets = conv.layer_offsets()
    first: dict = {}

    def ranks() -> Iterator[list[PlannedItem]]:
        """One output rank per pipeline stage and expert rank; progress once its file is written."""
        groups = [(pp, ep) for pp in range(tree.pp_size) for ep in range(tree.ep_size)]
        done = 0
        for index, (pp, ep) in enumerate(groups):
            items, sd0, group_bytes, label = conv.group(index, pp, ep, offsets)
            if index == 0:
                first.update(sd0)
            yield items
            done += group_bytes
            if progress:
                progress(done, conv.total, label)

    def common() -> dict:
        return {
            "iteration": first.get("iteration"),
            "checkpoint_version": first.get("checkpoint_version"),
            "args": _plain(vars(first["args"]))
            if hasattr(first.get("args"), "__dict__")
            else _plain(first.get("args")),
            "opt_param_scheduler": _plain(first.get("opt_param_scheduler")),
            "converted_from": {"format": "megatron-legacy", "tp": tree.tp_size, "pp": tree.pp_size, "ep": tree.ep_size},
        }

    write_checkpoint(root, ranks(), common, fsync=fsync)
    conv.report.iteration = first.get("iteration")
    conv.report.skipped = sorted(conv.skipped)
    log.info(
        "converted %s -> %s: %d tensors, %d chunks, %.1f MiB",
        tree.directory,
        root,
        conv.report.tensors,
        conv.report.chunks,
        conv.report.nbytes / 2**20,
    )
    return conv.report
