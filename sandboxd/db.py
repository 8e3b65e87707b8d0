"""The daemon's one persistence layer: a SQLite database, its one transaction helper, typed rows, migrations.

Writes go through one connection under one re-entrant lock, WAL mode and `synchronous=FULL`: a reply
is sent only after its record is committed, so whatever the daemon acknowledged survives `kill -9`.
The fsync of a transaction comes after its COMMIT, outside that lock, and is shared by every
transaction committed meanwhile (group commit, see `transaction`). A `lazy` transaction (a tool
call's record: two per call, on the hot path) does not wait for it at all: its frames are in the WAL
file, in the kernel's page cache, before COMMIT returns, so it survives the daemon's `kill -9` all the
same; the next fsync, at most `FLUSH_S` later, makes it survive a host crash too. An fsync costs
milliseconds here; a call is meant to cost less. Nor does any transaction of a request wait on its own
(`one_flush`): the request's reply waits once, for all of them.
Reads from a thread that is not writing take a connection of their own (one per thread, WAL readers
see the last commit) and no lock, so a listing answered on the socket thread never waits behind a
revocation's transaction or a VACUUM. `secure_delete` zeroes what a delete frees, so forgetting can
be physical (see `purge`).

Every table is created and changed by the numbered migrations of `sandboxd.migrations`, applied at
start-up in order; `PRAGMA user_version` records the last one applied. Rows come back as the msgspec
struct a caller names (`rows(sql, params, SessionRow)`), so no module passes `dict[str, Any]` around.

The state may instead live on a PostgreSQL server (`Database("postgresql://...")`, the `state` setting):
the same class, the same SQL, over a connection of `sandboxd.pg` that translates SQLite's dialect; one
writer at a time across every daemon on that database, as one SQLite file allows one, except that
transactions of different sessions' own rows run at once. The group commit is the same there: a
commit does not wait for the disk under the lock, a WAL flush on a connection of its own does after it.

Why one module of this size: a transaction, the group commit that makes it durable, the connections it
may run on and the purge grouped like the fsyncs share one writer lock and one set of counters; split,
each half would reach into the other's state to keep the durability promise.
"""

from __future__ import annotations

import logging
import os
import queue
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from sandboxd.errors import SandboxUnavailable
from sandboxd.migrations import MIGRATIONS, Migration

T = TypeVar("T")
log = logging.getLogger("sandboxd")

#: the longest a lazy commit waits for its fsync (the window a host crash, not a kill, can lose)
FLUSH_S = 0.05
#: connections for sessions' own transactions on a server (beyond the daemon's one writer connection)
SESSION_WRITERS = 8
#: the longest a session transaction waits for one of the SESSION_WRITERS connections
POOL_WAIT_S = 60.0
#: TRUNCATE checkpoints tried (each waiting up to the busy timeout for readers) before a purge gives up
TRUNCATE_TRIES = 3


def connect(path: Path | str, node: str | None = None) -> Any:
    """A connection with the pragmas every sandboxd database uses (a server's for a postgresql:// URL)."""
    if pg_url(path):
        from sandboxd import pg

        conn_pg = pg.Connection(str(path), node=node)
        conn_pg.bootstrap()
        return conn_pg
    conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    # Revoked content must not survive in freed pages.
    conn.execute("PRAGMA secure_delete=ON")
    return conn


