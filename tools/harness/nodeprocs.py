"""Python processes on a namespace node without a new interpreter: preloaded, then moved inside.

``Node.spawn([sys.executable, ...])`` runs a fresh interpreter in the node (``nsenter``), which
spends 3 CPU-seconds importing torch and ckptd before it does anything; the namespace tests start
a few dozen trainers that way. :func:`start_in_node` instead forks one from the preloaded
forkserver (:func:`tools.harness.ranks.process_context`) and moves it into the node's network and
mount namespaces (``setns``, what ``nsenter --net --mount`` does) before it runs anything: the
same sockets, ``/dev/shm`` and runtime directory as a spawned one, and the processes it starts
(a node daemon) are the node's as well.

Its standard input and output are a socket to the caller (:attr:`NodeChild.stdin` and
:attr:`NodeChild.stdout`, as a ``Popen`` with pipes has them), or ``output`` names a file for its
output and its input is empty. :class:`NodeChild` has the part of ``subprocess.Popen``'s and of
``multiprocessing.Process``'s interface the harnesses use.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from multiprocessing.context import ForkServerProcess
from typing import Any, BinaryIO

from tools.harness.netns import Node
from tools.harness.ranks import follow_std_fds, process_context

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000


def enter_namespaces(pid: int, cwd: str) -> None:
    """Move this process into the network and mount namespaces of process ``pid`` and change to
    ``cwd`` there. The process must have one thread (the kernel refuses a mount namespace
    otherwise): a forkserver child has, until it starts threads of its own."""
    libc = ctypes.CDLL(None, use_errno=True)
    for name, kind in (("net", CLONE_NEWNET), ("mnt", CLONE_NEWNS)):
        fd = os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(fd, kind) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"cannot enter the {name} namespace of process {pid}: {os.strerror(err)}")
        finally:
            os.close(fd)
    os.chdir(cwd)


def _in_node(
    anchor_pid: int,
    cwd: str,
    env: dict[str, str],
    channel: socket.socket | None,
    output: str | None,
    fn: Callable[..., int | None],
    args: tuple[Any, ...],
) -> None:
    enter_namespaces(anchor_pid, cwd)
    if channel is not None:
        os.dup2(channel.fileno(), 0)
        os.dup2(channel.fileno(), 1)
        channel.close()
    else:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if output is not None:
            out = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
    follow_std_fds()
    os.environ.clear()
    os.environ.update(env)
    code = fn(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code or 0)


class NodeChild:
    """A process :func:`start_in_node` started."""

    def __init__(self, proc: ForkServerProcess, channel: socket.socket | None) -> None:
        self._proc = proc
        self._channel = channel
        self.pid: int | None = proc.pid
        self.stdin: BinaryIO | None = channel.makefile("wb") if channel is not None else None
        self.stdout: BinaryIO | None = channel.makefile("rb", buffering=0) if channel is not None else None

    # subprocess.Popen's
    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"process {self.pid} on a node", timeout or 0.0)
        self._close()
        return code

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()

    # multiprocessing.Process's
    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._proc.join(timeout)
        if self._proc.exitcode is not None:
            self._close()

    def _close(self) -> None:
        for stream in (self.stdin, self.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:  # a write the child never read: nothing to flush into
                    pass
        if self._channel is not None:
            self._channel.close()


def start_in_node(
    node: Node,
    fn: Callable[..., int | None],
    args: tuple[Any, ...],
    env: Mapping[str, str],
    *,
    output: str | None = None,
) -> NodeChild:
    """Run ``fn(*args)`` on ``node`` with exactly ``env`` (in the cluster's working directory), as
    ``node.spawn`` runs an interpreter; it exits with what ``fn`` returns. Without ``output``, its
    standard input and output are the returned child's ``stdin`` and ``stdout``."""
    mine, theirs = socket.socketpair() if output is None else (None, None)
    proc = process_context().Process(
        target=_in_node,
        args=(node.anchor_pid, str(node.cluster.cwd), dict(env), theirs, output, fn, args),
        daemon=True,  # ended with the harness; a trainer's own processes are subprocesses
    )
    try:
        proc.start()
    finally:
        if theirs is not None:
            theirs.close()
    return NodeChild(proc, mine)
