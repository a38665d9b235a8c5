"""Key mapping at load: rename, fuse and split checkpoint tensors before resharding.

A mapping is a small declarative list of rules, applied in order to the checkpoint's keys::

    rules = [
        Rename("model.*", "*"),                                   # drop a prefix
        Fuse("layers.*.qkv.weight",                                # q, k, v -> fused qkv
             ["layers.*.q.weight", "layers.*.k.weight", "layers.*.v.weight"], axis=0),
        Split("layers.*.fc1.weight", ["layers.*.gate.weight", "layers.*.up.weight"], axis=0),
    ]
    ckptd.load(sharded_state_dict, ckpt_dir, key_mapping=rules)

Rules describe how the *checkpoint's* keys become the keys the load requests. ``*`` matches any
(non-empty) text; every pattern of one rule has the same number of ``*`` and they take the
same values. ``Fuse`` concatenates its sources along ``axis`` (``groups > 1`` interleaves them:
the fused tensor is ``groups`` blocks, each holding the next ``1/groups`` of every source, as
Megatron's GQA ``linear_qkv`` does). ``Split`` is the inverse; ``sizes`` gives each target's
extent along ``axis`` (default: equal parts). Nothing is copied: the mapping only changes which
stored bytes each requested element comes from, so every rule composes with any resharding.
Also available as plain data: ``rules_from_config([{"rename": ["a.*", "b.*"]}, {"fuse": ...}])``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import LoadMismatchError, ShardingError
from ..mapping import ShardedObject
from .view import CheckpointView, Source, VirtualTensor


@dataclass(frozen=True)
class Rename:
    """Checkpoint keys matching ``pattern`` are requested as ``replacement`` (tensors and objects)."""

    pattern: str
    replacement: str


@dataclass(frozen=True)
class Fuse:
    """Request ``target`` as the concatenation of checkpoint tensors ``sources`` along ``axis``."""

    target: str
    sources: tuple[str, ...]
    axis: int = 0
    groups: int = 1

    def __init__(self, target: str, sources: Iterable[str], axis: int = 0, groups: int = 1) -> None:
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "sources", tuple(sources))
        object.__setattr__(self, "axis", axis)
        object.__setattr__(self, "groups", groups)


@dataclass(frozen=True)
class Split:
    """Request ``targets`` as consecutive parts (along ``axis``) of checkpoint tensor ``source``."""

    source: str
    targets: tuple[str, ...]
    axis: int = 0
    sizes: tuple[int, ...] | None = None
    groups: int = 1

    def __init__(
        self, source: str, targets: Iterable[str], axis: int = 0, sizes: Iterable[int] | None = None, groups: int = 1
    ) -> None:
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "targets", tuple(targets))
        object.__setattr__(self, "axis", axis)
        object.__setattr__(self, "sizes", None if sizes is None else tuple(int(s) for s in sizes))
        object.__setattr__(self, "groups", groups)


Rule = Rename | Fuse | Split


def rules_from_config(config: Sequence[dict[str, Any]]) -> list[Rule]:
    """Rules from plain data (JSON/YAML): ``{"rename": [pattern, replacement]}``,
    ``{"fuse": target, "sources": [...], "axis": 0, "groups": 1}``,
    ``{"split": source, "targets": [...], "axis": 0, "sizes": [...], "groups": 1}``."""
    rules: list[Rule] = []
    for i, entry in enumerate(config):
        try:
            if "rename" in entry:
                pattern, replacement = entry["rename"]
                rules.append(Rename(pattern, replacement))
            elif "fuse" in entry:
                rules.append(
                    Fuse(entry["fuse"], entry["sources"], int(entry.get("axis", 0)), int(entry.get("groups", 1)))
                )
            elif "split" in entry:
                rules.append(
                    Split(
                        entry["split"],
                        entry["targets"],
                        int(entry.get("axis", 0)),
                        entry.get("sizes"),
                        int(entry.get("groups", 1)),
                    )
                )
            else:
                raise KeyError("rename/fuse/split")
        except (KeyError, TypeError, ValueError) as exc:
            raise LoadMismatchError(
                f"key mapping entry {i} ({entry!r}) is malformed ({exc!r}); expected "
                "{'rename': [pattern, replacement]}, {'fuse': target, 'sources': [...]} or "
                "{'split': source, 'targets': [...]}"
            ) from exc
    return rules


class _Pattern:
    def __init__(self, text: str, rule: Rule) -> None:
        self.text = text
        self.stars = text.count("*")
        parts = [re.escape(p) for p in text.split("*")]
        self.regex = re.compile("(.+?)".join(parts) + r"\Z")
        self.rule = rule

    def match(self, key: str) -> tuple[str, ...] | None:
        m = self.regex.match(key)
        return m.groups() if m else None

    def expand(self, values: tuple[str, ...]) -> str:
        parts = self.text.split("*")
        out = parts[0]
        for v, p in zip(values, parts[1:]):
            out += v + p
        return out


def _patterns(rule: Rule, texts: Sequence[str]) -> list[_Pattern]:
    pats = [_Pattern(t, rule) for t in texts]
    if len({p.stars for p in pats}) > 1:
        raise LoadMismatchError(
            f"key mapping rule {rule}: its patterns {list(texts)} have different numbers of '*'; "
            "every pattern of a rule must use the same wildcards"
        )
    return pats


def _check_axis(rule: Rule, key: str, t: VirtualTensor, axis: int) -> None:
    if not 0 <= axis < len(t.shape):
        raise LoadMismatchError(f"key mapping rule {rule}: axis {axis} does not exist in '{key}' of shape {t.shape}")


def _add(view: CheckpointView, rule: Rule, t: VirtualTensor) -> None:
    if t.key in view.tensors or t.key in view.objects:
        raise LoadMismatchError(
            f"key mapping rule {rule} produces '{t.key}', which already exists in the checkpoint "
            "(or was produced by an earlier rule); rename one of them"
        )
    view.tensors[t.key] = t


def _object_key(unique_key: str) -> tuple[str, str]:
    """``(key, "/shard_...")`` of a ShardedObject's unique key; a plain byte item is all key."""
    try:
        obj = ShardedObject.empty_from_unique_key(unique_key)
    except ShardingError:
        return unique_key, ""
    return obj.key, unique_key[len(obj.key) :]


