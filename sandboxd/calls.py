"""Tool calls: routed to the firewall (external tools) or run in the session's sandbox, recorded ahead, answered once.

A sandbox call is recorded as running before it runs and answered only after its result is committed;
a retry of its call id is answered from the record, never run again. Every result has the session's
forgotten values filtered out before it is recorded or returned (`sanitized`). The call records are a
branch participant too: a replay's calls are recorded under its branch and become the session's when
it commits, when the old suffix's records are deleted.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from sandboxd import protocol as p
from sandboxd.branch import Branch
from sandboxd.config import DaemonConfig
from sandboxd.db import Database
from sandboxd.errors import (
    CallIdConflict,
    CallInterrupted,
    ExternalUnavailable,
    FlowBlocked,
    InvalidArguments,
    NotFound,
    PathEscape,
    RecordedError,
    ResourceLimit,
    SandboxdError,
    SandboxUnavailable,
    ToolError,
    ToolTimeout,
    to_wire,
)
from sandboxd.firewall.flow import tainted_argument
from sandboxd.firewall.handlers import FirewallHandlers, result_text
from sandboxd.revocation.forgetting import ForgetFilter
from sandboxd.session import Sessions
from sandboxd.streams import Streams
from sandboxd.tools.builtin import executor_request
from sandboxd.tools.registry import ToolRegistry

log = logging.getLogger("sandboxd")

_EXECUTOR_ERRORS: dict[str, Callable[[str, dict[str, Any]], SandboxdError]] = {
    "path_escape": lambda msg, d: PathEscape(str(d.get("path", "")), str(d.get("reason", msg))),
    "not_found": lambda msg, d: NotFound(msg, **d),
    "invalid_arguments": lambda msg, d: InvalidArguments(str(d.get("tool", "")), msg),
    "resource_limit": lambda msg, d: ResourceLimit(str(d.pop("call_id", "")), str(d.pop("limit", "disk")), msg, **d),
}


def executor_failure(reply: dict[str, Any], **details: Any) -> SandboxdError:
    """The error an executor's error reply stands for."""
    details = dict(reply.get("details") or {}, **details)
    factory = _EXECUTOR_ERRORS.get(reply["error"])
    return factory(reply["message"], details) if factory else ToolError(reply["message"], **details)


class CallRow(msgspec.Struct, kw_only=True):
    """A sandbox call as recorded: status running, done, error, timeout or interrupted."""

    call_id: str
    session_id: str
    tool: str
    args: str
    status: str
    seq: int | None = None
    effect: str | None = None
    result: str | None = None
    created_at: float | None = None
    finished_at: float | None = None
    branch: str | None = None
    turn: int | None = None

    def ledger_call(self) -> p.LedgerCall:
        """The record as the operator sees it beside the ledger's external calls."""
        saved = json.loads(self.result) if self.result else None
        error = f"{saved['code']}: {saved['message']}" if saved and saved.get("kind") == "error" else None
        result = {k: v for k, v in saved.items() if k != "kind"} if saved and not error else None
        return p.LedgerCall(call_id=self.call_id, session_id=self.session_id, tool=self.tool,
                            effect=msgspec.convert(self.effect, p.EffectClass), state=self.status,
                            args=json.loads(self.args), result=result, error=error, created_at=self.created_at or 0.0,
                            updated_at=self.finished_at or self.created_at or 0.0)


