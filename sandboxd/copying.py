"""`sandboxd cp`: files copied into and out of a session's workspace byte for byte, a chunk per request.

Bytes travel as MessagePack binary on the wire and base64 inside the executor's JSON frames, so nothing
is decoded as text on the way. A copy in changes the sandbox like a write-class call: no snapshot equals
it afterwards. Paths are confined to /workspace by the executor, as a tool's are.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

from sandboxd import protocol as p
from sandboxd.calls import executor_failure
from sandboxd.session import Sessions

#: seconds one chunk may take inside the sandbox
CHUNK_TIMEOUT_S = 60.0


class Copying:
    """Handlers of CopyIn and CopyOut."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions

    def handlers(self) -> dict[type[Any], Callable[[Any], p.Response]]:
        return {p.CopyInRequest: self.copy_in, p.CopyOutRequest: self.copy_out}

    def copy_in(self, req: p.CopyInRequest) -> p.CopyInResponse:
        payload = {"op": "write_bytes", "path": req.path, "append": req.append,
                   "data": base64.b64encode(req.data).decode("ascii")}
        with self.sessions.lock(req.session_id):
            self.sessions.check_open(req.session_id)
            self.sessions.update(req.session_id, env_snapshot=None)  # the sandbox changes: no snapshot equals it
            reply = self.sessions.executor(req.session_id, payload, CHUNK_TIMEOUT_S)
        if "error" in reply:
            raise executor_failure(reply, path=req.path)
        return p.CopyInResponse(request_id=req.request_id, path=req.path, size=int(reply["size"]))

    def copy_out(self, req: p.CopyOutRequest) -> p.CopyOutResponse:
        payload = {"op": "read_bytes", "path": req.path, "offset": req.offset, "length": req.length}
        with self.sessions.lock(req.session_id):
            self.sessions.check_open(req.session_id)
            reply = self.sessions.executor(req.session_id, payload, CHUNK_TIMEOUT_S)
        if "error" in reply:
            raise executor_failure(reply, path=req.path)
        return p.CopyOutResponse(request_id=req.request_id, path=req.path, offset=req.offset,
                                 data=base64.b64decode(reply["data"]), size=int(reply["size"]),
                                 mode=int(reply.get("mode", 0o644)))
