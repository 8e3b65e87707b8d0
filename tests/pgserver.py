"""A real PostgreSQL server for the tests: initdb into a temporary directory, pg_ctl on a socket there.

Debian's `postgresql` package (installed by `make postgres`) provides the binaries. The server runs as
an unprivileged user (initdb refuses root): the one the package created, or the caller when not root.
Each test gets a schema of its own (`PgServer.fresh_url`), which costs a CREATE SCHEMA, not a database.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg


def _bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def available() -> str | None:
    """Why no server can be started here, or None when one can."""
    if _bin("initdb") is None or _bin("pg_ctl") is None:
        return "PostgreSQL's initdb/pg_ctl are not installed (make postgres)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run the server as"
    return None


class PgServer:
    """One server in a temporary directory, stopped and removed by `stop`."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="sandboxd-pg-"))
        self.data = self.root / "data"
        self.sockets = self.root / "sock"
        self.sockets.mkdir()
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            for path in (self.root, self.sockets):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._run(_bin("initdb"), "-D", str(self.data), "-U", self.user, "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        self.start()
        self.url = f"postgresql://{self.user}@/postgres?host={self.sockets}"

    def start(self) -> None:
        # No TCP listener: the socket directory is the only way in. fsync stays on (durability is the point).
        options = f"-c listen_addresses='' -c unix_socket_directories={self.sockets} -c max_connections=200"
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", options,
                  "-w", "start")

    def crash(self) -> None:
        """Stop the server as a crash would (immediate: no checkpoint, no flush of what is not on disk)."""
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def _run(self, *argv: str | None) -> None:
        command = [a for a in argv if a is not None]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def fresh_url(self) -> str:
        """A URL whose tables live in a new, empty schema."""
        schema = "t_" + secrets.token_hex(6)
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        return f"{self.url}&options=-csearch_path%3D{schema}"

    def stop(self) -> None:
        try:
            self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
