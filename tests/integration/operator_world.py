"""A daemon wired to real mail and HTTP sinks, and a session driven to a known history without a model.

`drive` plays an agent's part through the client (artifacts, checkpoints with snapshots, tool calls), so
rollbacks, forks and revocations have a history to work on in a few hundred milliseconds. Its shape:

    cp-start                     (empty workspace)
    user-1, turn 1: write notes.txt = v1, webhook {"event": "first"}  (fired)
    cp-1-turn  <- checkpoint A   (notes v1)
    user-2, turn 2: write notes.txt = v2, webhook {"event": "revised"} (fired), send_email (held: manual)
    cp-2-turn  <- checkpoint B   (notes v2)
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandboxd import protocol as p
from sandboxd.client import Client, RemoteError
from sandboxd.launcher import DaemonProcess
from tests.sinks import HttpSink, MailSink

EMAIL: dict[str, object] = {"to": ["team@example.test"], "subject": "notes", "body": "v2 is out"}


class Sinks:
    """The outside world: an SMTP sink and an HTTP sink (the webhook at /hook, its undo at /undo)."""

    def __init__(self) -> None:
        self.smtp = MailSink()
        self.http = HttpSink()

    def posts(self, path: str) -> list[dict[str, object]]:
        return [r for r in self.http.requests if r["path"] == path]

    def config(self, crash_at: list[str] | None = None, webhook_path: str = "/hook", timeout: float = 5.0) -> Path:
        path = Path(tempfile.mkdtemp(prefix="sandboxd-cfg-")) / "sandboxd.toml"
        path.write_text(
            f"crash_at = {crash_at or []!r}\n"
            f"[firewall]\nadapter_timeout_s = {timeout}\n"
            f"[firewall.smtp]\nhost = \"127.0.0.1\"\nport = {self.smtp.port}\n"
            f"[firewall.webhook]\nurl = \"{self.http.url(webhook_path)}\"\n"
            f"undo_url = \"{self.http.url('/undo')}\"\n"
            "[firewall.release]\nsend_email = \"manual\"\n".replace("'", '"'))
        return path

    def close(self) -> None:
        self.smtp.close()
        self.http.close()


@pytest.fixture
def sinks() -> Iterator[Sinks]:
    made = Sinks()
    yield made
    made.close()


@pytest.fixture
def operated(sinks: Sinks, daemon_factory: Callable[..., DaemonProcess]) -> DaemonProcess:
    """A daemon whose firewall reaches the sinks."""
    return daemon_factory(["--config", str(sinks.config())])


def checkpoint(client: Client, sid: str, cid: str, step: int, turn: int, manifest: list[str]) -> p.CheckpointRecord:
    return client.checkpoint(sid, p.CheckpointRecord(checkpoint_id=cid, step=step, turn=turn, token_offset=10 * step,
                                                     cache_handle=f"local:{10 * step}", reason="turn",
                                                     manifest=manifest))


def observe(client: Client, sid: str, aid: str, call: str, text: str, step: int, turn: int) -> None:
    client.record_artifacts(sid, [p.Artifact(artifact_id=aid, type="observation", parents=[call], turn=turn,
                                             step=step, content=text, token_span=(10 * step, 10 * step + 5))])


def act(client: Client, sid: str, turn: int, calls: list[tuple[str, dict[str, object]]], step: int) -> int:
    """One model turn that makes `calls`, each answered by an observation; returns the next step."""
    client.record_artifacts(sid, [p.Artifact(artifact_id=f"turn-{turn}", type="model_turn", turn=turn, step=step,
                                             content=f"turn {turn}", token_span=(10 * step, 10 * step + 5))])
    for k, (tool, args) in enumerate(calls):
        call = f"call-{turn}-{k}"
        client.record_artifacts(sid, [p.Artifact(artifact_id=call, type="tool_call", parents=[f"turn-{turn}"],
                                                 turn=turn, step=step, content=tool, meta={"tool": tool})])
        try:
            text = client.call(sid, tool, args, call_id=f"live/{call}", turn=turn).stdout
        except RemoteError as exc:  # an adapter timeout, say: the agent reads the error
            text = f"error {exc.wire_code}"
        step += 1
        observe(client, sid, f"obs-{step}", call, text or "[held]", step, turn)
    return step


def user(client: Client, sid: str, step: int, text: str) -> int:
    client.record_artifacts(sid, [p.Artifact(artifact_id=f"user-{step + 1}", type="user", step=step + 1,
                                             content=text, token_span=(10 * step, 10 * step + 5))])
    return step + 1


def drive(client: Client, sid: str, slow: bool = False) -> dict[str, p.CheckpointRecord]:
    """The history of the module docstring; returns its checkpoints by name. With `slow` the first webhook
    is not made (the far side is slow: the second's outcome is unknown)."""
    client.record_artifacts(sid, [p.Artifact(artifact_id="sys", type="system", content="You keep notes.",
                                             token_span=(0, 5))])
    start = checkpoint(client, sid, "cp-start", 0, 0, ["sys"])
    step = user(client, sid, 0, "Write the first notes.")
    first: list[tuple[str, dict[str, object]]] = [] if slow else [("webhook", {"body": {"event": "first"}})]
    step = act(client, sid, 1, [("write_file", {"path": "notes.txt", "content": "v1\n"}), *first], step)
    a = checkpoint(client, sid, "cp-1-turn", step, 1, ["sys", "user-1"])
    step = user(client, sid, step, "Revise the notes and tell everyone.")
    step = act(client, sid, 2, [("write_file", {"path": "notes.txt", "content": "v2\n"}),
                                ("webhook", {"body": {"event": "revised"}}), ("send_email", EMAIL)], step)
    b = checkpoint(client, sid, "cp-2-turn", step, 2, ["sys", "user-1", f"user-{step - 3}"])
    return {"start": start, "A": a, "B": b}


def notes(client: Client, sid: str) -> str:
    return client.call(sid, "read_file", {"path": "notes.txt"}).stdout


def by_tool(client: Client, sid: str, tool: str) -> list[p.LedgerCall]:
    return [c for c in client.calls(sid) if c.tool == tool and not c.call_id.startswith("cmp-")]
