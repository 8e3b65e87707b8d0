"""Who is on the other end of the socket: CURVE key files, the ZAP handler, and the peer of a request.

Two kinds of peer exist:

* **tcp://** — the transport is CURVE. The daemon admits a client only if its public key is in
  `client_keys_dir` (a `*.key` file there) or is an operator key, and names it by that key (z85).
  Refusals happen in the handshake, so a refused client sees no reply at all: the daemon logs them.
* **ipc://** — the socket file is owner-only (0600, in a 0700 state directory), so whoever can
  connect already is the daemon's owner: the peer is `local` and acts as an operator.

Key files use the ZPL certificate format of czmq's `zcert` and pyzmq's `zmq.auth`, so keys made by
either tool work here and the other way round::

    #   ZeroMQ CURVE Public Certificate, written by `sandboxd keys`
    metadata
        name = "agent-a"
    curve
        public-key = "<40 z85 characters>"

`NAME.key` holds only the public key and may be handed out; `NAME.key_secret` adds a line
`secret-key = "<40 z85 characters>"`, is created mode 0600 and is refused if others can read it.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.auth
from zmq.utils import z85

from sandboxd import protocol as p
from sandboxd.errors import Unauthorized

if TYPE_CHECKING:
    from sandboxd.config import AuthConfig

log = logging.getLogger("sandboxd")

#: where libzmq sends its ZAP requests (RFC 27); the handler must be bound before a CURVE socket binds
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: a client retries its handshake every ~100 ms; one log line per refused key per this many seconds
REFUSAL_LOG_INTERVAL_S = 60.0


class KeyFileError(ValueError):
    """A key file that is missing, malformed or too widely readable."""


@dataclass(frozen=True)
class Peer:
    """Who sent a request: a CURVE public key (z85) or `local`, and whether it may act on any session."""

    key: str
    operator: bool = False


LOCAL_PEER = Peer("local", operator=True)

#: requests on the firewall's shared outbox: releasing a 'manual' hold is the operator's decision
#: and the outside world is not the agent's to reset or to read around its tools
OPERATOR_ONLY = (p.ReleaseCallRequest, p.DropCallRequest, p.ResolveCallRequest, p.WorldResetRequest,
                 p.WorldStateRequest, p.RollbackRequest, p.ForkRequest, p.CompensateRequest,
                 p.AdoptSessionRequest)


def authorize(request: p.Request, peer: Peer, owner_of: Callable[[str], str | None],
              session_of_revocation: Callable[[str], str | None]) -> None:
    """The one ownership rule, the daemon's and the fleet door's: a request naming a session, or a
    revocation of one, is its owner's (`owner_of` gives None for an unknown session) or an operator's."""
    if peer.operator:
        return
    every_session = (isinstance(request, p.OutboxRequest | p.ListCallsRequest | p.ListRevocationsRequest)
                     and request.session_id is None)
    if isinstance(request, OPERATOR_ONLY) or every_session:
        raise Unauthorized(None, type(request).__name__)
    session_id = getattr(request, "session_id", None)
    if session_id is None and isinstance(revocation_id := getattr(request, "revocation_id", None), str):
        session_id = session_of_revocation(revocation_id)
    owner = owner_of(session_id) if isinstance(session_id, str) else None
    # An unknown id passes through to its handler's unknown_session: ids are random, so that reveals nothing.
    if owner is not None and owner != peer.key:
        raise Unauthorized(session_id)


# Key files -----------------------------------------------------------------------------------


def _certificate(name: str, public: str, secret: str | None) -> str:
    kind = "**Secret** Certificate" if secret else "Public Certificate"
    lines = [f"#   ****  Generated on {datetime.datetime.now():%Y-%m-%d %H:%M:%S} by sandboxd keys  ****",
             f"#   ZeroMQ CURVE {kind}", "", "metadata", f'    name = "{name}"', "curve",
             f'    public-key = "{public}"']
    if secret:
        lines.append(f'    secret-key = "{secret}"')
    return "\n".join(lines) + "\n"


def generate_keys(directory: Path, name: str, force: bool = False) -> tuple[Path, Path]:
    """Write a fresh keypair as DIR/NAME.key and DIR/NAME.key_secret (0600); returns both paths."""
    if not name or "/" in name or name.startswith("."):
        raise KeyFileError(f"bad key name {name!r}: use a plain file name")
    public, secret = (k.decode() for k in zmq.curve_keypair())
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    public_path, secret_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    for path, text, mode in ((secret_path, _certificate(name, public, secret), 0o600),
                             (public_path, _certificate(name, public, None), 0o644)):
        try:
            # Created with its final mode: the secret is never readable by others, not even briefly.
            fd = os.open(path, flags, mode)
        except FileExistsError as exc:
            raise KeyFileError(f"{path} exists; pass --force to replace it") from exc
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(path, mode)  # O_CREAT's mode is masked by the umask, and --force keeps the old mode
    return public_path, secret_path


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read CURVE key file {path}: {exc}") from exc
    for key in (public, secret):
        if key is not None and not _is_z85_key(key):
            raise KeyFileError(f"{path}: a CURVE key is 40 z85 characters, got {key!r}")
    return public, secret


def _is_z85_key(key: bytes) -> bool:
    try:
        return len(key) == 40 and len(z85.decode(key)) == 32
    except (KeyError, ValueError):  # a character outside the z85 alphabet
        return False


def read_public_key(path: Path) -> str:
    """The z85 public key of a `.key` (or `.key_secret`) file."""
    return _load(path)[0].decode()


def read_secret_key(path: Path) -> tuple[str, str]:
    """(public, secret) z85 keys of a `.key_secret` file that only its owner can read."""
    public, secret = _load(path)
    if secret is None:
        raise KeyFileError(f"{path} holds no secret-key: pass the NAME.key_secret file, not NAME.key")
    if (mode := path.stat().st_mode) & 0o077:
        raise KeyFileError(f"{path} is readable by others (mode {mode & 0o777:o}); chmod 600 it")
    if zmq.curve_public(secret) != public:
        raise KeyFileError(f"{path}: its public-key does not belong to its secret-key")
    return public.decode(), secret.decode()


def allowed_keys(directory: Path, strict: bool = True) -> set[str]:
    """The public keys of every `*.key` file in the allowlist directory; not strict: skip bad files."""
    keys = set()
    for path in sorted(directory.glob("*.key")):
        try:
            keys.add(read_public_key(path))
        except KeyFileError:
            if strict:
                raise
            # One bad file dropped in while serving must not shut every client out.
            log.error("skipping unreadable allowlist entry %s", path, exc_info=True)
    return keys


@dataclass(frozen=True)
class ServerKeys:
    """The daemon's CURVE keypair, its client allowlist directory and its operators' keys."""

    public: str
    secret: str
    client_keys_dir: Path
    operators: frozenset[str]

    @classmethod
    def load(cls, auth: AuthConfig) -> ServerKeys:
        """Read and check every file the `auth` section names; KeyFileError says which one is wrong."""
        if not auth.curve:
            raise KeyFileError("CURVE is not configured: set [auth] server_secret_key_file and client_keys_dir")
        public, secret = read_secret_key(Path(auth.server_secret_key_file))
        clients = Path(auth.client_keys_dir)
        if not clients.is_dir():
            raise KeyFileError(f"client_keys_dir {clients} is not a directory")
        allowed_keys(clients)  # a malformed allowlist entry is a start-up error, not a silent refusal
        operators = frozenset(read_public_key(Path(f)) for f in auth.operator_keys)
        return cls(public, secret, clients, operators)

    def admits(self, key: str) -> bool:
        """Whether a client with this public key may connect (read afresh: removing a file revokes it)."""
        return key in self.operators or key in allowed_keys(self.client_keys_dir, strict=False)


# The ZAP handler -----------------------------------------------------------------------------


class ZapHandler:
    """Answers libzmq's ZAP requests: admits allowlisted CURVE keys and names each client by its key.

    pyzmq's ThreadAuthenticator would do the admitting, but it logs refusals at debug level on its
    own logger and reads the allowlist once; here refusals are warnings with the key, and removing
    a key file takes effect at the client's next connection.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keys: ServerKeys) -> None:
        self.keys = keys
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)  # bound here, in the caller's thread, before any CURVE socket binds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sandboxd-zap", daemon=True)
        self._last_refusal: dict[str, float] = {}
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(200):
                self._sock.send_multipart(self.reply(self._sock.recv_multipart()))

    def reply(self, frames: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request; never raises, since a REP socket must answer every request."""
        request_id = frames[1] if len(frames) > 1 else b""
        if len(frames) < 6 or frames[0] != b"1.0":
            log.error("malformed ZAP request of %d frames", len(frames))
            return [b"1.0", request_id, b"500", b"malformed ZAP request", b"", b""]
        address, mechanism, credentials = frames[3].decode(errors="replace"), frames[5], frames[6:]
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            self._log_refusal(f"mechanism {mechanism.decode(errors='replace')}", address, "not CURVE")
            return [b"1.0", request_id, b"400", b"CURVE required", b"", b""]
        key = z85.encode(credentials[0]).decode()
        try:
            admitted = self.keys.admits(key)
        except (OSError, KeyFileError):
            log.exception("cannot read the client allowlist; refusing %s", key)
            return [b"1.0", request_id, b"500", b"allowlist unreadable", b"", b""]
        if not admitted:
            self._log_refusal(key, address, "not in client_keys_dir")
            return [b"1.0", request_id, b"400", b"client key not allowed", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", key.encode(), b""]

    def _log_refusal(self, key: str, address: str, reason: str) -> None:
        now = time.monotonic()
        if now - self._last_refusal.get(key, -REFUSAL_LOG_INTERVAL_S) < REFUSAL_LOG_INTERVAL_S:
            return
        if len(self._last_refusal) > 4096:  # random keys must not grow this without bound
            self._last_refusal = {k: t for k, t in self._last_refusal.items() if now - t < REFUSAL_LOG_INTERVAL_S}
        self._last_refusal[key] = now
        log.warning("refused client %s from %s: %s", key, address, reason,
                    extra={"peer_key": key, "peer_address": address})
