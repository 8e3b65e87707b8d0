"""Fixtures every test directory may use: a real PostgreSQL server, started once per run when asked for."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def pg_server() -> Iterator[object]:
    """A PostgreSQL server of this run (skips the test where none can start: `make postgres` installs it)."""
    pytest.importorskip("psycopg")
    from tests import pgserver

    why = pgserver.available()
    if why is not None:
        pytest.skip(why)
    server = pgserver.PgServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server: object) -> str:
    """A fresh, empty schema on the run's server, as a `--state` URL."""
    return pg_server.fresh_url()  # type: ignore[attr-defined]
