"""`sandboxd`: the daemon and its operator commands.

Every client command takes --endpoint and --json, and for a tcp:// daemon --server-key (the daemon's
NAME.key) and --client-key (this client's NAME.key_secret; see `sandboxd keys`).

Why one module of this size: one argparse tree and the one place every command's reply is printed.
Each command is a few lines mapping options to one client request; split by command, the shared
options (--endpoint, --json, the key files) and the printing helpers would be imported everywhere and
the tree would no longer be readable top to bottom. Logic does not belong here: it lives in the daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from sandboxd import protocol as p
from sandboxd.auth import KeyFileError, generate_keys, read_public_key
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


def _age(seconds: float | None) -> str:
    """A duration as an operator reads it: 42s, 7m, 3h, 2d."""
    if seconds is None:
        return ""
    seconds = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _bytes(n: float | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return ""


def cmd_serve(args: argparse.Namespace) -> None:
    from sandboxd.daemon import run

    try:
        config = load_config(args.config, state_dir=args.state_dir, endpoint=args.endpoint, image=args.image,
                             snapshot_backend=args.snapshot_backend, runtime=args.runtime, state=args.state,
                             node_id=args.node_id)
    except ValueError as exc:  # KeyFileError included: say which file, not a traceback
        raise SystemExit(f"sandboxd serve: {exc}") from exc
    try:
        run(config, verbose=args.verbose)
    except (SandboxdError, KeyFileError) as exc:  # an engine or key file that cannot serve as configured
        raise SystemExit(f"sandboxd serve: {exc}") from exc


def cmd_fleet_serve(args: argparse.Namespace) -> None:
    try:
        from sandboxd.fleet.door import serve
        from sandboxd.fleet.nodes import NodeSpec
    except ImportError as exc:
        raise SystemExit(f"sandboxd fleet: {exc} (install the fleet extra: pip install 'sandboxd[fleet]')") from exc
    if not args.state.startswith(("postgresql://", "postgres://")):
        raise SystemExit("sandboxd fleet serve: --state must be the postgresql:// URL every node shares")
    spec = NodeSpec(state=args.state, state_root=str(Path(args.state_root).resolve()),
                    config=str(args.config.resolve()) if args.config else "", runtime=args.runtime,
                    shared_dir=str(args.shared_dir.resolve()) if args.shared_dir else "",
                    keys_dir=str(args.fleet_keys.resolve()) if args.fleet_keys else "", port=args.node_port)
    door_dir = Path(args.state_root).resolve() / "door"
    try:
        serve(args.ray, spec, args.endpoint or f"ipc://{door_dir / 'sandboxd.sock'}", str(door_dir),
              cpus=args.sandbox_cpus, memory_mb=args.sandbox_memory_mb,
              door_config=str(args.door_config.resolve()) if args.door_config else "")
    except (ValueError, RuntimeError) as exc:  # KeyFileError included: say which file or node, not a traceback
        raise SystemExit(f"sandboxd fleet serve: {exc}") from exc


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


def cmd_console(args: argparse.Namespace) -> None:
    try:
        from sandboxd.console.app import Console, serve
    except ImportError as exc:  # the web stack is an extra
        raise SystemExit(f"sandboxd console: {exc}: pip install 'sandboxd[console]'") from exc
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("sandboxd console: it serves loopback only; reach it through an SSH tunnel")
    daemon = None
    if args.state_dir is not None:
        # The demo's daemon stopped when the demo ended: start one on its state to look at what happened.
        from sandboxd.launcher import DaemonProcess

        daemon = DaemonProcess(Path(args.state_dir).resolve(), ["--config", str(args.config)] if args.config else [])
        daemon.start()
        args.endpoint = daemon.endpoint
    try:
        serve(Console(lambda: _client(args), token=args.token, operator_keys=_console_keys(args)), args.host, args.port)
    finally:
        if daemon is not None:
            daemon.shutdown()


def _console_keys(args: argparse.Namespace) -> frozenset[str]:
    """Operators' public keys whose secret logs in to the console: --operator-key files, and the console's own
    --client-key (the key it reaches the daemon with)."""
    files = [*args.operator_key, *([args.client_key] if args.client_key else [])]
    try:
        return frozenset(read_public_key(Path(f)) for f in files)
    except KeyFileError as exc:
        raise SystemExit(f"sandboxd console: {exc}") from exc


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
        info = client.open_session(args.image, idle_timeout_s=args.idle_timeout, ttl_s=args.ttl)
        _print(args, info, lambda s: s.session_id)
    elif args.action == "close":
        if not args.id:
            raise SystemExit("sandboxd session close: a session id is required")
        client.close_session(args.id)
        _print(args, {"session_id": args.id, "state": "closed"}, lambda d: f"closed {d['session_id']}")
    else:
        _print(args, client.sessions(include_closed=args.all), _sessions_table)


def _sessions_table(sessions: list[p.SessionInfo]) -> str:
    now = time.time()
    rows = [["SESSION", "STATE", "IMAGE", "AGE", "IDLE", "MEMORY", "CPU", "PIDS", "DISK", "CLOSES"]]
    for s in sessions:
        idle = None if s.last_used_at is None else now - s.last_used_at
        limits = [f"idle {_age(s.idle_timeout_s)}" if s.idle_timeout_s else "",
                  f"at {_age(s.ttl_s)} old" if s.ttl_s else ""]
        cpu = s.usage.get("cpu_s")
        rows.append([s.session_id, s.state, s.image, _age(now - s.created_at), _age(idle),
                     _bytes(s.usage.get("memory_bytes")), "" if cpu is None else f"{cpu:.1f}s",
                     str(s.usage.get("pids", "")), _bytes(s.usage.get("disk_bytes")),
                     ", ".join(x for x in limits if x) or "never"])
    return _table(rows)


def _call_args(text: str) -> dict[str, Any]:
    """--args: a JSON object, `@FILE` to read it from a file, `-` to read it from stdin."""
    source = "--args"
    if text == "-":
        text, source = sys.stdin.read(), "--args - (stdin)"
    elif text.startswith("@"):
        try:
            text, source = Path(text[1:]).read_text(), f"--args {text}"
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"sandboxd call: --args {text}: cannot read {text[1:]}: {exc}") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"sandboxd call: {source} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise SystemExit(f"sandboxd call: {source} must be a JSON object")
    return value


def _call_id(args: argparse.Namespace, client: Client) -> str | None:
    """The call id to send: --retry's (which must name an earlier call), --call-id, or for an effectful call
    (or a streamed one) a new one, printed so a retry can name it and never run the call twice."""
    if args.retry:
        if args.call_id and args.call_id != args.retry:
            raise SystemExit("sandboxd call: --retry and --call-id name different calls")
        known = {name for c in client.calls(args.session) for name in (c.call_id, *c.agent_call_ids)}
        if args.retry not in known:
            raise SystemExit(f"sandboxd call: no call {args.retry} in session {args.session} to retry "
                             "(`sandboxd calls SESSION` lists them)")
        return str(args.retry)
    if args.call_id:
        return str(args.call_id)
    effect = next((t.effect for t in client.tools(args.session) if t.name == args.tool), None)
    if effect == "read" and not args.stream:
        return None
    minted = "cli-" + uuid.uuid4().hex[:16]
    print(f"sandboxd: call id {minted}; if you cannot tell whether it ran, repeat the command with "
          f"--retry {minted} (a retry never runs it twice)", file=sys.stderr)
    return minted


def cmd_call(args: argparse.Namespace, client: Client) -> None:
    call_args = _call_args(args.args)
    call_id = _call_id(args, client)
    streamed = (0, 0)
    if args.stream:
        assert call_id is not None
        result, streamed = _streamed_call(args, client, call_args, call_id)
    else:
        result = client.call(args.session, args.tool, call_args, call_id=call_id, timeout_s=args.call_timeout,
                             turn=args.turn)
    if args.json:
        _print(args, result, str)
        return
    if streamed == (0, 0):
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
    _announce_truncation(result)
    if result.held:
        print(f"sandboxd: {result.call_id} is held ({result.state}): `sandboxd outbox release {result.call_id}` "
              "fires it", file=sys.stderr)
    if result.exit_code:
        raise SystemExit(result.exit_code if 0 < result.exit_code < 256 else 1)


def _announce_truncation(result: p.CallResult) -> None:
    for name, cut, shown, size in (("stdout", result.stdout_truncated, result.stdout, result.stdout_size),
                                   ("stderr", result.stderr_truncated, result.stderr, result.stderr_size)):
        if cut:
            whole = f"of {size} bytes" if size is not None else "(its full size was not reported)"
            print(f"\nsandboxd: {name} truncated: {len(shown.encode())} bytes shown {whole}; write it to a file "
                  "in the workspace and copy that out with `sandboxd cp SESSION:PATH LOCAL`", file=sys.stderr)


def _streamed_call(args: argparse.Namespace, client: Client, call_args: dict[str, Any],
                   call_id: str) -> tuple[p.CallResult, tuple[int, int]]:
    """Run the call on a second connection and print its output as it comes; returns its result and how many
    characters of stdout and stderr were printed."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            with _client(args) as caller:
                outcome["result"] = caller.call(args.session, args.tool, call_args, call_id=call_id,
                                                timeout_s=args.call_timeout, turn=args.turn, stream=True)
        except BaseException as exc:  # handed to the main thread, which reports it
            outcome["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    out = err = 0
    while True:
        done = not worker.is_alive()
        chunk = client.call_output(args.session, call_id, out, err, timeout_s=0 if done else 1.0)
        sys.stdout.write(chunk.stdout)
        sys.stdout.flush()
        sys.stderr.write(chunk.stderr)
        out, err = out + len(chunk.stdout), err + len(chunk.stderr)
        if done and not (chunk.stdout or chunk.stderr):
            break
    worker.join()
    if "error" in outcome:
        exc = outcome["error"]
        if isinstance(exc, SandboxdError) and (out or err):
            exc.details.pop("stdout", None)  # printed already, as it came
            exc.details.pop("stderr", None)
        raise exc
    return outcome["result"], (out, err)


def cmd_snapshot(args: argparse.Namespace, client: Client) -> None:
    _print(args, client.snapshot(args.session, args.label),
           lambda s: f"{s.snapshot_id} ({s.elapsed_ms:.1f} ms)")


def cmd_restore(args: argparse.Namespace, client: Client) -> None:
    _print(args, client.restore(args.session, args.snapshot),
           lambda r: f"restored {r.snapshot_id} ({r.elapsed_ms:.1f} ms)")


def cmd_snapshots(args: argparse.Namespace, client: Client) -> None:
    if args.delete:
        broken = client.delete_snapshot(args.session, args.delete, force=args.force)
        _print(args, {"deleted": args.delete, "broken_checkpoints": broken},
               lambda d: f"deleted {d['deleted']}" + (
                   f"; checkpoints {', '.join(d['broken_checkpoints'])} can no longer restore files: rollbacks, "
                   "forks and revocations splicing there will fail" if d["broken_checkpoints"] else ""))
        return
    _print(args, client.snapshots(args.session), lambda ss: _table(
        [["SNAPSHOT", "LABEL", "LAYERS"]] + [[s.snapshot_id, s.label or "", str(s.layers)] for s in ss]))


def cmd_calls(args: argparse.Namespace, client: Client) -> None:
    if args.target == "resolve":
        if not args.call or not args.outcome:
            raise SystemExit("sandboxd calls resolve CALL --outcome done|failed [--reason TEXT]")
        _print(args, client.resolve(args.call, args.outcome, reason=args.reason or ""),
               lambda c: f"{c.call_id} is now {c.state} (by {c.decided_by})")
        return
    if args.call:
        raise SystemExit(f"sandboxd calls: unexpected {args.call!r} "
                         "(`calls SESSION`, `calls all`, `calls resolve CALL`)")
    calls = client.calls(None if args.target == "all" else args.target)
    _print(args, calls, lambda cs: _calls_table(cs, every_session=args.target == "all"))


def _calls_table(calls: list[p.LedgerCall], every_session: bool = False) -> str:
    now = time.time()
    rows = [["CALL", *(["SESSION"] if every_session else []), "TOOL", "EFFECT", "STATE", "AGE", "TURN", "TARGET",
             "PREVIEW", "DIGEST", "YOUR ID", "DECIDED BY"]]
    for c in calls:
        decided = f"{c.decided_by}: {c.reason}" if c.decided_by and c.reason else c.decided_by or ""
        rows.append([c.call_id, *([c.session_id] if every_session else []), c.tool, c.effect, c.state,
                     _age(now - c.created_at), "" if c.turn is None else str(c.turn), c.target, _short(c.preview),
                     c.digest[7:19], ",".join(c.agent_call_ids), decided])
    text = _table(rows)
    unknown = [c for c in calls if c.advice]
    return text + "".join(f"\n\n{c.call_id} is unknown: {c.advice}" for c in unknown)


def _short(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def cmd_outbox(args: argparse.Namespace, client: Client) -> None:
    if args.target in ("release", "drop"):
        if not args.call:
            raise SystemExit(f"sandboxd outbox {args.target} CALL [--reason TEXT]")
        if args.target == "release":
            _print(args, client.release(args.call, reason=args.reason or "", force=args.force),
                   lambda r: f"released {r.call_id}: {r.state}")
        else:
            if args.force:
                raise SystemExit("sandboxd outbox drop: --force is for release (a drop needs none)")
            client.drop(args.call, reason=args.reason or "")
            _print(args, {"dropped": args.call, "reason": args.reason or ""}, lambda d: f"dropped {d['dropped']}")
        return
    if args.call:
        raise SystemExit(f"sandboxd outbox: unexpected {args.call!r} (`outbox SESSION`, `outbox all`, "
                         "`outbox release CALL`, `outbox drop CALL`)")
    _print(args, client.approvals(None if args.target == "all" else args.target), _outbox_table)


def _outbox_table(box: p.OutboxResponse) -> str:
    now = time.time()
    rows = [["CALL", "SESSION", "TOOL", "STATE", "POLICY", "TURN", "AGE", "TARGET", "PREVIEW", "DIGEST", "NOTE"]]
    for h in box.held:
        note = f"replay {h.replay} open" if h.replay else ("session closed: release needs --force"
                                                          if h.session_state != "open" else "")
        rows.append([h.call_id, h.session_id, h.tool, h.state, h.policy, "" if h.turn is None else str(h.turn),
                     _age(now - h.held_at), h.target, _short(h.preview), h.digest[7:19], note])
    for c in box.unknown:
        rows.append([c.call_id, c.session_id, c.tool, c.state, c.policy or "", "" if c.turn is None else str(c.turn),
                     _age(now - c.created_at), c.target, _short(c.preview), c.digest[7:19],
                     "outcome unknown: see below"])
    text = _table(rows if len(rows) > 1 else [])
    return text + "".join(f"\n\n{c.call_id} is unknown: {c.advice}" for c in box.unknown)


def _remote(spec: str) -> tuple[str, str] | None:
    """SESSION:PATH as (session, path); None for a local path (write ./a:b for a local name with a colon)."""
    session, sep, path = spec.partition(":")
    if not sep or not session or "/" in session or not path:
        return None
    return session, path


#: bytes per CopyIn/CopyOut request, well under the default frame limit
COPY_CHUNK = 2 * 1024 * 1024


def cmd_cp(args: argparse.Namespace, client: Client) -> None:
    source, dest = _remote(args.source), _remote(args.dest)
    if (source is None) == (dest is None):
        raise SystemExit("sandboxd cp: exactly one of SOURCE and DEST is SESSION:PATH (the other a local path, "
                         "or - for stdin/stdout)")
    if dest is not None:
        session, path = dest
        try:
            reader = sys.stdin.buffer if args.source == "-" else open(args.source, "rb")  # noqa: SIM115
        except OSError as exc:
            raise SystemExit(f"sandboxd cp: cannot read {args.source}: {exc}") from exc
        with reader:
            chunk = reader.read(COPY_CHUNK)
            size = client.copy_in(session, path, chunk).size  # even an empty file is created
            while chunk := reader.read(COPY_CHUNK):
                size = client.copy_in(session, path, chunk, append=True).size
        _print(args, {"session_id": session, "path": path, "bytes": size},
               lambda d: f"copied {d['bytes']} bytes to {d['session_id']}:{d['path']}")
        return
    assert source is not None
    session, path = source
    target = Path(args.dest)
    if args.dest != "-" and target.is_dir():
        target = target / Path(path).name
    got = client.copy_out(session, path, 0, COPY_CHUNK)
    try:
        writer = sys.stdout.buffer if args.dest == "-" else open(target, "wb")  # noqa: SIM115
    except OSError as exc:
        raise SystemExit(f"sandboxd cp: cannot write {target}: {exc}") from exc
    with writer:
        writer.write(got.data)
        offset = len(got.data)
        while got.data and offset < got.size:
            got = client.copy_out(session, path, offset, COPY_CHUNK)
            writer.write(got.data)
            offset += len(got.data)
    if args.dest != "-":
        _print(args, {"session_id": session, "path": path, "local": str(target), "bytes": offset},
               lambda d: f"copied {d['bytes']} bytes from {d['session_id']}:{d['path']} to {d['local']}")


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
        if status.revocation.state in ("failed", "cancelled"):
            raise SystemExit(f"sandboxd revoke: {info.revocation_id} {status.revocation.state}: "
                             f"{status.revocation.error}")
        time.sleep(0.5)
    _print(args, {"revocation_id": info.revocation_id, "state": info.state, "tau": info.tau, "T": raised.T,
                  "taint_closure": raised.taint_closure, "checkpoint": info.checkpoint_id},
           lambda d: f"{d['revocation_id']} {d['state']}: tau={d['tau']} T={d['T']}, "
                     f"{len(d['taint_closure'])} artifacts tainted; the agent replays it when it next connects")
    if args.wait_done:
        state = client.revocation_status(info.revocation_id).revocation.state
        raise SystemExit(f"sandboxd revoke: {info.revocation_id} is still {state} after {args.wait_done:g}s: "
                         "no agent replayed it in time (sandboxd revocations to watch it)")


def cmd_rollback(args: argparse.Namespace, client: Client) -> None:
    if (args.to is None) == (args.turn is None):
        raise SystemExit("sandboxd rollback: give exactly one of --to CHECKPOINT|SNAPSHOT or --turn N")
    snapshot = args.to if args.to is not None and args.to.startswith("snap-") else None
    checkpoint = args.to if args.to is not None and snapshot is None else None
    report = client.rollback(args.session, checkpoint=checkpoint, snapshot=snapshot, turn=args.turn,
                             compensate=args.compensate, force=args.force)
    _print(args, report, _rollback_text)


def _rollback_text(r: dict[str, Any]) -> str:
    to = r["to"]
    lines = [f"{r['session_id']} rolled back to {to['checkpoint_id'] or 'its start'} (turn {to['turn']}, step "
             f"{to['step']}) as {r['rollback']}: files from {r['files_restored']}; {r['artifacts_removed']} "
             f"artifacts, {r['checkpoints_removed']} checkpoints, {r['calls_removed']} sandbox calls removed"]
    lines += [f"dropped (never fired): {c}" for c in r["dropped"]]
    for o in r["orphaned"]:
        undo = (f"compensation {o['compensation_state']}" + (f" ({o['compensation_error']})"
                                                              if o["compensation_error"] else "")
                if o["compensation_state"] else f"compensate with: sandboxd compensate {o['call_id']}"
                if o["compensation"] else "no compensation declared: undo it by hand")
        lines.append(f"orphaned (fired, cannot undo): {o['call_id']} {o['tool']}: {undo}")
    lines += [f"unresolved (unknown outcome, passed by --force): {c}" for c in r["unresolved"]]
    lines += [f"revocation cancelled: {c}" for c in r["revocations_cancelled"]]
    lines.append("the agent resumes from this point when it next connects")
    return "\n".join(lines)


def cmd_fork(args: argparse.Namespace, client: Client) -> None:
    report = client.fork(args.session, args.at, live_effects=args.live_effects)
    _print(args, report, lambda r: f"{r['session_id']} forked from {r['parent']} at {r['at']['checkpoint_id']}: "
           f"{r['artifacts']} artifacts, {r['checkpoints']} checkpoints, {r['inherited_calls']} ledger calls "
           f"inherited; its external calls are {'live' if r['effects'] == 'live' else 'held for release'}")


def cmd_compensate(args: argparse.Namespace, client: Client) -> None:
    done = client.compensate(args.call)
    _print(args, done, lambda d: f"{d['call_id']} compensated by {d['compensation']['call_id']}: "
           f"{d['compensation']['state']}" + (" (it had run before)" if d["compensation"]["deduplicated"] else ""))


def cmd_revocations(args: argparse.Namespace, client: Client) -> None:
    rows = client.revocations(args.session)
    _print(args, rows, lambda rs: _table([["REVOCATION", "SESSION", "SOURCE", "STATE", "RAISED BY", "AGE", "REASON"]]
                                         + [[r["revocation_id"], r["session_id"], r["source"], r["state"],
                                             r["raised_by"], _age(time.time() - r["created_at"]), r["error"] or ""]
                                            for r in rs]))


def cmd_revocation(args: argparse.Namespace, client: Client) -> None:
    info = client.cancel_revocation(args.id, args.reason)
    _print(args, info, lambda r: f"{r['revocation_id']} {r['state']}: {r['error']}")


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
    common.add_argument("--connect-wait", type=float, default=float(os.environ.get("SANDBOXD_CONNECT_WAIT", "5")),
                        metavar="SECONDS", help="seconds to wait for a daemon to answer at all before it is "
                        "daemon_unreachable (default: $SANDBOXD_CONNECT_WAIT or 5)")
    common.add_argument("--server-key", type=Path, metavar="FILE",
                        help="tcp:// daemons: the daemon's public key file (NAME.key), pinned")
    common.add_argument("--client-key", type=Path, metavar="FILE",
                        help="tcp:// daemons: this client's secret key file (NAME.key_secret)")

    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", type=Path, help="TOML configuration file")
    serve.add_argument("--state-dir")
    serve.add_argument("--state", metavar="URL",
                       help="state database: postgresql://... (several daemons may share it); default: SQLite")
    serve.add_argument("--node-id", help="this daemon's name on a shared state database (default HOST:STATE_DIR)")
    serve.add_argument("--endpoint")
    serve.add_argument("--image")
    serve.add_argument("--snapshot-backend", choices=["overlay", "copy"])
    serve.add_argument("--runtime", choices=["runc", "runsc"],
                       help="OCI runtime of the sandboxes: runc (default) or runsc (gVisor)")
    serve.add_argument("-v", "--verbose", action="store_true")
    serve.set_defaults(func=cmd_serve, client=False)

    fleet = sub.add_parser("fleet", help="a fleet of daemons on a Ray cluster").add_subparsers(dest="fleet_command",
                                                                                              required=True)
    fleet_serve = fleet.add_parser("serve", help="the front door: a daemon per Ray node, sessions routed to theirs")
    fleet_serve.add_argument("--ray", required=True, metavar="ADDRESS", help="the Ray cluster (ray.init address)")
    fleet_serve.add_argument("--state", required=True, metavar="URL", help="the postgresql:// database nodes share")
    fleet_serve.add_argument("--state-root", required=True, help="each node's state directory is made under it")
    fleet_serve.add_argument("--endpoint", help="the door's endpoint (default: ipc socket under STATE_ROOT/door)")
    fleet_serve.add_argument("--config", type=Path, help="the TOML configuration every node's daemon reads")
    fleet_serve.add_argument("--shared-dir", type=Path, help="storage every node mounts: snapshots are exported "
                             "there, and lost sessions re-created from it")
    fleet_serve.add_argument("--fleet-keys", type=Path, metavar="DIR",
                             help="the fleet's CURVE keys (made if absent), on storage every node reads: node "
                                  "daemons then listen on tcp://NODE_IP:PORT and admit only the door (default: "
                                  "ipc sockets, one host only)")
    fleet_serve.add_argument("--node-port", type=int, default=0, metavar="PORT",
                             help="with --fleet-keys: the port node daemons bind (default: a free one each)")
    fleet_serve.add_argument("--door-config", type=Path, metavar="FILE",
                             help="the door's own TOML: its [auth] keys for a tcp:// --endpoint")
    fleet_serve.add_argument("--runtime", choices=["runc", "runsc"], default="runc")
    fleet_serve.add_argument("--sandbox-cpus", type=float, default=0.5, help="Ray CPU a session holds")
    fleet_serve.add_argument("--sandbox-memory-mb", type=int, default=512, help="Ray memory a session holds")
    fleet_serve.set_defaults(func=cmd_fleet_serve, client=False)

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

    console = sub.add_parser("console", parents=[common], help="serve the operators' web console on 127.0.0.1")
    console.add_argument("--host", default="127.0.0.1")
    console.add_argument("--port", type=int, default=8780)
    console.add_argument("--token", default=os.environ.get("SANDBOXD_CONSOLE_TOKEN"),
                         help="login token (default: $SANDBOXD_CONSOLE_TOKEN, else random, printed at start)")
    console.add_argument("--operator-key", type=Path, action="append", default=[], metavar="FILE",
                         help="an operator's public key file (NAME.key): its secret key logs in too (repeatable)")
    console.add_argument("--state-dir", help="start a daemon on this state directory for the console's lifetime")
    console.add_argument("--config", type=Path, help="with --state-dir: the daemon's configuration file")
    console.set_defaults(func=cmd_console, client=False)

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
    session.add_argument("--idle-timeout", type=_positive, metavar="SECONDS",
                         help="open: close the session after this long without a request")
    session.add_argument("--ttl", type=_positive, metavar="SECONDS", help="open: close the session this long after "
                         "it opened, busy or not")
    call = add("call", cmd_call, "run a tool in a session")
    call.add_argument("session")
    call.add_argument("tool")
    call.add_argument("--args", default="{}", help="arguments as a JSON object; @FILE reads them from a file, "
                      "- from stdin")
    call.add_argument("--call-id", help="your id for the call (kept, and shown by `calls`)")
    call.add_argument("--retry", metavar="CALL_ID", help="retry the call with this id (the one printed when it "
                      "was made): answered from its record, never run twice")
    call.add_argument("--turn", type=int, help="the agent turn the call belongs to (on_commit tools need one; "
                      "`sandboxd commit SESSION TURN` releases them)")
    call.add_argument("--stream", action="store_true", help="print the output as it comes (shell, python)")
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
    snaps.add_argument("--force", action="store_true",
                       help="with --delete: delete it even though checkpoints refer to it (says what it breaks)")
    calls = add("calls", cmd_calls, "a session's calls (sandbox and external), or resolve an unknown one")
    calls.add_argument("target", metavar="SESSION|all|resolve")
    calls.add_argument("call", nargs="?", metavar="CALL")
    calls.add_argument("--outcome", choices=["done", "failed"], help="with resolve: did the effect happen?")
    calls.add_argument("--reason", help="with resolve: why (recorded with who resolved it)")
    outbox = add("outbox", cmd_outbox, "effects waiting for an operator (held, or outcome unknown): list (SESSION "
                 "or all), release CALL, drop CALL")
    outbox.add_argument("target", metavar="SESSION|all|release|drop")
    outbox.add_argument("call", nargs="?", metavar="CALL")
    outbox.add_argument("--reason", help="release, drop: why (recorded with who decided)")
    outbox.add_argument("--force", action="store_true", help="release: even though its session is closed")
    cp = add("cp", cmd_cp, "copy a file into or out of a session, byte for byte: cp LOCAL SESSION:PATH, "
             "cp SESSION:PATH LOCAL (- is stdin or stdout)")
    cp.add_argument("source")
    cp.add_argument("dest")
    commit = add("commit", cmd_commit, "commit a turn: release the effects held for it")
    commit.add_argument("session")
    commit.add_argument("turn", type=int)
    revoke = add("revoke", cmd_revoke, "revoke an input: forget TARGET (default: all of SOURCE) and replay")
    revoke.add_argument("session")
    revoke.add_argument("--source", required=True, help="the artifact the target entered through")
    revoke.add_argument("--target", help="the text to forget (default: the whole source)")
    revoke.add_argument("--wait-done", type=float, default=0.0, help="seconds to wait for the agent's replay")
    rollback = add("rollback", cmd_rollback, "roll a whole session back: files, held calls, provenance, checkpoints")
    rollback.add_argument("session")
    rollback.add_argument("--to", metavar="CHECKPOINT|SNAPSHOT", help="a checkpoint id, or a snapshot id (snap-...)")
    rollback.add_argument("--turn", type=int, help="back to the start of turn N (it and later turns are discarded)")
    rollback.add_argument("--compensate", action="store_true",
                          help="run the declared compensation of each orphaned effect (at most once)")
    rollback.add_argument("--force", action="store_true", help="roll back past calls whose outcome is unknown")
    fork = add("fork", cmd_fork, "a new session from a checkpoint of SESSION (its external calls held)")
    fork.add_argument("session")
    fork.add_argument("--at", required=True, metavar="CHECKPOINT")
    fork.add_argument("--live-effects", action="store_true",
                      help="let the fork's external calls fire as the release policy says (default: held)")
    compensate = add("compensate", cmd_compensate, "run an orphaned call's declared compensation (at most once)")
    compensate.add_argument("call", metavar="CALL")
    revs = add("revocations", cmd_revocations, "revocations with their states (of SESSION, or of every session)")
    revs.add_argument("session", nargs="?")
    revocation = add("revocation", cmd_revocation, "cancel a pending revocation: revocation cancel ID")
    revocation.add_argument("action", choices=["cancel"])
    revocation.add_argument("id", metavar="ID")
    revocation.add_argument("--reason", help="why (recorded with it)")
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
            partial = [exc.details.get(k) for k in ("stdout", "stderr")]
            if any(isinstance(text, str) and text for text in partial):  # a timed-out call's output, so far
                sys.stdout.write(str(partial[0] or ""))
                sys.stdout.flush()
                sys.stderr.write(str(partial[1] or ""))
                print("\nsandboxd: (the output above is what the call wrote before it was stopped)", file=sys.stderr)
            print(f"sandboxd: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _client(args: argparse.Namespace) -> Client:
    if (args.server_key is None) != (args.client_key is None):
        raise SystemExit("sandboxd: --server-key and --client-key go together")
    if args.server_key is None:
        return Client(args.endpoint, timeout_s=args.wait, connect_timeout_s=args.connect_wait)
    try:
        return Client.with_key_files(args.endpoint, args.server_key, args.client_key, timeout_s=args.wait,
                                     connect_timeout_s=args.connect_wait)
    except KeyFileError as exc:
        raise SystemExit(f"sandboxd: {exc}") from exc


if __name__ == "__main__":
    main()
