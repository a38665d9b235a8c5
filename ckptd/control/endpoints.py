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

``runtime_dir`` (default: ckptd.control.rundir) is created with mode 0700 and must be a directory
(not a link) owned by the current user, and owner-only when configured (:func:`open_private_dir`);
the token file must be a private regular file of this user, and a client refuses a daemon whose
pid file or socket another user owns (:func:`check_daemon_file`). A daemon puts back its files
when they vanish under it (ckptd.daemon.runfiles).
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import secrets
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..config import CkptdConfig
from ..errors import CkptdError, DaemonError
from ..storage.url import Location, S3Location, parse_location
from .netaddr import coordinator_bind_host, tcp_address
from .rundir import runtime_dir_for

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
    def detect(cls, environ: Mapping[str, str] | None = None) -> JobEnv:
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
        if not (
            0 <= rank < world and 0 <= local_rank < local_world and world % local_world == 0 and 0 <= node < je.nnodes
        ):
            raise CkptdError(
                f"inconsistent launch environment: RANK={rank} WORLD_SIZE={world} LOCAL_RANK="
                f"{local_rank} LOCAL_WORLD_SIZE={local_world} GROUP_RANK={node}; ckptd expects "
                "torchrun's variables (equal ranks per node)"
            )
        return je


def _torch_dist_rank() -> tuple[int, int]:
    # A process that has not imported torch.distributed has no process group: no import here (the
    # node daemon detects its place without torch).
    if "torch.distributed" not in sys.modules:
        return 0, 1
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def canonical_root(root: str | os.PathLike | S3Location) -> Location:
    """The one spelling of a root: a directory's real path, or the ``s3://`` location."""
    location = parse_location(root)
    return location if isinstance(location, S3Location) else Path(os.path.realpath(location))


def default_job_id(root: str | os.PathLike | S3Location) -> str:
    return hashlib.sha256(str(canonical_root(root)).encode()).hexdigest()[:12]


def default_runtime_dir() -> Path:
    """This user's runtime directory when none is configured (ckptd.control.rundir): found again
    by every process of the user, and never one another user created."""
    return runtime_dir_for(os.environ)


def _runtime_dir_named(path: Path, configured: bool) -> tuple[str, str]:
    """How a message names the runtime directory ``path`` (where its path came from), and what
    to do about it."""
    own = "a directory of your own (mode 0700)"
    if configured:
        return f"runtime directory {path} (CKPTD_RUNTIME_DIR)", f"set CKPTD_RUNTIME_DIR to {own}, or unset it"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and path == Path(xdg) / "ckptd":
        return (
            f"runtime directory {path} ($XDG_RUNTIME_DIR/ckptd)",
            f"set XDG_RUNTIME_DIR to your session's (/run/user/{os.getuid()}), or CKPTD_RUNTIME_DIR to {own}",
        )
    return f"runtime directory {path}", f"set CKPTD_RUNTIME_DIR to {own}"


