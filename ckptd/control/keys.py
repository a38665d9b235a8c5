"""CurveZMQ key pairs of one job, derived from its token: nothing new to distribute.

Every socket between ckptd processes runs CurveZMQ (Curve25519 key exchange, then every frame
encrypted and authenticated per session: see :mod:`ckptd.control.channel`). Its keys come from the
job token with HKDF-SHA256 (RFC 5869): one label for the servers' key pair (node daemons' rank
sockets, the coordinator's port), another for the clients' (ranks, node daemons talking upstream,
tools). Whoever holds the token can derive both; whoever does not can neither complete a handshake
with a server (the server's ZAP handler accepts only the derived client key) nor pose as a server
(clients pin the derived server key).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from ..errors import DaemonError

_SALT = b"ckptd control plane, CurveZMQ keys, v1"
SERVER_LABEL = b"ckptd curve server key"
CLIENT_LABEL = b"ckptd curve client key"


@dataclass(frozen=True, kw_only=True)
class CurveKeys:
    """Both key pairs of a job, Z85-encoded as libzmq's socket options take them (40 bytes each)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def client_public_raw(self) -> bytes:
        """The client public key as the 32 bytes a ZAP request carries."""
        return z85.decode(self.client_public)

    def __repr__(self) -> str:  # never print secrets into a log
        return f"CurveKeys(server_public={self.server_public!r}, client_public={self.client_public!r})"


def _hkdf_sha256(token: bytes, label: bytes) -> bytes:
    prk = hmac.new(_SALT, token, hashlib.sha256).digest()  # extract
    return hmac.new(prk, label + b"\x01", hashlib.sha256).digest()  # expand, one 32-byte block


def derive_keys(token: bytes) -> CurveKeys:
    """The job's server and client key pairs from its token (same token, same keys, anywhere)."""
    if not zmq.has("curve"):
        raise DaemonError(
            f"this libzmq ({zmq.zmq_version()}) was built without CurveZMQ, which every "
            "ckptd socket needs; install pyzmq's wheel from PyPI (it bundles libzmq with "
            "libsodium) or a libzmq built with libsodium"
        )
    server_secret = z85.encode(_hkdf_sha256(token, SERVER_LABEL))
    client_secret = z85.encode(_hkdf_sha256(token, CLIENT_LABEL))
    return CurveKeys(
        server_public=zmq.curve_public(server_secret),
        server_secret=server_secret,
        client_public=zmq.curve_public(client_secret),
        client_secret=client_secret,
    )
