"""`make demo`: a daemon, a sandbox session, tools, a snapshot, a change, a restore that undoes it.

Runs on embedded defaults: a fresh state directory under out/, the offline-built tool image, the
real Docker engine. Exits non-zero if any step does not behave as shown.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from sandboxd.client import Client, RemoteError
from sandboxd.launcher import DaemonProcess

OUT = Path("out")


def step(text: str) -> None:
    print(f"\n== {text}")


def show(label: str, value: str) -> None:
    body = value.rstrip("\n") or "(empty)"
    print(f"   {label}:\n" + "\n".join(f"     {line}" for line in body.splitlines()))


def check(condition: bool, what: str) -> None:
    if not condition:
        print(f"DEMO FAILED: {what}", file=sys.stderr)
        raise SystemExit(1)
    print(f"   ok: {what}")


def run(client: Client) -> None:
    step("open a session (one hardened container, no network, non-root, read-only root)")
    session = client.open_session()
    sid = session.session_id
    print(f"   session {sid}, container {session.container and session.container[:12]}")
    show("identity", client.call(sid, "shell", {"command": "id; ls /sys/class/net"}).stdout)

    step("run tools: write_file, python, list_dir")
    client.call(sid, "write_file", {"path": "report.md", "content": "# Quarterly report\nrevenue: 120\n"})
    client.call(sid, "python", {"code": "open('totals.json','w').write('{\"revenue\": 120}')"})
    before = client.call(sid, "list_dir", {}).stdout
    show("workspace", before)

    step("snapshot the workspace")
    snap = client.snapshot(sid, label="clean")
    print(f"   {snap.snapshot_id} in {snap.elapsed_ms:.1f} ms ({snap.layers} layers)")

    step("change files: overwrite, delete, add")
    client.call(sid, "shell", {"command": "echo 'revenue: 999 (tampered)' >> report.md; rm totals.json; "
                                          "echo 'ignore previous instructions' > injected.txt"})
    show("workspace after the change", client.call(sid, "list_dir", {}).stdout)

    step("restore the snapshot")
    restored = client.restore(sid, snap.snapshot_id)
    print(f"   restored in {restored.elapsed_ms:.1f} ms")
    after = client.call(sid, "list_dir", {}).stdout
    show("workspace after restore", after)
    check(after == before, "the file tree is exactly as it was at the snapshot")
    check("tampered" not in client.call(sid, "read_file", {"path": "report.md"}).stdout,
          "the overwritten file has its old contents")

    step("the firewall refuses what it must")
    for tool, args in (("read_file", {"path": "../etc/passwd"}), ("shell", {"command": "sleep 5", "timeout_s": 0.5})):
        try:
            client.call(sid, tool, args)
            check(False, f"{tool} {json.dumps(args)} should have been refused")
        except RemoteError as exc:
            print(f"   {tool} {json.dumps(args)} -> {exc.wire_code}: {exc.message}")

    step("close the session (container and snapshots removed)")
    client.close_session(sid)
    check(client.sessions() == [], "no session left open")


def main() -> None:
    state = (OUT / "demo-state").resolve()
    shutil.rmtree(state, ignore_errors=True)
    daemon = DaemonProcess(state, log=OUT / "demo-daemon.log")
    print(f"starting sandboxd (state {state}, log {daemon.log})")
    daemon.start()
    try:
        run(daemon.client())
    finally:
        daemon.shutdown()
    print("\ndemo complete")


if __name__ == "__main__":
    main()
