"""One sandboxd session as an MCP server serves it: calls, retries, held effects, provenance, revocations.

Every call goes to the daemon through `sandboxd.client.Client`, as `sandboxd call` does, under an agent
call id the retry window assigns (`sandboxd.mcp.retries`). A call runs in a task of this object, not of
the MCP request that asked for it: a client that times out cancels its request, the call goes on, and
the retry that follows waits for the same call instead of starting another (the daemon would refuse a
second request under a call id still running, and a new id would be a second email).

Calls are recorded and executed one at a time (the daemon serialises a session's sandbox calls anyway);
a held effect leaves that order while it waits for the operator, and its result is recorded when the
decision comes. Revocations the daemon raises for the session (an operator's `sandboxd revoke`, or its
injection detector) are taken between calls (`sandboxd.mcp.revocation`).

The daemon has no event channel for an operator's decision on a held call, so its ledger state is read
every `decision_poll_s`; the same for pending revocations while the client is idle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import anyio
import anyio.abc

from sandboxd import protocol as p
from sandboxd.client import Client, RemoteError
from sandboxd.errors import SandboxdError
from sandboxd.mcp.provenance import CallRecorder
from sandboxd.mcp.retries import KeyConflict, RetryWindow, WindowEntry
from sandboxd.mcp.revocation import take_revocation
from sandboxd.mcp.tools import Outcome, error_outcome, result_outcome

log = logging.getLogger("sandboxd.mcp")

T = TypeVar("T")

#: errors the daemon raises before a call runs: nothing happened, and the model should correct the call
REFUSED_BEFORE_RUN = ("unknown_tool", "invalid_arguments", "path_escape", "host_not_allowed", "flow_blocked",
                      "invalid_field")


@dataclass
class Hold:
    """An effect the firewall holds: who may release it and how."""

    call_id: str
    tool: str
    policy: str
    turn: int
    session_id: str

    def describe(self) -> dict[str, Any]:
        release = f"sandboxd outbox release {self.call_id}"
        if self.policy == "on_commit":
            release += f"  (or: sandboxd commit {self.session_id} {self.turn})"
        return {"call_id": self.call_id, "tool": self.tool, "policy": self.policy, "turn": self.turn,
                "release": release, "drop": f"sandboxd outbox drop {self.call_id}"}

    def text(self) -> str:
        who = "until its turn is committed" if self.policy == "on_commit" else "for an operator's approval"
        return (f"{self.tool} is held {who} and has NOT been sent yet (call {self.call_id}). An operator "
                f"releases it with `{self.describe()['release']}` or drops it with `{self.describe()['drop']}`; "
                "calling this tool again with the same arguments waits for that decision.")


@dataclass
class PendingCall:
    """A call of this session and its answer, shared by every MCP request that is a retry of it."""

    entry: WindowEntry
    tool: str
    args: dict[str, Any]
    turn: int = 0
    call_artifact: str = ""
    hold: Hold | None = None
    outcome: Outcome | None = None
    settled: anyio.Event = field(default_factory=anyio.Event)
    """Set once the call is answered or known to be held."""
    done: anyio.Event = field(default_factory=anyio.Event)
    discarded: bool = False
    """A revocation discarded this call: its result must not be recorded."""


class ClientPool:
    """One daemon client per worker thread (a `Client` is not thread-safe)."""

    def __init__(self, factory: Callable[[], Client]) -> None:
        self._factory = factory
        self._local = threading.local()
        self._made: list[Client] = []
        self._guard = threading.Lock()

    def get(self) -> Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._factory()
            self._local.client = client
            with self._guard:
                self._made.append(client)
        return client

    def close(self) -> None:
        with self._guard:
            for client in self._made:
                client.close()


class McpSession:
    """The bridge between MCP tool calls and one daemon session."""

    def __init__(self, factory: Callable[[], Client], session_id: str | None, *, image: str | None = None,
                 window_s: float = 60.0, decision_poll_s: float = 0.25, in_flight_wait_s: float = 120.0) -> None:
        self.clients = ClientPool(factory)
        self.session_id = session_id or ""
        self.attached = session_id is not None
        self.image = image
        self.window = RetryWindow(window_s)
        self.decision_poll_s = decision_poll_s
        self.in_flight_wait_s = in_flight_wait_s
        self.recorder = CallRecorder()
        self.manifests: dict[str, p.ToolManifest] = {}
        self.pending: dict[str, PendingCall] = {}
        self.notices: list[dict[str, Any]] = []
        self.closed = False
        self.last_activity = time.monotonic()
        self._lock = anyio.Lock()
        self._tg: anyio.abc.TaskGroup | None = None
        self._limiter = anyio.CapacityLimiter(8)

    # Daemon access ------------------------------------------------------------------------------

    async def daemon(self, fn: Callable[[Client], T]) -> T:
        """Run one blocking client operation on a worker thread."""
        return await anyio.to_thread.run_sync(lambda: fn(self.clients.get()), limiter=self._limiter)

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Open the session (or attach to it) and take up what was recorded in it before."""
        self._tg = tg
        if not self.attached:
            info = await self.daemon(lambda c: c.open_session(self.image))
            self.session_id = info.session_id
        await self.refresh_tools()
        graph = await self.daemon(lambda c: c.graph(self.session_id))
        self.recorder.rebuild(graph.artifacts)
        self._rebuild_window(graph.artifacts)

    def _rebuild_window(self, artifacts: list[p.Artifact]) -> None:
        """Calls recorded before a restart whose retries must still find them (an unanswered send above all)."""
        answered = {a.parents[0] for a in artifacts if a.type == "observation" and a.parents}
        now = time.monotonic()
        for artifact in artifacts:
            meta = artifact.meta
            if artifact.type != "tool_call" or "agent_call_id" not in meta or artifact.artifact_id in answered:
                continue
            tool = str(meta.get("tool", ""))
            manifest = self.manifests.get(tool)
            entry = WindowEntry(agent_call_id=str(meta["agent_call_id"]), tool=tool,
                                effect=manifest.effect if manifest else "write", signature=str(meta["signature"]),
                                key=meta.get("key"), started=now)
            self.window.add(entry)
            args = _recorded_args(artifact.content)
            self.pending[entry.agent_call_id] = PendingCall(entry=entry, tool=tool, args=args, turn=artifact.turn,
                                                            call_artifact=artifact.artifact_id)

    async def refresh_tools(self) -> list[p.ToolManifest]:
        tools = await self.daemon(lambda c: c.tools(self.session_id))
        self.manifests = {t.name: t for t in tools}
        return tools

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    # Calls -------------------------------------------------------------------------------------

    async def submit(self, tool: str, args: dict[str, Any], key: str | None) -> PendingCall | Outcome:
        """The pending call this MCP call is (a new one, started now, or the one it retries)."""
        self.touch()
        if self.closed:
            return error_outcome("session_closed", f"session {self.session_id} is closed")
        manifest = self.manifests.get(tool)
        if manifest is None:
            await self.refresh_tools()
            manifest = self.manifests.get(tool)
        if manifest is None:  # the daemon's own answer (unknown_tool); nothing ran, so nothing is recorded
            return await self._refused(tool, args)
        try:
            entry, new = self.window.claim(tool, manifest.effect, args, key, time.monotonic())
        except KeyConflict as exc:
            return error_outcome("call_id_conflict", str(exc))
        call = self.pending.get(entry.agent_call_id)
        if call is None:
            call = PendingCall(entry=entry, tool=tool, args=args)
            self.pending[entry.agent_call_id] = call
            self._start(call, resume=False)
        elif call.call_artifact and not call.done.is_set() and not self._running(call):
            self._start(call, resume=True)  # recorded before a restart, never answered: ask the daemon again
        elif new and call.done.is_set():
            self.window.finish(entry, time.monotonic())  # a key's call, answered before its entry expired
        self._prune()
        return call

    def _running(self, call: PendingCall) -> bool:
        return bool(call.entry.extra.get("running"))

    def _start(self, call: PendingCall, resume: bool) -> None:
        assert self._tg is not None, "submit before start"
        call.entry.extra["running"] = True
        self._tg.start_soon(self._run, call, resume)

    async def _refused(self, tool: str, args: dict[str, Any]) -> Outcome:
        try:
            result = await self.daemon(lambda c: c.call(self.session_id, tool, args))
        except RemoteError as exc:
            return error_outcome(exc.wire_code, exc.message, exc.details)
        return result_outcome(result)  # a tool the daemon gained since the listing

    async def _run(self, call: PendingCall, resume: bool) -> None:
        """Record, execute, wait for a held effect's decision, record the result. Never raises."""
        try:
            async with self._lock:
                await self.apply_revocations_locked()
                if not resume:
                    await self._record_call(call)
                outcome = await self._execute(call)
                if call.hold is None:
                    await self._observe_locked(call, outcome)
            if call.hold is not None:
                call.settled.set()
                outcome = await self._await_decision(call, call.hold)
                async with self._lock:
                    await self._observe_locked(call, outcome)
        except BaseException as exc:  # the waiting requests need an answer whatever happened
            if call.outcome is None:
                call.outcome = error_outcome(_code(exc), f"sandboxd mcp could not finish the call: {exc}")
            call.settled.set()
            call.done.set()
            call.entry.extra["running"] = False
            if not isinstance(exc, Exception):
                raise
            log.exception("call %s of %s failed in the MCP layer", call.entry.agent_call_id, call.tool)
            return
        call.entry.extra["running"] = False

    async def _record_call(self, call: PendingCall) -> None:
        entry = call.entry
        artifact = self.recorder.tool_call(call.tool, call.args, entry.agent_call_id, entry.signature, entry.key)
        call.turn, call.call_artifact = artifact.turn, artifact.artifact_id
        await self.daemon(lambda c: c.record_artifacts(self.session_id, [artifact]))
        if entry.effect == "external":
            await self._checkpoint("external", call.turn)

    async def _execute(self, call: PendingCall) -> Outcome:
        deadline = time.monotonic() + self.in_flight_wait_s
        while True:
            try:
                result = await self.daemon(lambda c: c.call(self.session_id, call.tool, call.args,
                                                            call_id=call.entry.agent_call_id, turn=call.turn))
                break
            except RemoteError as exc:
                # Another request is firing this very effect (one this server sent before it restarted):
                # its outcome is the answer, so wait for it rather than report a refusal.
                firing = exc.wire_code == "invalid_state" and exc.details.get("state") in ("intent", "fired",
                                                                                          "released")
                if not firing or time.monotonic() > deadline:
                    return error_outcome(exc.wire_code, exc.message, exc.details)
                await anyio.sleep(self.decision_poll_s)
        if result.held:
            call.hold = Hold(call_id=result.call_id, tool=call.tool, policy=str((result.data or {}).get("policy",
                             "manual")), turn=call.turn, session_id=self.session_id)
            return Outcome(text=call.hold.text(), is_error=False, structured={"held": call.hold.describe()})
        return result_outcome(result)

    async def _await_decision(self, call: PendingCall, hold: Hold) -> Outcome:
        """Wait for the operator's release or drop (or a turn commit) of a held effect."""
        while True:
            await anyio.sleep(self.decision_poll_s)
            if call.discarded:
                return error_outcome("dropped", f"{hold.call_id} was dropped: a revocation discarded this call")
            try:
                calls = await self.daemon(lambda c: c.calls(self.session_id))
            except RemoteError as exc:
                return error_outcome(exc.wire_code, exc.message, exc.details)
            record = next((c for c in calls if c.call_id == hold.call_id), None)
            state = record.state if record is not None else "absent"
            if state in ("staged", "released", "fired", "intent"):
                continue
            if state == "done":  # the call again under its own id: the ledger's answer, as `sandboxd call` has it
                try:
                    result = await self.daemon(lambda c: c.call(self.session_id, call.tool, call.args,
                                                                call_id=call.entry.agent_call_id, turn=call.turn))
                except RemoteError as exc:
                    return error_outcome(exc.wire_code, exc.message, exc.details)
                return result_outcome(result)
            if state in ("dropped", "shadowed", "absent"):
                return error_outcome("dropped", f"{hold.tool} call {hold.call_id} was dropped and was not sent",
                                     {"call_id": hold.call_id})
            reason = record.error if record is not None else None
            return error_outcome("effect_failed", f"{hold.tool} call {hold.call_id} was released and then {state}"
                                 + (f": {reason}" if reason else ""), {"call_id": hold.call_id, "state": state})

    async def _observe_locked(self, call: PendingCall, outcome: Outcome) -> None:
        """Hand the result over: checkpoint, record it as the next observation, answer every waiting request."""
        if not call.discarded and call.call_artifact in self.recorder.recorded:
            await self._checkpoint("turn", call.turn)
            artifact = self.recorder.observation(call.call_artifact, outcome.text,
                                                 {"tool": call.tool, "is_error": outcome.is_error,
                                                  "agent_call_id": call.entry.agent_call_id})
            await self.daemon(lambda c: c.record_artifacts(self.session_id, [artifact]))
            outcome = replace(outcome, observation=artifact.artifact_id)
        call.outcome = outcome
        self.window.finish(call.entry, time.monotonic())
        call.settled.set()
        call.done.set()

    async def _checkpoint(self, reason: str, turn: int) -> None:
        record = self.recorder.checkpoint(reason, turn)
        await self.daemon(lambda c: c.checkpoint(self.session_id, record))

    def _prune(self) -> None:
        live = {e.agent_call_id for e in self.window.entries()}
        self.pending = {k: c for k, c in self.pending.items() if k in live or not c.done.is_set()}

    def take_notices(self) -> list[dict[str, Any]]:
        notices, self.notices = self.notices, []
        return notices

    # Revocations -------------------------------------------------------------------------------

    async def apply_revocations(self) -> None:
        """Take the revocations the daemon holds for this session (between calls)."""
        if self.closed:
            return
        async with self._lock:
            await self.apply_revocations_locked()

    async def apply_revocations_locked(self) -> None:
        pending = await self.daemon(lambda c: c.pending_revocations(self.session_id))
        for info in pending:
            notice = await take_revocation(self, info)
            self.notices.append(notice)

    def discard(self, artifact_ids: list[str]) -> list[str]:
        """Forget the calls a revocation discarded: no retry is answered from them; returns their agent ids."""
        gone = {aid for aid in artifact_ids}
        agent_ids = {c.entry.agent_call_id for c in self.pending.values() if c.call_artifact in gone}
        for call in self.pending.values():
            if call.call_artifact in gone:
                call.discarded = True
        self.window.forget(agent_ids)
        self.pending = {k: c for k, c in self.pending.items() if k not in agent_ids or not c.done.is_set()}
        return sorted(agent_ids)

    # Closing -----------------------------------------------------------------------------------

    async def close_session(self) -> None:
        if self.closed or not self.session_id:
            return
        self.closed = True
        try:
            await self.daemon(lambda c: c.close_session(self.session_id))
        except SandboxdError as exc:
            log.warning("closing %s: %s", self.session_id, exc)


def _code(exc: BaseException) -> str:
    if isinstance(exc, RemoteError):
        return exc.wire_code
    if isinstance(exc, SandboxdError):
        return exc.code.value
    return "internal"


def _recorded_args(content: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(content)
    except ValueError:
        return {}
    args = value.get("arguments") if isinstance(value, dict) else None
    return args if isinstance(args, dict) else {}