def _apply_rename(view: CheckpointView, rule: Rename) -> int:
    src, dst = _patterns(rule, [rule.pattern, rule.replacement])
    renamed_t: dict[str, str] = {}
    for key in list(view.tensors):
        values = src.match(key)
        if values is not None:
            renamed_t[key] = dst.expand(values)
    renamed_o: dict[str, str] = {}
    for unique_key in list(view.objects):
        key, suffix = _object_key(unique_key)
        values = src.match(key)
        if values is not None:
            renamed_o[unique_key] = dst.expand(values) + suffix
    moved_t = {k: view.tensors.pop(k) for k in renamed_t}
    moved_o = {k: view.objects.pop(k) for k in renamed_o}
    for old, new in renamed_t.items():
        t = moved_t[old]
        t = VirtualTensor(new, t.dtype, t.shape, t.sources, origin=t.origin or f"renamed from '{old}'")
        _add(view, rule, t)
    for old, new in renamed_o.items():
        if new in view.objects or new in view.tensors:
            raise LoadMismatchError(f"key mapping rule {rule} renames '{old}' onto existing '{new}'")
        view.objects[new] = moved_o[old]
    return len(renamed_t) + len(renamed_o)


def _apply_fuse(view: CheckpointView, rule: Fuse) -> int:
    pats = _patterns(rule, [rule.target, *rule.sources])
    target_pat, source_pats = pats[0], pats[1:]
    if not source_pats:
        raise LoadMismatchError(f"key mapping rule {rule} has no sources")
    if rule.groups < 1:
        raise LoadMismatchError(f"key mapping rule {rule}: groups must be >= 1")
    matches = [v for k in sorted(view.tensors) if (v := source_pats[0].match(k)) is not None]
    for values in matches:
        keys = [p.expand(values) for p in source_pats]
        missing = [k for k in keys if k not in view.tensors]
        if missing:
            raise LoadMismatchError(
                f"key mapping rule {rule}: fusing {keys} into '{target_pat.expand(values)}', but "
                f"{missing} are not in the checkpoint (after earlier rules). The mapping does not "
                "cover this key; fix the rule's source names."
            )
        if len(set(keys)) != len(keys):
            raise LoadMismatchError(
                f"key mapping rule {rule}: fusing {keys} into '{target_pat.expand(values)}' names a "
                "source twice; each checkpoint tensor is fused once"
            )
        parts = [view.tensors[k] for k in keys]
        first = parts[0]
        _check_axis(rule, keys[0], first, rule.axis)
        for k, t in zip(keys, parts):
            other = tuple(s for i, s in enumerate(t.shape) if i != rule.axis)
            ref = tuple(s for i, s in enumerate(first.shape) if i != rule.axis)
            if t.dtype != first.dtype or len(t.shape) != len(first.shape) or other != ref:
                raise LoadMismatchError(
                    f"key mapping rule {rule}: cannot fuse '{k}' ({t.dtype}, shape {t.shape}) with "
                    f"'{keys[0]}' ({first.dtype}, shape {first.shape}) along axis {rule.axis}: "
                    "dtypes and all other axes must match"
                )
            if t.shape[rule.axis] % rule.groups:
                raise LoadMismatchError(
                    f"key mapping rule {rule}: '{k}' has {t.shape[rule.axis]} entries on axis "
                    f"{rule.axis}, not divisible into {rule.groups} groups"
                )
        sizes = [t.shape[rule.axis] for t in parts]
        total = sum(sizes)
        sources: list[Source] = []
        for g in range(rule.groups):
            block = g * total // rule.groups
            for i, t in enumerate(parts):
                part = sizes[i] // rule.groups
                lo = g * part
                dest = block + sum(s // rule.groups for s in sizes[:i])
                for s in t.sources:
                    r = s.restrict(rule.axis, lo, lo + part)
                    if r is not None:
                        sources.append(r.shifted(rule.axis, dest - lo))
        for k in keys:
            del view.tensors[k]
        shape = first.shape[: rule.axis] + (total,) + first.shape[rule.axis + 1 :]
        _add(
            view,
            rule,
            VirtualTensor(target_pat.expand(values), first.dtype, shape, sources, origin=f"fused from {keys}"),
        )
    return len(matches)


def _apply_split(view: CheckpointView, rule: Split) -> int:
    pats = _patterns(rule, [rule.source, *rule.targets])
    source_pat, target_pats = pats[0], pats[1:]
    if not target_pats:
        raise LoadMismatchError(f"key mapping rule {rule} has no targets")
    if rule.groups < 1:
        raise LoadMismatchError(f"key mapping rule {rule}: groups must be >= 1")
    matches = [(k, v) for k in sorted(view.tensors) if (v := source_pat.match(k)) is not None]
    for key, values in matches:
        t = view.tensors[key]
        _check_axis(rule, key, t, rule.axis)
        extent = t.shape[rule.axis]
        n = len(target_pats)
        if rule.sizes is None:
            if extent % n:
                raise LoadMismatchError(
                    f"key mapping rule {rule}: '{key}' has {extent} entries on axis {rule.axis}, "
                    f"not divisible into {n} equal parts; give sizes=..."
                )
            sizes = [extent // n] * n
        else:
            sizes = list(rule.sizes)
            if len(sizes) != n or any(s < 0 for s in sizes):
                raise LoadMismatchError(f"key mapping rule {rule}: sizes {sizes} must give one extent per target ({n})")
        if sum(sizes) != extent:
            raise LoadMismatchError(
                f"key mapping rule {rule}: the parts {sizes} cover {sum(sizes)} of the {extent} "
                f"entries of '{key}' (shape {t.shape}) on axis {rule.axis}; the mapping must cover "
                "the whole tensor"
            )
        if any(s % rule.groups for s in sizes):
            raise LoadMismatchError(
                f"key mapping rule {rule}: part sizes {sizes} are not divisible into {rule.groups} groups"
            )
        del view.tensors[key]
        for i, pat in enumerate(target_pats):
            part = sizes[i] // rule.groups
            sources: list[Source] = []
            for g in range(rule.groups):
                lo = g * extent // rule.groups + sum(s // rule.groups for s in sizes[:i])
                for s in t.sources:
                    r = s.restrict(rule.axis, lo, lo + part)
                    if r is not None:
                        sources.append(r.shifted(rule.axis, g * part - lo))
            shape = t.shape[: rule.axis] + (sizes[i],) + t.shape[rule.axis + 1 :]
            _add(
                view,
                rule,
                VirtualTensor(
                    pat.expand(values), t.dtype, shape, sources, origin=f"part {i} of '{key}' split on axis {rule.axis}"
                ),
            )
    return len(matches)


def apply_key_mapping(view: CheckpointView, rules: Sequence[Rule]) -> CheckpointView:
    """Apply ``rules`` in order to ``view`` (modified in place and returned).

    Raises LoadMismatchError naming the rule when a rule matches no key, a fuse/split does not
    cover its tensors, or shapes are incompatible.
    """
    for rule in rules:
        if isinstance(rule, Rename):
            n = _apply_rename(view, rule)
        elif isinstance(rule, Fuse):
            n = _apply_fuse(view, rule)
        elif isinstance(rule, Split):
            n = _apply_split(view, rule)
        else:
            raise LoadMismatchError(f"key mapping entry {rule!r} is not a Rename, Fuse or Split rule")
        if n == 0:
            raise LoadMismatchError(
                f"key mapping rule {rule} matched no key of the checkpoint (after earlier rules); "
                "remove it or fix its pattern"
            )
    for t in view.tensors.values():
        if not t.origin:
            continue
        covered = sum(math.prod(s.sizes) for s in t.sources)
        if covered != math.prod(t.shape):
            raise LoadMismatchError(
                f"tensor '{t.key}' ({t.origin or 'stored'}): its sources cover {covered} of "
                f"{math.prod(t.shape)} elements; the key mapping does not cover the tensor"
            )
    return view


__all__ = ["Rename", "Fuse", "Split", "Rule", "rules_from_config", "apply_key_mapping"]
