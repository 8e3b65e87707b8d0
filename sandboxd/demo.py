"""`make demo`: an agent is hijacked by a web page, the daemon revokes the page, the session is replayed.

On embedded defaults, with no network and no GPU: a daemon on the real Docker engine, a local mail
sink and web server, and a ~20-step session whose turns a scripted policy chooses and the local
transformers engine runs token by token. The vendor page carries an injected instruction; the agent
follows it (a note in its sandbox, an email through the firewall), then carries on. The default
detector flags the page; the agent takes the revocation, the daemon restores the sandbox, and the
suffix is replayed without the injection. Then the reference (B5: a fresh session run from scratch
without the injection) runs, and the two are compared. Writes out/demo-report.json and
out/demo-graph.svg. Exits non-zero if the replay does not agree with the reference.
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
from agent.harness import MailSink, Web, daemon_config, run_session
from agent.revocation import apply_pending
from agent.scenarios import VENDOR_PAGE, WORKSPACE, finance
from sandboxd.launcher import DaemonProcess
from sandboxd.revocation.graph_render import render

OUT = Path("out")


def main() -> None:
    OUT.mkdir(exist_ok=True)
    state = (OUT / "demo-state").resolve()
    shutil.rmtree(state, ignore_errors=True)
    mail, ref_mail, web = MailSink(), MailSink(), Web({"/vendors": VENDOR_PAGE})
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
        daemon.shutdown()
        reference.shutdown()
        for server in (mail, ref_mail, web):
            server.close()
    (OUT / "demo-report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    print(f"\nwrote {OUT / 'demo-report.json'} and {OUT / 'demo-graph.svg'}")
    if not report["agreement"]["all"] or report["leak_scan"]["hits"] or report["calls"]["fired_twice"]:
        print("DEMO FAILED: the replay does not match the reference", file=sys.stderr)
        raise SystemExit(1)
    print(f"\nlook at what happened: {sys.executable} -m sandboxd.cli console --state-dir {state} "
          f"--config {OUT / 'demo-sandboxd.toml'}")


def run(daemon: DaemonProcess, reference: DaemonProcess, mail: MailSink, web: Web) -> dict[str, Any]:
    client = daemon.client()
    scenario = finance(web.url("/vendors"))
    print("\n== the agent's session (scripted policy on the local engine, tools in a hardened sandbox)")
    agent = run_session(client, scenario, WORKSPACE)
    for block in agent.blocks:
        print(f"   {block.artifact_id:11s} {block.type:11s} {block.text[:88]!r}")
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
    ref = run_session(reference.client(), scenario, WORKSPACE, forget=[target])
    b5_wall = (time.monotonic() - started) * 1000
    b5_state = final_state(ref)
    agree = agreement(b7_state, b5_state)
    b5_tokens = ref.backend.meter.recomputed
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
    return report


if __name__ == "__main__":
    main()
