"""Targets of ``ckptd bench all`` (ratios from one run) and its table.

The targets, each a ratio of figures measured in the same run (``--check`` exits 1 on a miss;
a target whose figures were not measured, e.g. GPU ones on a CPU machine, says n/a):

- ``first_stall``: ckptd's first save stalls <= 2 x its steady-state stall (no pre-faulting), and
  ``first_stall_vs_dcp``: <= 1/4 of the first save of DCP async (the faster of THREAD and
  PROCESS, stager reused: its first save allocates the stager's buffers);
- ``node_shm``: the node's peak ``/dev/shm`` growth while ckptd saves <= 1.25 x the state
  (default staging budget);
- ``budget``: saves through a staging ring of a quarter of the state commit and load bit-exact,
  the ring no larger than the budget;
- ``soak_flat``: over back-to-back saves, rank RSS, daemon RSS and staging /dev/shm stay flat
  (the last sample <= 1.05 x the first, plus 16 MiB of allocator noise);
- ``train_overhead``: ckptd's training-loop overhead, first save included, <= 1/3 of the best DCP
  async's (THREAD or PROCESS, stager reused), with the default settings; ``train_overhead_lazy``
  the same with ``snapshot="lazy"`` (fenced before each update, as ``attach(optimizer)`` does);
- ``persist_vs_write``: ckptd's daemon write throughput (its wait for a writer thread, write and
  fsync; not the commit) >= 90 % of a sequential write + fsync of the same bytes next to it (the
  variant with the best median of: 1 stream, ``writer_threads`` streams, 1 stream with early
  writeback), median of the per-save ratios;
- ``small_stall``: stall with many small tensors <= 1/4 of DCP async PROCESS's;
- ``stall_flat``: ckptd's stall at the most ranks <= 1.25 x its stall at the fewest, at constant
  bytes per rank (the stall / memcpy ratio is shown too: a node with fewer cores than ranks
  slows every copy, ckptd's or not);
- ``daemon_memory``: the daemon's peak RSS beyond the shared rings (``RSS - RssShmem``) <= 256 MiB;
- ``gpu_lazy_stall``: with ``--device cuda``, the stall of ``snapshot="lazy"`` <= 10 ms (n/a on
  CPU runs).
"""

from __future__ import annotations

import statistics
from typing import Any

GIB = 1 << 30
MIB = 1 << 20


def _target(
    name: str, text: str, value: float | None, limit: float, higher_is_better: bool = False, detail: str = ""
) -> dict[str, Any]:
    ok = None if value is None else (value >= limit if higher_is_better else value <= limit)
    return {
        "name": name,
        "text": text,
        "value": value,
        "limit": limit,
        "op": ">=" if higher_is_better else "<=",
        "ok": ok,
        "detail": detail,
    }


def best_reference(ck: dict[str, Any]) -> str | None:
    """The reference write variant with the highest median GiB/s (the disk's best sequential mode)."""
    refs = ck.get("write_ref") or []
    if not refs:
        return None
    return max(refs[0], key=lambda v: statistics.median(r[v] for r in refs if r.get(v)))


def persist_ratios(ck: dict[str, Any]) -> list[float]:
    """Per save: ckptd's daemon write GiB/s (its write + fsync window, as the reference's) over the
    best reference variant's GiB/s measured next to it
    (same round, so the same disk conditions; one variant for all rounds, so no max of noisy
    samples inflates the reference)."""
    variant = best_reference(ck)
    out = []
    for row, ref in zip(ck.get("saves", []), ck.get("write_ref", [])):
        window = row.get("daemon_window_s", row.get("persist_s"))  # results from before daemon_window_s
        if variant and ref.get(variant) and window:
            out.append(ck["bytes"] / GIB / window / ref[variant])
    return out


def _dcp_async_first(saves: dict[str, Any]) -> tuple[str, float] | None:
    """The DCP async method (stager reused) with the smallest first-save stall, and that stall."""
    found = [
        (m, saves[m]["first_stall_s"])
        for m in ("dcp_async_thread", "dcp_async_process")
        if "first_stall_s" in saves.get(m, {})
    ]
    return min(found, key=lambda x: x[1]) if found else None


