"""`sandboxd cp`: files copied into and out of a session's workspace byte for byte, a chunk per request.

Bytes travel as MessagePack binary on the wire and base64 inside the executor's JSON frames, so nothing
is decoded as text on the way. A copy in changes the sandbox like a write-class call: no snapshot equals
it afterwards. Paths are confined to /workspace by the executor, as a tool's are. Every chunk is recorded
among the session's calls (tool `cp_in` or `cp_out`, its size and SHA-256, never its bytes), so `sandboxd
calls` shows what an operator put into the sandbox or took out of it.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from typing import Any

from sandboxd import protocol as p
from sandboxd.calls import Calls, executor_failure
from sandboxd.errors import SandboxdError
from sandboxd.session import Sessions

#: seconds one chunk may take inside the sandbox
CHUNK_TIMEOUT_S = 60.0


class Copying:
    """Handlers of CopyIn and CopyOut."""

    def __init__(self, sessions: Sessions, calls: Calls) -> None:
        self.sessions = sessions
        self.calls = calls

    def handlers(self) -> dict[type[Any], Callable[[Any], p.Response]]:
        return {p.CopyInRequest: self.copy_in, p.CopyOutRequest: self.copy_out}

    def copy_in(self, req: p.CopyInRequest) -> p.CopyInResponse:
        payload = {"op": "write_bytes", "path": req.path, "append": req.append,
                   "data": base64.b64encode(req.data).decode("ascii")}
        args = {"path": req.path, "append": req.append, "bytes": len(req.data),
                "sha256": hashlib.sha256(req.data).hexdigest()}
        with self.sessions.lock(req.session_id):
            self.sessions.check_open(req.session_id)
            # A write-class record: the sandbox changes, no snapshot equals it any more.
            call_id = self.calls.begin_operation(req.session_id, "cp_in", args, "write")
            reply = self._run(req.session_id, call_id, payload, req.path)
            self.calls.end_operation(req.session_id, call_id, {"size": int(reply["size"])})
        return p.CopyInResponse(request_id=req.request_id, path=req.path, size=int(reply["size"]))

    def copy_out(self, req: p.CopyOutRequest) -> p.CopyOutResponse:
        payload = {"op": "read_bytes", "path": req.path, "offset": req.offset, "length": req.length}
        with self.sessions.lock(req.session_id):
            self.sessions.check_open(req.session_id)
            call_id = self.calls.begin_operation(req.session_id, "cp_out", {"path": req.path, "offset": req.offset,
                                                                           "length": req.length}, "read")
            reply = self._run(req.session_id, call_id, payload, req.path)
            data = base64.b64decode(reply["data"])
            self.calls.end_operation(req.session_id, call_id, {"size": int(reply["size"]), "bytes": len(data),
                                                               "sha256": hashlib.sha256(data).hexdigest()})
        return p.CopyOutResponse(request_id=req.request_id, path=req.path, offset=req.offset, data=data,
                                 size=int(reply["size"]), mode=int(reply.get("mode", 0o644)))

    def _run(self, session_id: str, call_id: str, payload: dict[str, Any], path: str) -> dict[str, Any]:
        """The executor's reply to one chunk; a failure is recorded as the operation's end and raised."""
        try:
            reply = self.sessions.executor(session_id, payload, CHUNK_TIMEOUT_S)
            if "error" in reply:
                raise executor_failure(reply, path=path)
        except SandboxdError as exc:
            self.calls.end_operation(session_id, call_id, exc)
            raise
        return reply
