"""Assembles a daemon from its configuration: state, snapshot store, containers, service, server."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from typing import Any

from sandboxd.auth import ServerKeys
from sandboxd.config import DaemonConfig
from sandboxd.db import Database
from sandboxd.metrics import MetricsServer, parse_metrics_address
from sandboxd.revocation.forgotten import Forgotten
from sandboxd.sandbox.containers import ContainerManager
from sandboxd.server import Server
from sandboxd.service import Service
from snapshots import open_store


class JsonFormatter(logging.Formatter):
    """One JSON object per line, so operators can filter logs by session or call id."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"ts": round(time.time(), 3), "level": record.levelname.lower(),
                                 "msg": record.getMessage()}
        for key in ("session_id", "call_id", "request_id", "peer_key", "peer_address"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info or record.exc_text:
            entry["exc"] = record.exc_text or self.formatException(record.exc_info)  # type: ignore[arg-type]
        return json.dumps(entry)


class ForgetInLog(logging.Filter):
    """Keeps a session's forgotten values out of the lines logged about it from now on.

    A revocation scrubs the lines written before it; a line written after (its own commit, a call's failure
    quoting a result) is filtered as it is written, as everything else the daemon writes is. Values too
    short to be told from prose stay, as in that scrub (`Forgotten.prose_filter`)."""

    def __init__(self, forgotten: Forgotten) -> None:
        super().__init__()
        self.forgotten = forgotten

    def filter(self, record: logging.LogRecord) -> bool:
        session_id = getattr(record, "session_id", None)
        if not isinstance(session_id, str):
            return True
        try:
            forget = self.forgotten.prose_filter(session_id)
        except Exception:  # the state is closing: a line that may hold a forgotten value is not written whole
            record.msg, record.args, record.exc_info, record.exc_text = (
                "a line about this session, withheld: its forgotten values could not be read", None, None, None)
            return True
        if forget:
            text = record.getMessage()
            clean = forget.text(text)
            if clean != text:
                record.msg, record.args = clean, None
            if record.exc_info:
                record.exc_text = forget.text(logging.Formatter().formatException(record.exc_info))
                record.exc_info = None
        return True


def setup_logging(config: DaemonConfig, verbose: bool = False) -> None:
    handler_file = logging.FileHandler(config.state_path / "sandboxd.log")
    handler_err = logging.StreamHandler(sys.stderr)
    # stderr gets warnings only: a revocation scrubs the log file in the state directory, but cannot reach
    # wherever stderr was sent, so what a failed call's message quotes stays in the file alone.
    handler_err.setLevel(logging.WARNING)
    for handler in (handler_file, handler_err):
        handler.setFormatter(JsonFormatter())
    root = logging.getLogger("sandboxd")
    root.handlers[:] = [handler_file, handler_err]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


def build(config: DaemonConfig) -> tuple[Service, Server]:
    """Open the state, recover from any crash, and return a ready service and server."""
    config.state_path.mkdir(parents=True, exist_ok=True)
    config.state_path.chmod(0o700)
    # Loaded once, first: a bad key file is named before any state is opened or container touched.
    keys = ServerKeys.load(config.auth) if config.endpoint.startswith("tcp://") else None
    db = Database(config.state or config.state_path / "state.db", node=config.node_id)
    store = open_store(config.snapshot_backend, config.state_path / "snapshots", config.max_layers,
                       config.sandbox.disk_mb)
    containers = ContainerManager(config)
    containers.check_runtime()
    service = Service(config, db, containers, store)
    service.recover()
    return service, Server(config, service, keys)


def run(config: DaemonConfig, verbose: bool = False) -> None:
    """`sandboxd serve`: run until SIGTERM or SIGINT."""
    config.state_path.mkdir(parents=True, exist_ok=True)
    setup_logging(config, verbose)
    service, server = build(config)
    for handler in logging.getLogger("sandboxd").handlers:
        handler.addFilter(ForgetInLog(service.forgotten))
    metrics = None
    if config.metrics_address:
        host, port = parse_metrics_address(config.metrics_address, config.metrics_allow_remote)
        metrics = MetricsServer(host, port, service.metrics.registry)
        metrics.start()
    stopped = threading.Event()
    threading.Thread(target=_expire_sessions, args=(service, stopped), name="sandboxd-expiry", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    try:
        server.serve_forever()
    finally:
        stopped.set()
        if metrics is not None:
            metrics.stop()  # before the state closes: a scrape reads it
        # No mount outlives the daemon (the state directory can then be removed); the sandboxes stop with
        # them and start again, on fresh mounts, when the next daemon recovers the sessions.
        service.sessions.stop_all()
        service.db.close()


#: how often sessions are checked against their idle timeout and time to live
EXPIRY_CHECK_S = 1.0


def _expire_sessions(service: Service, stopped: threading.Event) -> None:
    """Close sessions whose idle timeout or time to live ran out, until the daemon stops."""
    log = logging.getLogger("sandboxd")
    while not stopped.wait(EXPIRY_CHECK_S):
        try:
            service.expire()
        except Exception:  # the next round tries again; the daemon goes on serving
            log.exception("expiring sessions failed")