def _stall_targets(main: dict[str, Any], res: dict[str, Any]) -> list[dict[str, Any]]:
    saves = main.get("save", {})
    ck = saves.get("ckptd")
    if not ck or "first_stall_s" not in ck:
        return []
    first, steady = ck["first_stall_s"], ck["stall_s_median"]
    out = [
        _target(
            "first_stall",
            "first save's stall / steady-state stall",
            first / steady,
            2.0,
            detail=f"{first:.3f} s vs {steady:.3f} s",
        )
    ]
    dcp = _dcp_async_first(saves)
    if dcp:
        out.append(
            _target(
                "first_stall_vs_dcp",
                "first save's stall / DCP async's first",
                first / dcp[1],
                0.25,
                detail=f"{first:.3f} s vs {_NAMES[dcp[0]]} {dcp[1]:.3f} s",
            )
        )
    during = res.get("memory", {}).get("save:ckptd", {})
    # The job's own segments (another tenant's /dev/shm use moves node_shm, not them).
    shm = during.get("ckptd_shm", during.get("node_shm"))
    if shm is not None and main.get("state_bytes"):
        # Whole pages per ring plus its header page: nothing at GiB scale, visible in tiny runs.
        pages = 2 * 4096 * main.get("ranks", 1) / main["state_bytes"]
        out.append(
            _target(
                "node_shm",
                "/dev/shm the node's staging rings hold at most while saving / state",
                shm / main["state_bytes"],
                1.25 + pages,
                detail=f"{shm / MIB:.0f} MiB for {main['state_bytes'] / MIB:.0f} MiB",
            )
        )
    return out


def _quiet(phase: str) -> bool:
    """Phases between measurements (making a state, tearing down), of any job."""
    return phase.rsplit(":", 1)[-1] in ("setup", "done")


def _budget_target(main: dict[str, Any]) -> list[dict[str, Any]]:
    b = main.get("budget")
    if not b:
        return []
    ratio = b["ring_nbytes"] / b["state_bytes"]
    fraction = float(b["budget"].rstrip("xX")) if b["budget"].lower().endswith("x") else None
    t = _target(
        "budget",
        f"staging ring of a {b['budget']} budget / state, bit-exact",
        ratio,
        (fraction or ratio) * 1.01 + 4096 * len(b["saves"]) / b["state_bytes"],
        detail=f"{len(b['saves'])} saves, durable {max(x['durable_s'] for x in b['saves']):.2f} s max, "
        f"{'bit-exact' if b['bit_exact'] else 'VALUES DIFFER'}",
    )
    if not b["bit_exact"]:
        t["ok"] = False
    return [t]


def _soak_target(main: dict[str, Any]) -> list[dict[str, Any]]:
    soak = main.get("soak")
    if not soak or len(soak["samples"]) < 2:
        return []
    # From the third save on: by then every ring page was written once (a ring is 1.25 x the
    # first save, allocated as it fills), so any growth after it is memory kept per save.
    samples = soak["samples"]
    first, last = samples[min(2, len(samples) - 1)], samples[-1]
    keys = ("rank_rss", "daemon_private", "staging_shm")
    growth = {k: (last[k] - 16 * MIB) / first[k] for k in keys if first.get(k)}
    worst = max(growth, key=lambda k: growth[k])
    return [
        _target(
            "soak_flat",
            f"memory after {soak['saves']} saves / after the third (worst: {worst})",
            growth[worst],
            1.05,
            detail=", ".join(f"{k} {first[k] / MIB:.0f} -> {last[k] / MIB:.0f} MiB" for k in growth),
        )
    ]


def _train_target(main: dict[str, Any]) -> list[dict[str, Any]]:
    """ckptd's loop overhead against the best DCP async's: with the default settings (a fork
    snapshot of CPU shards) and with ``snapshot="lazy"`` fenced before the update."""
    tr = main.get("train")
    dcps = [m for m in ("dcp_async_thread", "dcp_async_process") if tr and m in tr]
    if not tr or not dcps:
        return []
    best = min(dcps, key=lambda m: tr[m]["overhead"])
    dcp = tr[best]["overhead"]
    out = []
    for mode, name, text in (("ckptd", "train_overhead", "defaults"), ("ckptd_lazy", "train_overhead_lazy", "lazy")):
        if mode not in tr:
            continue
        ck = tr[mode]["overhead"]
        value = ck / dcp if dcp > 0 else (0.0 if ck <= 0 else float("inf"))
        out.append(
            _target(
                name,
                f"training-loop overhead, first save included ({text}) / best DCP async's",
                value,
                1 / 3,
                detail=f"{_NAMES[mode]} {ck:+.1%}, {_NAMES[best]} {dcp:+.1%} of {tr['none']['loop_s']:.2f} s",
            )
        )
    return out


