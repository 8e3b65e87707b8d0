"""Which MCP tool calls are retries of an earlier one: the idempotency window of `sandboxd mcp`.

The firewall identifies an external call by its intent and counts occurrences: a call under an agent
call id it has seen before is that call again (answered from the ledger, never fired twice), a call
under a new id is a new occurrence and fires. An MCP client that times out and retries sends a new
`tools/call` (a new JSON-RPC id) with the same name and arguments; nothing in the protocol says it is
the same call. So the MCP layer decides, and gives a retry the agent call id of the call it repeats:

- `_meta["sandboxd/idempotencyKey"]` (a string the client chose) settles it: the same key is the same
  call (with other arguments it is refused), a new key is a new call, even with identical arguments.
- Without a key, a call repeats the latest earlier call of the same tool with the same canonical
  arguments (the firewall's canonical JSON for external tools, so key order, whitespace runs and
  number spellings do not matter; exact JSON for sandbox tools, where whitespace is content) while
  that call is running or held, and after it finished:
  - `external`: for `window_s` seconds. Whether the answer reached the client cannot be known for
    sure (a response written as the client gives up is lost), and a second email cannot be undone.
  - `write`: for `window_s` seconds if no request ever handed its answer over (the client gave up
    on every one) and no other `write` has started since (its result may no longer hold). An answer
    the client got makes the same call again a deliberate new one: `make test` twice runs twice.
  - `read`: never; reading again is harmless and must see later writes.

So an agent that means to send the same message twice within the window must say so with distinct
keys. Rejected: the JSON-RPC id (a retry gets a new one); the MCP session id (a client that
reconnects after a network fault retries on a new session, and the modern revision has none).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from sandboxd.firewall.intent import canonical_json

#: the `_meta` key under which a client may name its call (any string up to 256 characters)
IDEMPOTENCY_KEY = "sandboxd/idempotencyKey"
MAX_KEY_LENGTH = 256


class KeyConflict(ValueError):
    """An idempotency key reused for a call of another tool or with other arguments."""


def call_signature(tool: str, effect: str, args: dict[str, Any]) -> str:
    """A digest of the tool and its arguments, equal for two spellings of one call."""
    if effect == "external":
        text = canonical_json(args)
    else:
        text = json.dumps(args, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(json.dumps([tool, text], ensure_ascii=False).encode()).hexdigest()


@dataclass
class WindowEntry:
    """One call as the window knows it: the agent call id every retry of it reuses."""

    agent_call_id: str
    tool: str
    effect: str
    signature: str
    key: str | None
    started: float
    finished: float | None = None
    stale: bool = False
    """A later write started: a finished write's result may no longer hold."""
    delivered: bool = False
    """A request handed the answer over to the client."""
    extra: dict[str, Any] = field(default_factory=dict)


class RetryWindow:
    """The calls of one sandboxd session that a later MCP call may repeat. Not thread-safe."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._by_key: dict[str, WindowEntry] = {}
        self._latest: dict[str, WindowEntry] = {}

    def claim(self, tool: str, effect: str, args: dict[str, Any], key: str | None,
              now: float) -> tuple[WindowEntry, bool]:
        """The entry this call belongs to and whether it is new (then the caller must run it)."""
        self._expire(now)
        signature = call_signature(tool, effect, args)
        if key is not None:
            known = self._by_key.get(key)
            if known is not None:
                if known.signature != signature:
                    raise KeyConflict(f"idempotency key {key!r} was used for another call ({known.tool} with "
                                      "other arguments)")
                return known, False
        else:
            latest = self._latest.get(signature)
            if latest is not None and self._repeats(latest, now):
                return latest, False
        entry = WindowEntry(agent_call_id=agent_call_id(key), tool=tool, effect=effect, signature=signature,
                            key=key, started=now)
        if effect == "write":
            for other in self._latest.values():
                if other.effect in ("read", "write"):
                    other.stale = True
        self.add(entry)
        return entry, True

    def add(self, entry: WindowEntry) -> None:
        """Remember an entry (a new call, or one rebuilt from the session's record)."""
        if entry.key is not None:
            self._by_key[entry.key] = entry
        else:
            self._latest[entry.signature] = entry

    def finish(self, entry: WindowEntry, now: float) -> None:
        """The call has its final answer: from now on the window runs."""
        entry.finished = now

    def forget(self, agent_call_ids: set[str]) -> None:
        """Drop entries (a revocation discarded their calls: their answers must not be served again)."""
        self._by_key = {k: e for k, e in self._by_key.items() if e.agent_call_id not in agent_call_ids}
        self._latest = {s: e for s, e in self._latest.items() if e.agent_call_id not in agent_call_ids}

    def entries(self) -> list[WindowEntry]:
        return [*self._by_key.values(), *self._latest.values()]

    def _repeats(self, entry: WindowEntry, now: float) -> bool:
        if entry.finished is None:
            return True
        if entry.effect == "read" or (entry.effect == "write" and (entry.stale or entry.delivered)):
            return False
        return now - entry.finished <= self.window_s

    def _expire(self, now: float) -> None:
        def live(entry: WindowEntry) -> bool:
            return entry.finished is None or now - entry.finished <= self.window_s

        self._by_key = {k: e for k, e in self._by_key.items() if live(e)}
        self._latest = {s: e for s, e in self._latest.items() if live(e)}


def agent_call_id(key: str | None) -> str:
    """The agent call id the daemon sees: derived from the client's key, else fresh."""
    if key is None:
        return "mcp-" + uuid.uuid4().hex
    return "mcp-k-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def idempotency_key(meta: Any) -> str | None:
    """The client's idempotency key from a request's `_meta`, None when absent; ValueError when malformed."""
    if not meta:
        return None
    value = meta.get(IDEMPOTENCY_KEY) if isinstance(meta, dict) else getattr(meta, "get", lambda _k: None)(
        IDEMPOTENCY_KEY)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_LENGTH:
        raise ValueError(f"_meta[{IDEMPOTENCY_KEY!r}] must be a non-empty string of at most {MAX_KEY_LENGTH} "
                         "characters")
    return value