def open_private_dir(
    path: Path,
    *,
    what: str | None = None,
    holds: str = "the job's sockets and token",
    hint: str | None = None,
    refuse_open_mode: bool = False,
    parents: bool = True,
    configured: bool = False,
) -> int:
    """Create ``path`` (mode 0700) if needed and open it without following a link; the caller
    closes the fd. Refused with DaemonError: a link (an attacker's ``/tmp/ckptd-<uid>`` pointing
    elsewhere), something else than a directory, or a directory owned by another user. A
    default directory of this user (ckptd's own, ckptd.control.rundir) that is group- or
    world-accessible is made 0700 (through the fd: the verified directory, never a link's target);
    one ``configured`` (``CKPTD_RUNTIME_DIR``: it may be shared on purpose, as ``/tmp`` is: made
    0700, it would lock out every other user) is refused instead, and so is one with
    ``refuse_open_mode`` (where a file another user put in it meanwhile would be taken for one of
    ours). Missing parents are made
    too unless ``parents`` is False (then FileNotFoundError). The errors name the directory as
    ``what`` (default: the runtime directory, and ``configured``: ``CKPTD_RUNTIME_DIR``'s), what it
    ``holds`` and what to do (``hint``)."""
    named, default_hint = _runtime_dir_named(path, configured)
    named = named if what is None else f"{what} {path}"
    hint = default_hint if hint is None else hint
    try:
        if parents:
            path.parent.mkdir(parents=True, exist_ok=True)
    except (NotADirectoryError, FileExistsError) as exc:  # a parent is a file
        raise DaemonError(f"{named} cannot be made: {exc.filename} is not a directory; {hint}") from None
    except OSError as exc:  # a parent is another user's (EACCES), a read-only filesystem...
        raise DaemonError(f"{named} cannot be made: {exc.filename}: {exc.strerror}; {hint}") from None
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except NotADirectoryError:
        raise DaemonError(f"{named} cannot be made: {path.parent} is not a directory; {hint}") from None
    except PermissionError as exc:  # its parent is another user's
        raise DaemonError(f"{named} cannot be made in {path.parent} ({exc.strerror}); {hint}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(path):
            raise DaemonError(
                f"{named} is a symbolic link (to {os.readlink(path)!r}), "
                f"which someone else may have planted to receive {holds}; "
                f"ckptd never follows it: remove it, or {hint}"
            ) from None
        if exc.errno == errno.ENOTDIR:
            raise DaemonError(f"{named} is not a directory; {hint}") from None
        raise DaemonError(f"{named} cannot be opened as a directory ({exc.strerror}); {hint}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise DaemonError(
                f"{named} is owned by uid {st.st_uid}, not by you (uid "
                f"{os.getuid()}); {holds} could be anyone's: {hint}"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077 and configured:
            raise DaemonError(
                f"{named} has mode {mode:#o}: other users may reach {holds} there, and ckptd does not "
                f"change the mode of a directory you chose (it may be shared, as /tmp is): chmod 700 "
                f"{path} if it is yours alone, or {hint} (a missing one is created 0700)"
            )
        if mode & 0o077 and refuse_open_mode:
            raise DaemonError(
                f"{named} has mode {mode:#o}, not 0700: other users may have put files of theirs among "
                f"{holds}, or read them: {hint}"
            )
        if mode & 0o077:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_private_dir(path: Path, *, configured: bool = False) -> Path:
    """Create ``path`` if needed and check it (see :func:`open_private_dir`); returns ``path``."""
    os.close(open_private_dir(path, configured=configured))
    return path


def runtime_dir_exists(path: Path, *, configured: bool) -> bool:
    """Whether the runtime directory ``path`` is there, for a tool that only looks for daemons in it
    (never makes it): False when it is missing. A path that cannot be one (a file, or under one;
    a link; another user's directory, or one in a directory only another user may enter) is a
    DaemonError saying so: not "no daemon runs"."""
    named, hint = _runtime_dir_named(path, configured)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        raise DaemonError(f"{named} cannot be there: a directory above it is a file; {hint}") from None
    except OSError as exc:  # EACCES: a directory above it is another user's
        raise DaemonError(
            f"{named} cannot be reached ({exc.strerror}): a directory above it is not yours to enter; {hint}"
        ) from None
    if stat.S_ISLNK(st.st_mode):
        raise DaemonError(f"{named} is a symbolic link (to {os.readlink(path)!r}); ckptd never follows it: {hint}")
    if not stat.S_ISDIR(st.st_mode):
        raise DaemonError(f"{named} is not a directory; {hint}")
    if st.st_uid != os.getuid():
        raise DaemonError(
            f"{named} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}); its sockets and "
            f"token could be anyone's: {hint}"
        )
    return True


def check_daemon_file(path: Path) -> None:
    """Refuse (DaemonError) a daemon's pid file or socket that this user does not own, or that is
    a link: with a shared runtime directory it could be another user's fake daemon. Absent: fine."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else f"owned by uid {st.st_uid}"
        raise DaemonError(
            f"{path} is {what}, not a file of yours (uid {os.getuid()}); refusing to talk "
            "to whatever daemon it belongs to. Remove it, or set CKPTD_RUNTIME_DIR to a "
            "directory of your own (mode 0700)"
        )


@dataclass(frozen=True)
class Endpoints:
    """Paths and addresses of one job's node daemon and coordinator."""

    root: Location  # a directory (its real path) or an s3:// location
    job: str
    node: int
    runtime_dir: Path
    coordinator_connect: str  # tcp://host:port node daemons connect to
    coordinator_bind: str  # tcp://host:port node 0's daemon binds (port 0: ephemeral)

    @classmethod
    def for_job(cls, root: str | os.PathLike | S3Location, env: JobEnv, config: CkptdConfig) -> Endpoints:
        root = canonical_root(root)
        job = config.job_id or default_job_id(root)
        if not job.replace("-", "").replace("_", "").isalnum() or len(job) > 40:
            raise CkptdError(f"job id {job!r}: use up to 40 letters, digits, '-' or '_'")
        runtime = Path(config.runtime_dir) if config.runtime_dir else default_runtime_dir()
        host = config.coordinator_host or env.master_addr or "127.0.0.1"
        port = config.coordinator_port
        if port == 0 and env.nnodes > 1:
            if env.master_port == 0:
                raise CkptdError(
                    "a multi-node job needs the coordinator's port: set MASTER_PORT "
                    "(torchrun does) or CKPTD_COORDINATOR_PORT"
                )
            port = env.master_port + 1
        # Only node 0 binds (never on 0.0.0.0: ckptd.control.netaddr). Other nodes do not look up
        # a route to the host: one missing at their start is no reason to fail, they only connect.
        bind_host = coordinator_bind_host(host, env.nnodes) if env.node == 0 else host
        ep = cls(root, job, env.node, runtime, tcp_address(host, port), tcp_address(bind_host, port))
        if len(str(ep.socket_path)) > _MAX_IPC_PATH:
            raise CkptdError(
                f"ipc socket path {ep.socket_path} is longer than {_MAX_IPC_PATH} "
                "bytes; set CKPTD_RUNTIME_DIR to a shorter directory"
            )
        return ep

    @property
    def launch_coordinator(self) -> str:
        """The coordinator address this launch's ranks tell their node daemon in HELLO: the one to
        bind on node 0, to connect to elsewhere; "" when no port is set (one node: any free port)."""
        address = self.coordinator_bind if self.node == 0 else self.coordinator_connect
        return "" if address.endswith(":0") else address

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


# A token carries at least 16 random bytes: 32 hex digits. Fewer than this many distinct
# characters in a token of that length is a pattern, not randomness (32 random hex digits have
# fewer with probability 4e-8).
TOKEN_MIN_CHARS = 32
_TOKEN_MIN_DISTINCT = 8
_TOKEN_MAX_NBYTES = 4096
# A run of this many characters in arithmetic order ("abcdefghij", "9876543210", "0000000000"):
# 10 random hex digits form one with probability 16**-8; anywhere in a 4 KiB token, below 1e-6.
_TOKEN_MAX_RUN = 10
_MAKE_TOKEN = "python -c 'import secrets; print(secrets.token_hex(32))'"


def _repeat_length(n: int) -> int:
    """The length of a substring whose second occurrence in a token of ``n`` characters marks a
    pattern: one that ``n`` random hex digits repeat with probability below 1e-6 (8 up to 64
    characters, 11 at 4 KiB)."""
    return max(8, math.ceil(math.log(n * n / 2 * 1e6, 16)))


def token_pattern(token: bytes) -> str | None:
    """What makes ``token`` a pattern rather than random bytes, or None: too few distinct
    characters, a repeated substring (``"01234567" * 4``, ``"deadbeef" * 8``), or a run in
    arithmetic order (``"0123456789"``). Random tokens of 32 to 4,096 hex digits or URL-safe
    base64 characters trip none of them but with probability below 1e-6."""
    distinct = len(set(token))
    if distinct < _TOKEN_MIN_DISTINCT:
        return f"only {distinct} distinct characters"
    size = _repeat_length(len(token))
    seen: dict[bytes, int] = {}
    for i in range(len(token) - size + 1):
        chunk = token[i : i + size]
        first = seen.setdefault(chunk, i)
        if first != i:
            return f"{chunk.decode(errors='replace')!r} occurs at characters {first} and {i}"
    run = 1
    for i in range(2, len(token)):
        run = run + 1 if token[i] - token[i - 1] == token[i - 1] - token[i - 2] else 1
        if run + 1 >= _TOKEN_MAX_RUN:
            start = i + 1 - _TOKEN_MAX_RUN
            return f"{token[start : i + 1].decode(errors='replace')!r} runs in sequence"
    return None


def check_token(token: bytes, source: str) -> bytes:
    """``token`` if it is long and varied enough to carry >= 16 random bytes, else DaemonError."""
    problem = f"{len(token)} characters" if len(token) < TOKEN_MIN_CHARS else token_pattern(token)
    if problem is not None:
        raise DaemonError(
            f"the job token from {source} is too weak ({problem}): it must carry at least 16 random "
            f"bytes, i.e. at least {TOKEN_MIN_CHARS} random characters such as hex digits, without "
            f"repeats or sequences. Make one with {_MAKE_TOKEN}"
        )
    return token


def read_token_file(dir_fd: int, path: Path) -> bytes:
    """The token in ``path``: a regular file (not a link, not a FIFO) of this user, mode 0600 or
    stricter, read through the one fd whose status was checked."""
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DaemonError(
                f"job token file {path} is a symbolic link; ckptd reads only a private "
                "regular file of yours: delete it and restart the job"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif st.st_uid != os.getuid():
            problem = f"is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
        elif stat.S_IMODE(st.st_mode) & 0o077:
            problem = f"has mode {stat.S_IMODE(st.st_mode):#o}: others may know the token"
        elif st.st_size > _TOKEN_MAX_NBYTES:
            problem = f"has {st.st_size} bytes, far more than a token"
        if problem is not None:
            raise DaemonError(
                f"job token file {path} {problem}; ckptd uses only a private (0600) "
                "regular file of yours: delete it and restart the job"
            )
        token = os.pread(fd, _TOKEN_MAX_NBYTES, 0).strip()
    finally:
        os.close(fd)
    if len(token) < TOKEN_MIN_CHARS:
        raise DaemonError(
            f"job token file {path} is damaged ({len(token)} bytes); delete it and "
            "restart the job (a new one is created)"
        )
    return check_token(token, f"file {path}")


def create_token_file(dir_fd: int, path: Path, token: bytes) -> bytes | None:
    """Create ``path`` (in the directory ``dir_fd``) holding ``token``; None if another process
    created it first.

    Written completely under a private name (``O_EXCL | O_NOFOLLOW``, 0600), then linked: readers
    never see a partial token, and of several racing creators exactly one link succeeds. The
    token returned is read back through the fd it was written with.
    """
    tmp = f"{path.name}.{os.getpid()}.{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        os.write(fd, token)
        os.fsync(fd)
        try:
            os.link(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            return None
        return os.pread(fd, _TOKEN_MAX_NBYTES, 0).strip()
    finally:
        os.close(fd)
        os.unlink(tmp, dir_fd=dir_fd)


def load_token(ep: Endpoints, config: CkptdConfig) -> bytes:
    """The job token: ``config.job_token``, else the shared token file (created once, 0600).

    The runtime directory is checked either way (see :func:`open_private_dir`): the daemon's
    socket and pid file live there, so a client must not trust one in someone else's directory.
    A token must carry at least 16 random bytes (:func:`check_token`); a token file is adopted
    only if it is a private regular file of this user.
    """
    dir_fd = open_private_dir(ep.runtime_dir, configured=bool(config.runtime_dir))
    try:
        if config.job_token:
            return check_token(config.job_token.encode(), "CKPTD_JOB_TOKEN")
        try:
            return read_token_file(dir_fd, ep.token_path)
        except FileNotFoundError:
            pass
        created = create_token_file(dir_fd, ep.token_path, secrets.token_hex(32).encode())
        return created if created is not None else read_token_file(dir_fd, ep.token_path)
    finally:
        os.close(dir_fd)
