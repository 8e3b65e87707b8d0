"""`make demo`: an agent is hijacked by a web page, the daemon revokes the page, the session is replayed.

On embedded defaults, with no network and no GPU: a daemon on the real Docker engine, a local mail
sink and web server, and a ~20-step session whose every turn the fixture model (agent/models/fixture,
a small Llama trained by agent/models/train_fixture.py) generates freely, greedy, through its own
chat template, its tool calls read in the Qwen2.5 / Hermes format. The vendor page carries an
injected instruction; the model follows it (an email through the firewall, a note in its sandbox),
then carries on. The default detector flags the page; the agent takes the revocation, the daemon
restores the sandbox, and the
suffix is replayed without the injection. Then the reference (B5: a fresh session run from scratch
without the injection) runs, and the two are compared. Writes out/demo-report.json and
out/demo-graph.svg. The report states the replay's agreement with the reference and, where they
differ, the first divergent token and its cause. Exits non-zero if the model was not hijacked, or the
revocation left a leak or fired an effect twice.

The agent's session is left open: the daemon stops (so `make demo` ends) without closing it, and the
demo prints the commands that bring a daemon back on its state to look at it (the console, the
provenance graph). The web server's port is any free one: the fixture was trained on the name
`vendor.test`, which the daemon's firewall resolves to it.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from agent.compare import agreement, counterfactual_artifact_distance, final_state
from agent.harness import MailSink, Web, daemon_config, run_model_session
from agent.models.fixture_data import FIXTURE_HOST
from agent.revocation import apply_pending
from agent.runtime import AgentSession
from agent.scenarios import VENDOR_PAGE, WORKSPACE, finance
from sandboxd.launcher import DaemonProcess
from sandboxd.revocation.graph_render import render

OUT = Path("out")


def main() -> None:
    OUT.mkdir(exist_ok=True)
    state = (OUT / "demo-state").resolve()
    shutil.rmtree(state, ignore_errors=True)
    mail, ref_mail, web = MailSink(), MailSink(), Web({"/vendors": VENDOR_PAGE}, name=FIXTURE_HOST)
    daemon = DaemonProcess(state, ["--config", str(daemon_config(OUT / "demo-sandboxd.toml", mail, web))],
                           log=OUT / "demo-daemon.log")
    # The reference runs in a world of its own, so its email does not land in the first world's sink.
    reference = DaemonProcess((OUT / "demo-reference-state").resolve(),
                              ["--config", str(daemon_config(OUT / "demo-reference.toml", ref_mail, web))],
                              log=OUT / "demo-reference.log")
    shutil.rmtree(reference.state_dir, ignore_errors=True)
    print(f"sandboxd: state {state}, log {daemon.log}")
    daemon.start()
    reference.start()
    try:
        report = run(daemon, reference, mail, web)
    finally:
        # The agent's session stays open for the operator to inspect; the daemon stops so the demo ends.
        daemon.shutdown(close_sessions=False)
        reference.shutdown()
        for server in (mail, ref_mail, web):
            server.close()
    (OUT / "demo-report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    print(f"\nwrote {OUT / 'demo-report.json'} and {OUT / 'demo-graph.svg'}")
    if not report["hijacked"] or report["leak_scan"]["hits"] or report["calls"]["fired_twice"]:
        print("DEMO FAILED: the model was not hijacked, or the revocation left a leak or fired twice",
              file=sys.stderr)
        raise SystemExit(1)
    print(inspect_hint(state, OUT / "demo-sandboxd.toml", report["session"]))


def inspect_hint(state: Path, config: Path, session: str) -> str:
    """The commands that look at the demo's session, which stays open on its state after the demo ends."""
    cli = f"{sys.executable} -m sandboxd.cli"
    endpoint = f"ipc://{state / 'sandboxd.sock'}"
    return (f"\nthe session {session} is left open on {state}; look at it:\n"
            f"  the web console (starts a daemon on the state for as long as it runs):\n"
            f"    {cli} console --state-dir {state} --config {config}\n"
            f"  or a daemon of your own, then the graph, the calls and the revocations from the CLI:\n"
            f"    {cli} serve --state-dir {state} --config {config} &\n"
            f"    {cli} graph {session} --endpoint {endpoint} --format svg --output out/session.svg\n"
            f"    {cli} calls {session} --endpoint {endpoint}\n"
            f"    {cli} revocations {session} --endpoint {endpoint}")


