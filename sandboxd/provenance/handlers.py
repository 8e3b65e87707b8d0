"""Daemon requests that record and query provenance: artifacts, checkpoints, tau and taint closures."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from sandboxd import protocol as p
from sandboxd.provenance.store import ProvenanceStore
from sandboxd.session import Sessions


class ProvenanceHandlers:
    """Handlers for the provenance requests; hooks run on every recorded observation and checkpoint."""

    def __init__(self, store: ProvenanceStore, sessions: Sessions,
                 on_observation: Callable[[str, p.Artifact], None],
                 on_checkpoint: Callable[[str, str, str], None]) -> None:
        self.store = store
        self.sessions = sessions
        self.on_observation = on_observation
        self.on_checkpoint = on_checkpoint
        """(session, checkpoint id, branch): the outside world marks its state at every checkpoint."""

    def handlers(self) -> dict[type[Any], Callable[[Any], p.Response]]:
        return {
            p.RecordArtifactsRequest: self.record,
            p.CheckpointRequest: self.checkpoint,
            p.ProvenanceRequest: self.query,
            p.GraphRequest: self.graph,
        }

    def record(self, req: p.RecordArtifactsRequest) -> p.RecordArtifactsResponse:
        self.sessions.check_open(req.session_id)
        count = self.store.record(req.session_id, req.artifacts, branch=req.branch)
        if not req.branch:
            # The detector looks at what the agent has already consumed: observations of the live session.
            for artifact in req.artifacts:
                if artifact.type == "observation":
                    self.on_observation(req.session_id, artifact)
        return p.RecordArtifactsResponse(request_id=req.request_id, recorded=count)

    def checkpoint(self, req: p.CheckpointRequest) -> p.CheckpointResponse:
        with self.sessions.lock(req.session_id):
            self.sessions.check_open(req.session_id)
            snapshot_id = self.sessions.current(req.session_id) if req.snapshot else None
        record = msgspec.structs.replace(req.checkpoint, snapshot_id=snapshot_id, created_at=time.time())
        if not self.store.add_checkpoint(req.session_id, record, branch=req.branch):
            kept = self.store.checkpoint(req.session_id, record.checkpoint_id, req.branch)
            assert kept is not None
            return p.CheckpointResponse(request_id=req.request_id, checkpoint=kept)
        self.on_checkpoint(req.session_id, record.checkpoint_id, req.branch)
        return p.CheckpointResponse(request_id=req.request_id, checkpoint=record)

    def query(self, req: p.ProvenanceRequest) -> p.ProvenanceResponse:
        self.sessions.known(req.session_id)
        tau, last, closure, checkpoint = self.store.query(req.session_id, req.source)
        return p.ProvenanceResponse(request_id=req.request_id, source=req.source, tau=tau, T=last,
                                    taint_closure=closure, checkpoint=checkpoint)

    def graph(self, req: p.GraphRequest) -> p.GraphResponse:
        self.sessions.known(req.session_id)
        return p.GraphResponse(request_id=req.request_id, artifacts=self.store.artifacts(req.session_id),
                               checkpoints=self.store.checkpoints(req.session_id))
