"""What per-item checksums cost a data-file write (``write_data_file``), here and now.

Prints the raw speed of CRC-32C (what ckptd records) and of zlib's CRC-32 (older checkpoints), the
persist throughput of one rank's data file with checksums on and off (same items, same directory,
alternating runs so page-cache and disk state affect both alike) with their ratio, and the
throughput of ``verify_checkpoint`` (checksums, and ``deep`` decoding) on the written checkpoint
(page-cache hot). Run: ``ckptd bench checksums [--gib 1] [--fsync] [--dir /dev/shm]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import zlib

import torch

from ckptd.format.checksum import Checksum, crc32c
from ckptd.format.finalize import write_checkpoint
from ckptd.format.items import PlannedItem, write_data_file
from ckptd.format.records import TENSOR, ItemRecord
from ckptd.verify import verify_checkpoint


def crc_speed_gbps(nbytes: int, fn: Checksum) -> float:
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy().tobytes()
    fn(buf, 0)  # warm
    t0 = time.perf_counter()
    fn(buf, 0)
    return nbytes / (time.perf_counter() - t0) / 1e9


def make_items(total_bytes: int, item_bytes: int) -> list[PlannedItem]:
    items = []
    for i in range(max(1, total_bytes // item_bytes)):
        t = torch.randn(item_bytes // 4)
        rec = ItemRecord(
            fqn=f"t{i}",
            kind=TENSOR,
            rank=0,
            dtype="float32",
            global_shape=(t.numel(),),
            offsets=(0,),
            sizes=(t.numel(),),
        )
        items.append(PlannedItem(rec, t))
    return items


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="ckptd bench checksums", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=1.0, help="bytes per data file, GiB")
    ap.add_argument("--item-mib", type=int, default=64, help="size of one tensor item, MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fsync", action="store_true", help="fsync the data file (default: page cache)")
    ap.add_argument("--dir", default=None, help="directory to write into (default: a temp dir)")
    args = ap.parse_args(argv)
    total = int(args.gib * (1 << 30))
    print(
        f"CRC-32C: {crc_speed_gbps(256 << 20, crc32c):.2f} GB/s; zlib CRC-32: "
        f"{crc_speed_gbps(256 << 20, zlib.crc32):.2f} GB/s (zlib {zlib.ZLIB_RUNTIME_VERSION})"
    )
    items = make_items(total, args.item_mib << 20)
    base = tempfile.mkdtemp(prefix="ckptd-bench-crc-", dir=args.dir)
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for rep in range(args.repeats):
            # Alternate which mode runs first so a slow first write does not bias one of them.
            for checksums in (False, True) if rep % 2 == 0 else (True, False):
                d = os.path.join(base, f"c{int(checksums)}")
                os.makedirs(d, exist_ok=True)
                t0 = time.perf_counter()
                write_data_file(d, "__0_0.distcp", items, fsync=args.fsync, checksums=checksums)
                times[checksums].append(time.perf_counter() - t0)
                shutil.rmtree(d)
        d = os.path.join(base, "verify")
        os.makedirs(d)
        write_checkpoint(d, [items], {}, fsync=False)
        verify_s = {}
        for deep in (False, True):
            runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                report = verify_checkpoint(d, deep=deep)
                runs.append(time.perf_counter() - t0)
                if not report.ok:
                    raise SystemExit(f"verify failed: {report.findings}")
            verify_s[deep] = min(runs)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"write_data_file {total / 2**30:.2f} GiB, items {args.item_mib} MiB, fsync={args.fsync}, "
        f"{args.repeats} runs each (best / median; the best is least disturbed by other load):"
    )
    for label, key in (("checksums off", False), ("checksums on ", True)):
        best, med = min(times[key]), statistics.median(times[key])
        print(f"  {label}: {total / best / 1e9:.2f} / {total / med / 1e9:.2f} GB/s")
    print(
        f"  time ratio on/off: best {min(times[True]) / min(times[False]):.2f}, "
        f"median {statistics.median(times[True]) / statistics.median(times[False]):.2f}"
    )
    print(
        f"verify_checkpoint (best of {args.repeats}): checksums {total / verify_s[False] / 1e9:.2f} GB/s, "
        f"deep {total / verify_s[True] / 1e9:.2f} GB/s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