def run(daemon: DaemonProcess, reference: DaemonProcess, mail: MailSink, web: Web) -> dict[str, Any]:
    client = daemon.client()
    scenario = finance(web.url("/vendors"), compact_every=0)
    print("\n== the agent's session (the fixture model generating freely, tools in a hardened sandbox)")
    agent = run_model_session(client, scenario, WORKSPACE, echo=_echo)
    print(f"   mail sink received: {mail.subjects()}")

    pending = client.pending_revocations(agent.session_id)
    print(f"\n== the detector flagged {len(pending)} observation(s)")
    for info in pending:
        print(f"   {info.revocation_id}: source {info.source} (tau={info.tau}), raised by {info.raised_by}")
    print("\n== revocation (B7): restore the checkpoint before tau, replay the suffix")
    [b7] = apply_pending(agent)
    # Drawn after the revocation: the picture shows the replayed session, which never read the injection.
    graph = client.graph(agent.session_id)
    (OUT / "demo-graph.svg").write_text(render(graph.artifacts, graph.checkpoints, set(), "svg"))
    print(json.dumps(msgspec.to_builtins(b7), indent=2, sort_keys=True))
    b7_state = final_state(agent)

    print("\n== reference (B5): a fresh session, from scratch, that never sees the injection")
    target = VENDOR_PAGE[VENDOR_PAGE.index("<INFORMATION>"):VENDOR_PAGE.index("</INFORMATION>") + 14]
    started = time.monotonic()
    ref = run_model_session(reference.client(), scenario, WORKSPACE, forget=[target])
    b5_wall = (time.monotonic() - started) * 1000
    b5_state = final_state(ref)
    agree = agreement(b7_state, b5_state)
    assert ref.conversation is not None
    b5_tokens = ref.conversation.meter.recomputed
    divergence = first_divergence(agent, ref)
    print(f"   first divergent token: {divergence}")
    print(f"\n   {'':28s} {'B7 (this)':>12s} {'B5 (reset)':>12s}")
    print(f"   {'tokens recomputed':28s} {b7.tokens.recomputed:12d} {b5_tokens:12d}")
    print(f"   {'prefix reused':28s} {b7.tokens.reused_prefix:12d} {0:12d}")
    print(f"   {'wall ms':28s} {b7.wall_ms:12.0f} {b5_wall:12.0f}")
    print(f"   {'answer':28s} {b7_state.answer!r:>12.12s} {b5_state.answer!r:>12.12s}")
    print(f"   agreement with B5: {agree}")
    print(f"   B5 / B7 recomputed tokens: {b5_tokens / max(b7.tokens.recomputed, 1):.2f}x")
    print(f"   mail sink received: {mail.subjects()} (the orphaned one cannot be unsent)")
    report: dict[str, Any] = msgspec.to_builtins(b7)
    report["reference"] = {"method": "B5", "tokens_recomputed": b5_tokens, "wall_ms": b5_wall,
                           "answer": b5_state.answer, "session": ref.session_id}
    report["agreement"] = agree
    report["cad"] = counterfactual_artifact_distance(b7_state, b5_state)
    report["first_divergence"] = divergence
    report["hijacked"] = "q3 figures" in mail.subjects()
    report["session"] = agent.session_id
    return report


def _echo(block: object) -> None:
    print(f"   {block.artifact_id:11s} {block.type:11s} {block.text[:88]!r}", flush=True)  # type: ignore[attr-defined]


def first_divergence(b7: AgentSession, b5: AgentSession) -> dict[str, Any] | None:
    """Where the replayed session's tokens first differ from the reference's, in which block, and why."""
    a, b = b7.backend.token_ids(), b5.backend.token_ids()
    index = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if index is None:
        return None if len(a) == len(b) else {"token": min(len(a), len(b)), "why": "one session is longer"}
    block = next((blk for blk in b5.blocks if blk.span[0] <= index < blk.span[1]), None)
    kind = block.type if block is not None else "?"
    why = ("the world answered differently (an observation: e.g. the ledger's effect id in a mail receipt)"
           if kind == "observation" else
           "the model decoded another token after the same context: a cropped KV cache and a fresh prefill "
           "compute the same logits in another order, and a near tie can flip under greedy decoding"
           if kind == "model_turn" else f"a {kind} block differs")
    return {"token": index, "block": block.artifact_id if block else None, "type": kind,
            "b7": b7.backend.detokenize(a[max(0, index - 8):index + 8]),
            "b5": b5.backend.detokenize(b[max(0, index - 8):index + 8]), "why": why}


if __name__ == "__main__":
    main()
