"""A session's forgotten values: salted fingerprints in the `forgotten` table, and the filter made of them.

The salt is the daemon's secret (created once, owner-only, beside its state); without it the stored
fingerprints say nothing about the values. The filter is decoded once per session and kept until the
session forgets something else.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path

import msgspec

from sandboxd import protocol as p
from sandboxd.db import Database
from sandboxd.errors import InvalidArguments
from sandboxd.firewall.handlers import result_text
from sandboxd.revocation.erasure import MIN_NEEDLE_BYTES
from sandboxd.revocation.fingerprint import RevokedFingerprint
from sandboxd.revocation.forgetting import ForgetFilter, fingerprints_for, piece_fingerprints


def load_salt(state_dir: Path) -> bytes:
    """The daemon's secret fingerprint salt, created once (owner-only) and kept with its state."""
    path = state_dir / "forget.salt"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_bytes(32))
    return path.read_bytes()


class Forgotten:
    """Every session's forgotten values, and the filters that keep them out."""

    def __init__(self, db: Database, salt: bytes) -> None:
        self.db = db
        self.salt = salt
        self._filters: dict[str, ForgetFilter] = {}
        self._prose_filters: dict[str, tuple[ForgetFilter, ForgetFilter]] = {}
        self._guard = threading.Lock()

    def forget(self, session_id: str, value: str, pieces: list[str] | None = None) -> None:
        """From now on `value` never reaches this session again, in any form; only fingerprints are stored.

        Every form of the value (as given, decoded, the strings of a structured observation), matched in
        the decoded views of every text and whitespace-folded, so neither an escaped copy nor a tool that
        re-flows it (YAML folding a long string) brings it back. `pieces`: the parts of a value that was
        split across consecutive results, each as it ends or starts a result."""
        try:
            fps = fingerprints_for(value, self.salt) + piece_fingerprints(pieces or [], self.salt)
        except ValueError as exc:
            raise InvalidArguments("revoke", f"nothing to forget: {exc}", "$.target") from exc
        if not fps:
            raise InvalidArguments("revoke", "nothing to forget: the target is empty or only whitespace", "$.target")
        with self.db.transaction():
            for fp in fps:
                self.db.insert("forgotten", {"session_id": session_id, "fingerprint": msgspec.json.encode(fp).decode()})
        with self._guard:
            self._filters.pop(session_id, None)
            self._prose_filters.pop(session_id, None)

    def filter(self, session_id: str) -> ForgetFilter:
        """The session's forgotten values, decoded once and kept until the next `forget`."""
        with self._guard:
            cached = self._filters.get(session_id)
        if cached is None:
            rows = self.db.rows("SELECT fingerprint FROM forgotten WHERE session_id = ?", [session_id])
            fps = [msgspec.json.decode(r["fingerprint"], type=RevokedFingerprint) for r in rows]
            cached = ForgetFilter(fps, self.salt)
            with self._guard:
                self._filters[session_id] = cached
        return cached

    def prose_filter(self, session_id: str) -> ForgetFilter:
        """The session's forgotten values that the daemon's own prose (a log line, a report's notes) is filtered
        for: those that can be told from prose (`erasure.MIN_NEEDLE_BYTES`); decoded once, like `filter`."""
        forget = self.filter(session_id)
        with self._guard:
            cached = self._prose_filters.get(session_id)
            if cached is None or cached[0] is not forget:
                cached = forget, ForgetFilter([fp for fp in forget.fingerprints if fp.length >= MIN_NEEDLE_BYTES],
                                              self.salt)
                self._prose_filters[session_id] = cached
        return cached[1]

    def sanitize(self, session_id: str, artifact: p.Artifact, rendered: bool) -> str:
        """A recorded input with every forgotten value excised, as a fresh call would get it: the result of a
        tool served in the daemon (`rendered`) was rendered from data, and is filtered as that data."""
        forget = self.filter(session_id)
        return forget.rendered(artifact.content, result_text)[0] if rendered else forget.text(artifact.content)

    def drop(self, session_id: str) -> None:
        """A closed session keeps its fingerprints (a value it forgot must stay out of its records too); only
        the cached filter goes."""
        with self._guard:
            self._filters.pop(session_id, None)
            self._prose_filters.pop(session_id, None)
