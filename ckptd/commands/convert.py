"""``ckptd convert``: Megatron legacy trees -> torch_dist, and torch_dist -> one state dict file."""

from __future__ import annotations

import argparse
import math
from typing import Any, TextIO

from ..progress import Progress
from ._common import EXIT_OK, add_parser, guarded

DESCRIPTION = """\
Convert checkpoints.

  # Megatron legacy tree (mp_rank_XX[_YYY[_ZZZ]]/model_optim_rng.pt) -> torch_dist
  ckptd convert to-dist /ckpts/legacy /ckpts/iter_0000100 \\
      [--split 'REGEX=AXIS' | 'REGEX=replicated' | 'REGEX=glu:AXIS' ...] \\
      [--expert-parallel | --no-expert-parallel] [--glu | --no-glu] [--stack-layers] \\
      [--mcore-spec {auto,local,te}]

  # ... that a Megatron-Core GPTModel loads as-is (dist_checkpointing.load, ckptd.load)
  ckptd convert to-dist /ckpts/legacy /ckpts/iter_0000100 --stack-layers --mcore-spec auto

  # torch_dist (written by ckptd, Megatron-Core or torch DCP) -> one consolidated file
  ckptd convert consolidate /ckpts/iter_0000100 model.pt [--with-common] [--overwrite]

A progress bar is drawn on stderr when it is a terminal; otherwise the command is quiet apart
from a one-line summary on stdout.

exit status: 0 ok; 1 the conversion failed (message on stderr); 2 usage error."""


class ConvertProgress:
    """Adapts the converter's ``(done, total, label)`` callback to :class:`ckptd.progress.Progress`
    (drawn on stderr when it is a terminal, silent otherwise)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self.bar: Progress | None = None

    def __call__(self, done: int, total: int, label: str) -> None:
        if self.bar is None:
            self.bar = Progress(total, "to-dist", stream=self.stream)
        self.bar.set_total(total)
        self.bar.set_label(f"to-dist {label}")
        self.bar.advance(done - self.bar.done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def register(subparsers: Any) -> None:
    p = add_parser(subparsers, "convert", "legacy Megatron -> torch_dist; torch_dist -> one file", DESCRIPTION)
    sub = p.add_subparsers(dest="convert_command", metavar="{to-dist,consolidate}", required=True)
    to_dist = sub.add_parser("to-dist", help="Megatron legacy tree -> torch_dist")
    to_dist.add_argument("src", help="legacy checkpoint root or iter_* directory")
    to_dist.add_argument("dst", help="output torch_dist checkpoint directory (must hold no checkpoint)")
    to_dist.add_argument(
        "--split",
        action="append",
        default=[],
        metavar="REGEX=AXIS",
        help="TP split rule (before the built-in Megatron rules); repeatable",
    )
    to_dist.add_argument("--no-default-rules", action="store_true", help="use only --split rules")
    ep = to_dist.add_mutually_exclusive_group()
    ep.add_argument(
        "--expert-parallel",
        dest="ep",
        action="store_true",
        default=None,
        help="two-number rank dirs are TP+EP (default: as the checkpoint's args say; an error if they do not)",
    )
    ep.add_argument("--no-expert-parallel", dest="ep", action="store_false")
    glu = to_dist.add_mutually_exclusive_group()
    glu.add_argument(
        "--glu",
        dest="glu",
        action="store_true",
        default=None,
        help="linear_fc1 shards are [gate; up] halves (default: args.swiglu)",
    )
    glu.add_argument("--no-glu", dest="glu", action="store_false")
    to_dist.add_argument(
        "--stack-layers",
        action="store_true",
        help="Megatron-Core default naming: decoder.layers.<name> with a layer axis (every layer "
        "must hold each tensor of its stack in one shape)",
    )
    to_dist.add_argument(
        "--mcore-spec",
        choices=("auto", "local", "te"),
        default=None,
        help="name keys as a Megatron-Core GPTModel with this layer spec (the one that wrote the "
        "checkpoint; auto: from its keys) asks for them: the spec's renames and `_extra_state` "
        "objects",
    )
    to_dist.add_argument(
        "--allow-unsafe-pickle",
        action="store_true",
        help="unpickle arbitrary objects (numpy RNG states...); trusted files only",
    )
    to_dist.add_argument("--no-fsync", action="store_true", help="skip fsync (tests, scratch space)")
    cons = sub.add_parser("consolidate", help="torch_dist -> one state dict file")
    cons.add_argument("checkpoint")
    cons.add_argument("out", help="the file to write (not inside the checkpoint)")
    cons.add_argument(
        "--with-common",
        action="store_true",
        help='write {"state_dict": ..., "common": ..., "objects": ...} instead of the bare tensors '
        "(objects: the ShardedObjects, e.g. RNG states and _extra_state, by unique key)",
    )
    cons.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    cons.add_argument(
        "--allow-unsafe-pickle",
        action="store_true",
        help="decode arbitrary objects in the common state and ShardedObjects; trusted files only",
    )
    cons.add_argument("--no-fsync", action="store_true")
    p.set_defaults(func=run)


@guarded("convert")
def run(args: argparse.Namespace) -> int:
    from ..convert import SplitRule, consolidate, convert_legacy

    if args.convert_command == "consolidate":
        from ..api import load_sharded_metadata
        from ..convert.consolidate import check_output
        from ..mapping import ShardedTensor

        check_output(args.checkpoint, args.out, args.overwrite)  # before reading anything
        meta = load_sharded_metadata(args.checkpoint)
        total = sum(math.prod(t.global_shape) * t.dtype.itemsize for t in meta.values() if isinstance(t, ShardedTensor))
        objects = [k for k, v in meta.items() if not isinstance(v, ShardedTensor)]
        with Progress(total, f"consolidate {args.checkpoint}") as bar:
            out = consolidate(
                args.checkpoint,
                args.out,
                include_common=args.with_common,
                allow_unsafe_pickle=args.allow_unsafe_pickle,
                fsync=not args.no_fsync,
                progress=bar.advance,
                overwrite=args.overwrite,
            )
        if args.with_common:
            print(f"wrote {len(out['state_dict'])} tensors and {len(out['objects'])} objects into {args.out}")
        else:
            print(
                f"wrote {len(out)} tensors into {args.out}"
                + (
                    f"; left out {len(objects)} ShardedObjects (--with-common includes them): "
                    + ", ".join(objects[:8])
                    + (f" and {len(objects) - 8} more" if len(objects) > 8 else "")
                    if objects
                    else ""
                )
            )
        return EXIT_OK
    legacy_bar = ConvertProgress()
    try:
        report = convert_legacy(
            args.src,
            args.dst,
            rules=[SplitRule.parse(s) for s in args.split],
            use_default_rules=not args.no_default_rules,
            allow_unsafe_pickle=args.allow_unsafe_pickle,
            expert_parallel=args.ep,
            glu=args.glu,
            stack_layers=args.stack_layers,
            mcore_spec=args.mcore_spec,
            progress=legacy_bar,
            fsync=not args.no_fsync,
        )
    finally:
        legacy_bar.close()
    print(
        f"converted {report.tensors} tensors"
        + (f" and {report.objects} objects" if report.objects else "")
        + f" ({report.chunks} chunks, {report.nbytes / 2**20:.1f} MiB, "
        f"iteration {report.iteration}) into {args.dst}"
        + (f"; skipped non-tensor entries: {report.skipped}" if report.skipped else "")
        + (f"; not converted: {report.dropped}" if report.dropped else "")
    )
    return EXIT_OK
