"""``ckptd daemon``: run a node daemon (foreground, or ``--detach`` as the Checkpointer does)."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import CkptdConfig

DESCRIPTION = """\
Run the ckptd node daemon of one job (checkpoint root) and node. It receives the ranks' staged
saves over ipc://, writes their data files, and on node 0 also runs the job's coordinator, which
commits each checkpoint (rename iter_<step>.<attempt>.tmp -> iter_<step>, then the 'latest' tracker).

Normally a Checkpointer starts it (detached) when absent. Settings come from CKPTD_* environment
variables (see ckptd.config); SIGTERM stops it in order (in-flight saves get
CKPTD_SHUTDOWN_GRACE_S to commit; shared memory and socket files are removed).

`ckptd daemon stop --root R` asks every daemon of the root's job on this machine to shut down
the same way and waits for them (SIGTERM to one that does not answer), as long as each may take
with its own settings: twice its CKPTD_SHUTDOWN_GRACE_S (its work in flight, then its writer
threads), its CKPTD_REQUEST_TIMEOUT_S with a mirror (an upload), and 10 s to exit.

exit status: 0 stopped normally (or --detach: serving / already running; stop: all stopped);
1 error (the runtime directory cannot be used: the message says why; stop: a daemon did not stop
in time, or the root's daemons on this machine run under another job id or runtime directory than
this shell's: the message says what to run); 3 another
daemon of this job and node is running; 4 another job's daemon holds this node's lock in the root (one job per root)."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "daemon",
        help="run the node daemon of a checkpoint root",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "action",
        nargs="?",
        choices=("run", "stop"),
        default="run",
        help="run a daemon (default), or stop the running ones of --root",
    )
    p.add_argument("--root", required=True, help="checkpoint root the job saves into")
    p.add_argument("--node", type=int, default=None, help="node id (default: GROUP_RANK, else 0)")
    p.add_argument(
        "--nnodes", type=int, default=None, help="nodes in the job (default: WORLD_SIZE / LOCAL_WORLD_SIZE, else 1)"
    )
    p.add_argument("--job", default=None, help="job id (default: CKPTD_JOB_ID, else a hash of the root)")
    p.add_argument(
        "--coordinator",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the job's coordinator here (default: on node 0)",
    )
    p.add_argument(
        "--coordinator-connect",
        default=None,
        metavar="tcp://HOST:PORT",
        help="where node daemons reach the coordinator (default: from MASTER_ADDR/PORT)",
    )
    p.add_argument(
        "--coordinator-bind",
        default=None,
        metavar="tcp://HOST:PORT",
        help="where the coordinator listens (default: derived like --coordinator-connect)",
    )
    p.add_argument(
        "--exit-when-idle",
        action="store_true",
        help="exit after CKPTD_IDLE_EXIT_S with no ranks and no work (auto-started daemons)",
    )
    p.add_argument(
        "--detach", action="store_true", help="fork into the background; exit 0 once it serves (or one already runs)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os
    from dataclasses import replace

    if args.action == "run":
        # The daemon never touches a GPU: hide them, so that nothing it runs (torch.save, a
        # library it imports) can create a CUDA context, which costs host memory (hundreds of
        # MiB) and device memory on every GPU of a training node.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""

    from ..config import CkptdConfig
    from ..control.endpoints import Endpoints, JobEnv
    from ..control.netaddr import tcp_port
    from ..daemon.main import detach_and_run, run_daemon
    from ..errors import CkptdError

    try:
        config = CkptdConfig.from_env()
        if args.job:
            config = config.replace(job_id=args.job)
        if args.action == "stop":
            try:
                return _stop(args.root, config)
            except CkptdError as exc:  # the runtime directory cannot be looked into
                print(f"ckptd daemon: error: {exc}", file=sys.stderr)
                return 1
        env = JobEnv.detect()
        if args.node is not None or args.nnodes is not None:
            nnodes = args.nnodes if args.nnodes is not None else env.nnodes
            node = args.node if args.node is not None else 0
            if nnodes < 1 or not 0 <= node < nnodes:
                raise CkptdError(f"--node {node} --nnodes {nnodes}: give at least 1 node and a node id 0..nnodes-1")
            env = replace(env, node=node, local_world_size=1, world_size=nnodes, rank=node, local_rank=0)
        given = args.coordinator_connect or args.coordinator_bind
        if given and not config.coordinator_port:
            # An address given here needs no MASTER_PORT / CKPTD_COORDINATOR_PORT to derive one
            # (port 0: an ephemeral port, for a single node).
            config = config.replace(coordinator_port=tcp_port(given))
        ep = Endpoints.for_job(args.root, env, config)
        if given:
            ep = replace(
                ep,
                coordinator_connect=args.coordinator_connect or ep.coordinator_connect,
                coordinator_bind=args.coordinator_bind or ep.coordinator_bind,
            )
    except CkptdError as exc:
        print(f"ckptd daemon: error: {exc}", file=sys.stderr)
        return 2
    coordinator = ep.node == 0 if args.coordinator is None else args.coordinator
    try:
        if args.detach:
            return detach_and_run(
                ep,
                config,
                coordinator=coordinator,
                exit_when_idle=args.exit_when_idle,
                nnodes=env.nnodes,
                timeout_s=config.daemon_start_timeout_s,
            )
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
        return run_daemon(ep, config, coordinator=coordinator, exit_when_idle=args.exit_when_idle, nnodes=env.nnodes)
    except CkptdError as exc:  # before the daemon ran: its runtime directory cannot be used
        print(f"ckptd daemon: error: {exc}", file=sys.stderr)
        return 1


def _stop(root: str, config: CkptdConfig) -> int:
    from ..client.admin import local_daemons, other_job_advice, other_job_daemons, stop_daemon

    daemons = local_daemons(root, config)
    if not daemons:
        others = other_job_daemons(root, config)
        if others:  # "none runs" would leave them running, their rings in /dev/shm
            command = f"ckptd daemon stop --root {shlex.quote(str(root))} --job {{job}}"
            print(f"ckptd daemon: error: {other_job_advice(root, others, command)}", file=sys.stderr)
            return 1
        print(f"no ckptd daemon of {root} runs on this machine")
        return 0
    failed = []
    for d in daemons:
        if stop_daemon(d, config):  # as long as that daemon's own settings let it take
            print(f"stopped the daemon of node {d.node} (pid {d.pid})")
        else:
            failed.append(d.node)
    if failed:
        print(
            f"ckptd daemon: error: the daemons of nodes {failed} did not stop; see their logs in "
            f"{daemons[0].endpoints.runtime_dir}",
            file=sys.stderr,
        )
        return 1
    return 0
