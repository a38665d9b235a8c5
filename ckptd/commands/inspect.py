"""``ckptd inspect DIR``: tensors, chunking, objects and common keys of one checkpoint."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ._common import EXIT_OK, add_parser, checkpoint_of, emit_json, format_bytes, guarded, resolve, table

if TYPE_CHECKING:
    from ..describe import CheckpointSummary, TensorInfo

DESCRIPTION = """\
Show what a checkpoint holds, from its index (no tensor data is read): every tensor with dtype,
global shape, size and chunking (number of chunks, chunk shapes, data files), every stored
object (ShardedObject), the data files, how many items carry checksums, and the top-level keys
of the common state (common.pt, decoded weights-only). Given a checkpoint root, inspects the
checkpoint its 'latest' tracker names.

exit status: 0 ok; 1 the index cannot be read (damaged checkpoint: run 'ckptd verify');
2 usage error (path missing or not a checkpoint/root)."""

_MAX_LISTED = 3


def register(subparsers: Any) -> None:
    p = add_parser(subparsers, "inspect", "show tensors, chunking, objects and common keys", DESCRIPTION)
    p.add_argument("path", metavar="DIR", help="checkpoint directory (or a root: its latest checkpoint)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--allow-unsafe-pickle",
        action="store_true",
        help="decode common.pt fully (arbitrary pickles: only for trusted checkpoints)",
    )
    p.set_defaults(func=run)


def _shapes(t: TensorInfo) -> str:
    listed = ", ".join(f"{n}x{tuple(s)}" for s, n in t.chunk_shapes[:_MAX_LISTED])
    more = len(t.chunk_shapes) - _MAX_LISTED
    return listed + (f", +{more} more shapes" if more > 0 else "")


def _files(files: list[str]) -> str:
    if len(files) <= _MAX_LISTED:
        return ", ".join(files)
    return f"{files[0]} .. {files[-1]} ({len(files)} files)"


def _text(s: CheckpointSummary) -> str:
    lines = [f"checkpoint {s.path}"]
    if s.backend is None:
        lines.append("format: plain torch DCP (no metadata.json)")
    else:
        lines.append(
            f"format: {s.backend['sharded_backend']} v{s.backend['sharded_backend_version']}, "
            f"common {s.backend.get('common_backend', 'torch')} v{s.backend.get('common_backend_version', 1)}"
        )
    missing = [n for n, size in s.data_files.items() if size < 0]
    lines.append(
        f"data files: {len(s.data_files)}, {format_bytes(s.data_nbytes)} on disk"
        + (f" (MISSING: {', '.join(missing)})" if missing else "")
    )
    lines.append(f"checksums: {s.checksummed_items} of {s.items} items")
    lines.append("")
    lines.append(f"tensors: {len(s.tensors)}, {format_bytes(s.tensor_nbytes)}")
    if s.tensors:
        rows = [
            (t.key, t.dtype, tuple(t.shape), format_bytes(t.nbytes), t.chunks, _shapes(t), _files(t.files))
            for t in s.tensors
        ]
        lines.append(table(("KEY", "DTYPE", "SHAPE", "SIZE", "CHUNKS", "CHUNK SHAPES", "FILES"), rows, right=(3, 4)))
    lines.append("")
    lines.append(f"objects: {len(s.objects)}")
    if s.objects:
        object_rows = [(o.key, o.file, o.offset, o.length) for o in s.objects]
        lines.append(table(("KEY", "FILE", "OFFSET", "BYTES"), object_rows, right=(2, 3)))
    lines.append("")
    if s.common is None:
        lines.append(f"common: {s.common_note}")
    else:
        lines.append(f"common: {len(s.common)} keys")
        lines.extend(f"  {k}: {v}" for k, v in s.common.items())
    return "\n".join(lines)


@guarded("inspect")
def run(args: argparse.Namespace) -> int:
    path, _ = checkpoint_of(resolve(args.path), "inspect")
    from ..describe import describe_checkpoint  # torch: imported by the command that needs it

    summary = describe_checkpoint(path, allow_unsafe_pickle=args.allow_unsafe_pickle)
    if args.json:
        emit_json(summary.to_dict())
    else:
        print(_text(summary))
    return EXIT_OK
