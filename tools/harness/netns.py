"""Nodes as Linux namespaces on one machine: each its own network, `/dev/shm` and runtime directory.

A :class:`Cluster` of N nodes is what a multi-node job sees on real machines, as far as one host
can show it:

- a bridge ``ckn<pid>b`` (no address, unless :meth:`Cluster.host_address` gives the host one:
  the host has no route into the nodes' subnet) and, per node,
  a named network namespace ``ckn<pid>-n<i>`` joined to the bridge by a veth pair (host end
  ``ckn<pid>h<i>``, node end renamed ``eth0``), with one address on a private /24 that overlaps
  no address or route of the host (:func:`pick_subnet`) and no default route: traffic flows only
  between the harness's namespaces;
- per node an *anchor* process holding a private mount namespace in which a fresh tmpfs covers
  ``/dev/shm``, another the node's runtime directory (one path, :attr:`Cluster.runtime_dir`,
  which every node sees with its own contents, as real nodes see their own ``/run``) and another
  its local disk (:attr:`Cluster.local_disk`, likewise). Every
  process of the node is started inside both namespaces (``nsenter``), so ckptd's sockets,
  pid files, tokens and staging segments are private to the node, and the host's ``/dev/shm``
  never sees them; the tmpfs vanish with the node's last process (a killed node loses its shared
  memory as a rebooted machine does);
- every node shares the host's filesystem, so a checkpoint root under it is the job's shared
  filesystem.

Faults: :meth:`Node.link_down` / :meth:`Node.link_up` take the bridge port of a node down (as a
pulled cable or a failed switch port: the node keeps its address and reaches itself, nobody else),
:meth:`Node.kill` SIGKILLs every process in the node's namespaces, :meth:`Node.boot` brings up a
fresh anchor (empty ``/dev/shm`` and runtime directory), :meth:`Node.add_netem` slows its link
(where the kernel has ``sch_netem``).

Clean-up: :meth:`Cluster.destroy` kills every process of every node, deletes links, namespaces and
the bridge, and removes its directory; it runs from pytest finalizers (and is idempotent). Names
carry the creating process's pid, and :func:`sweep_stale` (run by :meth:`Cluster.create`) removes
what a harness that was killed outright left behind (its pid is gone).

This module depends on nothing of ckptd; the namespace tests (``tests/netns``) and
``tools/crash_matrix.py --netns`` (through :mod:`.netns_hosts`) use it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "ckn"
_NETNS_NAME = re.compile(rf"^{PREFIX}(\d+)-n(\d+)$")
_BRIDGE_NAME = re.compile(rf"^{PREFIX}(\d+)b$")
_BASE_DIR = re.compile(rf"^{PREFIX}(\d+)-")
SUBNET_CANDIDATES = tuple(ipaddress.ip_network(f"10.231.{k}.0/24") for k in range(1, 255))
HOST_BASE = 10  # node i gets <subnet>.(HOST_BASE + i)
SHM_NBYTES = 256 << 20  # each node's /dev/shm
RUNTIME_NBYTES = 16 << 20
DISK_NBYTES = 256 << 20  # each node's local disk
COMMAND_TIMEOUT_S = 20.0
ANCHOR_START_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 10.0


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, a tool missing, the kernel refused): the reason."""