class Database:
    """The state database: `transaction()` for writes, `rows()` / `row()` for typed reads."""

    def __init__(self, path: Path | str, migrations: Sequence[Migration] = MIGRATIONS, *,
                 node: str | None = None) -> None:
        self.url = str(path) if pg_url(path) else None
        self.path = Path(path)
        #: the daemon this connection serves, on a shared server (sessions carry it; recovery is its own)
        self.node = node if self.url else None
        self.conn = connect(path, node=self.node)
        self.lock = threading.RLock()
        self._local = threading.local()
        self._readers: list[Any] = []
        self._closing: list[Any] = []
        self._unsynced = threading.Event()
        self._closed = threading.Event()
        self._commits = 0
        """Transactions committed so far (under `_counts_lock`, with the pool's size), and how many of them are
        known on disk."""
        self._counts_lock = threading.Lock()
        self._pool: queue.LifoQueue[Any] = queue.LifoQueue()
        self._pool_made = 0
        self._synced = 0
        self._syncing = False
        self._scope: str | None = None
        self._flusher_conn: Any = None
        self._sync_cond = threading.Condition()
        self._purges_begun = self._purges_done = 0
        self._purging = False
        self._purge_all, self._purge_tables = False, set[str]()
        self._purge_cond = threading.Condition()
        self._reclaim_lock = threading.Lock()
        self._reclaimer: Any = None
        #: the connection purges copy the WAL with (one purge runs at a time: see `purge`)
        self._checkpointer: sqlite3.Connection | None = None
        self._columns: dict[str, frozenset[str]] = {}
        self.migrate(migrations)
        threading.Thread(target=self._flusher, name="sandboxd-wal-flush", daemon=True).start()

    @contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        """The write connection, under the lock; this thread's reads go through it meanwhile. Inside this
        thread's session transaction on a server, that transaction's connection, and no lock."""
        own = getattr(self._local, "session_conn", None)
        if own is not None:
            yield own
            return
        with self.lock:
            self._local.depth = getattr(self._local, "depth", 0) + 1
            try:
                yield self.conn
            finally:
                self._local.depth -= 1

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        own = getattr(self._local, "session_conn", None)
        if own is not None:
            yield own  # inside this thread's own write: read what it wrote
            return
        if getattr(self._local, "depth", 0):
            yield self.conn  # inside this thread's own write: read what it wrote
            return
        reader = getattr(self._local, "reader", None)
        if reader is None:
            reader = self._local.reader = self._reader()
            with self.lock:
                self._readers.append(reader)
        yield reader

    def _reader(self) -> Any:
        if self.url is not None:
            from sandboxd import pg

            return pg.Connection(self.url, read_only=True)
        reader = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=30)
        reader.execute("PRAGMA query_only=ON")
        return reader

    def in_flight(self) -> Any:
        """The set of calls being fired: this process's own (SQLite), every live daemon's (PostgreSQL)."""
        if self.url is None:
            return set()
        from sandboxd import pg

        in_flight = pg.InFlight(self.url)
        self._closing.append(in_flight)
        return in_flight

    def mine(self, column: str = "session_id") -> tuple[str, list[Any]]:
        """A condition (` AND ...`) keeping the rows of this daemon's sessions: nothing on an embedded
        database, which one daemon owns; on a shared server, what recovery may touch."""
        if self.node is None:
            return "", []
        return f" AND {column} IN (SELECT session_id FROM sessions WHERE node = ?)", [self.node]

    # Transactions ------------------------------------------------------------------------------

    @contextmanager
    def transaction(self, *, durable: bool = False, lazy: bool = False,
                    session: str | None = None) -> Iterator[Database]:
        """BEGIN IMMEDIATE .. COMMIT under the lock; rolls back on any exception. Durable when the block ends.

        Opened inside another transaction it joins it, unless `durable`: a write-ahead record (an effect's
        intent) must reach the disk when its block ends, before the effect fires, so nesting it is refused.

        Group commit: COMMIT writes the WAL without an fsync, under the lock; the fsync comes after the
        lock is released, shared by every transaction committed meanwhile (`_sync`). So a session's
        transaction never waits for another's fsync while holding the one writer's lock, and concurrent
        revocations (a dozen transactions each) do not queue behind each other's disk flushes.
        `lazy`: not even that wait; the flusher's fsync follows within `FLUSH_S` (see the module's docstring).

        `session`: the block writes only that session's rows, which this daemon owns, under the session's
        lock. On a shared server it then excludes only whole-database transactions and the same session's,
        not other sessions' (see `sandboxd.pg`); a block of a wider reach cannot join it. There such a
        block runs on a connection of a small pool, outside the daemon's lock: its session's lock and the
        server's locks keep it apart from the same session's writes and from whole-database transactions
        (on this daemon's connection or any other daemon's) as they would keep two daemons apart, so the
        daemon's sessions record their calls at once instead of queueing on the one connection."""
        if getattr(self._local, "session_conn", None) is not None:
            if durable:
                raise RuntimeError("a durable transaction was opened inside an open transaction")
            if session != self._local.session:
                raise RuntimeError(f"a transaction beyond session {self._local.session} was opened inside its own")
            yield self
            return
        if session is not None and self.url is not None and not getattr(self._local, "depth", 0):
            with self._session_transaction(session):
                yield self
            committed = self._count_commit()
        else:
            with self._whole_transaction(durable, session):
                yield self
            committed = self._local.committed
            if not committed:  # joined an open transaction, which waits for the disk when it ends
                return
        if lazy:
            self._unsynced.set()
        elif not durable and getattr(self._local, "deferred", None) is not None:
            self._local.deferred = max(self._local.deferred, committed)  # `one_flush` waits for it
        else:
            self._sync(committed)

    @contextmanager
    def one_flush(self) -> Iterator[None]:
        """The block's transactions share one wait for the disk, at its end: a request's transactions, which
        are acknowledged together by its one reply. Inside it a commit does not wait for its fsync; the
        block's end waits for one covering all of them (raising, like a commit's, when it fails).

        What a reply acknowledges is on disk before the reply, as before. Against `kill -9` nothing
        changes (a commit's frames are in the kernel when COMMIT returns). Against a host crash, the block's
        commits reach the disk as a prefix of the WAL, as a crash between them would leave them. What must
        be on disk before something outside the database acts on it is `durable` and waits at its own end,
        covering every commit before it: an effect's intent before the effect fires, a branch's status
        before its participants act, a closing session's state before its sandbox goes (and events wait
        for the block's end, `Events.held`). A revocation's begin and commit were a dozen transactions
        each, each waiting for its own group fsync: under 16 concurrent revocations, 15% of a worker's time."""
        if getattr(self._local, "deferred", None) is not None:
            yield  # joined: the outermost block waits
            return
        self._local.deferred = 0
        failed = True
        try:
            yield
            failed = False
        finally:
            upto, self._local.deferred = self._local.deferred, None
            try:  # what was committed reaches the disk, the block failed or not
                if upto > self._synced:  # not covered already (by an intent's wait, or another thread's)
                    self._sync(upto)
            except Exception:
                if not failed:
                    raise
                # The block's own exception is the one to raise (a broken invariant stays one).
                log.warning("the state's flush after a failed request failed", exc_info=True)

    @contextmanager
    def _whole_transaction(self, durable: bool, session: str | None) -> Iterator[None]:
        with self._writing():
            if self.conn.in_transaction:
                if durable:
                    raise RuntimeError("a durable transaction was opened inside an open transaction")
                if self._scope is not None and session != self._scope:
                    raise RuntimeError(f"a transaction beyond session {self._scope} was opened inside its own")
                yield
                self._local.committed = 0  # joined: the outer block waits for the disk, not this one
                return
            self.conn.execute("PRAGMA synchronous=NORMAL")
            try:
                self._begin(session)
                try:
                    yield
                except BaseException:
                    self.conn.execute("ROLLBACK")
                    raise
                self.conn.execute("COMMIT")
            finally:
                self._scope = None
                # Statements outside a transaction (autocommit) keep the fsync of their own.
                self.conn.execute("PRAGMA synchronous=FULL")
            self._local.committed = self._count_commit()

    @contextmanager
    def _session_transaction(self, session: str) -> Iterator[None]:
        try:
            conn = self._pool.get_nowait()
        except queue.Empty:
            conn = self._connect() if self._pool_made < SESSION_WRITERS else self._pooled()
        self._local.session_conn, self._local.session = conn, session
        healthy = False
        try:
            conn.begin(session)
            try:
                yield
            except BaseException:
                conn.execute("ROLLBACK")
                healthy = True
                raise
            conn.execute("COMMIT")
            healthy = True
        finally:
            self._local.session_conn = self._local.session = None
            if healthy:
                self._pool.put(conn)
            else:  # its state unknown (a lost server, a failed COMMIT): a new connection takes its place
                conn.close()
                with self._counts_lock:
                    self._pool_made -= 1

    def _pooled(self) -> Any:
        try:
            return self._pool.get(timeout=POOL_WAIT_S)
        except queue.Empty:
            # Every writer busy this long means a stuck server, not load: the caller fails, it does not hang.
            raise SandboxUnavailable(f"no state connection came free within {POOL_WAIT_S:.0f} s") from None

    def _connect(self) -> Any:
        from sandboxd import pg

        with self._counts_lock:
            self._pool_made += 1
        try:
            conn = pg.Connection(self.url or "", node=self.node)
        except BaseException:
            # Not made: the count must not keep a place for it, or after SESSION_WRITERS failed connects
            # (a server briefly down) every session transaction would wait for a connection never made.
            with self._counts_lock:
                self._pool_made -= 1
            raise
        with self.lock:
            self._closing.append(conn)
        return conn

    def _count_commit(self) -> int:
        with self._counts_lock:
            self._commits += 1
            return self._commits

    def _begin(self, session: str | None) -> None:
        if self.url is None:
            self.conn.execute("BEGIN IMMEDIATE")
        else:
            self.conn.begin(session)
        self._scope = session

    def _sync(self, upto: int) -> None:
        """Return once the WAL is on disk up to commit number `upto`: join the fsync in flight if it covers
        it, else start one covering every commit so far (the group)."""
        with self._sync_cond:
            while self._synced < upto:
                if self._syncing:
                    self._sync_cond.wait()
                    continue
                self._syncing = True
                # Read without the writers' lock (a thread may hold it around its transaction and wait on
                # this condition): a count that only grows, and every commit it counts has written the WAL.
                group = self._commits
                self._sync_cond.release()
                flushed = False
                try:
                    self._fsync_wal()
                    flushed = True
                finally:
                    self._sync_cond.acquire()
                    self._syncing = False
                    # A failed flush covers nothing: its waiters try one of their own, and fail or return durable.
                    if flushed:
                        self._synced = max(self._synced, group)
                    self._sync_cond.notify_all()

    def _fsync_wal(self) -> None:
        if self.url is not None:
            if self._closed.is_set():  # not flushed, so not durable: said, not counted as done
                raise RuntimeError("the state is closed: a commit after its last flush is not known to be durable")
            if self._flusher_conn is None:
                from sandboxd import pg

                self._flusher_conn = pg.Connection(self.url)
                self._closing.append(self._flusher_conn)
            try:
                self._flusher_conn.flush()
            except Exception:
                # The caller learns its commit may not be durable; the next flush tries a new connection.
                self._flusher_conn.close()
                self._flusher_conn = None
                raise
            return
        try:
            fd = os.open(f"{self.path}-wal", os.O_RDONLY)
        except FileNotFoundError:  # checkpointed away (TRUNCATE), which syncs what it checkpoints
            return
        try:
            os.fsync(fd)  # the inode's pages, whichever descriptor wrote them
        finally:
            os.close(fd)

    def _flusher(self) -> None:
        """fsync the WAL after lazy commits, at most every FLUSH_S: many calls share one fsync."""
        while not self._closed.is_set():
            self._unsynced.wait()
            self._unsynced.clear()
            if self._closed.is_set():
                return
            try:
                self._sync(self._commits)
            except Exception:  # a server out of reach: the next lazy commit tries again (and its own error shows)
                log.warning("the state's flush failed", exc_info=True)
            self._closed.wait(FLUSH_S)

    def execute(self, sql: str, params: Iterable[Any] = ()) -> sqlite3.Cursor:
        """One statement under the lock (inside a transaction when it writes)."""
        with self._writing() as conn:
            return conn.execute(sql, list(params))

    # Typed reads -------------------------------------------------------------------------------

    def rows(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        """Every row of a query, as a mapping of column to value (for queries no struct describes)."""
        with self._reading() as conn:
            cursor = conn.execute(sql, list(params))
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, values, strict=True)) for values in cursor.fetchall()]

    def row(self, sql: str, params: Iterable[Any] = ()) -> dict[str, Any] | None:
        found = self.rows(sql, params)
        return found[0] if found else None

    def structs(self, sql: str, params: Iterable[Any], as_: type[T]) -> list[T]:
        """Every row of a query, each as the msgspec struct `as_` (its fields name the columns it needs)."""
        return [msgspec.convert(row, as_, strict=False) for row in self.rows(sql, params)]

    def struct(self, sql: str, params: Iterable[Any], as_: type[T]) -> T | None:
        """The first row of a query as `as_`, or None."""
        found = self.structs(sql, params, as_)
        return found[0] if found else None

    def value(self, sql: str, params: Iterable[Any] = ()) -> Any:
        """The first column of the first row, or None."""
        with self._reading() as conn:
            found = conn.execute(sql, list(params)).fetchone()
        return None if found is None else found[0]

    # Typed writes (call inside `transaction()`) ---------------------------------------------------

    def insert(self, table: str, row: msgspec.Struct | Mapping[str, Any], *, replace: bool = False) -> None:
        """Insert one row from a struct (its fields are the columns) or a mapping."""
        values = msgspec.to_builtins(row) if isinstance(row, msgspec.Struct) else dict(row)
        columns = ", ".join(f'"{c}"' for c in values)
        marks = ", ".join("?" for _ in values)
        verb = "INSERT OR REPLACE" if replace else "INSERT"
        self.execute(f'{verb} INTO "{table}" ({columns}) VALUES ({marks})', list(values.values()))

    def update(self, table: str, where: Mapping[str, Any], **fields: Any) -> int:
        """Set `fields` on the rows matching every `where` column; returns how many changed."""
        sets = ", ".join(f'"{c}" = ?' for c in fields)
        conditions = " AND ".join(f'"{c}" = ?' for c in where)
        cursor = self.execute(f'UPDATE "{table}" SET {sets} WHERE {conditions}', [*fields.values(), *where.values()])
        return int(cursor.rowcount)

    # Housekeeping ------------------------------------------------------------------------------

    def migrate(self, migrations: Sequence[Migration]) -> int:
        """Apply the migrations newer than the database, each in its own transaction; returns the version."""
        current = int(self.value("PRAGMA user_version") or 0)
        for migration in sorted(migrations, key=lambda m: m.version):
            if migration.version <= current:
                continue
            with self.transaction():
                # Read again under the writer lock: another daemon on a shared server may have applied it.
                current = int(self.value("PRAGMA user_version") or 0)
                if migration.version <= current:
                    continue
                migration.apply(self.conn)
                self.conn.execute(f"PRAGMA user_version = {int(migration.version)}")
                self._columns.clear()
            current = migration.version
        return current

    def columns(self, table: str) -> frozenset[str]:
        """The columns of `table` (none: no such table), read once: only `migrate` changes the schema.
        A revocation's scrub asks for every content table's under the writers' lock, where each statement
        is time every other session waits."""
        found = self._columns.get(table)
        if found is None:
            found = frozenset(row["name"] for row in self.rows(f'PRAGMA table_info("{table}")'))
            if found:  # a table still to be made is asked for again
                self._columns[table] = found
        return found

    def purge(self, tables: Iterable[str] | None = None, *, erase: bool = True) -> None:
        """Make deleted rows physically gone from the files, the WAL included.

        secure_delete already overwrites deleted content (and freed pages) with zeros in the database
        pages; what remains is the old page images in the WAL, which a TRUNCATE checkpoint removes.
        Rejected: VACUUM on every purge, which rewrites the whole database under the lock (seconds once
        many sessions share it) for nothing secure_delete has not already done.

        Grouped like the fsyncs: one checkpoint begun after the caller's commits covers them all, so
        revocations committing at once share a checkpoint instead of queueing one each behind the lock.
        And the checkpoint's copying and fsyncs happen outside the writers' lock (`_backfill`).

        On a PostgreSQL server (no secure_delete) the cost is a rewrite of the tables, so it is paid only
        where it is promised: `erase` (content a revocation forgot, which it then scans for) rewrites
        `tables` (None: every table); without it (a closed session's rows) see `sandboxd.pg.reclaim`.
        """
        if self.url is not None and not erase:
            self._reclaim()
            return
        with self._purge_cond:
            if tables is None:
                self._purge_all = True
            else:
                self._purge_tables.update(tables)
            # The checkpoint in flight, if any, may have begun before the caller's last write: the next one.
            wanted = self._purges_begun + 1
            while self._purges_done < wanted:
                if self._purging:
                    self._purge_cond.wait()
                    continue
                self._purging = True
                self._purges_begun += 1
                # This purge covers the tables of every caller waiting for it.
                group = None if self._purge_all else sorted(self._purge_tables)
                self._purge_all, self._purge_tables = False, set()
                self._purge_cond.release()
                done = False
                try:
                    self._checkpoint(group)
                    done = True
                finally:
                    self._purge_cond.acquire()
                    self._purging = False
                    if done:
                        self._purges_done = self._purges_begun
                    else:
                        # A failed purge covers nobody: its tables go back, and each caller waiting for it
                        # runs one of its own (and fails, or returns with its content gone).
                        if group is None:
                            self._purge_all = True
                        else:
                            self._purge_tables.update(group)
                    self._purge_cond.notify_all()

    def _checkpoint(self, tables: list[str] | None) -> None:
        if self.url is not None:
            with self._writing():
                self.conn.purge(tables)  # no secure_delete there: see `sandboxd.pg`
            return
        self._backfill()
        with self._writing() as conn:
            for _ in range(TRUNCATE_TRIES):
                busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                if not busy:
                    return
        # A reader held the WAL through every busy timeout: what the caller wrote may still be in it.
        raise RuntimeError(f"the WAL of {self.path} could not be truncated: a reader held it throughout")

    def _backfill(self) -> None:
        """Copy the WAL into the database file and sync it, without the writers' lock.

        A TRUNCATE checkpoint needs the writers' lock (SQLite's, and so ours on its one write connection)
        for all of its work: an fsync of the WAL, copying its frames, an fsync of the database, the
        truncation. Done under the lock, every session's transactions waited for two fsyncs per purge.
        A PASSIVE checkpoint on a connection of its own does the copying and both fsyncs while writers go
        on; the TRUNCATE that follows under the lock then has only what was committed meanwhile to copy,
        usually nothing, and when nothing is left to copy it neither copies nor syncs: it truncates. So
        the promise is the TRUNCATE's as before; this only moves its work out from under the lock."""
        if self._checkpointer is None:
            self._checkpointer = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None,
                                                 timeout=30)
            self._checkpointer.execute("PRAGMA synchronous=FULL")
        # Busy (another checkpoint running, the write connection's automatic one) is no error here:
        # whatever this leaves, the TRUNCATE copies itself.
        self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()

    def _reclaim(self) -> None:
        # Outside the writer lock, on a connection of its own: a plain VACUUM blocks no writer, here or
        # on any other daemon, and the daemon's transactions go on meanwhile.
        with self._reclaim_lock:
            if self._reclaimer is None:
                from sandboxd import pg

                self._reclaimer = pg.Connection(self.url or "")
                with self.lock:
                    self._closing.append(self._reclaimer)
            self._reclaimer.reclaim()

    def vacuum(self) -> None:
        """Rewrite the whole database (and empty the WAL): the last resort when a scan still finds a value."""
        with self._writing() as conn:
            conn.execute("VACUUM")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        try:  # the lazy commits' last group: a stop must not leave them to the host's (or server's) luck
            self._sync(self._commits)
        except Exception:
            log.warning("the state's last flush failed", exc_info=True)
        self._closed.set()
        self._unsynced.set()
        with self._sync_cond:  # a flush in flight on a server connection finishes before it closes
            while self._syncing:
                self._sync_cond.wait()
        with self.lock:
            for reader in [*self._readers, *self._closing, *([self._checkpointer] if self._checkpointer else [])]:
                reader.close()
            self._readers.clear()
            self.conn.close()


def pg_url(state: object) -> bool:
    """Whether a state setting names a PostgreSQL server (postgresql://...) rather than a SQLite file."""
    return isinstance(state, str) and state.startswith(("postgresql://", "postgres://"))
