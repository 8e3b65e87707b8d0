"""The wire contract: every message round-trips; every kind of malformed frame gets its own code."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sandboxd import protocol as p
from sandboxd.errors import ErrorCode, ProtocolError

MANIFEST = p.ToolManifest(name="shell", description="d", parameters={"type": "object"}, effect="write")
SESSION = p.SessionInfo(session_id="s-1", image="img", state="open", created_at=1.5, container="abc")
SNAPSHOT = p.SnapshotInfo(snapshot_id="snap-1", session_id="s-1", created_at=2.0, label="l", layers=3)
RESULT = p.CallResult(call_id="c-1", tool="shell", exit_code=0, stdout="out", stderr="", replayed=True)

EXTERNAL = p.CallResult(call_id="fx-1", tool="send_email", exit_code=0, stdout="{}", stderr="", state="done",
                        data={"message_id": "<fx-1@sandboxd>"}, deduplicated=True)
LEDGER = p.LedgerCall(call_id="fx-1", session_id="s-1", tool="send_email", effect="external", state="unknown",
                      args={"to": ["a@b.c"]}, turn=2, occurrence=0, policy="immediate")
HELD = p.HeldCall(call_id="fx-1", session_id="s-1", tool="send_email", policy="on_commit", turn=2, held_at=1.0,
                  args={})

ART = p.Artifact(artifact_id="obs-3", type="observation", parents=["call-2-0"], token_span=(10, 42), turn=2, step=3,
                 content="result", meta={"tool": "read_file"})
CP = p.CheckpointRecord(checkpoint_id="cp-2-2-turn-7", step=2, turn=2, token_offset=10, cache_handle="local:10:ab",
                        reason="turn", manifest=["sys", "user-1"], snapshot_id="snap-1", created_at=3.0)
TOKENS = p.TokenCounts(reused_prefix=10, prefilled=5, decoded=7, recomputed=12, full_reset=40)
RINFO = p.RevocationInfo(revocation_id="rv-1", session_id="s-1", source="obs-3", state="pending",
                         raised_by="operator", tau=3, checkpoint_id="cp-2-2-turn-7")
REPORT = p.RevocationReport(revocation_id="rv-1", session="s-1", source="obs-3", tau=3, T=9, T_original=11,
                            taint_closure=["obs-3", "turn-3"], checkpoint={"id": "cp", "token_offset": 10},
                            tokens=TOKENS, transitions_replayed=7, calls={"fired_twice": 0},
                            leak_scan={"locations_checked": 3, "hits": 0}, not_erased=[], wall_ms=5.0)

SAMPLES: list[Any] = [
    p.HealthRequest(request_id="r"),
    p.OpenSessionRequest(request_id="r", image="img"),
    p.CloseSessionRequest(request_id="r", session_id="s-1"),
    p.ListSessionsRequest(request_id="r", include_closed=True),
    p.ListToolsRequest(request_id="r", session_id="s-1"),
    p.CallRequest(request_id="r", session_id="s-1", tool="shell", args={"command": "ls", "n": [1, 2.5, None]},
                  call_id="c-1", timeout_s=2.0, clock=1700000000.25),
    p.SnapshotRequest(request_id="r", session_id="s-1", label="x"),
    p.RestoreRequest(request_id="r", session_id="s-1", snapshot_id="snap-1"),
    p.ListSnapshotsRequest(request_id="r", session_id="s-1"),
    p.DeleteSnapshotRequest(request_id="r", session_id="s-1", snapshot_id="snap-1"),
    p.HealthResponse(request_id="r", version="0.1", protocol=1, open_sessions=2, uptime_s=3.0),
    p.OpenSessionResponse(request_id="r", session=SESSION),
    p.CloseSessionResponse(request_id="r", session_id="s-1"),
    p.ListSessionsResponse(request_id="r", sessions=[SESSION]),
    p.ListToolsResponse(request_id="r", tools=[MANIFEST]),
    p.CallResponse(request_id="r", result=RESULT),
    p.SnapshotResponse(request_id="r", snapshot=SNAPSHOT),
    p.RestoreResponse(request_id="r", session_id="s-1", snapshot_id="snap-1", elapsed_ms=1.0),
    p.ListSnapshotsResponse(request_id="r", snapshots=[SNAPSHOT]),
    p.DeleteSnapshotResponse(request_id="r", snapshot_id="snap-1"),
    p.ErrorResponse(request_id="r", code="unknown_tool", message="m", details={"tool": "x"}),
    p.CommitTurnRequest(request_id="r", session_id="s-1", turn=3),
    p.DropTurnRequest(request_id="r", session_id="s-1", turn=3),
    p.ListCallsRequest(request_id="r", session_id="s-1"),
    p.OutboxRequest(request_id="r"),
    p.ReleaseCallRequest(request_id="r", call_id="fx-1"),
    p.DropCallRequest(request_id="r", call_id="fx-1"),
    p.ResolveCallRequest(request_id="r", call_id="fx-1", outcome="failed", result=None),
    p.WorldResetRequest(request_id="r", session_id="s-1", injections={"injection_bill_text": "x"},
                        user_task="user_task_0"),
    p.WorldStateRequest(request_id="r", session_id="s-1"),
    p.RollbackRequest(request_id="r", session_id="s-1", turn=3, compensate=True),
    p.RollbackRequest(request_id="r", session_id="s-1", checkpoint="cp-1", force=True),
    p.RollbackResponse(request_id="r", report=p.RollbackReport(
        rollback="br-1", session_id="s-1", to=CP, files_restored="snap-1", dropped=["fx-2"],
        orphaned=[p.OrphanedEffect(call_id="fx-1", tool="webhook", args={"body": 1}, fired_at=1.0,
                                   compensation="POST undo", compensation_call="cmp-fx-1", compensation_state="done")],
        unresolved=[], artifacts_removed=4, checkpoints_removed=2, calls_removed=1, revocations_cancelled=["rv-1"],
        wall_ms=3.5)),
    p.ForkRequest(request_id="r", session_id="s-1", checkpoint="cp-1", live_effects=True),
    p.AdoptSessionRequest(request_id="r", session_id="s-1"),
    p.AdoptSessionResponse(request_id="r", session=p.SessionInfo(session_id="s-1", image="i", state="open",
                                                                 created_at=1.0), snapshot_id="snap-1"),
    p.ForkResponse(request_id="r", session=p.SessionInfo(session_id="s-2", image="i", state="open", created_at=1.0),
                   report=p.ForkReport(session_id="s-2", parent="s-1", at=CP, artifacts=3, checkpoints=1, snapshots=1,
                                       inherited_calls=2, effects="held")),
    p.CompensateRequest(request_id="r", call_id="fx-1"),
    p.CompensateResponse(request_id="r", call_id="fx-1", result=EXTERNAL),
    p.ListRevocationsRequest(request_id="r"),
    p.ListRevocationsResponse(request_id="r", revocations=[]),
    p.CancelRevocationRequest(request_id="r", revocation_id="rv-1", reason="raised by mistake"),
    p.CancelRevocationResponse(request_id="r", revocation=p.RevocationInfo(
        revocation_id="rv-1", session_id="s-1", source="obs-3", state="cancelled", raised_by="operator", tau=3,
        error="cancelled by an operator: raised by mistake", created_at=5.0)),
    p.DeleteSnapshotRequest(request_id="r", session_id="s-1", snapshot_id="snap-1", force=True),
    p.DeleteSnapshotResponse(request_id="r", snapshot_id="snap-1", broken=["cp-1"]),
    p.WorldResponse(request_id="r", session_id="s-1", suite="banking", environment=b"\x80\x04N."),
    p.CopyInRequest(request_id="r", session_id="s-1", path="bin/a.out", data=b"\x00\xff\x7fELF", append=True),
    p.CopyInResponse(request_id="r", path="bin/a.out", size=5),
    p.CopyOutRequest(request_id="r", session_id="s-1", path="bin/a.out", offset=5, length=1024),
    p.CopyOutResponse(request_id="r", path="bin/a.out", data=b"\x00\xff", offset=0, size=2, mode=0o755),
    p.CallOutputRequest(request_id="r", session_id="s-1", call_id="cli-1", stdout_offset=3, timeout_s=1.0),
    p.CallOutputResponse(request_id="r", call_id="cli-1", stdout="line\n", stderr="", running=True),
    p.WaitEventsRequest(request_id="r", session_id="s-1", after=3, epoch="e1", timeout_s=5.0),
    p.WaitEventsResponse(request_id="r", epoch="e1", events=[p.Event(seq=4, kind="revocation", subject="rv-1")]),
    p.CommitTurnResponse(request_id="r", released=[EXTERNAL]),
    p.DropTurnResponse(request_id="r", dropped=["fx-1"]),
    p.ListCallsResponse(request_id="r", calls=[LEDGER]),
    p.OutboxResponse(request_id="r", held=[HELD]),
    p.ReleaseCallResponse(request_id="r", result=EXTERNAL),
    p.DropCallResponse(request_id="r", call_id="fx-1"),
    p.ResolveCallResponse(request_id="r", call=LEDGER),
    p.RecordArtifactsRequest(request_id="r", session_id="s-1", artifacts=[ART], branch="s-1#1"),
    p.CheckpointRequest(request_id="r", session_id="s-1", checkpoint=CP, snapshot=False),
    p.ProvenanceRequest(request_id="r", session_id="s-1", source="obs-3"),
    p.GraphRequest(request_id="r", session_id="s-1"),
    p.RevokeRequest(request_id="r", session_id="s-1", source="obs-3", target="result"),
    p.PendingRevocationsRequest(request_id="r", session_id="s-1"),
    p.BeginRevocationRequest(request_id="r", revocation_id="rv-1"),
    p.CommitRevocationRequest(request_id="r", revocation_id="rv-1", tokens=TOKENS, transitions_replayed=7,
                              final_step=9, answer="a", call_counts={"reexecuted": 2}),
    p.RevocationStatusRequest(request_id="r", revocation_id="rv-1"),
    p.RecordArtifactsResponse(request_id="r", recorded=1),
    p.CheckpointResponse(request_id="r", checkpoint=CP),
    p.ProvenanceResponse(request_id="r", source="obs-3", tau=3, T=9, taint_closure=["obs-3"], checkpoint=CP),
    p.GraphResponse(request_id="r", artifacts=[ART], checkpoints=[CP]),
    p.RevokeResponse(request_id="r", revocation=RINFO, taint_closure=["obs-3"], T=9),
    p.PendingRevocationsResponse(request_id="r", revocations=[RINFO]),
    p.BeginRevocationResponse(request_id="r", revocation_id="rv-1", branch="s-1#1", checkpoint=CP,
                              inputs=[p.ExogenousInput(type="user", text="next")], source_call="call-2-0",
                              source_result="clean"),
    p.CommitRevocationResponse(request_id="r", report=REPORT),
    p.RevocationStatusResponse(request_id="r", revocation=RINFO, report=REPORT),
]


def test_every_message_type_has_a_sample() -> None:
    covered = {type(m).__name__ for m in SAMPLES}
    assert covered == set(p.REQUEST_TYPES) | set(p.RESPONSE_TYPES)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Any) -> None:
    frame = p.encode(message)
    decode = p.decode_request if type(message).__name__ in p.REQUEST_TYPES else p.decode_response
    assert decode(frame) == message


def frame(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


MALFORMED = [
    (b"\xc1", ErrorCode.BAD_FRAME),
    (b"", ErrorCode.BAD_FRAME),
    (msgspec.msgpack.encode([1, 2]), ErrorCode.BAD_FRAME),
    (msgspec.msgpack.encode("HealthRequest"), ErrorCode.BAD_FRAME),
    (frame(request_id="r"), ErrorCode.UNKNOWN_TYPE),
    (frame(type="DropTablesRequest", request_id="r"), ErrorCode.UNKNOWN_TYPE),
    (frame(type=7, request_id="r"), ErrorCode.UNKNOWN_TYPE),
    (frame(type="HealthResponse", request_id="r"), ErrorCode.UNKNOWN_TYPE),
    (frame(type="HealthRequest"), ErrorCode.INVALID_FIELD),
    (frame(type="CallRequest", request_id="r", session_id="s", tool="shell"), ErrorCode.INVALID_FIELD),
    (frame(type="CallRequest", request_id="r", session_id=5, tool="shell", args={}), ErrorCode.INVALID_FIELD),
    (frame(type="CallRequest", request_id="r", session_id="s", tool="t", args=[]), ErrorCode.INVALID_FIELD),
    (frame(type="CallRequest", request_id="r", session_id="s", tool="t", args={}, timeout_s="1"),
     ErrorCode.INVALID_FIELD),
    (frame(type="HealthRequest", request_id="r", admin=True), ErrorCode.INVALID_FIELD),
    (frame(type="HealthRequest", request_id=b"r"), ErrorCode.INVALID_FIELD),
    (frame(type="CallRequest", request_id="r", session_id="s", tool="t", args={}, mode="fire"),
     ErrorCode.INVALID_FIELD),
    (frame(type="ResolveCallRequest", request_id="r", call_id="c", outcome="maybe"), ErrorCode.INVALID_FIELD),
]


@pytest.mark.parametrize(("data", "code"), MALFORMED)
def test_malformed_frames_get_their_code(data: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as err:
        p.decode_request(data)
    assert err.value.code == code


def test_oversized_frame() -> None:
    big = p.encode(p.CallRequest(request_id="r", session_id="s", tool="t", args={"x": "a" * 5000}))
    with pytest.raises(ProtocolError) as err:
        p.decode_request(big, max_frame=4096)
    assert err.value.code == ErrorCode.FRAME_TOO_LARGE
    assert err.value.details == {"size": len(big), "limit": 4096}
    assert p.decode_request(big, max_frame=len(big)).request_id == "r"


def test_request_id_is_recovered_for_error_replies() -> None:
    assert p.request_id_of(frame(type="Nope", request_id="abc")) == "abc"
    assert p.request_id_of(b"\xc1") == ""
    assert p.request_id_of(frame(request_id=3)) == ""
