"""What the console's pages show, read through the client: plain dicts for the templates and the event stream."""

from __future__ import annotations

import io
import json
from typing import Any

from sandboxd import protocol as p
from sandboxd.client import Client


def _ago(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _usage(key: str, value: Any) -> str:
    if key.endswith("_bytes") and isinstance(value, int):
        return f"{key.removesuffix('_bytes')} {value / (1 << 20):.1f} MiB"
    return f"{key} {value}"


def session_rows(client: Client, sessions: list[p.SessionInfo], now: float) -> list[dict[str, Any]]:
    """One row per session: owner, age, idle time, resource use, state."""
    rows = []
    for s in sessions:
        calls = client.calls(s.session_id) if s.state == "open" else []
        # A daemon that reports when a session was last used says so; otherwise its last call does.
        last = getattr(s, "last_used_at", None) or max([s.created_at, *(c.updated_at for c in calls)])
        usage = dict(getattr(s, "usage", {}) or {})
        usage.setdefault("calls", len(calls))
        rows.append({"id": s.session_id, "owner": getattr(s, "owner", "") or "", "image": s.image, "state": s.state,
                     "age": _ago(now - s.created_at), "idle": _ago(max(0.0, now - last)),
                     "usage": ", ".join(_usage(k, v) for k, v in sorted(usage.items()))})
    return rows


def timeline(client: Client, session_id: str) -> list[dict[str, Any]]:
    """Turns, tool calls (arguments and results), checkpoints and snapshots, in time order."""
    items: list[dict[str, Any]] = []
    graph = client.graph(session_id)
    for a in graph.artifacts:
        if a.type in ("model_turn", "reply", "user"):
            items.append({"kind": a.type, "id": a.artifact_id, "turn": a.turn, "at": 0.0, "text": a.content[:2000]})
    for c in client.calls(session_id):
        items.append({"kind": "call", "id": c.call_id, "tool": c.tool, "state": c.state, "turn": c.turn,
                      "at": c.created_at, "args": json.dumps(c.args, indent=1, sort_keys=True)[:4000],
                      "result": json.dumps(c.result, indent=1, sort_keys=True)[:4000] if c.result else ""})
    for cp in graph.checkpoints:
        snap_note = f", snapshot {cp.snapshot_id}" if cp.snapshot_id else ""
        items.append({"kind": "checkpoint", "id": cp.checkpoint_id, "turn": cp.turn, "at": cp.created_at,
                      "text": f"{cp.reason}, step {cp.step}{snap_note}"})
    for snap in client.snapshots(session_id):
        items.append({"kind": "snapshot", "id": snap.snapshot_id, "turn": None, "at": snap.created_at,
                      "text": snap.label or ""})
    # Artifacts carry no wall-clock time: they keep recording order, placed by turn among the timed items.
    items.sort(key=lambda i: (i["turn"] if i["turn"] is not None else 1 << 30, i["at"]))
    return items


def approvals(client: Client, now: float) -> list[dict[str, Any]]:
    """Held, staged and unknown calls: tool, recipient or URL, the full payload, age and turn."""
    rows = []
    for h in client.outbox(None):
        target = h.args.get("to") or h.args.get("url") or ""
        rows.append({"call_id": h.call_id, "session": h.session_id, "tool": h.tool,
                     "state": getattr(h, "state", "held"), "policy": h.policy, "turn": h.turn,
                     "age": _ago(now - h.held_at), "target": json.dumps(target),
                     "payload": json.dumps(h.args, indent=2, sort_keys=True), "replay": h.replay})
    seen = {r["call_id"] for r in rows}
    for s in client.sessions():
        for c in client.calls(s.session_id):
            if c.state == "unknown" and c.call_id not in seen:
                rows.append({"call_id": c.call_id, "session": c.session_id, "tool": c.tool, "state": "unknown",
                             "policy": c.policy, "turn": c.turn, "age": _ago(now - c.created_at),
                             "target": json.dumps(c.args.get("to") or c.args.get("url") or ""),
                             "payload": json.dumps(c.args, indent=2, sort_keys=True), "replay": None})
    return rows


def decisions(client: Client) -> list[dict[str, Any]]:
    """Released and dropped external calls with who decided and why, where the daemon records it."""
    out = []
    for s in client.sessions():
        for c in client.calls(s.session_id):
            # A released call is `done` (or `failed`) by now: its decider is what marks it as decided.
            if c.state == "dropped" or c.decided_by:
                out.append({"call_id": c.call_id, "tool": c.tool, "state": c.state,
                            "by": c.decided_by or "", "reason": c.reason or ""})
    return out


def plots(client: Client) -> dict[str, str]:
    """SVG plots: calls per second over the open sessions' ledgers, revocation cost against tau."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stamps = [c.created_at for s in client.sessions() for c in client.calls(s.session_id) if c.created_at]
    reports = []
    if hasattr(client, "revocations"):
        for r in client.revocations():
            status = client.revocation_status(r["revocation_id"])
            if status.report is not None:
                reports.append(status.report)
    out: dict[str, str] = {}
    fig, ax = plt.subplots(figsize=(6, 2.5))
    if stamps:
        start = min(stamps)
        seconds = [int(t - start) for t in stamps]
        ax.hist(seconds, bins=range(0, max(seconds) + 2))
    ax.set_xlabel("seconds since the first call")
    ax.set_ylabel("calls per second")
    out["calls per second"] = _svg(fig, plt)
    fig, ax = plt.subplots(figsize=(6, 2.5))
    ax.scatter([r.tau for r in reports], [r.tokens.recomputed + r.tokens.prefilled for r in reports])
    ax.set_xlabel("tau (step the revoked input entered)")
    ax.set_ylabel("tokens recomputed")
    out["revocation cost against tau"] = _svg(fig, plt)
    return out


def _svg(fig: Any, plt: Any) -> str:
    buf = io.StringIO()
    fig.tight_layout()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def revoked(client: Client, session_id: str) -> set[str]:
    """Artifacts a revocation of the session takes back (raised or done): drawn redacted, never their text."""
    sources = {r.source for r in client.pending_revocations(session_id)}
    if hasattr(client, "revocations"):  # every revocation, done ones too, where the client lists them
        sources |= {r["source"] for r in client.revocations(session_id) if r.get("state") != "cancelled"}
    known = {a.artifact_id for a in client.graph(session_id).artifacts}
    out: set[str] = set()
    for source in sources & known:
        out |= set(client.provenance(session_id, source).taint_closure)
    return out
