"""``ckptd status ROOT``: health of the root's node daemons on this machine, queues and throughput."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from ._common import EXIT_FAILURE, EXIT_OK, add_parser, emit_json, format_bytes, guarded, table

DESCRIPTION = """\
Ask every live ckptd daemon of ROOT's job on this machine for its status: connected ranks,
staging rings, data-file writes in flight, steps awaiting the coordinator, measurements
(bytes written, write throughput, persist and commit latency of recent steps), memory (the
daemon's and each rank's RSS, the /dev/shm its staging rings hold, current and peak), and what its
sockets rejected (malformed or oversized messages, handshakes without the job's keys,
connections dropped before authenticating). Node 0's daemon also reports its coordinator's
steps and port. Each daemon is named with its job id and its log file. It says where the
daemon really serves its Prometheus metrics (or why it does not: another process may hold
CKPTD_METRICS_PORT), and counts the daemon's internal errors (logged with their traceback).
--prometheus prints the Prometheus text format (the same a daemon serves on CKPTD_METRICS_PORT).

exit status: 0 at least one daemon answered; 1 none runs, or one did not answer."""


def register(subparsers: Any) -> None:
    p = add_parser(subparsers, "status", "health, queues and throughput of a root's daemons", DESCRIPTION)
    p.add_argument("root", metavar="ROOT", help="checkpoint root the job saves into")
    p.add_argument("--job", default=None, help="job id, if the job set CKPTD_JOB_ID")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the raw status replies as JSON")
    out.add_argument("--prometheus", action="store_true", help="print Prometheus text format")
    p.set_defaults(func=run)


def _seconds(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}s"


def _print(info: dict[str, Any]) -> None:
    m = info.get("metrics", {})
    rate = m.get("write_bytes_per_s")
    print(
        f"node {info['node']}: daemon pid {info['pid']} ({info['instance']}) of job {info['job']}, "
        f"up {m.get('uptime_s', 0):.0f}s" + ("  [stopping]" if info.get("stopping") else "")
    )
    print(f"  log: {info['log']}")
    print(
        f"  ranks connected: {sorted(c['rank'] for c in info['clients']) or 'none'}; "
        f"writes in flight: {info['jobs_in_flight']}; steps awaiting commit: {info['pending_steps'] or 'none'}"
    )
    print(
        f"  saves received {m.get('saves_received', 0)}, committed {m.get('steps_committed', 0)}, "
        f"aborted {m.get('steps_aborted', 0)}; written {format_bytes(m.get('bytes_written', 0))}"
        + (f" at {format_bytes(rate)}/s" if rate else "")
        + f"; rejected messages {info.get('rejected_messages', 0)}"
    )
    coord = info.get("coordinator")
    if info.get("rejected_messages"):
        parts = [("ranks' socket", info.get("rejected", {}))]
        if coord is not None:
            parts.append(("coordinator's port", coord.get("rejected", {})))
        print(
            "  rejected: "
            + "; ".join(
                f"{where}: " + (", ".join(f"{kind} {n}" for kind, n in counts.items() if n) or "none")
                for where, counts in parts
            )
        )
    rings = info.get("rings", [])
    if rings:
        rows = [
            (p["rank"], format_bytes(p["ring_nbytes"]), len(p["busy"]), p["queued"], "retired" if p["retired"] else "")
            for p in rings
        ]
        print(
            "  "
            + table(("RANK", "RING", "SAVES IN FLIGHT", "QUEUED", ""), rows, right=(0, 1, 2, 3)).replace("\n", "\n  ")
        )
    _print_memory(info.get("memory"))
    _print_health(info)
    recent = m.get("recent_steps", [])[-5:]
    if recent:
        step_rows = [
            (
                s["step"],
                s["outcome"],
                s["ranks"],
                format_bytes(s["nbytes"]),
                _seconds(s["queue_s"]),
                _seconds(s["persist_s"]),
                _seconds(s["commit_s"]),
            )
            for s in recent
        ]
        print(
            "  "
            + table(
                ("STEP", "OUTCOME", "RANKS", "BYTES", "QUEUE", "PERSIST", "COMMIT"), step_rows, right=(0, 2, 3, 4, 5, 6)
            ).replace("\n", "\n  ")
        )
    if coord is not None:
        steps = coord.get("steps", {})
        print(
            f"  coordinator {coord['address']}: nodes {coord['nodes']}; steps in progress: "
            + (
                ", ".join(f"{s} {v['phase']} ({len(v['written'])}/{v['world_size']} written)" for s, v in steps.items())
                or "none"
            )
        )
    _print_mirror(info.get("mirror"))


def _print_mirror(mirror: dict[str, Any] | None) -> None:
    if mirror is None:
        return
    last = mirror.get("last_upload")
    copied = mirror["mirrored_step"]
    node = mirror.get("node") or 0
    if node:  # node-local disks: this node uploads its own files when node 0 asks (ckptd.roots.mirror_nodes)
        line = f"  mirror {mirror['url']}: node {node} uploads its files of each copy"
    else:
        line = f"  mirror {mirror['url']}: latest copy step {'none' if copied is None else copied}"
    if mirror.get("uploading_step") is not None:
        line += f"; copying step {mirror['uploading_step']}"
    if last:
        line += f"; last copy step {last['step']} in {last['seconds']:.1f}s"
    print(line)
    if mirror.get("failed_node") is not None:
        print(f"  mirror: the last copy round failed at node {mirror['failed_node']}")
    if mirror.get("error"):
        print(f"  mirror problem: {mirror['error']}")


def _print_health(info: dict[str, Any]) -> None:
    served = info.get("prometheus")
    if served is not None and served.get("serving"):
        print(
            f"  metrics served on {served['url']} ({served['connections']} connections open; "
            f"{served['served']} served, {served['dropped']} dropped at the limit, {served['timed_out']} timed out)"
        )
    elif served is not None:
        print(f"  metrics NOT served: {served['problem']}")
    errors = info.get("internal_errors") or {}
    if errors.get("count"):
        print(
            f"  INTERNAL ERRORS: {errors['count']} ("
            + ", ".join(f"{chore} {n}" for chore, n in errors["by_chore"].items())
            + f"); last: {errors['last']}; the daemon kept running; its log has the tracebacks"
        )


def _print_memory(mem: dict[str, Any] | None) -> None:
    if not mem:
        return

    def both(p: dict[str, int]) -> str:
        return f"{format_bytes(p['current'])} (peak {format_bytes(p['peak'])})"

    shm = mem["dev_shm"]
    print(
        f"  memory: daemon RSS {both(mem['daemon_rss'])}; staging rings in /dev/shm "
        f"{both(mem['staging_shm'])}; /dev/shm used {both(shm)} of {format_bytes(shm['size'])}"
    )
    if mem["ranks_rss"]:
        print(
            "  ranks' RSS (training and staging): " + ", ".join(f"rank {r['rank']} {both(r)}" for r in mem["ranks_rss"])
        )


@guarded("status")
def run(args: argparse.Namespace) -> int:
    from ..client.admin import daemon_status, local_daemons, other_job_advice, other_job_daemons
    from ..config import CkptdConfig
    from ..daemon.metrics import prometheus_text
    from ..errors import DaemonError, ProtocolError

    config = CkptdConfig.from_env()
    if args.job:
        config = config.replace(job_id=args.job)
    daemons = local_daemons(args.root, config)
    if not daemons:
        others = other_job_daemons(args.root, config)
        command = f"ckptd status {shlex.quote(str(args.root))} --job {{job}}"
        advice = other_job_advice(args.root, others, command) if others else ""
        if args.json:
            emit_json({"root": args.root, "daemons": [], **({"advice": advice} if advice else {})})
        else:
            print(advice or f"no ckptd daemon of {args.root} runs on this machine")
        return EXIT_FAILURE
    replies: list[dict[str, Any]] = []
    failed = False
    for d in daemons:
        # Where to look next: the daemon's log, as it says (a foreground one logs to its stderr);
        # of one that does not answer, the file a detached daemon logs to (the job id is in its name).
        where = {"job": d.endpoints.job, "log": f"{d.endpoints.log_path} (if it was started detached)"}
        try:
            replies.append({**where, **daemon_status(d, config)})
        except (DaemonError, ProtocolError) as exc:  # not answered, refused, or answered wrongly
            failed = True
            replies.append({"node": d.node, "pid": d.pid, **where, "error": str(exc)})
    if args.json:
        emit_json({"root": args.root, "daemons": replies})
    elif args.prometheus:
        print(prometheus_text([r for r in replies if "error" not in r]), end="")
    else:
        for r in replies:
            if "error" in r:
                print(f"node {r['node']}: daemon pid {r['pid']} of job {r['job']}: {r['error']}")
                print(f"  log: {r['log']}")
            else:
                _print(r)
    return EXIT_FAILURE if failed else EXIT_OK
