"""One factory for the model backends, and the agent as a program: `run_agent` (what `sandboxd agent run`
does) and `EventWatcher` (pending revocations taken between turns, as the daemon announces them).

Importing this module imports no torch: the local backend's module is imported only when it is built.
"""

from __future__ import annotations

import queue
import secrets
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agent.chat import ChatRenderer
from agent.models.base import Sampling
from agent.runtime import AgentSession, Exogenous
from sandboxd import protocol as p
from sandboxd.client import Client

BACKENDS = ("local", "sglang", "openai")


def build_backend(kind: str, *, model: str, url: str | None = None, api_key: str | None = None,
                  cache_salt: str | None = None) -> Any:
    """A backend by name: `local` (transformers in process, MODEL a directory), `sglang` (native /generate at
    URL; MODEL a directory with the model's tokenizer), `openai` (chat completions at URL, MODEL its name)."""
    if kind == "local":
        from agent.models.local import LocalBackend  # torch, only here

        return LocalBackend.from_pretrained(model)
    if kind == "sglang":
        if not url:
            raise ValueError("--backend sglang needs --url (the server root, e.g. http://127.0.0.1:30000)")
        from agent.models.sglang import SGLangBackend, SGLangConfig
        from agent.models.tokenizer import HFTokenizer

        # A random salt per session by default: under the server's shared namespace another tenant could
        # probe this session's prefixes through cached_tokens or timing.
        salt = cache_salt or secrets.token_hex(8)
        return SGLangBackend(SGLangConfig(base_url=url, cache_salt=salt), tokenizer=HFTokenizer.from_pretrained(model))
    if kind == "openai":
        if not url:
            raise ValueError("--backend openai needs --url (the API root, e.g. http://127.0.0.1:8000/v1)")
        from agent.models.openai import OpenAIBackend

        return OpenAIBackend(url, model, api_key=api_key)
    raise ValueError(f"unknown backend {kind!r}; choose one of {', '.join(BACKENDS)}")


def chat_for(kind: str, model: str) -> Callable[[list[dict[str, Any]]], ChatRenderer] | None:
    """The renderer factory of a token backend (the model directory's chat template); None for openai,
    whose server applies the template."""
    if kind == "openai":
        return None
    if not Path(model).is_dir():
        raise ValueError(f"--model {model}: a {kind} backend needs the model's directory (its tokenizer and chat "
                         "template)")
    return lambda tools: ChatRenderer.from_dir(model, tools)


class EventWatcher:
    """Long-polls the daemon's events for a session on a thread of its own (its own client: a client is not
    thread-safe); the agent takes the revocations between turns."""

    def __init__(self, endpoint: str, session_id: str, *, client_factory: Callable[[], Client] | None = None) -> None:
        self.session_id = session_id
        self._factory = client_factory or (lambda: Client(endpoint))
        self.events: queue.Queue[p.Event] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"events-{session_id}")

    def start(self) -> EventWatcher:
        self._thread.start()
        return self

    def _run(self) -> None:
        after, epoch = 0, ""
        with self._factory() as client:
            while not self._stop.is_set():
                try:
                    reply = client.wait_events(self.session_id, after=after, epoch=epoch, timeout_s=2.0)
                except Exception:  # the daemon restarting, a timeout: try again unless stopped
                    self._stop.wait(1.0)
                    continue
                if reply.epoch != epoch:
                    after = 0
                epoch = reply.epoch
                for event in reply.events:
                    after = max(after, event.seq)
                    self.events.put(event)

    def revocations(self) -> list[str]:
        """Revocation ids announced since the last call."""
        found: list[str] = []
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return found
            if event.kind == "revocation":
                found.append(event.subject)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def take_revocations(watcher: EventWatcher, on_report: Callable[[p.RevocationReport], None]) -> Callable[..., None]:
    """A `between_turns` hook: when the daemon announced a revocation, replay it now, then go on with the inputs
    not yet taken."""
    from agent.revocation import apply_pending

    def hook(agent: AgentSession) -> None:
        if not watcher.revocations():
            return
        remaining = list(agent.queue)
        agent.queue.clear()
        hook_saved, agent.between_turns = agent.between_turns, None  # the replay runs the loop itself
        try:
            for report in apply_pending(agent):
                on_report(report)
        finally:
            agent.between_turns = hook_saved
        agent.queue.extend(remaining)

    return hook


def run_agent(client: Client, *, backend: str, model: str, tasks: Sequence[str], url: str | None = None,
              workspace: Path | None = None, max_turns: int = 12, system: str | None = None,
              temperature: float = 0.0, seed: int | None = None, toolcall_format: str = "hermes",
              session_id: str | None = None, echo: Callable[[Any], None] | None = None,
              on_report: Callable[[p.RevocationReport], None] = lambda _r: None, linger_s: float = 0.0,
              endpoint: str | None = None) -> AgentSession:
    """A model-driven agent on the user's tasks in a sandbox session (a new one unless `session_id`)."""
    from agent.harness import seed_workspace

    engine = build_backend(backend, model=model, url=url)
    sid = session_id or client.open_session().session_id
    if workspace is not None:
        files = {str(f.relative_to(workspace)): f.read_text() for f in sorted(workspace.rglob("*")) if f.is_file()}
        seed_workspace(client, sid, files)
    agent = AgentSession(client, sid, engine, system=system, chat=chat_for(backend, model),
                         toolcall_format=toolcall_format, sampling=Sampling(temperature=temperature, seed=seed),
                         max_turns=max_turns, max_turn_tokens=512, echo=echo)
    watcher = EventWatcher(endpoint or client.endpoint, sid).start()
    hook = take_revocations(watcher, on_report)
    agent.between_turns = hook
    try:
        agent.start([Exogenous(type="user", text=t) for t in tasks])
        agent.run()
        if linger_s > 0:  # wait for revocations raised after the last task (from another terminal)
            watcher._stop.wait(linger_s)
            hook(agent)
            agent.run()
    finally:
        watcher.stop()
    return agent
