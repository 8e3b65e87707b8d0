"""Every table of the state database, as numbered migrations applied at start-up (`Database.migrate`).

A migration is applied once, in its own transaction, and never edited after it shipped: a change to the
schema is a new migration. Version 1 is the schema sandboxd 0.1 created (through sqlite-utils, with the
same names and types), written with IF NOT EXISTS, so a database of that version is taken as it is.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Migration:
    """One step of the schema: its version, what it does, and the statements (or function) that do it."""

    version: int
    description: str
    statements: tuple[str, ...] = ()
    function: Callable[[Any], None] | None = None

    def apply(self, conn: Any) -> None:
        # `conn`: a sqlite3 connection, or `sandboxd.pg.Connection` (the same calls, SQLite's SQL)
        for statement in self.statements:
            conn.execute(statement)
        if self.function is not None:
            self.function(conn)


_V1 = (
    """CREATE TABLE IF NOT EXISTS sessions (
        session_id TEXT PRIMARY KEY, image TEXT NOT NULL, state TEXT NOT NULL, created_at FLOAT NOT NULL,
        closed_at FLOAT, container_id TEXT, env_snapshot TEXT, owner TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS calls (
        call_id TEXT, session_id TEXT NOT NULL REFERENCES sessions(session_id), seq INTEGER, tool TEXT NOT NULL,
        args TEXT NOT NULL, effect TEXT, status TEXT NOT NULL, result TEXT, created_at FLOAT, finished_at FLOAT,
        branch TEXT, turn INTEGER, PRIMARY KEY (session_id, call_id))""",
    """CREATE TABLE IF NOT EXISTS snapshots (
        snapshot_id TEXT PRIMARY KEY, session_id TEXT REFERENCES sessions(session_id), label TEXT,
        created_at FLOAT, layers INTEGER, elapsed_ms FLOAT)""",
    """CREATE TABLE IF NOT EXISTS revocations (
        revocation_id TEXT PRIMARY KEY, session_id TEXT, source TEXT, target TEXT, fingerprint TEXT, state TEXT,
        raised_by TEXT, tau INTEGER, T INTEGER, checkpoint_id TEXT, branch TEXT, closure TEXT, report TEXT,
        created_at FLOAT, started_at FLOAT, suffix TEXT)""",
    "CREATE TABLE IF NOT EXISTS forgotten (session_id TEXT, fingerprint TEXT)",
    "CREATE INDEX IF NOT EXISTS idx_calls_session_id_seq ON calls (session_id, seq)",
    "CREATE INDEX IF NOT EXISTS idx_snapshots_session_id ON snapshots (session_id)",
    """CREATE TABLE IF NOT EXISTS prov_artifacts (
        session_id TEXT, artifact_id TEXT, seq INTEGER, type TEXT, turn INTEGER, step INTEGER,
        token_start INTEGER, token_end INTEGER, committed INTEGER, content TEXT, meta TEXT, source_ids TEXT,
        branch TEXT, PRIMARY KEY (session_id, branch, artifact_id))""",
    """CREATE TABLE IF NOT EXISTS prov_edges (
        session_id TEXT, branch TEXT, parent TEXT, child TEXT, PRIMARY KEY (session_id, branch, parent, child))""",
    """CREATE TABLE IF NOT EXISTS prov_checkpoints (
        session_id TEXT, checkpoint_id TEXT, step INTEGER, turn INTEGER, token_offset INTEGER, cache_handle TEXT,
        reason TEXT, manifest TEXT, snapshot_id TEXT, created_at FLOAT, artifact_seq INTEGER, branch TEXT,
        PRIMARY KEY (session_id, branch, checkpoint_id))""",
    "CREATE INDEX IF NOT EXISTS idx_prov_artifacts_session_id_seq ON prov_artifacts (session_id, seq)",
    "CREATE INDEX IF NOT EXISTS idx_prov_edges_session_id_child ON prov_edges (session_id, child)",
    "CREATE INDEX IF NOT EXISTS idx_prov_checkpoints_session_id_step ON prov_checkpoints (session_id, step)",
    """CREATE TABLE IF NOT EXISTS ledger_calls (
        call_id TEXT PRIMARY KEY, lineage TEXT, branch TEXT, session_id TEXT, tool TEXT, intent_key TEXT,
        intent TEXT, args TEXT, occurrence INTEGER, state TEXT, policy TEXT, turn INTEGER, result TEXT,
        simulated TEXT, error TEXT, attempts INTEGER, created_at FLOAT, updated_at FLOAT, recovered_from TEXT)""",
    """CREATE TABLE IF NOT EXISTS ledger_reached (
        branch TEXT, call_id TEXT, lineage TEXT, session_id TEXT, intent_key TEXT, occurrence INTEGER,
        turn INTEGER, reached_at FLOAT, PRIMARY KEY (branch, call_id))""",
    """CREATE TABLE IF NOT EXISTS ledger_aliases (
        branch TEXT, agent_call_id TEXT, call_id TEXT, PRIMARY KEY (branch, agent_call_id))""",
    """CREATE TABLE IF NOT EXISTS ledger_branches (
        branch TEXT PRIMARY KEY, lineage TEXT, parent TEXT, status TEXT, from_turn INTEGER, created_at FLOAT,
        finished_at FLOAT)""",
    """CREATE TABLE IF NOT EXISTS ledger_events (
        id INTEGER PRIMARY KEY, call_id TEXT, at FLOAT, from_state TEXT, to_state TEXT, note TEXT)""",
    """CREATE TABLE IF NOT EXISTS outbox_held (
        call_id TEXT PRIMARY KEY, session_id TEXT, lineage TEXT, branch TEXT, turn INTEGER, policy TEXT,
        held_at FLOAT)""",
    "CREATE INDEX IF NOT EXISTS idx_ledger_calls_state ON ledger_calls (state)",
    "CREATE INDEX IF NOT EXISTS idx_ledger_reached_branch_intent_key ON ledger_reached (branch, intent_key)",
    "CREATE INDEX IF NOT EXISTS idx_ledger_reached_session_id ON ledger_reached (session_id)",
    "CREATE INDEX IF NOT EXISTS idx_ledger_branches_lineage_status ON ledger_branches (lineage, status)",
    "CREATE INDEX IF NOT EXISTS idx_ledger_events_call_id ON ledger_events (call_id)",
    "CREATE INDEX IF NOT EXISTS idx_outbox_held_session_id_turn ON outbox_held (session_id, turn)",
)


def _add_missing_columns(table: str, columns: dict[str, str]) -> Callable[[sqlite3.Connection], None]:
    """Add what a 0.1 daemon that predates a column lacks (it stamped version 1 at every start)."""

    def apply(conn: sqlite3.Connection) -> None:
        present = {row[1] for row in conn.execute(f'PRAGMA table_info("{table}")')}
        for name, kind in columns.items():
            if name not in present:
                conn.execute(f'ALTER TABLE "{table}" ADD COLUMN "{name}" {kind}')

    return apply


def _v2(conn: sqlite3.Connection) -> None:
    _add_missing_columns("revocations", {"suffix": "TEXT", "pieces": "TEXT", "error": "TEXT"})(conn)
    _add_missing_columns("ledger_calls", {"simulated": "TEXT", "recovered_from": "TEXT"})(conn)


_V3 = (
    # One record of branch operations: the ledger's branches and the operations that open replays,
    # rollbacks and forks (kind, splice checkpoint) are one table, and "a replay is open" lives there only.
    "ALTER TABLE ledger_branches RENAME TO branches",
    "ALTER TABLE branches ADD COLUMN kind TEXT",
    "ALTER TABLE branches ADD COLUMN splice TEXT",
    "UPDATE branches SET status = 'open' WHERE status = 'replay'",
    "DROP INDEX IF EXISTS idx_ledger_branches_lineage_status",
    "CREATE INDEX IF NOT EXISTS idx_branches_lineage_status ON branches (lineage, status)",
)


def _v7(conn: Any) -> None:
    if getattr(conn, "dialect", "sqlite") == "postgresql":
        # Shared by several daemons: a session belongs to the one that opened it (each connection of a
        # daemon sets `sandboxd.node`), and recovery touches only its own. An embedded file has one daemon.
        conn.execute("ALTER TABLE sessions ADD COLUMN node TEXT DEFAULT current_setting('sandboxd.node', true)")
    else:
        conn.execute("ALTER TABLE sessions ADD COLUMN node TEXT")
    conn.execute("CREATE INDEX IF NOT EXISTS idx_sessions_node_state ON sessions (node, state)")


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "the tables of sandboxd 0.1", _V1),
    Migration(2, "revocations of split targets and their errors; the simulated answers of staged effects",
              function=_v2),
    Migration(3, "one table of branches, for the ledger and for branch operations", _V3),
    Migration(4, "where a live session's provenance ended when a branch of it opened", (
        "CREATE TABLE IF NOT EXISTS prov_branches (branch TEXT PRIMARY KEY, session_id TEXT, artifact_end INTEGER, "
        "checkpoint_end INTEGER)",)),
    Migration(5, "who decided a held or unknown call and why; sessions' idle timeout and time to live", (
        "ALTER TABLE ledger_events ADD COLUMN actor TEXT",
        "ALTER TABLE ledger_events ADD COLUMN reason TEXT",
        "ALTER TABLE sessions ADD COLUMN idle_timeout_s FLOAT",
        "ALTER TABLE sessions ADD COLUMN ttl_s FLOAT")),
    Migration(6, "rollbacks and forks: a fork's parent and its held effects, an operation's report", (
        "ALTER TABLE sessions ADD COLUMN forked_from TEXT",
        "ALTER TABLE sessions ADD COLUMN hold_effects INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE branches ADD COLUMN report TEXT",
    )),
    Migration(7, "the node (daemon) a session lives on, when several share one PostgreSQL database", function=_v7),
)