def _run(
    argv: Sequence[str], *, stdin: str | None = None, check: bool = True, timeout_s: float = COMMAND_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run a host command (``ip``, ``tc``...) with a bound; raise with its stderr when ``check``."""
    proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=timeout_s, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def unavailable_reason() -> str | None:
    """Why namespace nodes cannot run here, or None when they can (checked by making one)."""
    if os.geteuid() != 0:
        return f"network and mount namespaces need root (this runs as uid {os.geteuid()})"
    missing = [tool for tool in ("ip", "bridge", "nsenter", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        return f"tools missing: {', '.join(missing)}"
    probe = f"{PREFIX}{os.getpid()}-n999"
    try:
        made = _run(["ip", "netns", "add", probe], check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()}"
        entered = _run(
            [
                "ip",
                "netns",
                "exec",
                probe,
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "mount",
                "-t",
                "tmpfs",
                "-o",
                "size=1m",
                "tmpfs",
                "/dev/shm",
            ],
            check=False,
        )
        if entered.returncode != 0:
            return f"a private mount namespace with a tmpfs failed: {entered.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"namespaces cannot be made: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def pick_subnet(taken: Iterable[ipaddress.IPv4Network] = ()) -> ipaddress.IPv4Network:
    """A /24 of 10.231.0.0/16 that overlaps no address or route of the host (nor ``taken``)."""
    used = list(taken)
    for line in (
        _run(["ip", "-4", "-o", "addr", "show"]).stdout.splitlines()
        + _run(["ip", "-4", "route", "show", "table", "all"]).stdout.splitlines()
    ):
        for word in line.split():
            try:
                net = ipaddress.ip_network(word, strict=False)
            except ValueError:
                continue
            if isinstance(net, ipaddress.IPv4Network) and net.prefixlen > 0:
                used.append(net)
    start = os.getpid() % len(SUBNET_CANDIDATES)  # concurrent harnesses usually differ
    for k in range(len(SUBNET_CANDIDATES)):
        cand = SUBNET_CANDIDATES[(start + k) % len(SUBNET_CANDIDATES)]
        if not any(cand.overlaps(u) for u in used):
            return cand
    raise NetnsUnavailable("every /24 of 10.231.0.0/16 overlaps an address or route of this host")


def netns_pids(name: str) -> list[int]:
    """Every process in network namespace ``name`` (``ip netns pids``)."""
    proc = _run(["ip", "netns", "pids", name], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def kill_netns_processes(name: str, timeout_s: float = KILL_TIMEOUT_S) -> list[int]:
    """SIGKILL every process in ``name`` until none is left; returns the pids still there after
    ``timeout_s`` (a process in uninterruptible sleep)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = netns_pids(name)
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def sweep_stale() -> list[str]:
    """Remove namespaces, bridges and directories of harnesses whose process is gone; returns
    what was removed. Harnesses that still run are left alone."""
    removed = []
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NETNS_NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            kill_netns_processes(name)
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    for line in _run(["ip", "-o", "link", "show", "type", "bridge"], check=False).stdout.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        m = _BRIDGE_NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _run(["ip", "link", "del", name], check=False)
            removed.append(name)
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        m = _BASE_DIR.match(path.name)
        if m and path.is_dir() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    if removed:
        log.warning("removed leftovers of killed namespace harnesses: %s", removed)
    return removed


@dataclass
class Node:
    """One node: a network namespace, and an anchor process holding its private mounts."""

    cluster: Cluster
    index: int
    address: str
    anchor: subprocess.Popen[bytes] | None = None
    netem: bool = False

    @property
    def netns(self) -> str:
        return f"{self.cluster.name}-n{self.index}"

    @property
    def host_link(self) -> str:
        """The host end of the node's veth pair (a port of the bridge)."""
        return f"{self.cluster.name}h{self.index}"

    # --- lifecycle ----------------------------------------------------------------------------
    def boot(self) -> None:
        """Start the anchor: a private mount namespace inside the node's network namespace with
        empty tmpfs over ``/dev/shm``, the runtime directory and the local disk; returns once they
        are mounted."""
        if self.anchor is not None and self.anchor.poll() is None:
            raise RuntimeError(f"node {self.index} is running already")
        rt = str(self.cluster.runtime_dir)
        script = (
            f"mount -t tmpfs -o size={SHM_NBYTES},mode=1777 tmpfs /dev/shm && "
            f"mount -t tmpfs -o size={RUNTIME_NBYTES},mode=0700 tmpfs {rt} && "
            f"mount -t tmpfs -o size={DISK_NBYTES},mode=0755 tmpfs {self.cluster.local_disk} && "
            "echo ready && exec sleep 2147483647"
        )
        self.anchor = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        assert self.anchor.stdout is not None
        ready, _, _ = select.select([self.anchor.stdout], [], [], ANCHOR_START_TIMEOUT_S)
        line = self.anchor.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.anchor.kill()
            err = self.anchor.communicate(timeout=5)[1].decode(errors="replace")
            raise NetnsUnavailable(f"node {self.index}'s private mounts failed: {err.strip() or 'no answer'}")
        self.view.unlink(missing_ok=True)
        self.view.symlink_to(f"/proc/{self.anchor.pid}/root")

    @property
    def anchor_pid(self) -> int:
        """The pid whose namespaces are the node's (after ``ip netns exec`` and ``unshare``
        exec'd into it, the shell's)."""
        if self.anchor is None or self.anchor.poll() is not None:
            raise RuntimeError(f"node {self.index} is down (boot it first)")
        return self.anchor.pid

    @property
    def up(self) -> bool:
        return self.anchor is not None and self.anchor.poll() is None

    def kill(self, timeout_s: float = KILL_TIMEOUT_S) -> None:
        """SIGKILL every process in the node's namespaces (its anchor too): the machine is gone,
        and with it its shared memory and runtime files. The network namespace and its link stay
        (the machine's NIC), for :meth:`boot`."""
        left = kill_netns_processes(self.netns, timeout_s)
        if self.anchor is not None:
            self.anchor.wait(timeout_s)
            self.anchor = None
        if left:
            raise RuntimeError(f"node {self.index}: processes {left} survived SIGKILL for {timeout_s} s")

    def pids(self) -> list[int]:
        return netns_pids(self.netns)

    # --- running things on the node ---------------------------------------------------------
    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside the node's namespaces (cwd: the repository's path)."""
        return [
            "nsenter",
            "--target",
            str(self.anchor_pid),
            "--mount",
            "--net",
            f"--wd={self.cluster.cwd}",
            "--",
            *argv,
        ]

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], **popen: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` on the node with exactly ``env``."""
        return subprocess.Popen(self.command(argv), env=dict(env), **popen)  # type: ignore[call-overload]

    def run(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = COMMAND_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(argv),
            env=dict(env) if env is not None else None,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    @property
    def view(self) -> Path:
        """A link to the node's root as the node sees it (``/proc/<anchor>/root``), repointed at
        every boot: paths through it stay valid across reboots (and lead nowhere while down)."""
        assert self.cluster.base is not None
        return self.cluster.base / f"n{self.index}"

    def path(self, inside: str | os.PathLike) -> Path:
        """``inside`` (an absolute path as the node sees it) reached from the host: the node's
        private runtime directory or /dev/shm."""
        return self.view / Path(inside).relative_to("/")

    # --- the network ---------------------------------------------------------------------------
    def link_down(self) -> None:
        """Take the node's bridge port down: nobody reaches the node, nor it anyone else; the
        node still reaches its own address."""
        _run(["ip", "link", "set", self.host_link, "down"])

    def link_up(self) -> None:
        _run(["ip", "link", "set", self.host_link, "up"])

    def isolate(self) -> None:
        """Partition the node off inside the network: its bridge port stops forwarding while both
        ends keep their carrier, so neither side's kernel notices (as with a failed switch or
        router between them) and TCP retransmits with growing back-off until :meth:`rejoin`."""
        _run(["bridge", "link", "set", "dev", self.host_link, "state", "0"])

    def rejoin(self) -> None:
        _run(["bridge", "link", "set", "dev", self.host_link, "state", "3"])

    def add_netem(self, spec: str) -> None:
        """Apply a netem qdisc (e.g. ``delay 20ms 5ms loss 1%``) to both directions of the node's
        link; raises NetnsUnavailable with tc's reason when the kernel has no netem."""
        for args in (
            ["tc", "qdisc", "add", "dev", self.host_link, "root", "netem", *spec.split()],
            ["ip", "netns", "exec", self.netns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", *spec.split()],
        ):
            proc = _run(args, check=False)
            if proc.returncode != 0:
                self.clear_netem()
                raise NetnsUnavailable(f"`{' '.join(args)}` failed: {proc.stderr.strip()}")
            self.netem = True

    def clear_netem(self) -> None:
        _run(["tc", "qdisc", "del", "dev", self.host_link, "root"], check=False)
        _run(["ip", "netns", "exec", self.netns, "tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
        self.netem = False


@dataclass
class Cluster:
    """N nodes (see the module docstring). Use :meth:`create`; always :meth:`destroy`."""

    nnodes: int
    cwd: str = field(default_factory=os.getcwd)
    name: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    subnet: ipaddress.IPv4Network | None = None
    base: Path | None = None
    nodes: list[Node] = field(default_factory=list)
    _created: list[list[str]] = field(default_factory=list)  # undo commands, newest last

    @property
    def bridge(self) -> str:
        return f"{self.name}b"

    @property
    def runtime_dir(self) -> Path:
        """Every node's private runtime directory (the same path, a tmpfs of its own per node)."""
        assert self.base is not None
        return self.base / "rt"

    @property
    def local_disk(self) -> Path:
        """Every node's local disk: the same path, a tmpfs of its own per node (node-local NVMe
        mounted alike on every machine), where the host's filesystem is the shared one."""
        assert self.base is not None
        return self.base / "disk"

    @classmethod
    def create(cls, nnodes: int, cwd: str | None = None) -> Cluster:
        """Make the bridge, the namespaces and links, and boot every node; on any failure undo
        what was made and raise (NetnsUnavailable when the machine cannot)."""
        if not 1 <= nnodes <= 32:
            raise ValueError(f"{nnodes} nodes: use 1 to 32")
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        sweep_stale()
        cluster = cls(nnodes, cwd or os.getcwd())
        if _run(["ip", "link", "show", cluster.bridge], check=False).returncode == 0:
            raise RuntimeError(f"{cluster.bridge} exists: this process runs one Cluster at a time")
        try:
            cluster._make()
        except BaseException:
            cluster.destroy()
            raise
        return cluster

    def _make(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self.runtime_dir.mkdir(mode=0o700)
        self.local_disk.mkdir()
        self.subnet = pick_subnet()
        hosts = list(self.subnet.hosts())
        self._created.append(["ip", "link", "del", self.bridge])
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "link", "set", self.bridge, "up"])
        for i in range(self.nnodes):
            node = Node(self, i, str(hosts[HOST_BASE + i - 1]))
            self._created.append(["ip", "netns", "del", node.netns])
            _run(["ip", "netns", "add", node.netns])
            self._created.append(["ip", "link", "del", node.host_link])
            _run(["ip", "link", "add", node.host_link, "type", "veth", "peer", "name", "eth0", "netns", node.netns])
            _run(["ip", "link", "set", node.host_link, "master", self.bridge, "up"])
            _run(
                ["ip", "-n", node.netns, "-batch", "-"],
                stdin=(f"addr add {node.address}/{self.subnet.prefixlen} dev eth0\nlink set eth0 up\nlink set lo up\n"),
            )
            self.nodes.append(node)
        for node in self.nodes:
            node.boot()

    def host_address(self) -> str:
        """Give the host an address on the bridge (the subnet's first) and return it: a service
        the host runs there (an object store) is then reachable from every node over its link, and
        :meth:`Node.link_down` cuts a node off from it too."""
        assert self.subnet is not None
        address = str(next(self.subnet.hosts()))
        if address not in _run(["ip", "-o", "addr", "show", "dev", self.bridge]).stdout:
            _run(["ip", "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", self.bridge])
        return address

    def destroy(self) -> list[str]:
        """Kill every node's processes, delete links, namespaces and bridge, remove the
        directory; returns problems (processes that survived). Safe to call twice."""
        problems = []
        for node in self.nodes:
            left = kill_netns_processes(node.netns)
            if left:
                problems.append(f"node {node.index}: processes {left} survived SIGKILL")
            if node.anchor is not None:
                try:
                    node.anchor.wait(KILL_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    problems.append(f"node {node.index}: anchor {node.anchor.pid} did not exit")
                node.anchor = None
        while self._created:
            _run(self._created.pop(), check=False)
        self.nodes = []
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None
        return problems

    def leftovers(self) -> list[str]:
        """Namespaces and links of this cluster that still exist (empty after :meth:`destroy`)."""
        names = {line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.split()}
        links = _run(["ip", "-o", "link", "show"]).stdout
        return sorted(n for n in names if n.startswith(f"{self.name}-")) + sorted(
            set(re.findall(rf"\b({re.escape(self.name)}[bh]\d*)\b", links))
        )