def canonical_args(args: dict[str, Any]) -> str:
    """Arguments as stable JSON, so a retried call id can be compared with its record."""
    return json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class Calls:
    """Every tool call of every session; `call` is the request handler."""

    name = "calls"

    def __init__(self, db: Database, config: DaemonConfig, sessions: Sessions, tools: ToolRegistry,
                 effects: FirewallHandlers, forget: Callable[[str], ForgetFilter],
                 flagged: Callable[[str], list[tuple[str, str]]]) -> None:
        self.db = db
        self.config = config
        self.sessions = sessions
        self.tools = tools
        self.effects = effects
        self.forget = forget
        self.flagged = flagged
        self.streams = Streams()
        self.now = threading.local()
        """The call this thread answers at once (`sandboxd.atonce`): its session (whose lock it holds), the
        tool, its host read and when that began."""

    def call(self, req: p.CallRequest) -> p.CallResponse:
        now = getattr(self.now, "session", None) == req.session_id  # see `sandboxd.atonce`
        manifest = self.now.manifest if now else self.tools.validate(req.tool, req.args)
        if manifest.effect == "external" and self.config.firewall.flow_control:
            blocked = tainted_argument(req.args, self.flagged(req.session_id))
            if blocked is not None:
                raise FlowBlocked(req.tool, *blocked)
        if self.effects.serves(req.tool):
            # Effects run in the daemon, never in the sandbox, and outside the session lock: the ledger
            # serialises what must be serialised, and a slow mail server must not stall tools.
            self.sessions.check_open(req.session_id)
            result = self.effects.call(req, req.session_id)
            return p.CallResponse(request_id=req.request_id, result=self.sanitized(req.session_id, result))
        with self._session_lock(req.session_id):
            self.sessions.check_open(req.session_id)
            if req.call_id is not None and (record := self.record(req.session_id, req.call_id)) is not None:
                return p.CallResponse(request_id=req.request_id, result=_answer_from_record(req, record))
            if manifest.effect == "external":
                raise ExternalUnavailable(f"{req.tool} is an external tool that no effect adapter serves",
                                          tool=req.tool)
            call_id = req.call_id or "c-" + uuid.uuid4().hex
            # Answered at once, a call is recorded once, as it is answered: it is never seen running, and a
            # crash before its record loses nothing it acknowledged, nor anything a read did.
            unbegun = (req, manifest.effect) if now else None
            if unbegun is None:
                self._begin(call_id, req, manifest.effect)
            try:
                result = self.sanitized(req.session_id, self._execute(req, call_id))
            except SandboxdError as exc:
                if isinstance(exc, ToolTimeout) and (forget := self.forget(req.session_id)):
                    # What it wrote before it was killed is shown too: with forgotten values out, like any result.
                    for stream in ("stdout", "stderr"):
                        exc.details[stream] = forget.text(str(exc.details.get(stream, "")))
                code, message, details = to_wire(exc)
                status = "timeout" if isinstance(exc, ToolTimeout) else "error"
                self._finish(req.session_id, call_id, status,
                             {"kind": "error", "code": code.value, "message": message, "details": details}, unbegun)
                log.info("call %s of %s: %s", call_id, req.tool, status,
                         extra={"request_id": req.request_id, "session_id": req.session_id, "call_id": call_id})
                raise
            finally:
                self.streams.close(req.session_id, call_id)
            self._finish(req.session_id, call_id, "done", {"kind": "result", **msgspec.to_builtins(result)}, unbegun)
            log.debug("call %s of %s: done", call_id, req.tool,
                      extra={"request_id": req.request_id, "session_id": req.session_id, "call_id": call_id})
        return p.CallResponse(request_id=req.request_id, result=result)

    @contextmanager
    def _session_lock(self, session_id: str) -> Iterator[None]:
        if getattr(self.now, "session", None) == session_id:
            yield  # answered at once: `sandboxd.atonce.answering` holds it
            return
        with self.sessions.lock(session_id):
            yield

    def output(self, req: p.CallOutputRequest) -> p.CallOutputResponse:
        """What a streamed call has written so far (a long-poll; never takes the session lock the call holds)."""
        self.sessions.known(req.session_id)
        out, err, running = self.streams.read(req.session_id, req.call_id, req.stdout_offset, req.stderr_offset,
                                              req.timeout_s)
        return p.CallOutputResponse(request_id=req.request_id, call_id=req.call_id, stdout=out, stderr=err,
                                    running=running)

    def sanitized(self, session_id: str, result: p.CallResult) -> p.CallResult:
        """A result with the session's forgotten values excised, before it is recorded or returned.

        Structured data is filtered value by value and the text the agent reads is rendered again from
        the clean data, so no serialization of it (escaped or not) can carry a forgotten value."""
        forget = self.forget(session_id)
        if not forget:
            return result
        if result.data is None:
            # A sandbox tool's text (a listing's JSON lines, a file that holds JSON) is text, as its record is
            # when a replay re-feeds it (`Forgotten.sanitize`): filtered the same way both times.
            stdout, data = forget.text(result.stdout), None
        else:
            stdout, data = forget.rendered(result.stdout, result_text, result.data)
        return msgspec.structs.replace(result, stdout=stdout, stderr=forget.text(result.stderr), data=data)

    # Running in the sandbox --------------------------------------------------------------------

    def payload(self, req: p.CallRequest) -> dict[str, Any]:
        limits = self.config.tools
        timeout = min(float(req.args.get("timeout_s") or req.timeout_s or limits.timeout_s), limits.max_timeout_s)
        payload = executor_request(req.tool, req.args)
        payload.update(timeout=timeout, output_bytes=limits.output_bytes, max_bytes=limits.read_bytes)
        if req.clock is not None:
            payload["clock"] = req.clock
        return payload

    def _execute(self, req: p.CallRequest, call_id: str) -> p.CallResult:
        payload = self.payload(req)
        timeout = float(payload["timeout"])
        done = getattr(self.now, "reply", None)
        started = self.now.started if done is not None else time.monotonic()  # an at-once read was done earlier
        on_output = None
        if req.stream and not self.forget(req.session_id):  # see sandboxd.streams
            payload["stream"] = True
            on_output = self.streams.open(req.session_id, call_id).write
        try:
            reply = done if done is not None else self.sessions.executor(req.session_id, payload, timeout + 10.0,
                                                                          on_output)
        except SandboxUnavailable as exc:
            if not exc.details.get("oom_killed"):
                raise
            # Under gVisor the memory limit is the whole sandbox's: the OOM killer stops all of it.
            raise ResourceLimit(call_id, "memory", f"call {call_id} was killed: the sandbox ran out of memory "
                                f"(limit {self.config.sandbox.memory_mb} MB) and was restarted",
                                restarted=exc.details.get("restarted")) from exc
        if "error" in reply:
            raise executor_failure(reply, call_id=call_id, tool=req.tool)
        if reply.get("timed_out"):
            raise ToolTimeout(call_id, timeout, reply.get("stdout", ""), reply.get("stderr", ""))
        if reply.get("oom_killed"):
            raise ResourceLimit(call_id, "memory", f"call {call_id} was killed: it ran out of memory "
                                f"(limit {self.config.sandbox.memory_mb} MB)", exit_code=reply["exit_code"])
        return p.CallResult(
            call_id=call_id, tool=req.tool, exit_code=int(reply.get("exit_code", 0)),
            stdout=reply.get("stdout", ""), stderr=reply.get("stderr", ""),
            stdout_truncated=bool(reply.get("stdout_truncated")),
            stderr_truncated=bool(reply.get("stderr_truncated")),
            stdout_size=reply.get("stdout_size"), stderr_size=reply.get("stderr_size"),
            duration_ms=(time.monotonic() - started) * 1000,
        )

    # Records -----------------------------------------------------------------------------------

    def record(self, session_id: str, call_id: str) -> CallRow | None:
        return self.db.struct("SELECT * FROM calls WHERE session_id = ? AND call_id = ?", [session_id, call_id],
                              CallRow)

    def of_session(self, session_id: str | None) -> list[CallRow]:
        """A session's call records in order; None: every session's."""
        if session_id is None:
            return self.db.structs("SELECT * FROM calls ORDER BY created_at, seq", [], CallRow)
        return self.db.structs("SELECT * FROM calls WHERE session_id = ? ORDER BY seq", [session_id], CallRow)

    def _begin(self, call_id: str, req: p.CallRequest, effect: str,
               done: tuple[str, dict[str, Any]] | None = None) -> None:
        """Record a call as running before it runs (write-ahead); a write call makes the sandbox dirty.
        `done`: as ended (status, result) instead, for a call that was not recorded before it ran.

        Lazy commits, here and in `_finish`: in the WAL before the call runs or is answered, so a `kill -9`
        loses neither; only a host crash within `FLUSH_S` could (see sandboxd.db). Both write the session's
        rows only, under its lock: on a shared server they need not wait for other sessions' writes."""
        with self.db.transaction(lazy=True, session=req.session_id):
            if effect == "write":
                self.db.update("sessions", {"session_id": req.session_id}, env_snapshot=None)
            # The next seq numbered in the INSERT itself: one statement, one round trip to a server.
            status, result = done or ("running", None)
            self.db.execute(
                "INSERT INTO calls (call_id, session_id, seq, tool, args, effect, status, result, created_at, "
                "finished_at, branch, turn) SELECT ?, ?, COALESCE(MAX(seq), 0) + 1, ?, ?, ?, ?, ?, ?, ?, ?, ? "
                "FROM calls WHERE session_id = ?",
                [call_id, req.session_id, req.tool, canonical_args(req.args), effect, status,
                 None if result is None else json.dumps(result), time.time(), None if done is None else time.time(),
                 req.branch, req.turn, req.session_id])

    def begin_operation(self, session_id: str, tool: str, args: dict[str, Any], effect: str) -> str:
        """Record an operation on the sandbox that is no tool call (`sandboxd cp`) as running, like a call, so
        the session's calls show it (and a rollback or fork treats it as one); returns its id. The caller
        holds the session lock and ends it with `end_operation`."""
        call_id = "op-" + uuid.uuid4().hex
        self._begin(call_id, p.CallRequest(request_id="", session_id=session_id, tool=tool, args=args), effect)
        return call_id

    def end_operation(self, session_id: str, call_id: str, result: dict[str, Any] | SandboxdError) -> None:
        if isinstance(result, SandboxdError):
            code, message, details = to_wire(result)
            self._finish(session_id, call_id, "error",
                         {"kind": "error", "code": code.value, "message": message, "details": details})
        else:
            self._finish(session_id, call_id, "done", {"kind": "result", **result})

    def _finish(self, session_id: str, call_id: str, status: str, result: dict[str, Any],
                unbegun: tuple[p.CallRequest, str] | None = None) -> None:
        if unbegun is not None:
            self._begin(call_id, *unbegun, done=(status, result))
            return
        with self.db.transaction(lazy=True, session=session_id):
            self.db.update("calls", {"session_id": session_id, "call_id": call_id}, status=status,
                           result=json.dumps(result), finished_at=time.time())

    def interrupt_running(self) -> list[str]:
        """Mark calls a crash cut off; returns their ids."""
        mine, node = self.db.mine()  # on a shared state database: this daemon's sessions' calls only
        with self.db.transaction():
            ids = [r["call_id"] for r in self.db.rows("SELECT call_id FROM calls WHERE status = 'running'" + mine,
                                                      node)]
            self.db.execute("UPDATE calls SET status = 'interrupted' WHERE status = 'running'" + mine, node)
        return ids

    def delete_of(self, session_id: str) -> None:
        with self.db.transaction():
            self.db.execute("DELETE FROM calls WHERE session_id = ?", [session_id])

    # The branch participant of call records -----------------------------------------------------

    def begin(self, branch: Branch) -> None:
        """Nothing to do: the replay's calls name their branch."""

    def commit(self, branch: Branch) -> dict[str, Any]:
        """The old suffix's records go; the branch's become the session's."""
        with self.db.transaction():
            self.db.execute("DELETE FROM calls WHERE session_id = ? AND branch = '' AND created_at > ?",
                            [branch.session_id, branch.splice.created_at])
            self.db.execute("UPDATE calls SET branch = '' WHERE session_id = ? AND branch = ?",
                            [branch.session_id, branch.id])
        return {}

    def abandon(self, branch: Branch) -> None:
        with self.db.transaction():
            self.db.execute("DELETE FROM calls WHERE session_id = ? AND branch = ?", [branch.session_id, branch.id])


def _answer_from_record(req: p.CallRequest, record: CallRow) -> p.CallResult:
    """A retried call id: the recorded answer, never a second run."""
    if record.session_id != req.session_id or record.tool != req.tool or record.args != canonical_args(req.args):
        raise CallIdConflict(record.call_id, "for a different call (session, tool or arguments differ)")
    if record.status in ("running", "interrupted") or record.result is None:
        raise CallInterrupted(record.call_id)
    saved = json.loads(record.result)
    if saved.pop("kind") == "error":
        raise RecordedError(saved["code"], saved["message"], saved["details"])
    result = msgspec.convert(saved, p.CallResult)
    result.replayed = True
    return result
