"""Convert a Megatron-LM legacy (``--ckpt-format torch``) checkpoint into torch_dist.

A legacy checkpoint is one ``torch.save`` file per model-parallel rank::

    <root>/latest_checkpointed_iteration.txt          "100" or "release"
    <root>/iter_0000100/mp_rank_<TP:02d>[_<PP:03d>][_<EP:03d>]/model_optim_rng.pt

each holding ``{"args", "checkpoint_version", "iteration", "model" | "model0".., "optimizer",
"opt_param_scheduler", "rng_state"}`` with the rank's *local* tensors. Nothing in them says how a
tensor was split over tensor-parallel ranks, so :class:`SplitRule` s (regex -> axis) say it;
tensors no rule names must be identical on every TP rank (replicated): :mod:`.tpshards`. Pipeline
stages number their layers locally: the converter counts each stage's layers (and each expert
rank's local experts) and renumbers keys globally, as torch_dist checkpoints name them. Two-number rank
directories are TP x PP or TP x EP as the files' ``args`` say (never guessed). Expert ranks' tensors
outside their experts module must equal expert rank 0's; grouped-GEMM experts are written as
Megatron-Core stores them (:mod:`.experts`); any other per-expert-rank tensor is refused.

The output holds the model tensors (each TP shard written as a chunk at its global offset, so
nothing is concatenated in memory) and a common state with ``iteration``,
``checkpoint_version``, ``args`` (as a plain dict), a plain-data ``opt_param_scheduler`` and
``num_floating_point_operations_so_far``. Optimizer and RNG states are dropped: they are tied to the
old layout's flat buffers (Megatron's own converters drop them too); the report names every
top-level entry dropped, and every other file of the rank directories (a distributed optimizer's
``distrib_optim.pt``), which is not read (``ConversionReport.dropped``). Fused query/key/value
tensors of ``checkpoint_version`` < 2.0 are refused (:func:`_check_qkv_layout`). Files are memory-mapped, so memory use
stays small. A conversion that fails removes the files it wrote and the directories it made.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointExistsError, OutputInsideCheckpointError, ShardingError
from ..format.finalize import write_checkpoint
from ..format.items import PlannedItem, serialize_object
from ..format.layout import DCP_METADATA, METADATA_JSON
from ..format.records import TENSOR, ItemRecord, dtype_name, object_record
from ..mapping import ShardedObject
from . import experts as moe
from . import mcore, stacking
from .legacy_tree import LegacyTree, RankFile, check_same_entries, discover, model_chunks, read_rank_file
from .splitrules import DEFAULT_RULES, GLU_RULE, SplitRule
from .tpshards import global_shape, tp_chunks
from .undo import undone_on_failure

log = logging.getLogger("ckptd.convert")

Progress = Callable[[int, int, str], None]  # (done bytes, total bytes, label)
_EXPERT = re.compile(r"(?<=local_experts\.)(\d+)(?=\.)")


@dataclass
class ConversionReport:
    tensors: int = 0
    chunks: int = 0
    nbytes: int = 0
    objects: int = 0  # ShardedObjects (`_extra_state`) written, with mcore_spec
    skipped: list[str] = field(default_factory=list)
    # Top-level entries of the rank files not carried over (optimizer and RNG states, a rerun
    # state machine's: tied to the old layout or to one rank), then the other files of the rank
    # directories (a distributed optimizer's distrib_optim.pt).
    dropped: list[str] = field(default_factory=list)
    iteration: Any = None


_FUSED_QKV = (".query_key_value.weight", ".query_key_value.bias", ".key_value.weight", ".key_value.bias")


def _check_qkv_layout(sd: Mapping[str, Any], tree: LegacyTree) -> None:
    """Refuse fused query/key/value tensors in the head order of ``checkpoint_version`` < 2.0 (a
    missing version is 0, as Megatron-LM reads it): each rank's is ``[3, heads, dim]`` of its own
    heads, which Megatron-LM reorders after every load by the heads per partition of the loading
    layout. Joined across ranks they are no global tensor of any head order; and a tensor-parallel
    size other than the saved one, which a torch_dist checkpoint allows, reorders wrongly."""
    fused = next((k for chunk in model_chunks(dict(sd)) for k in chunk if k.endswith(_FUSED_QKV)), None)
    if fused is None:
        return
    version = sd.get("checkpoint_version")
    try:  # Megatron-LM compares it as it is (a numpy float, a 0-d tensor); a missing one is 0
        older = float(0 if version is None else version) < 2.0
    except (TypeError, ValueError):
        raise ShardingError(
            f"{tree.directory}: checkpoint_version {version!r} is not a number; Megatron-LM could not load it either"
        ) from None
    if older:
        raise ShardingError(
            f"{tree.directory}: '{fused}' is in the query/key/value head order of checkpoint_version "
            f"{0 if version is None else version} "
            f"(saved at tensor-parallel size {tree.tp_size}), which Megatron-LM fixes after loading for the "
            "loading layout only: load it once with Megatron-LM at the layout it was saved with and save it "
            "again (checkpoint_version >= 2.0), then convert that"
        )


def _other_files(tree: LegacyTree) -> list[str]:
    """The files of the rank directories besides their rank files, not converted (the distributed
    optimizer's ``distrib_optim.pt``, with its Adam moments and main parameters), by name."""
    names: set[str] = set()
    for f in tree.files:
        names.update(p.name for p in f.path.parent.iterdir() if p != f.path)
    return [f"{name} (files of the rank directories)" for name in sorted(names)]


def _count(pattern: re.Pattern[str], keys: Sequence[str]) -> int:
    found = {int(m.group(1)) for k in keys if (m := pattern.search(k))}
    return max(found) + 1 if found else 0


def _renumber(key: str, layer_offsets: Mapping[str, int], expert_offset: int) -> str:
    key = stacking.LAYER.sub(lambda m: str(int(m.group(1)) + layer_offsets.get(key[: m.start()], 0)), key, count=1)
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
        glu: bool = False,
        num_experts: int | None = None,
    ) -> None:
        self.tree = tree
        self.stack_layers = stack_layers
        self.glu = glu
        self.num_experts = num_experts  # args.num_experts: how many experts GroupedMLP's tensors hold
        self.mcore_map = mcore_map  # None: keep the legacy names, drop `_extra_state`
        self.num_layers: dict[str, int] = {}  # per layer stack (_stack), over every pipeline stage
        self.rules = [(re.compile(r.pattern), r) for r in rules]
        self.unsafe = allow_unsafe_pickle
        self.report = ConversionReport()
        self.total = sum(f.path.stat().st_size for f in tree.files)
        # Written tensors (a grouped expert's: with its expert index): their dtype and global shape.
        self.seen: dict[str | tuple[str, int], tuple[torch.dtype, tuple[int, ...]]] = {}
        # The pieces of the tensors outside layer stacks, as first written: a later stage's copy
        # is compared with them (memory-mapped views, nothing copied).
        self.outside_layers: dict[str | tuple[str, int], list[torch.Tensor]] = {}
        self.counted: set[str] = set()
        self.skipped: set[str] = set()
        self.objects: set[str] = set()
        self._ep0: tuple[int, list[list[dict[str, Any]]], list[RankFile]] | None = None

    def _rule(self, key: str) -> SplitRule | None:
        for regex, rule in self.rules:
            if regex.search(key):
                return rule
        return None

    def layer_offsets(self) -> dict[tuple[int, int], dict[str, int]]:
        """Global first layer of each layer stack in (model chunk, pipeline stage), counting stage
        by stage, each stack on its own. With ``stack_layers``, ShardingError unless every layer
        of a stack holds each of its keys alike (:func:`.stacking.check_uniform_layers`): known
        here, before anything is written."""
        counts: dict[tuple[int, int], dict[str, int]] = {}
        chunks: dict[tuple[int, int], dict[str, Any]] = {}
        for pp in range(self.tree.pp_size):
            sd = read_rank_file(self.tree.file(0, pp, 0).path, self.unsafe)
            for v, chunk in enumerate(model_chunks(sd)):
                counts[(v, pp)] = stacking.count_layers(list(chunk))
                chunks[(v, pp)] = chunk
        offsets: dict[tuple[int, int], dict[str, int]] = {}
        acc: dict[str, int] = {}
        for v in range(max(v for v, _ in counts) + 1):
            for pp in range(self.tree.pp_size):
                offsets[(v, pp)] = dict(acc)
                for stack, n in counts.get((v, pp), {}).items():
                    acc[stack] = acc.get(stack, 0) + n
        self.num_layers = acc
        if self.stack_layers:
            stacking.check_uniform_layers(((chunks[at], offsets[at]) for at in chunks), acc, str(self.tree.directory))
        return offsets

    def _stacked(self, gkey: str) -> re.Match[str] | None:
        """``gkey`` as a layer of a stack written stacked (``stack_layers``, :func:`.stacking.stacked`)."""
        return stacking.stacked(gkey) if self.stack_layers else None

    def _stacked_layers(self, key: str) -> int:
        """How many layers the stack of ``key`` (a global key, before Megatron-Core naming) has."""
        stack = stacking.stack_of(key)
        return 0 if stack is None else self.num_layers.get(stack, 0)

    def group(
        self, index: int, pp: int, ep: int, layer_offsets: dict[tuple[int, int], dict[str, int]]
    ) -> tuple[list[PlannedItem], dict, int, str]:
        """The items of output rank ``index`` (pipeline stage ``pp``, expert rank ``ep``: every TP
        rank's file of it merged), TP rank 0's state dict, the input's bytes and a label."""
        files = [self.tree.file(tp, pp, ep) for tp in range(self.tree.tp_size)]
        sds = [read_rank_file(f.path, self.unsafe) for f in files]
        group_bytes = sum(f.path.stat().st_size for f in files)
        per_rank = [model_chunks(sd) for sd in sds]
        items: list[PlannedItem] = []
        label = files[0].path.parent.name
        check_same_entries(per_rank, files)  # written from TP rank 0's keys
        for v, chunk0 in enumerate(per_rank[0]):
            experts = _count(_EXPERT, list(chunk0))
            te_experts = moe.te_local_experts(chunk0)
            glu_of: dict[str, bool | None] = {}
            if self.tree.tp_size > 1:
                moe.check_glu(chunk0, self.glu, str(files[0].path))
                glu_of = moe.mlp_glu(chunk0)
            layer_offset = layer_offsets.get((v, pp), {})
            for key, value in chunk0.items():
                if not isinstance(value, torch.Tensor):
                    if self.mcore_map is not None and mcore.is_extra_state(key) and not ep:
                        gkey = _renumber(key, layer_offset, 0)
                        items += self.extra_state(index, gkey, value, key)
                    else:
                        self.skipped.add(key)  # e.g. TransformerEngine `_extra_state`: not a weight
                    continue
                shards = self._tp_shards(key, v, per_rank, files)
                grouped = moe.grouped_key(key)
                if grouped is not None:
                    items += self.grouped(index, (ep, layer_offset), key, grouped, shards, te_experts, files[0])
                    continue
                is_expert = _EXPERT.search(key) is not None
                if not is_expert and self.tree.ep_size > 1 and moe.in_experts(key):
                    raise ShardingError(
                        f"'{key}' in {files[0].path} belongs to an MoE experts module, so each expert-"
                        f"parallel rank holds its own, but it is none of the expert weights ckptd "
                        f"converts ({moe.KNOWN}); writing one rank's would lose the others'. "
                        f"{moe.MEGATRON_CONVERT}"
                    )
                if ep and not is_expert:
                    # Replicated over expert-parallel ranks (written by EP rank 0), as Megatron keeps
                    # every non-expert parameter: checked, so that no per-rank tensor is lost.
                    self._check_as_ep0(key, v, pp, ep, shards, files)
                    continue
                gkey = _renumber(key, layer_offset, ep * experts if is_expert else 0)
                pieces = tp_chunks(gkey, shards, self._rule(gkey), (glu_of[key],) if key in glu_of else None)
                gshape = global_shape(shards, self._rule(gkey))
                layers = self._stacked_layers(gkey)
                if self.mcore_map is not None:
                    gkey = mcore.mcore_key(self.mcore_map, gkey)
                items += self._emit(index, gkey, gkey, shards[0].dtype, gshape, pieces, layers)
        return items, sds[0], group_bytes, label

    def _tp_shards(
        self, key: str, v: int, per_rank: list[list[dict[str, Any]]], files: list[RankFile]
    ) -> list[torch.Tensor]:
        shards = []
        for r, chunks in enumerate(per_rank):
            t = chunks[v].get(key)
            if not isinstance(t, torch.Tensor):
                raise ShardingError(f"'{key}' is in TP rank 0's file but not in {files[r].path}")
            shards.append(t)
        return shards

    def _check_as_ep0(
        self, key: str, v: int, pp: int, ep: int, shards: list[torch.Tensor], files: list[RankFile]
    ) -> None:
        """Raise unless expert rank ``ep``'s ``key`` equals expert rank 0's (TP rank by TP rank)."""
        if self._ep0 is None or self._ep0[0] != pp:
            ep0_files = [self.tree.file(tp, pp, 0) for tp in range(self.tree.tp_size)]
            self._ep0 = (pp, [model_chunks(read_rank_file(f.path, self.unsafe)) for f in ep0_files], ep0_files)
        _, ep0, ep0_files = self._ep0
        for r, t in enumerate(shards):
            ref = ep0[r][v].get(key) if v < len(ep0[r]) else None
            if not (
                isinstance(ref, torch.Tensor) and ref.dtype == t.dtype and ref.shape == t.shape and torch.equal(ref, t)
            ):
                raise ShardingError(
                    f"'{key}' in {files[r].path} (expert-parallel rank {ep}) "
                    + ("is not in" if ref is None else "differs from the one in")
                    + f" expert rank 0's {ep0_files[r].path}, so each expert rank holds its own, but it "
                    f"is none of the expert weights ckptd converts ({moe.KNOWN}); writing rank 0's "
                    f"would lose the others'. {moe.MEGATRON_CONVERT}"
                )

    def grouped(
        self,
        index: int,
        where: tuple[int, dict[str, int]],
        key: str,
        g: moe.GroupedKey,
        shards: list[torch.Tensor],
        te_experts: int,
        file0: RankFile,
    ) -> list[PlannedItem]:
        """A grouped-GEMM expert tensor as Megatron-Core stores it (see :mod:`.experts`): each local
        expert's TP shards at their global expert index of ``<layer>.mlp.experts.experts.linear_fc<n>``
        (``where``: the expert rank and the layer offsets of its pipeline stage)."""
        ep, layer_offset = where
        if g.local is not None:
            num_local = te_experts
        elif self.num_experts is None or self.num_experts % self.tree.ep_size:
            raise ShardingError(
                f"'{key}' in {file0.path} is GroupedMLP's tensor of all local experts, but the args "
                f"give num_experts={self.num_experts!r}, which does not say how many it holds at "
                f"expert-parallel size {self.tree.ep_size}. {moe.MEGATRON_CONVERT}"
            )
        else:
            num_local = self.num_experts // self.tree.ep_size
        if self.num_experts is not None and num_local * self.tree.ep_size != self.num_experts:
            raise ShardingError(
                f"'{key}' in {file0.path}: {num_local} local experts at expert-parallel size "
                f"{self.tree.ep_size}, but the args say num_experts={self.num_experts}"
            )
        gkey = _renumber(g.target, layer_offset, 0)
        per_tp = [moe.per_expert(g, t, num_local, str(file0.path)) for t in shards]
        items: list[PlannedItem] = []
        for i in range(len(per_tp[0])):
            expert = ep * num_local + (g.local if g.local is not None else i)
            expert_shards = [experts[i] for experts in per_tp]
            pieces = [(p.unsqueeze(0), (expert, *o)) for p, o in tp_chunks(gkey, expert_shards, self._rule(gkey))]
            gshape = [num_local * self.tree.ep_size, *global_shape(expert_shards, self._rule(gkey))]
            items += self._emit(
                index, gkey, (gkey, expert), shards[0].dtype, gshape, pieces, self._stacked_layers(gkey)
            )
        return items

    def _emit(
        self,
        index: int,
        gkey: str,
        unit: str | tuple[str, int],
        dtype: torch.dtype,
        gshape: list[int],
        pieces: list[tuple[torch.Tensor, tuple[int, ...]]],
        layers: int,
    ) -> list[PlannedItem]:
        """The records of ``pieces`` (chunks of ``gkey``; ``unit``: what they complete, the tensor or
        one expert of it), stacked over the ``layers`` of its stack with ``stack_layers``."""
        if unit in self.seen:
            if self.seen[unit] != (dtype, tuple(gshape)):
                raise ShardingError(f"'{gkey}' appears in several pipeline stages with different shapes")
            first = self.outside_layers.get(unit, [])
            if len(first) == len(pieces) and not all(torch.equal(a, b) for a, (b, _) in zip(first, pieces)):
                # Megatron keeps a tied embedding's copies in sync (the last stage's, MTP's): one
                # that differs is no copy, and keeping either may be wrong.
                log.warning(
                    "'%s' is held by several pipeline stages with different values; the first stage's is "
                    "kept. Check the source checkpoint (a tied embedding's copies should be equal)",
                    gkey,
                )
            else:
                log.info("'%s' is held by several pipeline stages; keeping the first", gkey)
            return []
        self.seen[unit] = (dtype, tuple(gshape))
        if not layers:  # what several stages hold is outside the layers (embedding, output layer)
            self.outside_layers[unit] = [p for p, _ in pieces]
        if gkey not in self.counted:
            self.counted.add(gkey)
            self.report.tensors += 1
        stacked = self._stacked(gkey)
        if stacked:
            # Megatron-Core's default torch_dist naming: one tensor per layer type with the layer
            # number as a prepended axis.
            gkey = f"{stacked.group(1)}.{stacked.group(3)}"
            layer = int(stacked.group(2))
            gshape = [layers, *gshape]
            pieces = [(p.unsqueeze(0), (layer, *o)) for p, o in pieces]
        items = []
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
        return items

    def extra_state(self, index: int, gkey: str, value: object, key: str) -> list[PlannedItem]:
        """A module's ``_extra_state`` (TP rank 0's) as the ShardedObject Megatron-Core's
        ``sharded_state_dict`` asks for (``make_sharded_object_for_checkpoint``): one element of a
        ``(num_layers,)`` array with stacked layers, else a ``(1,)`` array of its own."""
        if mcore.DROPPED_EXTRA_STATE.search(gkey):
            self.skipped.add(key)
            return []
        layers = self._stacked_layers(gkey)
        gkey = mcore.mcore_key(self.mcore_map or (), gkey)
        stacked = self._stacked(gkey)
        if stacked:
            obj = ShardedObject(
                key=f"{stacked.group(1)}.{stacked.group(3)}",
                data=value,
                global_shape=(layers,),
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
        keys = [k for chunk in model_chunks(read_rank_file(path, allow_unsafe_pickle)) for k in chunk]
        mcore.check_convertible(keys, str(path))
        stages.append((keys, str(path)))
    if spec == "auto":
        with_layers = [(keys, where) for keys, where in stages if any(stacking.LAYER.search(k) for k in keys)]
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
    checkpoint's ``args.swiglu`` / ``args.gated_linear_unit``) stores ``linear_fc1`` (legacy name:
    ``dense_h_to_4h``) TP shards ``[gate_r; up_r]`` as ``[gate; up]``, as Megatron-Core's
    torch_dist does. ``stack_layers``
    names layers as Megatron-Core's default does (``decoder.layers.<name>`` with the layer number
    as a leading axis) instead of ``decoder.layers.<i>.<name>``; layers that differ (a tensor some
    lack, or hold in another shape) raise ShardingError before anything is written.

    ``mcore_spec`` (``"local"``, ``"te"`` or ``"auto"``: from the keys) names the layer spec of the
    Megatron-Core GPTModel that wrote the checkpoint; the output then holds what that model's
    ``sharded_state_dict()`` asks for (with ``stack_layers``; without, what it asks for with
    ``metadata={"non_homogeneous_layers": True}``): the spec's key renames and every
    ``_extra_state`` as a ShardedObject (see :mod:`ckptd.convert.mcore`). MoE experts and
    pre-Megatron-Core (``language_model.*``) names are refused. ``progress(done, total, label)``
    is called after each pipeline/expert group. ``dst`` must not hold a checkpoint; if the
    conversion fails, what it created in ``dst`` is removed.

    MoE experts: SequentialMLP's ``local_experts.<i>`` keep their names, renumbered to the global
    expert. TEGroupedMLP's ``experts.linear_fc<n>.weight<i>`` and GroupedMLP's ``experts.weight1|2``
    (all local experts in one transposed buffer; ``args.num_experts`` says how many) become
    Megatron-Core's ``experts.experts.linear_fc<n>.weight``, with the expert as a leading axis (see
    :mod:`ckptd.convert.experts`). Any other tensor that differs between expert ranks is refused.
    ``expert_parallel`` (None: from ``args``, read with ``allow_unsafe_pickle``) says whether
    two-number rank directories are TP x EP rather than TP x PP; args that do not say raise.
    """
    tree = discover(src, expert_parallel, allow_unsafe_pickle)
    args = read_rank_file(tree.files[0].path, allow_unsafe_pickle).get("args")
    get = args.get if isinstance(args, dict) else lambda name: getattr(args, name, None)
    if glu is None:
        glu = bool(get("swiglu") or get("gated_linear_unit"))
    if glu:
        rules = list(rules) + [GLU_RULE]
    num_experts = get("num_experts")
    root = Path(dst)
    for source in {Path(src).resolve(), tree.directory.resolve()}:
        target = root.resolve()
        if target == source or source in target.parents:
            # Its files next to the rank directories would make the legacy checkpoint look like
            # a torch_dist one to Megatron-LM's format detection and to ckptd.
            raise OutputInsideCheckpointError(
                f"{dst} is inside the legacy checkpoint {src} being converted (as {target}); write the "
                "torch_dist checkpoint elsewhere"
            )
    for marker in (METADATA_JSON, DCP_METADATA):
        if (root / marker).exists():
            raise CheckpointExistsError(f"{root} already holds a checkpoint ({marker} exists)")
    mcore_map = None  # decided (or refused) before anything is written
    if mcore_spec is not None:
        mcore_map = _mcore_map(tree, mcore.check_spec(mcore_spec), allow_unsafe_pickle)
    conv = _Converter(
        tree,
        list(rules) + (list(DEFAULT_RULES) if use_default_rules else []),
        allow_unsafe_pickle,
        stack_layers,
        mcore_map,
        glu=glu,
        num_experts=num_experts if isinstance(num_experts, int) else None,
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
                _check_qkv_layout(sd0, tree)
                first.update(sd0)
            yield items
            done += group_bytes
            if progress:
                progress(done, conv.total, label)

    def common() -> dict:
        out = {
            "iteration": first.get("iteration"),
            "checkpoint_version": first.get("checkpoint_version"),
            "args": _plain(vars(first["args"]))
            if hasattr(first.get("args"), "__dict__")
            else _plain(first.get("args")),
            "opt_param_scheduler": _plain(first.get("opt_param_scheduler")),
            "converted_from": {"format": "megatron-legacy", "tp": tree.tp_size, "pp": tree.pp_size, "ep": tree.ep_size},
        }
        if "num_floating_point_operations_so_far" in first:  # Megatron-LM's FLOP count, read on resume
            out["num_floating_point_operations_so_far"] = _plain(first["num_floating_point_operations_so_far"])
        conv.report.dropped = sorted(
            str(k) for k in first if k not in out and not (k == "model" or re.fullmatch(r"model\d+", str(k)))
        ) + _other_files(tree)
        return out

    with undone_on_failure(root):
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