def evaluate(res: dict[str, Any]) -> list[dict[str, Any]]:
    main = res.get("main", {})
    out = _stall_targets(main, res) + _budget_target(main) + _soak_target(main) + _train_target(main)
    ck = main.get("save", {}).get("ckptd")
    if ck:
        ratios = persist_ratios(ck)
        out.append(
            _target(
                "persist_vs_write",
                "daemon write GiB/s (writer wait + write + fsync) / sequential write+fsync GiB/s",
                statistics.median(ratios) if ratios else None,
                0.9,
                True,
                detail=f"reference: {best_reference(ck)}; per save: " + ", ".join(f"{r:.2f}" for r in ratios),
            )
        )
    small = main.get("small")
    if small and "stall_s_median" in small.get("ckptd", {}) and "stall_s_median" in small.get("dcp_async_process", {}):
        a, b = small["ckptd"]["stall_s_median"], small["dcp_async_process"]["stall_s_median"]
        out.append(
            _target(
                "small_stall",
                f"{main.get('small_tensors')} small tensors: stall / DCP async's",
                a / b,
                0.25,
                detail=f"{a:.3f} s vs {b:.3f} s",
            )
        )
    sc = res.get("scaling") or []
    if len(sc) > 1:
        lo, hi = sc[0], sc[-1]
        curve = ", ".join(f"{p['ranks']}: {p['stall_s_median']:.3f} s" for p in sc)
        norm = ", ".join(f"{p['ranks']}: {p['stall_s_median'] / p['memcpy_s']:.2f}" for p in sc)
        out.append(
            _target(
                "stall_flat",
                f"stall at {hi['ranks']} ranks / at {lo['ranks']}",
                hi["stall_s_median"] / lo["stall_s_median"],
                1.25,
                detail=f"stall {curve}; stall/memcpy {norm}",
            )
        )
    daemon = res.get("memory", {}).get("all", {}).get("daemon_private")
    if daemon is not None:
        out.append(_target("daemon_memory", "daemon peak RSS beyond the rings, MiB", daemon / MIB, 256.0))
    lazy = main.get("lazy") if res.get("config", {}).get("device") == "cuda" else None
    out.append(
        _target(
            "gpu_lazy_stall",
            "snapshot=lazy stall on the GPU, ms",
            lazy["stall_s_median"] * 1e3 if lazy else None,
            10.0,
            detail="" if lazy else "not measured: needs --device cuda",
        )
    )
    return out


# --- table ------------------------------------------------------------------------------------
_NAMES = {
    "ckptd": "ckptd",
    "dcp_save": "DCP save",
    "dcp_async_thread": "DCP async THREAD",
    "dcp_async_process": "DCP async PROCESS",
    "dcp_async_process_new": "DCP async PROCESS new",
    "none": "no checkpointing",
    "ckptd_copy": "ckptd copy",
    "ckptd_lazy": "ckptd lazy",
}


def write_threads_line(config: dict[str, Any], ranks: int) -> str:
    """How many threads each side writes with (DCP's matched to ckptd's: see harness.dcp_thread_count)."""
    return (
        f"  write threads: DCP FileSystemWriter(thread_count={config['dcp_thread_count']}) per rank; "
        f"ckptd's daemon writer_threads={config['writer_threads']} per node ({ranks} ranks on it)"
    )


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _save_table(saves: dict[str, Any]) -> list[str]:
    lines = [
        f"  {'method':<19}{'stall med':>10}{'stall max':>10}{'first':>9}{'durable med':>13}"
        f"{'persist GiB/s = bytes / (durable - stall)':>43}"
    ]
    for m, s in saves.items():
        if "error" in s:
            lines.append(f"  {_NAMES.get(m, m):<19}failed: {s['error'][:200]}")
            continue
        lines.append(
            f"  {_NAMES.get(m, m):<19}{_f(s.get('stall_s_median')):>10}{_f(s.get('stall_s_max')):>10}"
            f"{_f(s.get('first_stall_s')):>9}{_f(s.get('durable_s_median')):>13}"
            f"{_f(s.get('persist_gibps'), '.2f'):>43}"
        )
    return lines


