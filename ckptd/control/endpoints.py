"""Where the parties of one job meet: the launch environment, runtime paths, addresses, token.

A *job* is one checkpoint root (its id defaults to a hash of the root's real path, so a restarted
trainer finds the daemon that still persists its last saves). Per job and node:

- ``<runtime_dir>/<job>-n<node>.sock``: the daemon's ``ipc://`` endpoint for its ranks;
- ``<runtime_dir>/<job>-n<node>.pid``: pid file, ``flock``-ed by the live daemon for its lifetime
  (a free lock means no daemon, whatever the file says);
- ``<runtime_dir>/<job>-n<node>.log``: the daemon's log;
- ``<runtime_dir>/<job>.token``: the job token (0600) unless ``CKPTD_JOB_TOKEN`` is set; all
  nodes of a multi-machine job must share it through ``CKPTD_JOB_TOKEN``;
- ``/dev/shm/ckptd-<job>-n<node>-*``: the staging segments of the node's ranks.

``runtime_dir`` is created with mode 0700 and must be owned by the current user.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..config import CkptdConfig
from ..errors import CkptdError, DaemonError
from .netaddr import coordinator_bind_host, tcp_address

SHM_DIR = Path("/dev/shm")
# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
_MAX_IPC_PATH = 107


@dataclass(frozen=True)
class JobEnv:
    """This process's place in the job, from torchrun's variables (single process without them)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> "JobEnv":
        """Read RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT.

        Without RANK, torch.distributed (when initialized) gives rank and world size; without
        either, this is a single process. No collective is used.
        """
        env = os.environ if environ is None else environ
        try:
            if "RANK" in env and "WORLD_SIZE" in env:
                rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            else:
                rank, world = _torch_dist_rank()
            local_world = int(env.get("LOCAL_WORLD_SIZE", world))
            local_rank = int(env.get("LOCAL_RANK", rank % local_world))
            node = int(env.get("GROUP_RANK", rank // local_world))
            port = int(env.get("MASTER_PORT", "0"))
        except ValueError as exc:
            raise CkptdError(f"malformed torchrun environment variable: {exc}") from None
        je = cls(rank, local_rank, world, local_world, node, env.get("MASTER_ADDR", "127.0.0.1"), port)
        if not (0 <= rank < world and 0 <= local_rank < local_world and world % local_world == 0
                and 0 <= node < je.nnodes):
            raise CkptdError(
                f"inconsistent launch environment: RANK={rank} WORLD_SIZE={world} LOCAL_RANK="
                f"{local_rank} LOCAL_WORLD_SIZE={local_world} GROUP_RANK={node}; ckptd expects "
                "torchrun's variables (equal ranks per node)"
            )
        return je


def _torch_dist_rank() -> tuple[int, int]:
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def default_job_id(root: str | os.PathLike) -> str:
    return hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:12]


def default_runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "ckptd"
    return Path(f"/tmp/ckptd-{os.getuid()}")


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` with mode 0700 if needed; refuse one owned by someone else or group/world-accessible."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise DaemonError(f"runtime directory {path} is owned by uid {st.st_uid}, not by you; "
                          "set CKPTD_RUNTIME_DIR to a directory of your own")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


@dataclass(frozen=True)
class Endpoints:
    """Paths and addresses of one job's node daemon and coordinator."""

    root: Path
    job: str
    node: int
    runtime_dir: Path
    coordinator_connect: str  # tcp://host:port node daemons connect to
    coordinator_bind: str  # tcp://host:port node 0's daemon binds (port 0: ephemeral)

    @classmethod
    def for_job(cls, root: str | os.PathLike, env: JobEnv, config: CkptdConfig) -> "Endpoints":
        root = Path(os.path.realpath(root))
        job = config.job_id or default_job_id(root)
        if not job.replace("-", "").replace("_", "").isalnum() or len(job) > 40:
            raise CkptdError(f"job id {job!r}: use up to 40 letters, digits, '-' or '_'")
        runtime = Path(config.runtime_dir) if config.runtime_dir else default_runtime_dir()
        host = config.coordinator_host or env.master_addr or "127.0.0.1"
        port = config.coordinator_port
        if port == 0 and env.nnodes > 1:
            if env.master_port == 0:
                raise CkptdError("a multi-node job needs the coordinator's port: set MASTER_PORT "
                                 "(torchrun does) or CKPTD_COORDINATOR_PORT")
            port = env.master_port + 1
        bind_host = coordinator_bind_host(host, env.nnodes)  # never 0.0.0.0 (ckptd.control.netaddr)
        ep = cls(root, job, env.node, runtime, tcp_address(host, port), tcp_address(bind_host, port))
        if len(str(ep.socket_path)) > _MAX_IPC_PATH:
            raise CkptdError(f"ipc socket path {ep.socket_path} is longer than {_MAX_IPC_PATH} "
                             "bytes; set CKPTD_RUNTIME_DIR to a shorter directory")
        return ep

    @property
    def stem(self) -> str:
        return f"{self.job}-n{self.node}"

    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / f"{self.stem}.sock"

    @property
    def ipc_address(self) -> str:
        return f"ipc://{self.socket_path}"

    @property
    def pid_path(self) -> Path:
        return self.runtime_dir / f"{self.stem}.pid"

    @property
    def log_path(self) -> Path:
        return self.runtime_dir / f"{self.stem}.log"

    @property
    def token_path(self) -> Path:
        return self.runtime_dir / f"{self.job}.token"

    @property
    def shm_prefix(self) -> str:
        """Name prefix of every staging segment of this job and node."""
        return f"ckptd-{self.stem}-"


def load_token(ep: Endpoints, config: CkptdConfig) -> bytes:
    """The job token: ``config.job_token``, else the shared token file (created once, 0600)."""
    if config.job_token:
        return config.job_token.encode()
    ensure_private_dir(ep.runtime_dir)
    path = ep.token_path
    if not path.exists():
        # Written completely under a private name, then linked: readers never see a partial token,
        # and of several racing creators exactly one link succeeds.
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    token = path.read_bytes().strip()
    if len(token) < 32:
        raise DaemonError(f"job token file {path} is damaged ({len(token)} bytes); delete it and "
                          "restart the job")
    return token
