"""`sandboxd`: the daemon and its operator commands.

Every client command takes --endpoint and --json, and for a tcp:// daemon --server-key (the daemon's
NAME.key) and --client-key (this client's NAME.key_secret; see `sandboxd keys`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from sandboxd.auth import KeyFileError, generate_keys
from sandboxd.client import Client
from sandboxd.config import load_config
from sandboxd.errors import SandboxdError


def _print(args: argparse.Namespace, value: Any, text: Callable[[Any], str]) -> None:
    if args.json:
        print(json.dumps(msgspec.to_builtins(value), indent=2, sort_keys=True))
    else:
        print(text(value))


def _table(rows: list[list[str]]) -> str:
    if not rows:
        return "(none)"
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def cmd_serve(args: argparse.Namespace) -> None:
    from sandboxd.daemon import run

    try:
        config = load_config(args.config, state_dir=args.state_dir, endpoint=args.endpoint, image=args.image,
                             snapshot_backend=args.snapshot_backend, runtime=args.runtime)
    except ValueError as exc:  # KeyFileError included: say which file, not a traceback
        raise SystemExit(f"sandboxd serve: {exc}") from exc
    try:
        run(config, verbose=args.verbose)
    except SandboxdError as exc:  # an engine that cannot run the sandboxes as configured
        raise SystemExit(f"sandboxd serve: {exc}") from exc


def cmd_mcp(args: argparse.Namespace) -> None:
    try:
        from sandboxd.mcp.options import McpOptions
        from sandboxd.mcp.server import run
    except ImportError as exc:  # the SDK is an extra
        raise SystemExit(f"sandboxd mcp: the MCP SDK is not installed ({exc}): pip install 'sandboxd[mcp]'") from exc
    try:
        options = McpOptions(
            transport=args.transport, host=args.host, port=args.port, path=args.path, token=args.token,
            allow_remote=args.allow_remote, session=args.session, image=args.image,
            close_on_exit=args.close_on_exit, idle_timeout_s=args.idle_timeout, retry_window_s=args.retry_window,
            hold_poll_s=args.hold_poll, hold_wait_s=args.hold_wait, close_tool=args.close_tool,
            endpoint=args.endpoint, server_key=args.server_key, client_key=args.client_key, wait_s=args.wait)
    except ValueError as exc:
        raise SystemExit(f"sandboxd mcp: {exc}") from exc
    run(options)


def cmd_keys(args: argparse.Namespace) -> None:
    try:
        public_path, secret_path = generate_keys(args.dir, args.name, force=args.force)
    except KeyFileError as exc:
        raise SystemExit(f"sandboxd keys: {exc}") from exc
    print(f"public key: {public_path}  (give to the daemon: client_keys_dir / operator_keys / --server-key)")
    print(f"secret key: {secret_path}  (mode 0600; keep it: --client-key / server_secret_key_file)")


def cmd_health(args: argparse.Namespace, client: Client) -> None:
    _print(args, client.health(), lambda h: f"sandboxd {h.version}: {h.open_sessions} open sessions, "
           f"up {h.uptime_s:.0f}s")


def cmd_tools(args: argparse.Namespace, client: Client) -> None:
    tools = client.tools(args.session)
    _print(args, tools, lambda ts: _table([["NAME", "EFFECT", "DESCRIPTION"]]
                                          + [[t.name, t.effect, t.description] for t in ts]))


def cmd_session(args: argparse.Namespace, client: Client) -> None:
    if args.action == "open":
        info = client.open_session(args.image)
        _print(args, info, lambda s: s.session_id)
    elif args.action == "close":
        if not args.id:
            raise SystemExit("sandboxd session close: a session id is required")
        client.close_session(args.id)
        _print(args, {"session_id": args.id, "state": "closed"}, lambda d: f"closed {d['session_id']}")
    else:
        sessions = client.sessions(include_closed=args.all)
        _print(args, sessions, lambda ss: _table([["SESSION", "STATE", "IMAGE"]]
                                                 + [[s.session_id, s.state, s.image] for s in ss]))


def cmd_call(args: argparse.Namespace, client: Client) -> None:
    try:
        call_args = json.loads(args.args)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"sandboxd call: --args is not valid JSON: {exc}") from exc
    if not isinstance(call_args, dict):
        raise SystemExit("sandboxd call: --args must be a JSON object")
    result = client.call(args.session, args.tool, call_args, call_id=args.call_id, timeout_s=args.call_timeout)
    if args.json:
        _print(args, result, str)
        return
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.exit_code:
        raise SystemExit(result.exit_code if 0 < result.exit_code < 256 else 1)


def cmd_snapshot(args: argparse.Namespace, client: Client) -> None:
    _print(args, client.snapshot(args.session, args.label),
           lambda s: f"{s.snapshot_id} ({s.elapsed_ms:.1f} ms)")


def cmd_restore(args: argparse.Namespace, client: Client) -> None:
    _print(args, client.restore(args.session, args.snapshot),
           lambda r: f"restored {r.snapshot_id} ({r.elapsed_ms:.1f} ms)")


def cmd_snapshots(args: argparse.Namespace, client: Client) -> None:
    if args.delete:
        client.delete_snapshot(args.session, args.delete)
        _print(args, {"deleted": args.delete}, lambda d: f"deleted {d['deleted']}")
        return
    _print(args, client.snapshots(args.session), lambda ss: _table(
        [["SNAPSHOT", "LABEL", "LAYERS"]] + [[s.snapshot_id, s.label or "", str(s.layers)] for s in ss]))


def cmd_calls(args: argparse.Namespace, client: Client) -> None:
    if args.target == "resolve":
        if not args.call or not args.outcome:
            raise SystemExit("sandboxd calls resolve CALL --outcome done|failed")
        _print(args, client.resolve(args.call, args.outcome), lambda c: f"{c.call_id} is now {c.state}")
        return
    calls = client.calls(args.target)
    _print(args, calls, lambda cs: _table([["CALL", "TOOL", "EFFECT", "STATE", "TURN"]] + [
        [c.call_id, c.tool, c.effect, c.state, "" if c.turn is None else str(c.turn)] for c in cs]))


def cmd_outbox(args: argparse.Namespace, client: Client) -> None:
    if args.target in ("release", "drop"):
        if not args.call:
            raise SystemExit(f"sandboxd outbox {args.target} CALL")
        if args.target == "release":
            _print(args, client.release(args.call), lambda r: f"released {r.call_id}: {r.state}")
        else:
            client.drop(args.call)
            _print(args, {"dropped": args.call}, lambda d: f"dropped {d['dropped']}")
        return
    held = client.outbox(None if args.target == "all" else args.target)
    _print(args, held, lambda hs: _table([["CALL", "SESSION", "TOOL", "POLICY", "TURN", "OPEN REPLAY"]] + [
        [h.call_id, h.session_id, h.tool, h.policy, "" if h.turn is None else str(h.turn), h.replay or ""]
        for h in hs]))


def cmd_commit(args: argparse.Namespace, client: Client) -> None:
    released = client.commit_turn(args.session, args.turn)
    _print(args, released, lambda rs: "\n".join(f"{r.call_id}: {r.state}" for r in rs) or "nothing held")


def cmd_revoke(args: argparse.Namespace, client: Client) -> None:
    raised = client.revoke(args.session, args.source, args.target)
    info = raised.revocation
    deadline = time.monotonic() + args.wait_done
    while args.wait_done and time.monotonic() < deadline:
        status = client.revocation_status(info.revocation_id)
        if status.report is not None:
            _print(args, status.report, lambda r: json.dumps(msgspec.to_builtins(r), indent=2, sort_keys=True))
            return
        time.sleep(0.5)
    _print(args, {"revocation_id": info.revocation_id, "state": info.state, "tau": info.tau, "T": raised.T,
                  "taint_closure": raised.taint_closure, "checkpoint": info.checkpoint_id},
           lambda d: f"{d['revocation_id']} {d['state']}: tau={d['tau']} T={d['T']}, "
                     f"{len(d['taint_closure'])} artifacts tainted; the agent replays it when it next connects")


def cmd_graph(args: argparse.Namespace, client: Client) -> None:
    from sandboxd.revocation.graph_render import render

    graph = client.graph(args.session)
    closure: set[str] = set()
    if args.source:
        closure = set(client.provenance(args.session, args.source).taint_closure)
    # The closure is what a revocation of the source takes back: drawn redacted unless asked otherwise.
    text = render(graph.artifacts, graph.checkpoints, closure, args.format, source=args.source,
                  redact=set() if args.show_text else closure)
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text)


def cmd_agent(args: argparse.Namespace, client: Client) -> None:
    from agent.backends import run_agent

    def echo(block: Any) -> None:
        if args.json:
            return
        if block.type == "model_turn":
            for (_cid, call), error in zip(block.calls, block.errors or [None] * len(block.calls), strict=True):
                print(f"[{block.artifact_id}] call {call.name} {json.dumps(call.arguments)[:200]}"
                      + (f"  (invalid: {error})" if error else ""), flush=True)
            if block.reply is not None:
                print(f"[{block.artifact_id}] answer: {block.reply}", flush=True)
        elif block.type == "observation":
            print(f"[{block.artifact_id}] result: {block.text[:200]!r}", flush=True)
        elif block.type == "user":
            print(f"\n[{block.artifact_id}] task: {block.text}", flush=True)

    def report(r: Any) -> None:
        print(f"\n[revocation {r.revocation_id}] replayed from step {r.tau}: {r.tokens.recomputed} tokens recomputed, "
              f"{r.tokens.reused_prefix} reused; answer {r.answer!r}; notes {r.not_erased}", flush=True)

    try:
        agent = run_agent(client, backend=args.backend, model=args.model, tasks=args.task, url=args.url,
                          workspace=args.workspace, max_turns=args.max_turns, system=args.system,
                          temperature=args.temperature, seed=args.seed, toolcall_format=args.tool_format,
                          session_id=args.session, echo=echo, on_report=report, linger_s=args.linger,
                          endpoint=client.endpoint)
    except ValueError as exc:
        raise SystemExit(f"sandboxd agent run: {exc}") from exc
    _print(args, {"session_id": agent.session_id, "answer": agent.answer(), "turns": agent.turn, "steps": agent.step},
           lambda d: f"\nsession {d['session_id']}: {d['turns']} turns, {d['steps']} steps; answer: {d['answer']!r}")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="sandboxd", description="Tool-execution firewall for LLM agents.")
    sub = top.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoint", help="daemon endpoint (default: ipc socket in the state directory)")
    common.add_argument("--json", action="store_true", help="print JSON")
    common.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the daemon's reply")
    common.add_argument("--server-key", type=Path, metavar="FILE",
                        help="tcp:// daemons: the daemon's public key file (NAME.key), pinned")
    common.add_argument("--client-key", type=Path, metavar="FILE",
                        help="tcp:// daemons: this client's secret key file (NAME.key_secret)")

    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", type=Path, help="TOML configuration file")
    serve.add_argument("--state-dir")
    serve.add_argument("--endpoint")
    serve.add_argument("--image")
    serve.add_argument("--snapshot-backend", choices=["overlay", "copy"])
    serve.add_argument("--runtime", choices=["runc", "runsc"],
                       help="OCI runtime of the sandboxes: runc (default) or runsc (gVisor)")
    serve.add_argument("-v", "--verbose", action="store_true")
    serve.set_defaults(func=cmd_serve, client=False)

    keys = sub.add_parser("keys", help="make a CURVE keypair: DIR/NAME.key (public), DIR/NAME.key_secret (0600)")
    keys.add_argument("--dir", type=Path, required=True, help="where to write the two files")
    keys.add_argument("--name", required=True, help="base name of the files, e.g. server or agent-a")
    keys.add_argument("--force", action="store_true", help="replace existing files")
    keys.set_defaults(func=cmd_keys, client=False)

    mcp = sub.add_parser("mcp", parents=[common], help="serve one session's tools over MCP (stdio or HTTP)")
    mcp.add_argument("--transport", choices=["stdio", "http"], default="stdio")
    mcp.add_argument("--host", default="127.0.0.1", help="http: address to bind (loopback unless --allow-remote)")
    mcp.add_argument("--port", type=int, default=8765, help="http: port to bind")
    mcp.add_argument("--path", default="/mcp", help="http: the endpoint's path")
    mcp.add_argument("--token", default=os.environ.get("SANDBOXD_MCP_TOKEN"),
                     help="http: bearer token clients present (default: $SANDBOXD_MCP_TOKEN, else generated "
                          "and printed on stderr)")
    mcp.add_argument("--allow-remote", action="store_true", help="http: allow a non-loopback --host")
    mcp.add_argument("--session", help="attach to this open session (default: open a new one)")
    mcp.add_argument("--image", help="image of a new session")
    mcp.add_argument("--close-on-exit", action=argparse.BooleanOptionalAction, default=None,
                     help="close the session when the server stops (default: only a session it opened)")
    mcp.add_argument("--idle-timeout", type=float, default=0.0, metavar="SECONDS",
                     help="close the session and stop after this long without a request (0: never)")
    mcp.add_argument("--retry-window", type=float, default=60.0, metavar="SECONDS",
                     help="an identical call this soon after an answer is a retry of it")
    mcp.add_argument("--hold-poll", type=float, default=20.0, metavar="SECONDS",
                     help="2026-07-28 clients: how long one round waits for an operator's decision")
    mcp.add_argument("--hold-wait", type=float, default=600.0, metavar="SECONDS",
                     help="older clients: how long one call waits for an operator's decision")
    mcp.add_argument("--close-tool", action="store_true", help="offer the model a tool that closes the session")
    mcp.set_defaults(func=cmd_mcp, client=False)

    def add(name: str, func: Callable[..., None], help_text: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, parents=[common], help=help_text)
        cmd.set_defaults(func=func, client=True)
        return cmd

    add("health", cmd_health, "daemon status")
    add("tools", cmd_tools, "tool manifests").add_argument("session", nargs="?")
    session = add("session", cmd_session, "open, close or list sessions")
    session.add_argument("action", choices=["open", "close", "list"])
    session.add_argument("id", nargs="?")
    session.add_argument("--image")
    session.add_argument("--all", action="store_true", help="list closed sessions too")
    call = add("call", cmd_call, "run a tool in a session")
    call.add_argument("session")
    call.add_argument("tool")
    call.add_argument("--args", default="{}", help="arguments as a JSON object")
    call.add_argument("--call-id")
    call.add_argument("--call-timeout", type=float, help="seconds before the tool is killed")
    snap = add("snapshot", cmd_snapshot, "snapshot a session's workspace")
    snap.add_argument("session")
    snap.add_argument("--label")
    restore = add("restore", cmd_restore, "restore a snapshot")
    restore.add_argument("session")
    restore.add_argument("snapshot")
    snaps = add("snapshots", cmd_snapshots, "list (or --delete) a session's snapshots")
    snaps.add_argument("session")
    snaps.add_argument("--delete", metavar="SNAPSHOT")
    calls = add("calls", cmd_calls, "a session's calls (sandbox and external), or resolve an unknown one")
    calls.add_argument("target", metavar="SESSION|resolve")
    calls.add_argument("call", nargs="?", metavar="CALL")
    calls.add_argument("--outcome", choices=["done", "failed"], help="with resolve: did the effect happen?")
    outbox = add("outbox", cmd_outbox, "held external effects: list (SESSION or all), release CALL, drop CALL")
    outbox.add_argument("target", metavar="SESSION|all|release|drop")
    outbox.add_argument("call", nargs="?", metavar="CALL")
    commit = add("commit", cmd_commit, "commit a turn: release the effects held for it")
    commit.add_argument("session")
    commit.add_argument("turn", type=int)
    revoke = add("revoke", cmd_revoke, "revoke an input: forget TARGET (default: all of SOURCE) and replay")
    revoke.add_argument("session")
    revoke.add_argument("--source", required=True, help="the artifact the target entered through")
    revoke.add_argument("--target", help="the text to forget (default: the whole source)")
    revoke.add_argument("--wait-done", type=float, default=0.0, help="seconds to wait for the agent's replay")
    graph = add("graph", cmd_graph, "draw the provenance graph, a source's taint closure highlighted")
    graph.add_argument("session")
    graph.add_argument("--format", choices=["json", "dot", "svg"], default="json")
    graph.add_argument("--source", help="highlight the taint closure of this artifact (its text redacted)")
    graph.add_argument("--show-text", action="store_true",
                       help="with --source: draw the closure's text too instead of a digest of it")
    graph.add_argument("--output", "-o", help="write to this file instead of stdout")
    agent = add("agent", cmd_agent, "run a model-driven agent in a sandbox session")
    agent.add_argument("action", choices=["run"], help="run: the agent on the given tasks")
    agent.add_argument("--backend", choices=["local", "sglang", "openai"], default="local",
                       help="local: transformers in this process; sglang: an SGLang server's native /generate; "
                            "openai: any OpenAI-compatible chat-completions endpoint")
    agent.add_argument("--model", required=True, metavar="PATH_OR_NAME",
                       help="local and sglang: the model directory (weights for local; tokenizer and chat template "
                            "for both); openai: the model name the endpoint serves")
    agent.add_argument("--url", help="sglang: server root (http://HOST:30000); openai: API root (http://HOST:8000/v1)")
    agent.add_argument("--task", action="append", required=True, help="a task for the agent (repeatable, in order)")
    agent.add_argument("--max-turns", type=int, default=12, help="model turns a task may take before the next one")
    agent.add_argument("--workspace", type=Path, metavar="DIR", help="seed the sandbox with this directory's files")
    agent.add_argument("--system", help="system prompt (default: a short tool-using assistant prompt)")
    agent.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default); above 0 needs --seed")
    agent.add_argument("--seed", type=int, help="sampling seed (a replay samples the same tokens)")
    agent.add_argument("--tool-format", default="hermes", choices=["hermes", "qwen25", "llama3", "mistral", "json"],
                       help="how the model writes tool calls (parsed with SGLang's detectors)")
    agent.add_argument("--session", help="run in this open session (default: open a new one)")
    agent.add_argument("--linger", type=float, default=0.0, metavar="SECONDS",
                       help="after the last task, wait this long for revocations raised with `sandboxd revoke`")
    return top


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not args.client:
        args.func(args)
        return
    try:
        with _client(args) as client:
            args.func(args, client)
    except SandboxdError as exc:
        if args.json:
            print(json.dumps({"error": exc.code.value, "message": exc.message,
                              "details": msgspec.to_builtins(exc.details)}, indent=2, sort_keys=True))
        else:
            print(f"sandboxd: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def _client(args: argparse.Namespace) -> Client:
    if (args.server_key is None) != (args.client_key is None):
        raise SystemExit("sandboxd: --server-key and --client-key go together")
    if args.server_key is None:
        return Client(args.endpoint, timeout_s=args.wait)
    try:
        return Client.with_key_files(args.endpoint, args.server_key, args.client_key, timeout_s=args.wait)
    except KeyFileError as exc:
        raise SystemExit(f"sandboxd: {exc}") from exc


if __name__ == "__main__":
    main()