def render(res: dict[str, Any]) -> str:
    c, main, m = res["config"], res.get("main", {}), res.get("machine", {})
    lines: list[str] = []
    gib = main.get("state_bytes", 0) / GIB
    lines.append(
        f"ckptd bench all: {c['ranks']} ranks, {gib:.2f} GiB state in {main.get('tensors')} tensors "
        f"of {c['tensor_mib']:g} MiB; {c['repeats']} saves per method after one warm-up"
    )
    lines.append(
        f"  machine: {m.get('cpus')} cpus, {m.get('mem_gib', 0):.0f} GiB, torch {m.get('torch')}; "
        f"dir {c.get('dir')}: {m.get('filesystem')}"
    )
    if c.get("dcp_thread_count"):
        lines.append(write_threads_line(c, c["ranks"]))
    if "memcpy_s" in main:
        lines.append("reference limits (same run):")
        lines.append(
            f"  warm memcpy of the state, all ranks at once: {main['memcpy_s']:.3f} s = "
            f"{main['state_bytes'] / GIB / main['memcpy_s']:.2f} GiB/s"
        )
        refs = main.get("save", {}).get("ckptd", {}).get("write_ref", [])
        if refs:
            lines.append("  sequential write + fsync of the node's bytes after each ckptd save, GiB/s:")
            for variant in refs[0]:
                vals = [r[variant] for r in refs if r.get(variant)]
                lines.append(
                    f"    {variant + ':':<28}"
                    + ", ".join(f"{v:.2f}" for v in vals)
                    + f" (median {statistics.median(vals):.2f})"
                )
    if "save" in main:
        lines.append(
            f"saves ({gib:.2f} GiB; seconds; durable: ckptd committed, DCP .metadata written; persist "
            "window, every method: from save() returning to durable, medians; DCP save blocks: its whole time):"
        )
        lines += _save_table(main["save"])
        snap = main["save"].get("ckptd", {}).get("snapshot_s_median")
        if snap:
            lines.append(
                f"  (ckptd: the fork snapshot's copy into shared memory took {snap:.3f} s, off the "
                "training path, between stall and persist)"
            )
    if "lazy" in main:
        lz = main["lazy"]
        lines.append(
            f"ckptd snapshot=lazy: stall median {lz['stall_s_median']:.4f} s, max {lz['stall_s_max']:.4f} s "
            f"(save() returns after planning); the fence before the update waited {lz['fence_s_median']:.3f} s "
            f"(median); durable {lz['durable_s_median']:.3f} s"
        )
    b = main.get("budget")
    if b:
        lines.append(
            f"ckptd with staging budget {b['budget']}: ring {b['ring_nbytes'] / MIB:.0f} MiB for a "
            f"{b['state_bytes'] / MIB:.0f} MiB state; stall "
            + ", ".join(f"{x['stall_s']:.3f}" for x in b["saves"])
            + " s; durable "
            + ", ".join(f"{x['durable_s']:.2f}" for x in b["saves"])
            + " s; "
            + ("loaded bit-exact" if b["bit_exact"] else "LOADED VALUES DIFFER")
        )
    soak = main.get("soak")
    if soak and soak["samples"]:
        first, last = soak["samples"][0], soak["samples"][-1]
        lines.append(
            f"ckptd soak, {soak['saves']} saves of {soak['state_bytes'] / MIB:.0f} MiB (first -> last, MiB): "
            + ", ".join(
                f"{k} {first[k] / MIB:.0f} -> {last[k] / MIB:.0f}" for k in ("rank_rss", "daemon_rss", "staging_shm")
            )
        )
    if "small" in main:
        lines.append(
            f"many small tensors ({main['small_tensors']} tensors, {main['small_state_bytes'] / GIB:.2f} GiB):"
        )
        lines += _save_table(main["small"])
    tr = main.get("train")
    if tr:
        lines.append(
            f"training loop: matmul n={tr['matmul_n']} ({tr['step_s'] * 1e3:.0f} ms/step, target "
            f"{tr['target_step_s'] * 1e3:.0f}), a save every {tr['every']} steps, {tr['saves']} saves "
            "per run; runs in the order A-B-C-C-B-A, means:"
        )
        lines.append(
            f"  {'mode':<19}{'steps/s':>9}{'overhead':>10}{'stall med':>11}{'stall max':>11}  loop s (runs)"
            f"{'bg CPU s':>10}"
        )
        mem = res.get("memory", {})
        for mode in ("none", "dcp_async_thread", "dcp_async_process", "ckptd", "ckptd_copy", "ckptd_lazy"):
            if mode not in tr:
                continue
            x = tr[mode]
            ph = mem.get(f"train:{mode}", {})
            bg = ph.get("dcp_bg_cpu_s", 0.0) + ph.get("daemon_cpu_s", 0.0)
            lines.append(
                f"  {_NAMES[mode]:<19}{x['steps_per_s']:>9.2f}{x['overhead']:>+10.1%}"
                f"{_f(x.get('stall_s_median')):>11}{_f(x.get('stall_s_max')):>11}  "
                f"{x['loop_s']:.2f} ({', '.join(f'{v:.2f}' for v in x['runs_s'])}){bg:>10.2f}"
            )
    sc = res.get("scaling")
    if sc:
        lines.append("ckptd stall vs ranks per node (constant bytes per rank):")
        lines.append(
            f"  {'ranks':>5}{'MiB/rank':>10}{'stall med':>11}{'stall max':>11}{'memcpy':>9}{'stall/memcpy':>14}"
            f"{'durable':>9}"
        )
        for p in sc:
            lines.append(
                f"  {p['ranks']:>5}{p['bytes_per_rank'] / MIB:>10.0f}{p['stall_s_median']:>11.3f}"
                f"{p['stall_s_max']:>11.3f}{p['memcpy_s']:>9.3f}{p['stall_s_median'] / p['memcpy_s']:>14.2f}"
                f"{p['durable_s_median']:>9.3f}"
            )
    ld = res.get("load")
    if ld:
        rs = ", ".join(f"-> {k} {v:.2f}" for k, v in ld["ckptd_reshard_gibps"].items())
        lines.append(
            f"load (GiB/s, warm page cache, {ld['bytes'] / GIB:.2f} GiB model saved at TP=2, hidden {ld['hidden']}):"
        )
        lines.append(
            f"  ckptd same layout {ld['ckptd_same_layout_gibps']:.2f}; ckptd resharded {rs}; "
            f"DCP load (-> full tensors) {ld['dcp_load_gibps']:.2f}"
        )
        lines.append(
            f"  TP=1 checkpoint, same request: ckptd {ld['ckptd_same_layout_tp1_gibps']:.2f}, "
            f"DCP {ld['dcp_same_layout_tp1_gibps']:.2f}"
        )
    mem = res.get("memory", {})
    if mem:
        lines.append(
            "peak memory, MiB (trainer: max over ranks; shm = RssShmem; node shm: /dev/shm growth; "
            "ckptd shm: the rings' pages):"
        )
        cols = (
            "trainer_rss",
            "trainer_shm",
            "dcp_bg_rss",
            "dcp_bg_shm",
            "daemon_rss",
            "daemon_shm",
            "daemon_private",
            "node_shm",
            "ckptd_shm",
        )
        lines.append(f"  {'phase':<28}" + "".join(f"{k:>15}" for k in cols))
        for phase, v in mem.items():
            if _quiet(phase):
                continue
            lines.append(f"  {phase:<28}" + "".join(f"{v[k] / MIB:>15.0f}" if k in v else f"{'-':>15}" for k in cols))
        lines.append(
            "CPU seconds used per phase (all processes of a role; node: the whole machine's busy time, "
            "kernel threads included):"
        )
        cpu_cols = ("trainer_cpu_s", "dcp_bg_cpu_s", "daemon_cpu_s", "node_cpu_s")
        lines.append(f"  {'phase':<28}" + "".join(f"{k:>15}" for k in cpu_cols))
        for phase, v in mem.items():
            if not _quiet(phase) and any(k in v for k in cpu_cols):
                lines.append(f"  {phase:<28}" + "".join(f"{v[k]:>15.2f}" if k in v else f"{'-':>15}" for k in cpu_cols))
    lines.append("targets (ratios from this run):")
    for t in res.get("targets", []):
        status = {True: "ok  ", False: "MISS", None: "n/a "}[t["ok"]]
        val = "-" if t["value"] is None else f"{t['value']:.3f}"
        lines.append(f"  {status} {t['text']} = {val} (target {t['op']} {t['limit']:.3g}); {t['detail']}")
    cl = res.get("cleanup", {})
    left = [k for k in ("daemons_not_stopped", "daemons_alive", "processes_left", "shm_left") if cl.get(k)]
    lines.append("cleanup: " + ("everything removed" if not left and cl.get("dir_removed") else f"LEFT OVER {cl}"))
    return "\n".join(lines)
