"""CURVE keys: the files `inferctl keygen` writes, and the sockets that use them.

A key pair is two files made by zmq.auth: NAME.key (the public key, to share)
and NAME.key_secret (both halves; keep it private). The daemon's tcp endpoints,
its data sockets and a tcp control socket alike, speak CURVE with the server's
pair; the supervisor's ZAP handler (supervisor/intake/handshakes.py) lets in
only clients whose public key file lies in the authorized folder.
"""

from __future__ import annotations

import os
from typing import Union

import zmq
import zmq.auth
from zmq.utils import z85

KeyFile = Union[str, "os.PathLike[str]"]


def load_public(path: KeyFile) -> bytes:
    """The public key in a key file (either of the two)."""
    return zmq.auth.load_certificate(path)[0]


def load_pair(path: KeyFile) -> tuple[bytes, bytes]:
    """(public, secret) from a NAME.key_secret file; ValueError when the file holds no secret key."""
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{os.fspath(path)} holds no secret key (use the .key_secret file)")
    return public, secret


def secure_client(socket: zmq.Socket, server_public: bytes, pair: tuple[bytes, bytes]) -> None:
    """Make `socket` a CURVE client of the server whose public key is `server_public`."""
    socket.curve_serverkey = server_public
    socket.curve_publickey, socket.curve_secretkey = pair


class CurveServer:
    """The daemon's side of CURVE: its secret key, and the clients' keys it lets in."""

    def __init__(self, secret_key: str, authorized_keys: str) -> None:
        self._secret = load_pair(secret_key)[1] if secret_key else None
        self._authorized_folder = authorized_keys
        self._authorized: set[bytes] = set()  # Z85, as the key files hold them

    @property
    def enabled(self) -> bool:
        """True when the config names a server key (and so an authorized folder)."""
        return self._secret is not None

    def load_keys(self) -> None:
        """Read the authorized clients' public keys from their folder."""
        if self._secret is not None:
            self._authorized = set(zmq.auth.load_certificates(self._authorized_folder))

    def authorized(self, key: bytes) -> bool:
        """Whether a client with public key `key` (32 bytes, as a ZAP request gives it) may connect."""
        return len(key) == 32 and z85.encode(key) in self._authorized

    def secure(self, socket: zmq.Socket) -> None:
        """Make `socket` a CURVE server (call before bind); CURVE must be enabled."""
        assert self._secret is not None, "CURVE is not configured"
        socket.curve_secretkey = self._secret
        socket.curve_server = True
