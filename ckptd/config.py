"""Every tunable of asynchronous saving, in one frozen dataclass, overridable from the environment.

``CkptdConfig.from_env()`` is the only place that reads ``CKPTD_*`` variables: each field ``x``
is overridden by ``CKPTD_X`` (upper case), parsed as the field's type. A renamed field's old name
(:data:`DEPRECATED_NAMES`) still works, as a keyword and as a variable, with a FutureWarning. A
Checkpointer passes its config to the daemon it auto-starts through :meth:`CkptdConfig.to_env`,
so both sides agree.

Timeouts are in seconds and bound every wait in the control plane: no call waits forever.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, fields
from typing import Any

from .errors import CkptdError

ENV_PREFIX = "CKPTD_"
_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}
ON_FULL_POLICIES = ("wait", "skip")
# Old config names that still work, with the field each now sets (a FutureWarning says so).
DEPRECATED_NAMES = {"slot_wait_timeout_s": "in_flight_wait_timeout_s"}
SNAPSHOT_MODES = ("auto", "copy", "lazy")


@dataclass(frozen=True)
class CkptdConfig:
    """Knobs of the Checkpointer, the node daemon and the coordinator.

    Staging: each rank streams its saves through a ring of shared memory (ckptd.staging.ring)
    whose size is ``staging_budget``: ``"1.25x"`` (the default) is 1.25 x the rank's first save,
    so the node needs 1.25 x its state in /dev/shm; ``"0.25x"`` works too (a save then streams
    through a quarter of its size while the daemon drains it); ``"8GiB"`` is bytes for the whole
    node, shared by its ranks. ``on_full`` decides what a save does when the ring has no room for it yet:
    ``"wait"`` (default: the producer waits for the daemon, outside ``save()`` for fork and lazy
    snapshots) or ``"skip"`` (logged, reported on the handle, and the step is aborted on every
    rank). ``pin_memory`` pins the ring for CUDA in the background (in a process that uses CUDA;
    ckptd.staging.pinning). ``snapshot`` says who copies the shards into the ring: with
    ``"auto"`` (default), while an optimizer is attached (``Checkpointer.attach(optimizer)``: a
    fence before every update is guaranteed) as ``"lazy"``; otherwise, when every shard is plain
    CPU memory, a forked copy-on-write child does while training goes on (ckptd.staging.fork;
    ``save()`` stalls for the fork only), else (CUDA tensors: a device-to-host copy) the trainer
    inside ``save()``; with ``"copy"`` always the trainer; with ``"lazy"`` a copier thread of the
    trainer (CUDA: the side stream) after ``save()`` returned, fenced by
    ``Checkpointer.before_update()`` before the next optimizer step (ckptd.staging.lazy).

    Persisting: ``writer_threads`` per node daemon; ``fsync`` and ``checksums`` as in
    :func:`ckptd.save`; ``keep_last`` committed checkpoints are kept (0: keep all), older ones are
    deleted only after a newer one committed; ``megatron_tracker`` also writes Megatron-LM's
    ``latest_checkpointed_iteration.txt`` next to ``latest``. ``mirror`` (``s3://bucket/prefix``)
    adds a second tier to a local root: every step committed locally is then copied there in the
    background, keeping ``mirror_keep_last`` copies (0: all; see ckptd.roots.mirror).
    ``node_local`` says the root is a disk of each node at the same path, not shared (it needs a
    mirror): each node commits its own ranks' files there, and the mirror holds every node's
    (ckptd.roots.nodelocal).
    ``file_mode`` (octal; default 0o600: owner read-write only, since a shared primary group such
    as ``users`` would otherwise let anyone copy the weights; 0o640 opens them to the group) is
    the mode of every file the daemon writes into the root (data, metadata, trackers); step
    directories get it plus x wherever r is set (0o700). The process umask may narrow it further.
    """

    # staging
    staging_budget: str = "1.25x"  # "<f>x": f x the rank's first save; "<n>[KMG]iB": bytes per node
    on_full: str = "wait"
    pin_memory: bool = True
    # While the ring is still being pinned, a save's CUDA tensors are copied into free device memory
    # (at most this fraction of it) instead of waiting for the pinning (ckptd.staging.devsnap); 0: wait.
    device_snapshot_fraction: float = 0.25
    snapshot: str = "auto"  # "auto": lazy with attach(optimizer), else fork (CPU) / DMA in save() (CUDA)
    # persisting
    writer_threads: int = 2
    fsync: bool = True
    checksums: bool = True
    keep_last: int = 0
    megatron_tracker: bool = True
    # two tiers (ckptd.roots.mirror): an s3://bucket/prefix every locally committed step is copied to
    mirror: str = ""
    mirror_keep_last: int = 0  # committed copies kept in the mirror (0: keep all)
    node_local: bool = False  # the root is each node's own disk (multi-node: needs a mirror)
    check_common: bool = True  # compare every rank's common state with rank 0's (a warning when they differ)
    file_mode: int = dataclasses.field(default=0o600, metadata={"octal": True})
    # Background work yields to training: CPU niceness of the node daemon, whose I/O also runs at
    # the lowest best-effort I/O priority. (Fork snapshot children are not niced: the sooner they
    # are done, the fewer pages training writes are copied for them.)
    daemon_nice: int = 10
    policy: str = "manual"  # "auto": Checkpointer.due() picks the interval (ckptd.client.policy)
    mtbf_s: float = 0.0  # the job's mean time between failures, for policy="auto"
    restart_s: float = 0.0  # time to restart and reload after a failure, for policy="auto"
    metrics_port: int = 0  # >0: the node daemon serves Prometheus text on <metrics_host>:<port>/metrics
    # Loopback by default: metrics are then readable by every local user, and by nobody else.
    metrics_host: str = "127.0.0.1"
    # control plane
    runtime_dir: str = ""  # default: $XDG_RUNTIME_DIR/ckptd or /tmp/ckptd-<uid>
    job_id: str = ""  # default: derived from the checkpoint root's real path
    job_token: str = ""  # default: a random token kept in <runtime_dir>/<job>.token (0600)
    run_id: str = ""  # one value per launch, equal on every rank: names save attempts (ckptd.control.attempt)
    coordinator_host: str = ""  # default: MASTER_ADDR, else 127.0.0.1
    coordinator_port: int = 0  # default: MASTER_PORT + 1 for multi-node jobs, else ephemeral
    max_message_nbytes: int = 64 << 20
    # timeouts (seconds)
    request_timeout_s: float = 30.0
    daemon_start_timeout_s: float = 60.0
    in_flight_wait_timeout_s: float = 600.0  # a save waiting for one of the rank's BLOCKS saves in flight to end
    snapshot_timeout_s: float = 600.0
    commit_timeout_s: float = 600.0
    # node-local disks: a mirror copy round waiting for every node's upload, and a resume waiting
    # for the mirror's copy of files its node lacks (ckptd.roots.mirror_nodes, ckptd.storage.nodeview)
    mirror_timeout_s: float = 600.0
    coordinator_timeout_s: float = 30.0
    heartbeat_s: float = 1.0
    idle_exit_s: float = 60.0
    shutdown_grace_s: float = 30.0
    close_timeout_s: float = 600.0
    # A resume waiting for the commits the previous launch left in flight (0: never waits).
    resume_wait_s: float = 600.0
    # Test hooks (fault injection, see ckptd.daemon.faults); never set them in production.
    debug_write_delay_s: float = 0.0  # seconds slept before the daemon opens each file for writing
    debug_fault_file: str = ""  # file of fault rules ("fail ENOSPC 4096", "delay 2"), re-read per open
    # Deprecated: sets in_flight_wait_timeout_s (the name is from when the ring had slots). Not a
    # field, so to_env() and fields() know the new name only.
    slot_wait_timeout_s: InitVar[float | None] = None

    def __post_init__(self, slot_wait_timeout_s: float | None) -> None:
        if slot_wait_timeout_s is not None:
            _warn_deprecated("slot_wait_timeout_s", stacklevel=4)  # the caller of CkptdConfig()
            object.__setattr__(self, "in_flight_wait_timeout_s", slot_wait_timeout_s)
        if self.on_full not in ON_FULL_POLICIES:
            raise CkptdError(f"config on_full={self.on_full!r}: choose one of {ON_FULL_POLICIES}")
        if self.snapshot not in SNAPSHOT_MODES:
            raise CkptdError(f"config snapshot={self.snapshot!r}: choose one of {SNAPSHOT_MODES}")
        if self.policy not in ("manual", "auto"):
            raise CkptdError(f"config policy={self.policy!r}: choose 'manual' or 'auto'")
        if self.policy == "auto" and self.mtbf_s <= 0:
            raise CkptdError(
                f"config policy='auto' needs the job's mean time between failures: set mtbf_s > 0 "
                f"(CKPTD_MTBF_S), got {self.mtbf_s}"
            )
        parse_budget(self.staging_budget)  # raises CkptdError naming the setting
        if not 0.0 <= self.device_snapshot_fraction <= 1.0:
            raise CkptdError(
                f"config device_snapshot_fraction={self.device_snapshot_fraction}: "
                "a fraction of the free device memory, 0 to 1"
            )
        if self.writer_threads < 1:
            raise CkptdError(f"config writer_threads={self.writer_threads}: need at least 1")
        for name in ("keep_last", "mirror_keep_last"):
            if getattr(self, name) < 0:
                raise CkptdError(f"config {name}={getattr(self, name)}: use 0 to keep all, or K >= 1")
        if self.node_local and not self.mirror:
            raise CkptdError(
                "config node_local=True: a root on each node's own disk needs a mirror "
                "(mirror='s3://bucket/prefix'): no node sees the others' files, so resuming on another "
                "layout or on a replaced node reads them from the mirror"
            )
        if self.file_mode & ~0o666 or self.file_mode & 0o600 != 0o600:
            raise CkptdError(
                f"config file_mode={self.file_mode:#o}: use read/write bits only (no x, setuid or "
                "sticky bits), including owner read-write (0o600), e.g. 0o640 or 0o600"
            )
        try:
            ipaddress.ip_address(self.metrics_host)
        except ValueError:
            raise CkptdError(
                f"config metrics_host={self.metrics_host!r}: give a numeric IP address of this machine "
                "(127.0.0.1, the default, serves this machine only; 0.0.0.0 every interface)"
            ) from None
        if not 0 <= self.metrics_port <= 65535:
            raise CkptdError(f"config metrics_port={self.metrics_port}: a TCP port (1-65535), or 0 for no metrics")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s") and not (math.isfinite(value) and value >= 0):
                # NaN compares false with everything: a timeout of NaN never, or always, expires.
                raise CkptdError(f"config {f.name}={value}: must be a finite number of seconds >= 0")
        for name in _POSITIVE_S:
            if getattr(self, name) <= 0:
                raise CkptdError(f"config {name}={getattr(self, name)}: must be > 0 (a wait of 0 s never succeeds)")
        if self.max_message_nbytes < _MIN_MESSAGE_NBYTES:
            raise CkptdError(
                f"config max_message_nbytes={self.max_message_nbytes}: a SAVE of even a few items needs more; "
                f"use at least {_MIN_MESSAGE_NBYTES} (default {64 << 20})"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> CkptdConfig:
        """Defaults, then ``CKPTD_<FIELD>`` variables, then keyword ``overrides`` (highest)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(f.name, "octal" if f.metadata.get("octal") else f.type, raw)
        for old, new in DEPRECATED_NAMES.items():  # the new name wins where both are given
            raw = environ.get(ENV_PREFIX + old.upper())
            if raw is not None:
                _warn_deprecated(old, env=True, stacklevel=3)  # the caller of from_env()
                values.setdefault(new, _parse(old, {f.name: f.type for f in fields(cls)}[new], raw))
            if old in overrides:
                _warn_deprecated(old, stacklevel=3)
                overrides.setdefault(new, overrides.pop(old))
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise CkptdError(f"unknown config fields {sorted(unknown)}")
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> CkptdConfig:
        return dataclasses.replace(self, **changes)

    def daemon_stop_bound_s(self, *, mirror: bool) -> float:
        """The longest an orderly stop of a node daemon with this config takes, but its process's
        exit: its work in flight gets ``shutdown_grace_s`` (then it is aborted), and its close
        waits up to ``request_timeout_s`` for a ``mirror`` upload and up to ``shutdown_grace_s``
        again for its writer and commit threads (ckptd.daemon.node)."""
        return 2 * self.shutdown_grace_s + (self.request_timeout_s if mirror else 0.0)

    def to_env(self) -> dict[str, str]:
        """``CKPTD_*`` variables that make :meth:`from_env` rebuild this config elsewhere."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.metadata.get("octal"):
                out[ENV_PREFIX + f.name.upper()] = f"{v:#o}"
            else:
                out[ENV_PREFIX + f.name.upper()] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        return out


def _warn_deprecated(old: str, *, stacklevel: int, env: bool = False) -> None:
    # A FutureWarning is shown to users by default, once per place that raised it.
    new = DEPRECATED_NAMES[old]
    name, now = (ENV_PREFIX + old.upper(), ENV_PREFIX + new.upper()) if env else (old, new)
    warnings.warn(f"ckptd config {name} is deprecated; use {now} (same meaning)", FutureWarning, stacklevel=stacklevel)


# Waits that must be able to succeed: a request, the daemon's start, the heartbeat's period and
# the coordinator's silence allowance.
_POSITIVE_S = ("request_timeout_s", "daemon_start_timeout_s", "heartbeat_s", "coordinator_timeout_s")
_MIN_MESSAGE_NBYTES = 64 << 10


def parse_budget(budget: str) -> tuple[float, int]:
    """``staging_budget`` as ``(fraction of a save, 0)`` or ``(0, bytes per node)``."""
    text = budget.strip().upper().replace(" ", "")
    try:
        if text.endswith("X"):
            fraction = float(text[:-1])
            if 0 < fraction < math.inf:
                return fraction, 0
        else:
            digits = text.rstrip("KMGTIB")
            value = float(digits) * _UNITS[text[len(digits) :]]
            if 1 <= value < math.inf:
                return 0.0, int(value)
    except (KeyError, ValueError, OverflowError):
        pass
    raise CkptdError(
        f'config staging_budget={budget!r}: use a multiple of one save ("1.25x", or '
        '"0.25x" to stream saves through a quarter of their size) or bytes per node '
        '("8GiB")'
    )


def _parse(name: str, type_name: Any, raw: str) -> Any:
    t = type_name if isinstance(type_name, str) else getattr(type_name, "__name__", str(type_name))
    try:
        if t == "bool":
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if t == "int":
            return int(raw)
        if t == "octal":  # 640, 0640 and 0o640 all mean 0o640
            return int(raw.strip(), 8)
        if t == "float":
            return float(raw)
        return raw
    except ValueError:
        raise CkptdError(f"environment variable {ENV_PREFIX}{name.upper()}={raw!r} is not a valid {t}") from None
